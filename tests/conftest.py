"""Shared fixtures: tiny real models built from config, and helpers to run the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DEMO_DATA = REPO / "demo" / "data"

os.environ.setdefault("FINETUNE_CACHE", str(REPO / ".cache" / "finetune-tests"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# DeepSpeed JIT-compiles its CPU ops (shared-memory comm, CPU Adam) on first use: build them once
# per checkout, not once per test run.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
_SHM_BEFORE = set(Path("/dev/shm").glob("deepspeed_*")) if Path("/dev/shm").is_dir() else set()


def pytest_sessionfinish(session, exitstatus):
    """DeepSpeed's CPU comm leaves shared-memory buffers behind; remove those this session made."""
    for leftover in set(Path("/dev/shm").glob("deepspeed_*")) - _SHM_BEFORE if Path("/dev/shm").is_dir() else ():
        leftover.unlink(missing_ok=True)


def run_cli(*args: str, cwd: Path = REPO, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m finetune ARGS` in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "finetune", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps process-wide state; each in-process run starts from none."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)


@pytest.fixture(scope="session")
def demo_tokenizer_dir(tmp_path_factory) -> Path:
    from finetune.demo import build_tokenizer

    texts = [json.loads(line)["text"] for line in (DEMO_DATA / "corpus.jsonl").read_text().splitlines()[:1500]]
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(texts).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, demo_tokenizer_dir) -> Path:
    """A random-weight two-layer Llama with the demo tokenizer: enough for exactness tests."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-model")
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> Path:
    """The demo base model, built by the real command with a short pretraining."""
    out = tmp_path_factory.mktemp("demo") / "model"
    result = run_cli("make-demo-model", "--out", str(out), "--steps", "120")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def ram_root() -> Path:
    """A staging root on the RAM-backed /dev/shm (as model.ramdisk uses), removed at the end."""
    import shutil
    import uuid

    root = Path("/dev/shm") / f"finetune-tests-{uuid.uuid4().hex[:8]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def base_config(model_dir: Path, out_dir: Path, **sections) -> dict:
    cfg = {
        "model": {"name_or_path": str(model_dir)},
        "adapter": {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"train": str(DEMO_DATA / "train.jsonl"), "eval": str(DEMO_DATA / "eval.jsonl"), "format": "alpaca", "max_seq_len": 128},
        "train": {"output_dir": str(out_dir), "max_steps": 4, "micro_batch_size": 4, "lr": 1e-3},
        "logging": {"report_to": [], "progress_bar": False, "plot": False},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg
