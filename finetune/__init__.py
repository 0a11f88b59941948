"""finetune: fine-tune Hugging Face causal language models, from one CPU box to many GPU nodes."""

import os

__version__ = "0.1.0"

if not os.path.exists("/proc/driver/nvidia"):
    # DeepSpeed, imported by transformers and peft when installed, guesses its accelerator and warns
    # on every import where there is no GPU.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
