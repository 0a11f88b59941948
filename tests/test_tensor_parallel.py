"""Tensor parallelism (distributed.tensor_parallel) with FSDP2 on a 2-D mesh: 4 real gloo processes as 2 data-parallel
x 2 tensor-parallel, against one process with the same global batch; its checkpoint resumed on another mesh; what
it cannot run refused in one line."""

from __future__ import annotations

import shutil

import pytest
from conftest import base_config, finetune_in_process, step_rows, train_strategy, write_config

TP2 = {"train": {"micro_batch_size": 2}, "distributed": {"tensor_parallel": 2}}  # 4 processes: each pair shares 2 rows of the 4


@pytest.fixture(scope="module")
def split_runs(trained, tiny_model_dir):
    """method -> the 2 x 2 run (the LoRA one saves at step 2) and the one-process run."""
    saving = {"lora": {"checkpoint": {"save_every": 2, "async_save": False}}, "full": {}}
    return {m: (trained(tiny_model_dir, m, 4, "fsdp", **TP2, **saving[m]), trained(tiny_model_dir, m)) for m in ("lora", "full")}


@pytest.mark.parametrize("method", ["lora", "full"])
def test_two_by_two_mesh_trains_as_one_process(split_runs, method):
    (out, losses, summary), (ref_out, ref_losses, ref) = split_runs[method]
    assert summary["world_size"] == 4 and losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), (losses, ref_losses)
    assert [r["grad_norm"] for r in step_rows(out)] == pytest.approx([r["grad_norm"] for r in step_rows(ref_out)], rel=1e-4)  # clipped as one process
    # each process holds less than FSDP2 over the 2 data-parallel processes alone would give it: the layers are split too
    assert all(n < ref["param_numel_per_rank"][0] / 2 for n in summary["param_numel_per_rank"]), summary["param_numel_per_rank"]
    assert "(of 4: 2 share each row, each holding a share of the weights)" in (out / "console.log").read_text()
    # the plan's split of the layers (each process's gradients: its trained elements x 4 bytes) is what each one held
    from finetune.config.files import load_config
    from finetune.outputs.plan import make_plan

    planned = make_plan(load_config(out / "finetune_config.yaml", check_model=False), devices=4).rows["gradients"] / 4
    assert planned == pytest.approx(summary["param_numel_per_rank"][0], rel=0.02), (planned, summary["param_numel_per_rank"])
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
    ours, theirs = load_file(out / name), load_file(ref_out / name)  # gathered from both mesh dimensions into the full shapes
    assert sorted(ours) == sorted(theirs)
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-5


def test_a_two_by_two_checkpoint_resumes_on_two_processes_without_the_split(tmp_path, tiny_model_dir, split_runs):
    (out, losses, _), _ = split_runs["lora"]
    saved = out / "checkpoints" / "step-000002"
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(saved, resumed_dir / "checkpoints" / saved.name)
    _, resumed, _ = train_strategy(tmp_path, "resumed", tiny_model_dir, "lora", 2, "fsdp")
    assert resumed == pytest.approx(losses[2:], rel=1e-5), (resumed, losses)


def test_a_per_head_norm_sums_its_gradient_over_the_split(released, trained):
    """Qwen3's q/k norms see only a process's heads (the plan's replicated_with_grad_allreduce): under full fine-tuning
    their gradients are summed over the pair, or each copy would move by its half. SGD, whose step is the gradient
    (Adam's first steps are its sign, which half a gradient keeps)."""
    from safetensors.torch import load_file

    model, sgd = released("qwen3-0.6b"), {"optimizer": "sgd", "lr": 0.5}
    one_out, one, _ = trained(model, "full", train=sgd)
    two_out, two, summary = trained(model, "full", 4, "fsdp", train={**TP2["train"], **sgd}, distributed=TP2["distributed"])
    assert summary["world_size"] == 4 and two == pytest.approx(one, rel=1e-5, abs=1e-6), (two, one)
    ours, theirs = load_file(two_out / "model.safetensors"), load_file(one_out / "model.safetensors")
    norms = [k for k in ours if k.endswith(("q_norm.weight", "k_norm.weight"))]
    assert norms and max((ours[k] - theirs[k]).abs().max().item() for k in norms) < 1e-5
    assert max((theirs[k] - load_file(model / "model.safetensors")[k]).abs().max().item() for k in norms) > 1e-3  # they moved


def test_what_the_split_cannot_run_is_refused_in_one_line(tmp_path, tiny_model_dir, family_dirs):
    from finetune.config.errors import UserError
    from finetune.config.schema import ModelConfig
    from finetune.model.loading import load_model
    from finetune.parallel import tensor_parallel

    def refused(sections, command="validate"):
        config = write_config(tmp_path / "c.yaml", base_config(tiny_model_dir, tmp_path / "out", **sections))
        result = finetune_in_process(command, "--config", str(config))
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        return result.stderr

    fsdp = {"distributed": {"strategy": "fsdp", "tensor_parallel": 2}}
    assert "tensor_parallel: 2 runs with distributed.strategy fsdp" in refused({"distributed": {"tensor_parallel": 2}})
    assert "runs with train.objective sft (not dpo)" in refused({**fsdp, "train": {"objective": "dpo"}, "data": {"format": "preference"}})
    assert "runs with adapter.method lora or full" in refused({**fsdp, "adapter": {"method": "dora"}})
    assert "runs with a 16/32-bit base" in refused({**fsdp, "model": {"quantization": {"bits": 4, "backend": "torchao"}}})
    assert "tensor_parallel: 2 does not divide the 1 processes started" in refused(fsdp, "train")
    tiny = load_model(ModelConfig(name_or_path=str(tiny_model_dir)), say=lambda _: None)  # 4 heads, 2 key/value heads
    with pytest.raises(UserError, match="^distributed.tensor_parallel: 4 does not divide the model's key/value heads 2; choose a divisor$"):
        tensor_parallel.check_model(4, tiny)
    for family, why in (("mixtral", "plan uses .*moe_tp_experts"), ("phi3", "plan uses colwise_gather_output")):
        model = load_model(ModelConfig(name_or_path=str(family_dirs(family))), say=lambda _: None)
        with pytest.raises(UserError, match=why):
            tensor_parallel.check_model(2, model)
