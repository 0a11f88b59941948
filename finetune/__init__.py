"""finetune: fine-tune Hugging Face causal language models, from one CPU box to many GPU nodes."""

__version__ = "0.1.0"
