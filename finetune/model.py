"""Model: load the tokenizer and base model through the ordinary Auto* path, then add the adapter.

Any local HF folder or hub id goes through the same calls; nothing here knows about the demo model.
"""

from __future__ import annotations

import importlib.util

import torch

from finetune.config import AdapterConfig, ModelConfig
from finetune.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(cfg.name_or_path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(f"model.name_or_path: cannot load a tokenizer from '{cfg.name_or_path}': {str(err).splitlines()[0]}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def check_attention(cfg: ModelConfig) -> None:
    if cfg.attn_implementation.startswith("flash_attention"):
        if not torch.cuda.is_available():
            raise UserError(f"model.attn_implementation: {cfg.attn_implementation} needs a CUDA GPU; use sdpa here")
        package = "flash_attn_interface" if cfg.attn_implementation.endswith("3") else "flash_attn"
        if importlib.util.find_spec(package) is None:
            raise UserError(f"model.attn_implementation: {cfg.attn_implementation} needs the '{package}' package installed")


def load_model(cfg: ModelConfig):
    from transformers import AutoModelForCausalLM

    check_attention(cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            cfg.name_or_path,
            revision=cfg.revision,
            dtype=DTYPES[cfg.dtype],
            attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
            use_safetensors=True,
        )
    except (OSError, ValueError) as err:
        raise UserError(f"model.name_or_path: cannot load '{cfg.name_or_path}': {str(err).splitlines()[0]}") from None
    model.config.use_cache = False  # no KV cache while training; generation turns it on per call
    return model


def apply_adapter(model, cfg: AdapterConfig, gradient_checkpointing: bool):
    """Wrap the model for the chosen method. Returns the model to train."""
    if gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if cfg.method == "full":
        return model
    from peft import LoraConfig, get_peft_model

    if gradient_checkpointing:
        # With a frozen embedding nothing before the first checkpointed block needs grad.
        model.enable_input_require_grads()
    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        use_dora=cfg.method == "dora",
        use_rslora=cfg.rslora,
        modules_to_save=cfg.modules_to_save,
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as err:
        raise UserError(f"adapter.target_modules: {str(err).splitlines()[0]}") from None


def describe(model) -> dict:
    """Parameter counts and bytes in memory, for the run summary."""
    total = trainable = nbytes = 0
    for p in model.parameters():
        total += p.numel()
        nbytes += p.numel() * p.element_size()
        if p.requires_grad:
            trainable += p.numel()
    return {"total_params": total, "trainable_params": trainable, "param_bytes": nbytes}
