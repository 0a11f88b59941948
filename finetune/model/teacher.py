"""Distillation's teacher: which weights it is (a model folder, or an adapter folder merged into its base),
the check that it shares the student's vocabulary, id by id, before any weight loads, and (sequence-level
distillation) the teacher loaded whole on one process and what its answers are cached by."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from finetune.config.errors import UserError
from finetune.config.schema import ModelConfig, QuantizationConfig
from finetune.model import nf4
from finetune.model.configs import model_config
from finetune.model.loading import load_model, quantize_layers


def teacher_source(folder: str, student: ModelConfig, tokenizer, sharded: str | None = None,
                   quantization: QuantizationConfig | None = None, across: bool = False) -> tuple[ModelConfig, str | None]:
    """(the teacher's base as a model config, the adapter folder to merge into it or None). The student's
    dtype and attention; `quantization` (distill.teacher_quantization), not the student's; no overrides or
    compilation of the student's. `sharded`: the strategy that loads weights sharded, if the run's does (no
    rank then holds what an adapter would merge into). `across` (distill.cross_tokenizer): its vocabulary is not checked."""
    path = Path(folder).expanduser()
    adapter = None
    if (path / "adapter_config.json").is_file():
        if sharded:
            raise UserError(f"distill.teacher: {path} is an adapter, merged into its base as the teacher loads, and distributed.strategy "
                            f"{sharded} loads no rank's weights whole; merge it first (finetune merge --adapter {path} --out DIR) and name DIR")
        adapter = str(path)
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base or not (Path(base) / "config.json").is_file():
            raise UserError(f"distill.teacher: {path} is an adapter whose base ({base}) is not a model folder here")
    elif (path / "config.json").is_file():
        base = str(path)
    else:
        raise UserError(f"distill.teacher: {path} is neither a model folder (config.json) nor an adapter folder (adapter_config.json)")
    cfg = student.model_copy(update={"name_or_path": base, "revision": None, "quantization": quantization, "config_overrides": {}, "compile": False,
                                     "tiled_mlp": 1, "ramdisk": False})
    if not across:
        check_vocabulary(tokenizer_folder(path, base), tokenizer, student, cfg)
    return cfg, adapter


def tokenizer_folder(path: Path, base: str) -> Path:
    """Where a teacher's tokenizer is: its own folder (an adapter's, if it saved one), else its base's."""
    return path if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file() else Path(base)


def teacher_tokenizer(folder: str, teacher: ModelConfig):
    """distill.cross_tokenizer: the teacher's own tokenizer (a fast one: the alignment reads its character offsets)."""
    from transformers import AutoTokenizer

    path = Path(folder).expanduser()
    theirs = AutoTokenizer.from_pretrained(str(tokenizer_folder(path, teacher.name_or_path)), trust_remote_code=teacher.trust_remote_code)
    if not theirs.is_fast:
        raise UserError(f"distill.cross_tokenizer: {folder}'s tokenizer has no fast (tokenizers) version; the spans are found from its "
                        "character offsets")
    return theirs


def check_vocabulary(folder: Path, tokenizer, student: ModelConfig, teacher: ModelConfig) -> None:
    """The teacher's tokenizer and logits width must be the student's: the divergence compares the two
    distributions entry by entry. One line naming the first token that differs."""
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=teacher.trust_remote_code)
    except Exception as err:  # noqa: BLE001 - any failure to read it means the same to the user
        raise UserError(f"distill.teacher: cannot load a tokenizer from {folder}: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
    ours, other = _by_id(tokenizer), _by_id(theirs)
    for i in range(max(len(ours), len(other))):
        if ours.get(i) != other.get(i):
            raise UserError(f"distill.teacher: {folder}'s tokenizer differs from the student's at id {i} ({other.get(i)!r} there, "
                            f"{ours.get(i)!r} here); distillation compares the two models' next-token probabilities id by id "
                            "(another family's teacher: set distill.cross_tokenizer: true)")
    widths = [logits_width(c, key) for c, key in ((student, "model.name_or_path"), (teacher, "distill.teacher"))]
    if widths[0] != widths[1]:
        raise UserError(f"distill.teacher: its model has {widths[1]} logits per token, the student {widths[0]}; "
                        "distillation needs the same vocabulary size")


def logits_width(cfg: ModelConfig, key: str) -> int:
    """The logits a model gives per token: its text config's vocab_size, read as loading reads it (a hub id too)."""
    width = getattr(model_config(cfg, key).get_text_config(), "vocab_size", None)
    if not isinstance(width, int) or width <= 0:
        raise UserError(f"{key}: the config of '{cfg.name_or_path}' gives no vocab_size (found {width!r}); distillation compares "
                        "the two models' logits entry by entry")
    return width


def _by_id(tokenizer) -> dict[int, str]:
    return {i: token for token, i in tokenizer.get_vocab().items()}


def merged(model: torch.nn.Module, adapter: str | None) -> torch.nn.Module:
    """The model with the adapter folder's weights merged in (none: as it is)."""
    if not adapter:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter).merge_and_unload()


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    return model.requires_grad_(False).eval()


def whole_teacher(cfg: ModelConfig, adapter: str | None, device) -> torch.nn.Module:
    """The teacher on this process alone, whatever the strategy (sequence-level distillation's answers)."""
    model = frozen(merged(load_model(cfg, device), adapter))
    if nf4.after_adapter(cfg):
        quantize_layers(model, cfg)
    return model if cfg.quantization is not None and not nf4.used(cfg) else model.to(device)  # bitsandbytes placed it as it quantized


def teacher_key(cfg: ModelConfig, adapter: str | None, *settings) -> str:
    """What a teacher's answers are cached by: its folders' files (path, size, time), how it loads, and `settings`."""
    h = hashlib.sha256(json.dumps([cfg.model_dump(mode="json"), settings]).encode())
    for folder in [Path(cfg.name_or_path), *([Path(adapter)] if adapter else [])]:
        for file in sorted(f for f in folder.expanduser().rglob("*") if f.is_file()):
            stat = file.stat()
            h.update(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:24]
