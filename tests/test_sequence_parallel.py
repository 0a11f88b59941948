"""Sequence parallelism (distributed.sequence_parallel): 2 processes that each hold half of every row
give the loss and gradients of one process holding whole rows, through DeepSpeed's Ulysses attention
over gloo, packed samples kept apart across the cut; training, eval and resume agree with one process."""

from __future__ import annotations

import json
import os

import pytest
from conftest import DEMO_DATA, REPO, base_config, finetune_in_process, read_jsonl, run_ranks, step_losses, train_strategy, write_config

pytest.importorskip("deepspeed")

# Each rank computes the whole batch's loss and gradients alone (the reference), then its slice's
# through Ulysses; the slices' sums, reduced over both ranks, must give the reference.
PROBE = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import torch, torch.distributed as dist
dist.init_process_group("gloo")
from conftest import samples_batch, textbook_samples, trained_grads
from finetune.objectives import loss
from finetune.parallel import sequence_parallel
from finetune.config.schema import AdapterConfig, ModelConfig
from finetune.model.loading import apply_adapter, load_model

sp = sequence_parallel.setup(2, dist.get_rank(), dist.get_world_size())
results = {}
for case, (model_dir, method, layout) in json.loads(sys.argv[2]).items():
    torch.manual_seed(0)
    model = load_model(ModelConfig(name_or_path=model_dir), say=lambda _: None)
    if method == "lora":  # adapters that change the output, so their gradients are not all alike
        model = apply_adapter(model, AdapterConfig(r=4, dropout=0.0), gradient_checkpointing=False)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    model.train()
    batch = samples_batch(textbook_samples(model.config.vocab_size), layout == "packed")
    reference = loss.token_loss_sum(model, loss.to_device(batch, "cpu"))
    reference.backward()
    expected = trained_grads(model)
    model.zero_grad()
    part = loss.token_loss_sum(model, loss.to_device(sp.shard(batch, 0), "cpu"))
    part.backward()
    total = part.detach().clone()
    dist.all_reduce(total)
    worst = 0.0
    for name, grad in trained_grads(model).items():
        dist.all_reduce(grad)
        worst = max(worst, ((grad - expected[name]).norm() / expected[name].norm()).item())
    results[case] = {"loss": total.item(), "reference": reference.item(), "grads": worst, "count": len(expected),
                     "cut_rows": batch["input_ids"].shape[1]}
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(results))
dist.destroy_process_group()
"""

CASES = [("llama3", "lora", "packed"), ("llama3", "full", "unpacked"), ("qwen2", "lora", "unpacked"), ("qwen2", "full", "packed"),
         ("mistral", "full", "packed"), ("phi3", "lora", "packed")]


@pytest.fixture(scope="module")
def probed(tmp_path_factory, family_dirs):
    """One 2-process launch for every case (each a fresh model)."""
    probe = tmp_path_factory.mktemp("sp") / "probe.py"
    probe.write_text(PROBE)
    cases = {"-".join(case): (str(family_dirs(case[0])), case[1], case[2]) for case in CASES}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_ranks(2, str(probe), str(REPO), json.dumps(cases), env=env, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.mark.parametrize("case", ["-".join(case) for case in CASES])
def test_two_slices_give_the_whole_rows_loss_and_gradients(probed, case):
    """Llama (GQA, 128k vocabulary), Qwen2 (q/k/v biases, a sliding window shorter than the samples),
    Mistral (sliding window), Phi-3 (fused qkv); 5 samples of 9-40 tokens packed into rows of 67 (odd:
    the second slice ends in a padding token) or one a row; LoRA and full fine-tuning. Measured: losses
    equal to 1e-7, gradients to 2.7e-7 (relative norm)."""
    got = probed[case]
    assert got["loss"] == pytest.approx(got["reference"], rel=1e-5), got
    assert got["grads"] < 1e-4 and got["count"] > 0, got



SP2 = {"distributed": {"sequence_parallel": 2}}


@pytest.mark.parametrize("strategy,method,tiled", [("ddp", "lora", 1), ("fsdp", "full", 2), ("zero3", "lora", 2)])
def test_training_with_two_slices_equals_one_process(tmp_path, tiny_model_dir, trained, strategy, method, tiled):
    """The demo data packed into rows of 128 tokens, 4 rows a step, eval included: 2 processes that
    share every row (a data-parallel world of 1), with the MLPs tiled under fsdp and zero3, against one
    plain process."""
    common = {"train": {"micro_batch_size": 4, "max_steps": 4}, "data": {"eval": str(DEMO_DATA / "eval.jsonl")}, "eval": {"every": 2}}
    reference, one, _ = trained(tiny_model_dir, method, **common)
    out, two, summary = train_strategy(tmp_path, "two", tiny_model_dir, method, 2, strategy, **common, **SP2, model={"tiled_mlp": tiled})
    assert summary["world_size"] == 2 and len(two) == 4
    assert "batch: 4 micro x 1 accum x 1 process(es) (of 2: 2 share each row) = 4 rows per step" in (out / "console.log").read_text()
    assert two == pytest.approx(one, rel=1e-5)
    evals = [[r["eval_loss"] for r in read_jsonl(o / "metrics.jsonl") if "eval_loss" in r] for o in (reference, out)]
    assert len(evals[0]) == 3 and evals[1] == pytest.approx(evals[0], rel=1e-5)  # at the start, step 2 and the end


def test_a_checkpoint_of_two_slices_resumes_with_two_bitwise_and_with_one_closely(tmp_path, tiny_model_dir):
    common = {"train": {"micro_batch_size": 4, "max_steps": 6}, "data": {"eval": None}}
    out, _, _ = train_strategy(tmp_path, "full", tiny_model_dir, "lora", 2, "ddp", **common, **SP2, checkpoint={"save_every": 3})
    saved = str(out / "checkpoints" / "step-000003")
    expected = step_losses(out)
    again, _, _ = train_strategy(tmp_path, "two", tiny_model_dir, "lora", 2, "ddp", **common, **SP2, checkpoint={"resume": saved})
    alone, _, _ = train_strategy(tmp_path, "one", tiny_model_dir, "lora", 1, "none", **common, checkpoint={"resume": saved})
    resumed = {s: loss for s, loss in step_losses(again).items() if s > 3}
    assert resumed == {s: expected[s] for s in (4, 5, 6)}  # the same floats
    assert step_losses(alone) == pytest.approx({s: expected[s] for s in (4, 5, 6)}, rel=1e-5)


def test_sizes_that_cannot_work_are_refused_in_one_line_before_loading(tmp_path, tiny_model_dir, family_dirs, capsys):
    """The tiny Llama has 4 attention heads and 2 key/value heads."""
    def refused(sections, command="validate", model=tiny_model_dir):
        config = write_config(tmp_path / "c.yaml", base_config(model, tmp_path / "out", **sections))
        result = finetune_in_process(command, "--config", str(config))
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        return result.stderr

    assert "3 does not divide the model's attention heads 4 and key/value heads 2" in refused({"distributed": {"sequence_parallel": 3}})
    assert "4 does not divide the model's key/value heads 2; choose a divisor of 2" in refused({"distributed": {"sequence_parallel": 4}})
    assert "splits the rows of sft runs only, not dpo's pairs" in refused({**SP2, "train": {"objective": "dpo"}, "data": {"format": "preference"}})
    assert "2 does not divide the 1 processes started" in refused(SP2, "train")
    assert "soft-caps its attention logits (50.0), which runs eager attention" in refused(SP2, "validate", family_dirs("gemma2"))
    assert "model.compile is not supported with yet" in refused({"model": {"tiled_mlp": 2, "compile": True}})
    if not __import__("torch").cuda.is_available():
        assert "train.offload_activations: moves saved activations from a GPU" in refused({"train": {"offload_activations": True}})
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_model_on_eager_attention_with_a_router_loss_or_a_state_along_the_row_is_refused(family_dirs):
    from finetune.config.errors import UserError
    from finetune.config.schema import ModelConfig
    from finetune.model.loading import load_model
    from finetune.parallel import sequence_parallel

    gemma2 = load_model(ModelConfig(name_or_path=str(family_dirs("gemma2"))), say=lambda _: None)  # soft-capping: eager attention
    with pytest.raises(UserError, match="runs eager attention"):
        sequence_parallel.check_model(2, gemma2, 0.0)
    mixtral = load_model(ModelConfig(name_or_path=str(family_dirs("mixtral"))), say=lambda _: None)
    with pytest.raises(UserError, match="load-balancing loss"):
        sequence_parallel.check_model(2, mixtral, 0.02)
    sequence_parallel.check_model(2, mixtral, 0.0)
    lfm2 = load_model(ModelConfig(name_or_path=str(family_dirs("lfm2"))), say=lambda _: None)  # finetune's packed attention, and a convolution
    with pytest.raises(UserError, match=r"^distributed.sequence_parallel: this model's Lfm2ShortConv layers carry a state along the row, "):
        sequence_parallel.check_model(2, lfm2, 0.0)


@pytest.mark.parametrize("family", ["llama3", "qwen2", "phi3"])
@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_tiled_mlp_gives_the_untiled_loss_and_gradients(family_dirs, family, method):
    """model.tiled_mlp 3 (rows of 67 tokens: chunks of 23, 23, 21) under gradient checkpointing, as
    training runs it: the loss to 1e-6, every gradient to 1e-5 (relative norm)."""
    import torch
    from conftest import samples_batch, textbook_samples, trained_grads

    from finetune.config.schema import AdapterConfig, ModelConfig
    from finetune.model.loading import apply_adapter, load_model
    from finetune.objectives import loss
    from finetune.parallel import sequence_parallel

    results, folder = [], str(family_dirs(family))  # built before seeding: building draws random weights
    for tiled in (1, 3):
        torch.manual_seed(0)
        model = load_model(ModelConfig(name_or_path=folder), say=lambda _: None)
        if method == "lora":
            model = apply_adapter(model, AdapterConfig(r=4, dropout=0.0), gradient_checkpointing=True)
            with torch.no_grad():  # B away from zero: A's gradients then differ from zero too
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if tiled > 1:
            assert sequence_parallel.tile_mlps(model, tiled) == model.config.num_hidden_layers
        model.train()
        value = loss.token_loss_sum(model, loss.to_device(samples_batch(textbook_samples(model.config.vocab_size), True), "cpu"))
        value.backward()
        results.append((value.item(), trained_grads(model)))
    (plain, expected), (tiled, got) = results
    assert tiled == pytest.approx(plain, rel=1e-6)
    assert expected.keys() == got.keys() and any("mlp" in name for name in got)
    for name, grad in expected.items():
        assert (got[name] - grad).norm() <= 1e-5 * grad.norm(), name


def test_a_tiled_mlp_recomputes_under_the_forwards_autocast(family_dirs):
    """bf16 weights and fp32 LoRA under bf16 autocast with peft's input casts off, as bf16 training runs
    them: the backward's recomputed chunks run under autocast as the forward did (outside it, the first
    chunk's bf16 input met an fp32 LoRA weight and raised; seen on an H200), and the loss and gradients
    are the untiled ones."""
    import torch
    from conftest import samples_batch, textbook_samples, trained_grads

    from finetune.config.schema import AdapterConfig, ModelConfig
    from finetune.model.loading import adapter_input_casting_off, apply_adapter, load_model
    from finetune.objectives import loss
    from finetune.parallel import sequence_parallel

    results, folder = [], str(family_dirs("llama3"))
    for tiled in (1, 3):
        torch.manual_seed(0)
        model = apply_adapter(load_model(ModelConfig(name_or_path=folder, dtype="bfloat16"), say=lambda _: None), AdapterConfig(r=4, dropout=0.0),
                              gradient_checkpointing=True)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        if tiled > 1:
            sequence_parallel.tile_mlps(model, tiled)
        model.train()
        with adapter_input_casting_off(model, "bf16"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                value = loss.token_loss_sum(model, loss.to_device(samples_batch(textbook_samples(model.config.vocab_size), True), "cpu"))
            value.backward()
        results.append((value.item(), trained_grads(model)))
    (plain, expected), (tiled, got) = results
    assert tiled == pytest.approx(plain, rel=1e-3)  # bf16 matmuls over chunks of 23 rows instead of 67 may round apart
    for name, grad in expected.items():
        assert got[name].dtype == torch.float32 and (got[name] - grad).norm() <= 2e-2 * grad.norm(), name


def test_tiling_refuses_experts_and_ddp(tmp_path, tiny_model_dir, family_dirs, monkeypatch):
    from finetune.config.errors import UserError
    from finetune.config.schema import ModelConfig
    from finetune.model.loading import load_model
    from finetune.parallel import sequence_parallel

    mixtral = load_model(ModelConfig(name_or_path=str(family_dirs("mixtral"))), say=lambda _: None)
    with pytest.raises(UserError, match="tiles dense MLPs only; this model's feed-forward layers are MixtralSparseMoeBlock"):
        sequence_parallel.tile_mlps(mixtral, 2)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as a launcher of 2 processes sets it
    config = write_config(tmp_path / "c.yaml", base_config(tiny_model_dir, tmp_path / "out", model={"tiled_mlp": 2}))
    result = finetune_in_process("validate", "--config", str(config))
    assert result.returncode == 2 and "DDP takes one per step; use distributed.strategy fsdp or a zero strategy" in result.stderr
