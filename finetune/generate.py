"""`finetune generate`: try a trained result on a prompt, with the tokens streamed to the terminal."""

from __future__ import annotations

import sys

import torch

from finetune.config import ModelConfig
from finetune.errors import UserError
from finetune.merge import attach, find_adapter, load_base, tokenizer_source
from finetune.model import load_model, load_tokenizer


def load(model_dir: str | None, adapter_dir: str | None, base: str | None = None):
    """(model, tokenizer): a model folder (merged or full fine-tune) as saved, or base + adapter as trained."""
    if model_dir:
        cfg = ModelConfig(name_or_path=model_dir, dtype="auto")
        return load_model(cfg).eval(), load_tokenizer(cfg)
    adapter = find_adapter(adapter_dir, base)
    model = attach(load_base(adapter, quantized=adapter.quantized), adapter)
    return model, load_tokenizer(ModelConfig(name_or_path=tokenizer_source(adapter)))


@torch.no_grad()
def generate(model, tokenizer, prompt: str, chat: bool = False, max_new_tokens: int = 128, temperature: float = 0.0,
             stream: bool = True) -> str:
    """The continuation of `prompt` (greedy unless temperature > 0), printed token by token if `stream`."""
    from transformers import TextStreamer

    if chat:
        if not tokenizer.chat_template:
            raise UserError("--chat: this tokenizer has no chat template; leave out --chat to send the prompt as plain text")
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    # A rendered chat template already carries the special tokens it needs.
    ids = tokenizer(prompt, add_special_tokens=not chat, return_tensors="pt").input_ids.to(next(model.parameters()).device)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, use_cache=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, streamer=streamer, **sampling)
    if stream:
        sys.stdout.flush()
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
