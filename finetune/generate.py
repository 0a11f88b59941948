"""`finetune generate`: try a trained result on a prompt, with the tokens streamed to the terminal."""

from __future__ import annotations

import sys
from pathlib import Path

from finetune.config import ModelConfig
from finetune.errors import UserError
from finetune.evaluate import generate as continuation
from finetune.adapters import attach, find_adapter, load_base, tokenizer_source
from finetune.model import load_model, load_tokenizer


def load(model_dir: str | None, adapter_dir: str | None, base: str | None = None):
    """(model, tokenizer): a model folder (merged or full fine-tune) as saved, or base + adapter as trained."""
    if model_dir:
        if not Path(model_dir).expanduser().is_dir():
            raise UserError(f"--model: folder not found: {model_dir}")
        cfg = ModelConfig(name_or_path=model_dir, dtype="auto")
        return load_model(cfg).eval(), load_tokenizer(cfg)
    adapter = find_adapter(adapter_dir, base)
    model = attach(load_base(adapter, quantized=adapter.quantized), adapter)
    return model, load_tokenizer(ModelConfig(name_or_path=tokenizer_source(adapter)))


def generate(model, tokenizer, prompt: str, chat: bool = False, max_new_tokens: int = 128, temperature: float = 0.0,
             stream: bool = True) -> str:
    """The continuation of `prompt` (greedy unless temperature > 0), printed token by token if `stream`."""
    from transformers import TextStreamer

    if chat:
        if not tokenizer.chat_template:
            raise UserError("--chat: this tokenizer has no chat template; leave out --chat to send the prompt as plain text")
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    # A rendered chat template already carries the special tokens it needs.
    text = continuation(model, tokenizer, prompt, max_new_tokens, add_special_tokens=not chat, temperature=temperature, streamer=streamer)
    if stream:
        sys.stdout.flush()
    return text
