"""Shared fixtures: tiny real models built from config, and helpers to run the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
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


def finetune_cli(capsys, *args: str):
    """`finetune ARGS` in this process, for what a fresh process proves nothing more about (its output
    and exit code): returncode, stdout, stderr as run_cli gives them. An unexpected exception fails the test."""
    from finetune.cli import main

    try:
        code = main(list(args))
    except SystemExit as exit:  # argparse: --help, usage errors
        code = exit.code
    out = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


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


def build_bpe_model(out: Path, corpus_rows: list[str], steps: int = 300) -> Path:
    """A small pretrained Llama with a byte-level BPE tokenizer (GPT-2's pre-tokenization, words merged
    into tokens as in real models, unlike the demo's near-character one; trained for up to 4,096
    tokens, the demo corpus yields 847), pretrained with finetune's full fine-tuning on `corpus_rows`
    (JSONL lines of {"text": ...})."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.config import validate_config
    from finetune.demo import byte_level_bpe
    from finetune.train import run

    tokenizer = byte_level_bpe([json.loads(row)["text"] for row in corpus_rows], 4096, fill=False)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    init, corpus = out.parent / f"{out.name}-init", out.parent / f"{out.name}-corpus.jsonl"
    LlamaForCausalLM(config).save_pretrained(init)
    tokenizer.save_pretrained(init)
    corpus.write_text("\n".join(corpus_rows) + "\n")
    run(validate_config({
        "model": {"name_or_path": str(init), "dtype": "float32"}, "adapter": {"method": "full"},
        "data": {"train": str(corpus), "format": "completion", "max_seq_len": 256},
        "train": {"output_dir": str(out), "max_steps": steps, "micro_batch_size": 8, "lr": 3e-3, "warmup_steps": 10, "mixed_precision": "bf16"},
        "eval": {"on_start": False}, "logging": {"report_to": [], "progress_bar": False, "plot": False, "log_every": 10}}, "bpe-model"))
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # the test that asked for the model starts a run of its own
    return out


@pytest.fixture(scope="session")
def bpe_model_dir(tmp_path_factory) -> Path:
    """The BPE model pretrained on the demo corpus but its last 500 rows, which `bpe_finetune_rows`
    holds for fine-tuning (text the model has the style of but never saw)."""
    rows = (DEMO_DATA / "corpus.jsonl").read_text().splitlines()
    return build_bpe_model(tmp_path_factory.mktemp("bpe") / "model", rows[:-500])


@pytest.fixture(scope="session")
def bpe_finetune_rows(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bpe-rows") / "rows.jsonl"
    path.write_text("\n".join((DEMO_DATA / "corpus.jsonl").read_text().splitlines()[-500:]) + "\n")
    return path
