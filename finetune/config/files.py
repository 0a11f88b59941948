"""Config files: a run config found (by its path, or a shipped config's name), read, overridden (`--set key=value`)
and checked against the model's config.json; a model folder's JSON files read with one-line errors; a config
written back as YAML (beside every output and in every checkpoint)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from finetune.config.errors import UserError
from finetune.config.schema import RunConfig, looks_local, validate_config


def parse_override(item: str) -> tuple[list[str], Any]:
    """`train.lr=1e-4` -> (['train', 'lr'], 1e-4). The value is parsed as YAML, so types come out right."""
    if "=" not in item:
        raise UserError(f"--set {item}: expected KEY=VALUE, e.g. --set train.lr=1e-4")
    key, raw = item.split("=", 1)
    keys = key.strip().split(".")
    if not all(k.strip() for k in keys):
        raise UserError(f"--set {item}: the key is empty (expected KEY=VALUE, e.g. --set train.lr=1e-4)")
    try:
        return keys, yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise UserError(f"--set {item}: not a plain YAML value ({getattr(err, 'problem', None) or str(err).splitlines()[0]})") from None


def apply_override(raw: dict, keys: list[str], value: Any, source: str) -> None:
    node = raw
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise UserError(f"{source}: {'.'.join(keys)}: {k} is not a section")
        node = child
    node[keys[-1]] = value


# The repository's configs/, beside the package: a source checkout (or an editable install) has them; a wheel carries the
# package alone, and then a config is named by its path (NO_SHIPPED_CONFIGS says so).
SHIPPED_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


NO_SHIPPED_CONFIGS = (f"this finetune has no shipped configs ({SHIPPED_CONFIGS} is missing: a wheel carries the package alone); "
                      "give a config file's path, or install from a clone of the repository (pip install -e .)")


def find_config(name: str | os.PathLike) -> Path:
    """A config file by path, or by the name of a shipped config (`qlora`, `qlora.yaml`, `llama3-8b`):
    configs/ and then configs/presets/, as torchtune resolves its built-in config names."""
    path = Path(name)
    if path.is_file() or path.parent != Path("."):
        return path
    for folder in (SHIPPED_CONFIGS, SHIPPED_CONFIGS / "presets"):
        for candidate in (folder / path.name, folder / f"{path.name}.yaml"):
            if candidate.is_file():
                return candidate
    return path


def shipped_configs() -> list[tuple[str, str]]:
    """(name, the first line of its opening comment) of every shipped config, for `finetune configs`."""
    if not SHIPPED_CONFIGS.is_dir():
        raise UserError(f"finetune configs: {NO_SHIPPED_CONFIGS}")
    found = []
    for folder in (SHIPPED_CONFIGS, SHIPPED_CONFIGS / "presets"):
        for path in sorted(folder.glob("*.yaml")):
            found.append((str(path.relative_to(SHIPPED_CONFIGS.parent)), _first_sentence(path)))
    return found


def _first_sentence(path: Path) -> str:
    """A shipped config's opening comment (before its example commands), up to the first full stop."""
    words = []
    for line in path.read_text().splitlines():
        if not line.startswith("#") or line.startswith("#  "):
            break
        words.append(line.lstrip("#").strip())
    text = " ".join(words)
    return text.split(". ", 1)[0].rstrip(".")


def load_config(path: str | os.PathLike, overrides: list[str] = (), check_model: bool = True, check_paths: bool = True) -> RunConfig:
    """Read, override and validate a run config. Raises UserError with one line on any problem.
    check_paths: False where data, template and resume paths need not exist from here (a run's saved
    config read back; a plan)."""
    path = find_config(path)
    if not path.is_file():
        hint = "" if path.parent != Path(".") else (" (nor a shipped config: finetune configs lists them)" if SHIPPED_CONFIGS.is_dir()
                                                    else f"; {NO_SHIPPED_CONFIGS}")
        raise UserError(f"{path}: config file not found{hint}")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise UserError(f"{path}{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of sections (model, adapter, data, train, ...)")
    for item in overrides:
        keys, value = parse_override(item)
        apply_override(raw, keys, value, f"--set {item}")
    # Relative data and model paths are relative to the working directory, as users type them.
    cfg = validate_config(raw, str(path), check_paths)
    if check_model:
        check_against_model(cfg, str(path))
    return cfg


# Where a config.json gives the longest sequence: most families, GPT-2/GPT-J/CodeGen/GPT-BigCode, MPT.
# ALiBi models (Bloom) have no limit to give.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len")


def check_against_model(cfg: RunConfig, source: str) -> None:
    """Checks that need the model's config.json (read as JSON: no weights, no transformers import)."""
    model_dir = Path(cfg.model.name_or_path).expanduser()
    if not model_dir.exists():
        if looks_local(cfg.model.name_or_path):
            raise UserError(f"{source}: model.name_or_path: folder not found: {cfg.model.name_or_path}")
        return  # a hub id: checked when it is loaded
    model_cfg = read_model_config(model_dir, f"{source}: model.name_or_path")
    model_cfg = {**(model_cfg.get("text_config") or model_cfg), **cfg.model.config_overrides}
    key = next((k for k in CONTEXT_KEYS if model_cfg.get(k)), None)
    if key and cfg.data.max_seq_len > model_cfg[key]:
        raise UserError(f"{source}: data.max_seq_len: {cfg.data.max_seq_len} is larger than the model's {key} ({model_cfg[key]})")


def read_model_config(folder: Path, what: str) -> dict:
    """A model folder's config.json as a dict, or one line saying what is wrong with it."""
    path = Path(folder).expanduser() / "config.json"
    if not path.is_file():
        raise UserError(f"{what}: {path.parent} has no config.json (not a HF model folder)")
    return read_json_object(path, what)


def read_json_object(path: Path, what: str) -> dict:
    """A JSON file holding an object, or one line naming `what` and what is wrong with the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{what}: {path} is not valid JSON") from None
    if not isinstance(value, dict):
        raise UserError(f"{what}: {path}: expected a JSON object")
    return value


def to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def job_key(cfg: RunConfig) -> str | None:
    """A torchrun job's identity: its rendezvous id and its config, but for train.grad_accum (an elastic resize re-derives it).
    summary.json keeps it, so a worker torchrun starts again after the job finished knows it (preflight.finished_job)."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if not job:
        return None
    import hashlib

    config = to_yaml(cfg.model_copy(update={"train": cfg.train.model_copy(update={"grad_accum": 1})}))
    return hashlib.sha256(f"{job}\n{config}".encode()).hexdigest()
