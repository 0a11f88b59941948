"""A model's config as loading reads it: a local folder's config.json or a hub id's (from the Hub's cache, or the Hub),
at model.revision, with model.config_overrides applied. One function for loading, the processor, preflight's checks and
distillation's teacher check, so that a model named by id meets the same checks as a folder."""

from __future__ import annotations

from pathlib import Path

from finetune.config.errors import UserError
from finetune.config.files import read_model_config
from finetune.config.schema import ModelConfig, looks_local

# Families whose released checkpoints finetune reads as their language model alone, as transformers' causal-LM class loads
# it from them (the tower's weights left unread): Llama 4, whose image processor transformers has for torchvision only,
# which has no build for the CPU torch here (docs/platform-notes.md), so no Llama 4 picture was ever processed here.
LANGUAGE_ONLY = {"llama4": "Llama 4"}


def language_only(config: dict) -> dict:
    """A config.json's dict as finetune reads the model: a LANGUAGE_ONLY family's language model's config."""
    return config["text_config"] if config.get("model_type") in LANGUAGE_ONLY and config.get("text_config") else config


def model_config(cfg: ModelConfig, key: str = "model.name_or_path", say=None):
    """The model's config as loading reads it (a local folder, or a hub id from the cache or the hub, at model.revision),
    a LANGUAGE_ONLY family's language model's (said through `say`), with model.config_overrides applied; one line naming
    `key` if it cannot be read."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    if looks_local(cfg.name_or_path):
        read_model_config(Path(cfg.name_or_path), key)  # one line for a missing or garbage config.json
    try:
        config = AutoConfig.from_pretrained(cfg.name_or_path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, StrictDataclassError) as err:  # the last: a config whose fields disagree (num_hidden_layers, layer_types)
        raise UserError(f"{key}: cannot read the config of '{cfg.name_or_path}': {first_line(err)}") from None
    kind = config.model_type
    if kind in LANGUAGE_ONLY:
        config = config.get_text_config()
        if say:
            say(f"model: {kind} ({LANGUAGE_ONLY[kind]}): its language model trains alone, on text ({config.model_type}); its vision tower "
                "is not read: transformers has its image processor for torchvision only, which has no build for the CPU torch finetune "
                "is tested on (docs/vision.md)")
    override_config(config, cfg.config_overrides)
    return config


def override_config(config, overrides: dict) -> None:
    """model.config_overrides, set on the loaded config: only settings the model's config has."""
    unknown = [key for key in overrides if not hasattr(config, key)]
    if unknown:
        raise UserError(f"model.config_overrides: {', '.join(unknown)} is not a setting of {type(config).__name__} "
                        f"(its config.json has e.g. {', '.join(sorted(config.to_diff_dict())[:6])})")
    for key, value in overrides.items():
        setattr(config, key, value)


def first_line(err: Exception) -> str:
    from huggingface_hub.errors import StrictDataclassError

    if isinstance(err, StrictDataclassError) and err.__cause__ is not None:  # it wraps the config's own complaint: say that one
        err = err.__cause__
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__
