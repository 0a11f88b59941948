"""Training end to end on real tiny models: learning, exact reload, accumulation, launchers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, base_config, finetune_in_process, read_jsonl, write_config

from finetune.config.schema import validate_config
from finetune.data.datasets import load_data
from finetune.model.loading import load_tokenizer
from finetune.train import run


def test_demo_config_learns(demo_run):
    """The shipped demo config: eval loss on held-out words falls by more than half in 60 steps."""
    out, result = demo_run
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if "eval_loss" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 60
    assert evals[-1]["eval_loss"] < 0.5 * evals[0]["eval_loss"], evals
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "elapsed_s"):
        assert all(key in r for r in steps), key
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert not (out / "events.jsonl").exists()  # the guard's defaults never fire on a healthy run
    assert (out / "tokenizer.json").is_file() and (out / "finetune_config.yaml").is_file()
    assert (out / "loss_curve.png").stat().st_size > 1000
    assert list((out / "finetune").glob("events.out.tfevents.*")), "tensorboard events"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["world_size"] == 1
    assert "loss curve:" in result.stdout and "saved to:" in result.stdout


def test_overfit_one_batch(tmp_path, tiny_model_dir):
    """The classic sanity check: a model memorises one batch."""
    cfg = base_config(tiny_model_dir, tmp_path / "out", adapter={"method": "full"}, train={"lr": 3e-3, "warmup_steps": 0, "scheduler": "constant"})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "c.yaml", cfg)), "--overfit-batch", "80", "--set", "data.eval=null")
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["loss"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 80
    assert losses[0] > 4.0 and losses[-1] < 0.05, (losses[0], losses[-1])


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_saved_adapter_reloads_with_identical_logits(tmp_path, tiny_model_dir, method):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = validate_config(base_config(tiny_model_dir, tmp_path / "out", adapter={"method": method}, train={"max_steps": 3, "lr": 1e-2}), "test")
    trained = run(cfg).model.eval()
    tok = load_tokenizer(cfg.model)
    batch = load_data(cfg.data, tok, 0).eval.batch([0, 1], tok.pad_token_id)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "out").eval()
    untuned = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        kwargs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        a, b, c = trained(**kwargs).logits, reloaded(**kwargs).logits, untuned(**kwargs).logits
    assert (a - b).abs().max() < 1e-5
    assert (a - c).abs().max() > 1e-3  # the adapter really changed the model


def test_grad_accumulation_matches_one_big_batch(tmp_path, tiny_model_dir):
    """1 x micro-batch 8 and 4 x micro-batch 2 give the same first update (loss normalised per token)."""
    weights = []
    for micro, accum in ((8, 1), (2, 4)):
        cfg = base_config(
            tiny_model_dir, tmp_path / f"out{micro}", adapter={"method": "full"}, data={"eval": None, "packing": False},
            train={"max_steps": 1, "micro_batch_size": micro, "grad_accum": accum, "optimizer": "sgd", "lr": 0.5, "momentum": 0.0, "max_grad_norm": None},
        )
        model = run(validate_config(cfg, "test")).model
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    moved = 0.0
    for name, w0 in start.items():
        update_big, update_accum = weights[0][name] - w0, weights[1][name] - w0
        moved = max(moved, update_big.abs().max().item())
        assert torch.allclose(update_big, update_accum, atol=1e-6, rtol=1e-4), (name, (update_big - update_accum).abs().max())
    assert moved > 1e-3  # the step did something


def test_script_entry_point_runs(tmp_path, tiny_model_dir):
    """`python finetune/train.py --config ...` (what accelerate launch and torchrun execute)."""
    cfg = base_config(tiny_model_dir, tmp_path / "out")
    result = subprocess.run([sys.executable, "finetune/train.py", "--config", str(write_config(tmp_path / "c.yaml", cfg))],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 4


@pytest.mark.parametrize("precision,words", [("fp16", "fp16 needs a GPU"), ("fp8", "fp8 needs an NVIDIA GPU")])
def test_gpu_only_precision_refused_on_cpu(tmp_path, tiny_model_dir, precision, words):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    cfg = base_config(tiny_model_dir, tmp_path / "out", train={"mixed_precision": precision})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "c.yaml", cfg)))
    assert result.returncode == 2 and words in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_bad_data_row_stops_train_with_file_and_line(tmp_path, tiny_model_dir):
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": 3}\n')
    cfg = base_config(tiny_model_dir, tmp_path / "out", data={"train": str(data), "eval": None, "cache_dir": str(tmp_path / "c")})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "c.yaml", cfg)))
    assert result.returncode == 2, result.stderr
    assert f"{data}:2: field 'output' must be a string" in result.stderr


def test_gradient_checkpointing_with_lora_gives_the_same_step(tmp_path, tiny_model_dir):
    """Non-reentrant checkpointing with a frozen base still reaches the adapters, with identical losses."""
    runs = []
    for ckpt in (False, True):
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)
        cfg = base_config(tiny_model_dir, tmp_path / f"out{ckpt}", train={"max_steps": 3, "gradient_checkpointing": ckpt})
        result = run(validate_config(cfg, "test"))
        losses = [r["loss"] for r in read_jsonl(tmp_path / f"out{ckpt}" / "metrics.jsonl") if "loss" in r]
        runs.append((losses, {k: v.detach().clone() for k, v in result.model.named_parameters() if "lora_" in k}))
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-5)
    assert runs[0][1].keys() == runs[1][1].keys() and runs[0][1]
    for name, value in runs[0][1].items():
        assert torch.allclose(value, runs[1][1][name], atol=1e-6), name


def test_a_nan_loss_in_the_first_steps_stops_the_run_before_the_update(tmp_path, tiny_model_dir):
    cfg = base_config(tiny_model_dir, tmp_path / "out", train={"max_steps": 6, "micro_batch_size": 2})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "c.yaml", cfg)), fault="nan@2")
    assert result.returncode == 3, result.stderr[-2000:]  # the run stopped itself: a divergence
    assert "error: step 3: the training loss is nan in the first 10 steps, so the model is not learning; stopped" in result.stderr
    assert "Traceback" not in result.stderr
    assert [r.get("step") for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r] == [1, 2]  # nothing after
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_a_finished_run_lets_go_of_its_model(tmp_path, tiny_model_dir):
    """Once train.run has returned and its result is dropped, the model is freed at once: no thread of
    the run and no reference cycle of its state still holds it. (The watchdog's thread held the whole run
    state for up to a poll after the run, and the state's cycles until the next full collection: on an
    H200, five runs in one process each started with the weights of the runs before still on the card.)"""
    import weakref

    # bitsandbytes logs an optional import that failed with the exception as the record's argument, and
    # pytest's log capture keeps the record: imported first inside the run, it would keep the run's frames.
    import bitsandbytes  # noqa: F401

    cfg = base_config(tiny_model_dir, tmp_path / "out", data={"eval": None}, train={"max_steps": 2})
    result = run(validate_config(cfg, "test"))
    model = weakref.ref(result.model)
    del result
    assert model() is None


def test_the_replica_check_sees_one_value_off_by_one_ulp_with_constant_memory():
    """The end-of-run check that DDP replicas hold the same weights: a 256 MB model is checked with a
    few tens of MB of extra memory (a flat float64 copy with its positions: over 1 GB), and the smallest possible drift shows."""
    from finetune.parallel.distributed import replica_checksum
    from finetune.parallel.runtime import peak_rss, reset_peak_rss

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 1024, 1024)), torch.nn.Parameter(torch.randn(1000))]
    drifted = [torch.nn.Parameter(p.detach().clone()) for p in params]
    with torch.no_grad():
        drifted[0].view(-1)[5_000_000] = torch.nextafter(drifted[0].view(-1)[5_000_000], torch.tensor(float("inf")))
    reset_peak_rss()
    before = peak_rss()
    same = replica_checksum(params)
    extra = peak_rss() - before
    assert torch.equal(same, replica_checksum([torch.nn.Parameter(p.detach().clone()) for p in params]))
    assert not torch.equal(same, replica_checksum(drifted))
    assert extra < 96 * 2**20, f"the check took {extra / 2**20:.0f} MiB"
