"""Shared fixtures: tiny real models built from config, and helpers to run the real CLI."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml
from ranks import free_port, run_ranks  # noqa: F401  (free_port: the tests import it from here)

REPO = Path(__file__).resolve().parent.parent
# finetune's CPU attention kernel on every CPU (model/attention.SDPA_FIRST), in this process and those it launches: the
# suite's numbers do not depend on the CPU kind. test_fast_paths checks the choice itself;
# FINETUNE_CPU_ATTENTION=sdpa make test runs the suite through torch's kernel instead.
os.environ.setdefault("FINETUNE_CPU_ATTENTION", "finetune")


def bench_module(name: str) -> types.ModuleType:
    """A module of bench/, with bench/ on the import path only while it imports: left there, bench/released.py
    would shadow tests/released.py for every later test of the worker."""
    import importlib

    sys.path.insert(0, str(REPO / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "bench"))
DEMO_DATA = REPO / "demo" / "data"

os.environ.setdefault("FINETUNE_CACHE", str(REPO / ".cache" / "finetune-tests"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on this 2-core machine: one thread each (and in every process they
    # start), or their OpenMP threads spin against each other's. Before torch is imported.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
_SHM_BEFORE = set(Path("/dev/shm").glob("deepspeed_*")) if Path("/dev/shm").is_dir() else set()


# A test is `slow` when it starts processes: it, a helper of its module it calls or a fixture it uses
# runs the CLI in a subprocess, torchrun (or its workers: run_ranks) or accelerate launch. `make test-fast` runs the others.
LAUNCHES = re.compile(r"\brun_cli\(|\brun_ranks\(|\bsubprocess\.|\bPopen\(|torch\.distributed\.run|\"accelerate\", \"launch\"")


@functools.cache
def _launching(module) -> set[str]:
    """The names of the module's functions (conftest's too) that start processes, directly or through another."""
    import inspect

    functions = {}
    for source in (module, sys.modules[__name__]):
        for name, value in vars(source).items():
            function = getattr(value, "__wrapped__", value)  # fixtures
            if inspect.isfunction(function) and getattr(function, "__module__", None) == source.__name__:
                functions[name] = inspect.getsource(function)
    found = {name for name, text in functions.items() if LAUNCHES.search(text)} - {"run_cli"}
    found.add("run_cli")
    while True:
        # A call, not the word: `trained` is also English in docstrings (fixtures a test requests are in its fixturenames)
        more = {name for name, text in functions.items() if name not in found and any(re.search(rf"\b{n}\(", text) for n in found)}
        if not more:
            return found
        found |= more


# Seconds each test file took in a measured suite (FINETUNE_FILE_SECONDS=1 make test writes it again): xdist hands whole
# files (--dist loadfile) to whichever worker is free, in collection order, so the longest go first and the last to
# start are short; xdist's own order (by number of tests) left a 5-minute file to start last while the other worker idled.
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")


def pytest_configure(config):
    config.option.loadscopereorder = False  # keep the order below


def pytest_collection_modifyitems(config, items):
    import inspect

    seconds = json.loads(FILE_SECONDS.read_text())
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0].removeprefix("tests/"), 10.0))  # stable: files stay whole

    for item in items:
        if item.get_closest_marker("slow") or not hasattr(item, "function"):
            continue
        launching = _launching(item.module) if item.module else set()
        text = inspect.getsource(item.function)
        if LAUNCHES.search(text) or launching & set(item.fixturenames) or any(re.search(rf"\b{n}\(", text) for n in launching):
            item.add_marker(pytest.mark.slow)


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _FILE_SECONDS[report.nodeid.split("::")[0]] = _FILE_SECONDS.get(report.nodeid.split("::")[0], 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Seconds each test file took (setup, call and teardown added up, over the workers): what to balance or
    share when the suite outgrows its 20 minutes."""
    if _FILE_SECONDS:
        slowest = sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])[:15]
        terminalreporter.write_line("slowest files: " + ", ".join(f"{name.removeprefix('tests/')} {seconds:.0f} s" for name, seconds in slowest))
        if os.environ.get("FINETUNE_FILE_SECONDS") == "1":
            measured = {name.removeprefix("tests/"): round(seconds, 1) for name, seconds in sorted(_FILE_SECONDS.items())}
            FILE_SECONDS.write_text(json.dumps(measured, indent=1) + "\n")


def pytest_sessionfinish(session, exitstatus):
    """DeepSpeed's CPU comm leaves shared-memory buffers behind; remove those this session made, once
    every worker is done (a worker that ends first must not take a running job's buffers)."""
    if hasattr(session.config, "workerinput"):
        return
    for leftover in set(Path("/dev/shm").glob("deepspeed_*")) - _SHM_BEFORE if Path("/dev/shm").is_dir() else ():
        leftover.unlink(missing_ok=True)


def hub_cached(monkeypatch, root: Path, repo_id: str, folder: Path) -> str:
    """`folder` laid out as the Hub's cache keeps a download of `repo_id` (snapshots/<commit>, refs/main), with this process
    reading that cache offline: a model named by id, as a user's is, with no hub to reach."""
    import huggingface_hub.constants as constants

    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo_id


def run_cli(*args: str, cwd: Path = REPO, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m finetune ARGS` in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "finetune", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def train_forked(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`finetune train ARGS` in a process of its own as run_cli gives it, forked by ranks.run_ranks (no imports of its
    own): for runs that a test kills or that kill themselves (FINETUNE_FAULT in `env`)."""
    return run_ranks(1, "finetune/train.py", *args, cwd=REPO, env={**os.environ, **(env or {})})


def finetune_cli(capsys, *args: str):
    """`finetune ARGS` in this process, for what a fresh process proves nothing more about (its output
    and exit code): returncode, stdout, stderr as run_cli gives them. An unexpected exception fails the test."""
    capsys.readouterr()  # what came before is not this command's
    return finetune_in_process(*args)


def finetune_in_process(*args: str, fault: str | None = None):
    """`finetune ARGS` run by the CLI's main in this process, as run_cli gives it (returncode, stdout,
    stderr), for runs whose process proves nothing more: `fault` is FINETUNE_FAULT's value (kinds that
    leave the process alive: an injected raise gives the exit code 1 a process would). Kills, hangs and
    signals need a process of their own (run_cli)."""
    import contextlib
    import io

    from accelerate.state import AcceleratorState

    from finetune.cli import main
    from finetune.config import faults

    out, err, saved = io.StringIO(), io.StringIO(), faults.FAULT
    faults.FAULT = faults.parse(fault)
    assert faults.FAULT is None or faults.FAULT.kind not in ("kill", "term", "hang", "kill-staging", "kill-saving", "hang-saving"), fault
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exit:  # argparse: --help, usage errors
                code = exit.code
            except RuntimeError as error:
                if "injected fault" not in str(error):
                    raise
                print(f"RuntimeError: {error}", file=sys.stderr)
                code = 1
    finally:
        faults.FAULT = saved
        AcceleratorState._reset_state(True)  # the next run in this process starts from none
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def step_losses(out: Path) -> dict[int, float]:
    """A run's logged loss at each step (metrics.jsonl; a step trained again after a resume or rollback: its last)."""
    return {r["step"]: r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r}


def step_rows(out: Path) -> list[dict]:
    """A run's per-step metrics rows (not its evals')."""
    return [r for r in read_jsonl(Path(out) / "metrics.jsonl") if "loss" in r]


def killed_and_resumed(tmp_path: Path, cfg: dict, save_every: int, kill_at: int):
    """`cfg` run in tmp_path/out with a checkpoint every `save_every` steps, SIGKILLed at the start of step `kill_at`
    (a process of its own, forked by ranks.run_ranks), then started again in this process: it must resume from the last checkpoint before the
    kill. Returns the second start's result and the run's per-step metrics rows."""
    cfg["train"]["output_dir"] = str(tmp_path / "out")
    config = str(write_config(tmp_path / "resumed.yaml", cfg))
    killed = train_forked("--config", config, "--save-every", str(save_every), env={"FINETUNE_FAULT": f"kill@{kill_at}"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = finetune_in_process("train", "--config", config, "--save-every", str(save_every))
    last = kill_at // save_every * save_every
    assert resumed.returncode == 0 and f"step-{last:06d} at step {last}" in resumed.stdout, resumed.stderr[-2000:]
    return resumed, step_rows(tmp_path / "out")


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps process-wide state; each in-process run starts from none."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)


def once(tmp_path_factory, name: str, build) -> Path:
    """The folder `name` that `build(folder)` fills, built once per test session whatever the worker:
    pytest-xdist's workers each set up session fixtures of their own, so the first to need it builds it
    under a file lock in the folder their temporary folders share, and the others reuse it. A build that
    raised is built again by the next that asks."""
    import fcntl
    import shutil

    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / f"{name}.done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (root / f"{name}.done").touch()
    return folder


@pytest.fixture(scope="session")
def demo_tokenizer_dir(tmp_path_factory) -> Path:
    from finetune.model.tiny import build_tokenizer

    texts = [json.loads(line)["text"] for line in (DEMO_DATA / "corpus.jsonl").read_text().splitlines()[:1500]]
    return once(tmp_path_factory, "tokenizer", build_tokenizer(texts).save_pretrained)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, demo_tokenizer_dir) -> Path:
    """A random-weight two-layer Llama with the demo tokenizer: enough for exactness tests."""

    def build(out):
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
        config = LlamaConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(out)
        tok.save_pretrained(out)

    return once(tmp_path_factory, "tiny-model", build)


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> Path:
    """The demo base model, built by the real command with a short pretraining."""

    def build(folder):
        result = finetune_in_process("make-demo-model", "--out", str(folder / "model"), "--steps", "120")
        assert result.returncode == 0, result.stderr[-3000:]

    return once(tmp_path_factory, "demo", build) / "model"


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, demo_model_dir):
    """The shipped demo config, 60 steps from the demo model (tensorboard on): (its output folder, the
    command's result). Run once for the session (test_train and test_harness read it, often on two workers)."""

    def build(folder):
        result = finetune_in_process(
            "train", "--config", "configs/demo.yaml", "--model", str(demo_model_dir), "--output-dir", str(folder / "out"),
            "--max-steps", "60", "--set", "eval.on_start=true", "--set", "eval.every=0", "--set", "eval.generate_samples=0",
            "--set", "logging.report_to=[tensorboard]",
        )
        assert result.returncode == 0, result.stderr[-3000:]
        (folder / "result.json").write_text(json.dumps(vars(result)))

    folder = once(tmp_path_factory, "demo-run", build)
    return folder / "out", types.SimpleNamespace(**json.loads((folder / "result.json").read_text()))


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

    from finetune.config.schema import validate_config
    from finetune.model.tiny import byte_level_bpe
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
        "train": {"output_dir": str(out), "max_steps": steps, "micro_batch_size": 8, "lr": 3e-3, "warmup_steps": 10},
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


# ----------------------------------------------------------------------------------------------
# The family matrix (tests/test_families.py, and the tests that run each family elsewhere)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
WINDOW = 8  # sliding windows far shorter than the samples below
# name: (model_type, what the config adds to TINY). Each is the feature that family brings.
FAMILIES = {
    "llama3": ("llama", dict(vocab_size=128256, rope_theta=500000.0)),  # GQA, 128k vocabulary, untied head
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),  # Llama 3.2 1B/3B tie the head to the embeddings
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),  # q/k/v biases; layer 1 slides
    "qwen3": ("qwen3", dict(head_dim=16)),  # q/k norms
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=16)),  # soft-capping (50/30), alternating windows
    "gemma3": ("gemma3_text", dict(sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("phi3", dict(sliding_window=WINDOW)),  # fused qkv_proj and gate_up_proj
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2-moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                    mlp_only_layers=[0])),  # a dense first layer, a shared expert
    "qwen3-moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)),
}
MOE = [name for name, (kind, extra) in FAMILIES.items() if "experts" in json.dumps(extra)]
# Architectures outside the matrix, each for how it treats packed rows (whole configs, not TINY: the
# older ones name their sizes otherwise). Dropout off: GPT-2-era configs train with it by default,
# and these tests compare paths number for number.
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
OTHERS = {
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, **NO_DROPOUT)),  # learned positions, Conv1D layers
    "starcoder": ("gpt_bigcode", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, multi_query=True, **NO_DROPOUT)),  # attention handed no positions
    "opt": ("opt", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64,
                        max_position_embeddings=512, dropout=0.0)),  # its masks come from an all-ones attention mask
    "gptj": ("gptj", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, rotary_dim=8, **NO_DROPOUT)),  # no sdpa in transformers
    "bloom": ("bloom", dict(hidden_size=64, n_layer=2, n_head=4)),  # ALiBi from the attention mask
    "falcon": ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True)),  # attention classes of its own
    # Qwen3-Next's Gated DeltaNet with dense MLPs (mlp_only_layers): with its experts, the eager reference's rounding came back 0.2%
    # larger in layer 0's dt_bias gradient, in rows of one sample as in packed rows alike; dense, both are within 1e-6.
    "qwen3-next": ("qwen3_next", dict(TINY, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                      linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32, mlp_only_layers=[0, 1], layer_types=["linear_attention", "full_attention"])),
    "qwen3.5": ("qwen3_5_text", dict(TINY, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                     linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"])),  # Qwen3.5's text side
    "lfm2": ("lfm2", dict(TINY, layer_types=["conv", "full_attention"])),  # a short convolution along the row
    # Mamba's selective scan beside attention and experts (Jamba); Mamba2's (Bamba); Mamba2 layers whose attention is handed no
    # position ids (GraniteMoE-Hybrid); Mamba alone, whose blocks are handed no keywords at all
    "jamba": ("jamba", dict(TINY, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                            expert_layer_offset=1, mamba_d_state=8, mamba_expand=2)),
    "bamba": ("bamba", dict(TINY, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1)),
    "granite-hybrid": ("granitemoehybrid", dict(TINY, layer_types=["mamba", "attention"], num_local_experts=2, num_experts_per_tok=1,
                                                mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1)),
    "mamba": ("mamba", dict(hidden_size=64, num_hidden_layers=2, state_size=8)),
    # RecurrentGemma: an RG-LRU block whose short convolution finetune does not run a sample at a time (refused packed)
    "recurrent-gemma": ("recurrent_gemma", dict(TINY, block_types=["recurrent", "attention"], lru_width=64, attention_window_size=8)),
    # DeepSeek-V3 / Kimi K2: latent attention (MLA: q and kv through low-rank projections, a decoupled rope part, value heads
    # narrower than the query's), a dense first layer, routed experts beside a shared one, grouped top-k routing
    "deepseek-v3": ("deepseek_v3", dict(TINY, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                                        n_shared_experts=1, first_k_dense_replace=1)),
    "glm4-moe": ("glm4_moe", dict(TINY, head_dim=16, partial_rotary_factor=0.5, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  n_shared_experts=1, first_k_dense_replace=1, use_qk_norm=True)),  # GLM-4.5: partial rotary, q/k norms
    "gpt-oss": ("gpt_oss", dict(TINY, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                layer_types=["sliding_attention", "full_attention"])),  # attention sinks, biased experts stored (E, in, out)
    # Gemma 4's text side: per-layer inputs (an embedding of each token for each layer), the last layers reading the keys and
    # values of earlier ones (num_kv_shared_layers), experts beside the dense MLP (26B-A4B's block), alternating windows
    "gemma4": ("gemma4_text", dict(TINY, num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                                   hidden_size_per_layer_input=8, vocab_size_per_layer_input=1024, num_kv_shared_layers=2, enable_moe_block=True,
                                   num_experts=4, top_k_experts=2, moe_intermediate_size=32)),
    # Llama 4's text side: chunked layers (each token sees its chunk of attention_chunk_size positions) beside a full one without
    # rotary positions, whose queries take a temperature by their place in the row from floor_scale tokens on (the releases': 8192)
    "llama4": ("llama4_text", dict(TINY, head_dim=16, intermediate_size=32, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
                                   attention_chunk_size=WINDOW, layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0])),
}
MOE_OTHERS = ["deepseek-v3", "glm4-moe", "gpt-oss"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, demo_tokenizer_dir):
    """name -> a saved random tiny model of that family, with the demo tokenizer; keyword arguments
    change its config (another model, built and kept beside it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    made = {}

    def get(name: str, **changes):
        key = (name, tuple(sorted(changes.items())))
        if key not in made:
            kind, extra = FAMILIES[name] if name in FAMILIES else OTHERS[name]
            ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            config = AutoConfig.for_model(kind, **{"vocab_size": len(tok), **(TINY if name in FAMILIES else {}), **ids, **extra, **changes})
            torch.manual_seed(0)
            out = tmp_path_factory.mktemp(name)
            AutoModelForCausalLM.from_config(config).save_pretrained(out)
            tok.save_pretrained(out)
            made[key] = out
        return made[key]

    return get


def with_released_tokenizer(name: str, family: str, out: Path) -> Path:
    """OTHERS[name]'s tiny random model with a released family's real tokenizer (tests/released.py: its vocabulary,
    special ids and chat template), saved at `out`."""
    import torch
    from released import tokenizer_dir
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir(family))
    kind, extra = OTHERS[name]
    config = AutoConfig.for_model(kind, **{**extra, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def released(tmp_path_factory):
    """name -> a released model's shape (tests/released.py: docs/examples/NAME/config.json), scaled down with its
    structure kept, random weights, its family's real tokenizer; keyword arguments change the config (or, as
    tokenizer=FAMILY, the tokenizer). Built once a session."""
    from released import build

    def get(name: str, **changes):
        key = hashlib.sha256(json.dumps(changes, sort_keys=True).encode()).hexdigest()[:8] if changes else "as-released"
        return once(tmp_path_factory, f"released-{name}-{key}", lambda folder: build(name, folder / "model", **changes)) / "model"

    return get


# ------------------------------------------------------------------------------------------------
# Batches and gradients the equivalence tests compare (fast paths, families, CUDA)


def packed_batch(model_dir):
    """Six alpaca rows packed into two rows of a batch (the shorter one padded), prompts masked."""
    from transformers import AutoTokenizer

    from finetune.data.encoding import tokenize_row
    from finetune.data.packing import Row, collate
    from finetune.data.rows import IGNORE

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"instruction": "What kind of word is this?", "input": w, "output": k}
            for w, k in [("apple", "noun"), ("red", "adjective"), ("finds", "verb"), ("Anna", "name"), ("tiger", "noun"), ("blue", "adjective")]]
    samples = [tokenize_row(r, tok, "alpaca", False) for r in rows]
    samples = [(s["input_ids"], [IGNORE] + s["labels"][1:]) for s in samples]
    packed = [Row(sum((s[0] for s in group), []), sum((s[1] for s in group), []), sum((list(range(len(s[0]))) for s in group), []))
              for group in (samples[:4], samples[4:])]
    return collate(packed, tok.pad_token_id)  # two rows, the shorter padded (a segment of its own)


def loss_and_grads(model, batch):
    """finetune's token loss sum over the batch and the trained parameters' gradients."""
    from finetune.objectives import loss

    model.zero_grad()
    value = loss.token_loss_sum(model, batch)
    value.backward()
    return value.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def textbook_samples(vocab: int) -> list[tuple[list[int], list[int]]]:
    """Five samples of 9-40 tokens (most longer than the window), prompts masked, first token never trained."""
    import torch

    from finetune.data.rows import IGNORE

    gen = torch.Generator().manual_seed(1)
    out = []
    for n in (30, 12, 25, 9, 40):
        ids = torch.randint(3, min(vocab, 700), (n,), generator=gen).tolist()
        out.append((ids, [IGNORE] * (n // 3) + ids[n // 3 :]))
    return out


def samples_batch(samples, packed: bool) -> dict:
    """The samples as a batch: packed into two rows, or one row each."""
    from finetune.data.packing import Row, collate

    rows = []
    for group in ([samples[:3], samples[3:]] if packed else [[s] for s in samples]):
        ids = [t for s in group for t in s[0]]
        rows.append(Row(ids, [t for s in group for t in s[1]], [p for s in group for p in range(len(s[0]))]))
    return collate(rows, pad_id=0)


def adapted_lora(model_dir):
    """The tiny model with a LoRA adapter whose B is not zero, so the policy differs from the reference (test_preference, test_grpo:
    losses and gradients against TRL's trainers)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                                                       target_modules="all-linear", init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.3)  # peft's random B moves the logits a lot on a 64-wide model; a milder difference from the reference
    return model


def trained_grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def textbook(model, samples, device: str = "cpu") -> tuple[float, dict]:
    """The library's eager attention and full logits, one sample at a time, plain cross-entropy."""
    import torch
    import torch.nn.functional as F

    from finetune.data.rows import IGNORE

    model.set_attn_implementation("eager")
    model.zero_grad()
    total = 0.0
    for ids, labels in samples:
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0, :-1]
        value = F.cross_entropy(logits.float(), torch.tensor(labels[1:], device=device), ignore_index=IGNORE, reduction="sum")
        value.backward()
        total += value.item()
    return total, trained_grads(model)


def strategy_config(model_dir, out, method, nproc, strategy="ddp", **sections) -> dict:
    """The config train_strategy runs: global batch 4 rows either way (1 process x micro 4, or 2 processes x
    micro 2: the same rows), 4 steps, no eval, `sections` merged in."""
    cfg = base_config(model_dir, out, adapter={"method": method}, data={"eval": None},
                      train={"max_steps": 4, "micro_batch_size": 4 // nproc, "lr": 1e-2 if method != "full" else 1e-3},
                      distributed={"strategy": strategy})
    for key, values in sections.items():
        cfg.setdefault(key, {}).update(values)
    return cfg


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """The test run table: `trained(model_dir, method, processes=1, strategy="ddp", **sections)` trains as
    train_strategy does, once per test session for each distinct config (its output folder aside; one
    process is the same run under any strategy's name), by whichever worker asks first (`once`), and
    gives every test that asks for that run its (output folder, per-step losses, summary). For tests
    that read a run's outputs and write nothing there."""
    table = {}

    def get(model_dir, method, processes=1, strategy="ddp", **sections):
        strategy = "none" if processes == 1 else strategy
        cfg = strategy_config(model_dir, Path("."), method, processes, strategy, **sections)
        del cfg["train"]["output_dir"]
        key = json.dumps([cfg, processes], sort_keys=True, default=str)
        if key not in table:
            table[key] = None  # a failed run fails the first test that asked for it, and is not retried
            name = "trained-" + hashlib.sha256(key.encode()).hexdigest()[:16]
            folder = once(tmp_path_factory, name, lambda f: train_strategy(f, "run", model_dir, method, processes, strategy, **sections))
            table[key] = run_outputs(folder / "run")
        if table[key] is None:
            pytest.fail("this shared run failed (see the first test that asked for it)")
        return table[key]

    return get


def torchrun(nproc: int, *args: str) -> list[str]:
    """The command that starts `nproc` processes of `args` on this machine with torchrun (a rendezvous of its own)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]


def train_strategy(tmp_path, name, model_dir, method, nproc, strategy="ddp", accelerate_config=None, **sections):
    """`finetune train` under a strategy: one process (in this one) or several (torchrun's workers as ranks.run_ranks
    starts them, or accelerate launch with one of configs/accelerate); (output folder, per-step losses, summary)."""
    out = tmp_path / name
    cfg = strategy_config(model_dir, out, method, nproc, strategy, **sections)
    config = str(write_config(tmp_path / f"{name}.yaml", cfg))
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        result = finetune_in_process("train", "--config", config)
    elif accelerate_config:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"configs/accelerate/{accelerate_config}.yaml",
                    "--main_process_port", str(free_port())]
        result = subprocess.run([*launcher, "finetune/train.py", "--config", config], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    else:  # torchrun's workers, without its agent or their imports (tests/ranks.py)
        result = run_ranks(nproc, "finetune/train.py", "--config", config, env=env, cwd=REPO)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    if nproc > 1:
        (out / "console.log").write_text(result.stdout + result.stderr)
    return run_outputs(out)


def run_outputs(out: Path) -> tuple[Path, list[float], dict]:
    """A finished run's (output folder, per-step losses, summary)."""
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    return out, losses, json.loads((out / "summary.json").read_text())


def gpu_branch_on_cpu(monkeypatch) -> None:
    """The CUDA branch of the packed attention and the fused loss taken on CPU tensors (their kernels as the tests
    replace them): finetune.model.attention.accelerator_path answers yes, where it is defined and where the loss uses it."""
    from finetune.model import attention
    from finetune.objectives import loss

    monkeypatch.setattr(attention, "accelerator_path", lambda tensor: True)
    monkeypatch.setattr(loss, "accelerator_path", lambda tensor: True)


def wait_for(done, job, what: str, seconds: float = 300, every: float = 0.05) -> None:
    """Poll `done()` until it holds, while `job` (a Popen) runs: a deadline, not an endless loop, bounds the wait, and
    a job that ends first fails the test with its stderr."""
    import time

    deadline = time.monotonic() + seconds
    while not done():
        assert job.poll() is None, f"the job ended before {what}: " + job.communicate()[1][-2000:]
        assert time.monotonic() < deadline, f"no {what} within {seconds:g} s"
        time.sleep(every)


def documented_varlen(with_gqa: bool):
    """torch.nn.attention.varlen.varlen_attn's documented contract, computed by sdpa per segment: its
    kernel runs on CUDA only (tests/test_gpu.py holds this stand-in to the real one). Checks what the caller must meet."""
    import torch
    import torch.nn.functional as F

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **kw):
        assert set(kw) <= ({"enable_gqa"} if with_gqa else set()) and cu_q.dtype == torch.int32 and cu_q is cu_k
        assert q.shape[1] == k.shape[1] or kw.get("enable_gqa"), "torch 2.11 needs as many key/value heads as query heads"
        edges = cu_q.tolist()
        assert edges[0] == 0 and edges[-1] == q.shape[0] and max_q == max_k == max(e - s for s, e in zip(edges, edges[1:]))
        left, right = window_size
        outs = []
        for s, e in zip(edges, edges[1:]):
            i, j = torch.arange(e - s, device=q.device)[:, None], torch.arange(e - s, device=q.device)[None]
            allowed = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device)
            if right >= 0:
                allowed &= j <= i + right
            if left >= 0:
                allowed &= j >= i - left
            outs.append(F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1) for x in (q, k, v)), attn_mask=allowed, scale=scale,
                                                       enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1))
        return torch.cat(outs)

    return varlen_attn
