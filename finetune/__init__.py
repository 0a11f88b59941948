"""finetune: fine-tune Hugging Face causal language models, from one CPU box to many GPU nodes."""

import logging
import os

__version__ = "0.1.0"

if not os.path.exists("/proc/driver/nvidia"):
    # DeepSpeed, imported by transformers and peft when installed, guesses its accelerator and warns
    # on every import where there is no GPU.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


class _TorchaoImportNoise(logging.Filter):
    """torchao 0.18, imported by peft whenever it is installed, logs each of its CUDA extensions that does not
    load on this machine, and makes torch 2.13 warn about two of its enums; finetune calls none of what
    either is about (docs/platform-notes.md)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Failed to load") or "is an Enum subclass and is now natively supported" in message)


for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_TorchaoImportNoise())
