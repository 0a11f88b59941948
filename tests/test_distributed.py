"""DDP, FSDP2 and DeepSpeed ZeRO over gloo with 2 real processes, against one process with the same
global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, base_config, free_port, strategy_config, torchrun, train_strategy, write_config

from finetune.config.schema import validate_config


@pytest.fixture(scope="module")
def single(trained, tiny_model_dir):
    return {m: trained(tiny_model_dir, m) for m in ("lora", "full", "dora")}


@pytest.fixture(scope="module")
def two_process_runs(trained, tiny_model_dir, ram_root):
    """2-process LoRA runs by strategy (from the run table), for the tests that only read their outputs. The ddp
    run stages the model in RAM (model.ramdisk): both ranks start at once, one copies, both load it."""

    def get(strategy):
        staging = {"model": {"ramdisk": str(ram_root / "ddp")}} if strategy == "ddp" else {}
        if strategy == "fsdp":  # a synchronous save, compared with a background one below
            staging["checkpoint"] = {"save_every": 2, "async_save": False}
        return trained(tiny_model_dir, "lora", 2, strategy, **staging)

    return get


# Offload moves the optimizer's states to the host whatever they belong to: the full model's are the larger test.
@pytest.mark.parametrize("strategy,method", [(s, m) for s in ("ddp", "fsdp", "zero2", "zero3") for m in ("lora", "full")]
                         + [("zero3_offload", "full"), ("fsdp", "dora"), ("zero3", "dora")])
def test_two_processes_match_one(tmp_path, tiny_model_dir, single, two_process_runs, strategy, method):
    # Activation checkpointing per decoder layer under FSDP changes nothing either.
    extra = {"train": {"gradient_checkpointing": True}} if (strategy, method) == ("fsdp", "dora") else {}
    if method == "lora":
        out, losses, summary = two_process_runs(strategy)
    else:
        out, losses, summary = train_strategy(tmp_path, "two", tiny_model_dir, method, 2, strategy, **extra)
    _, ref_losses, ref = single[method]
    assert summary["world_size"] == 2 and summary["strategy"] == strategy
    assert len(losses) == len(ref_losses) == 4
    assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-5), (losses, ref_losses)
    trainable = ref["param_numel_per_rank"][0]
    shards = summary["param_numel_per_rank"]
    if strategy != "ddp":  # really sharded: each rank holds about half (of the fp32 master weights for zero2)
        assert all(n <= trainable / 2 + 1024 for n in shards) and sum(shards) >= trainable, (shards, trainable)
    else:
        assert shards == [trainable, trainable] and summary["replicas_identical"] is True
    if strategy == "fsdp":  # rank 0 streamed the weights layer by layer from the files, but for DoRA
        assert ("rank 0 loads the whole model before sending the shards: DoRA" in (out / "console.log").read_text()) == (method == "dora")
    if method == "full" and strategy != "ddp":  # the shards gathered into the saved model: every weight, the trained values
        _same_saved_model(out, single["full"][0])


def _same_saved_model(saved, reference) -> None:
    from safetensors.torch import load_file

    ours, theirs = load_file(saved / "model.safetensors"), load_file(reference / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-4


def test_two_ranks_stage_one_ram_copy_and_both_load_it(two_process_runs, ram_root):
    """The losses of this run equal one process loading from disk (test_two_processes_match_one)."""
    out, _, summary = two_process_runs("ddp")
    console = (out / "console.log").read_text()
    staged = [line for line in console.splitlines() if "ramdisk: staged" in line]
    reused = [line for line in console.splitlines() if "ramdisk: reusing the staged copy" in line]
    assert len(staged) == len(reused) == 1, console[-3000:]
    assert summary["model_loaded_from"].startswith(str(ram_root / "ddp"))


def test_hybrid_fsdp_replicates_across_groups(tmp_path, tiny_model_dir, single):
    """HSDP with shards of 1 process over 2 processes: two replicas (a 2-D mesh), the same losses."""
    _, losses, summary = train_strategy(tmp_path, "hsdp", tiny_model_dir, "lora", 2, "fsdp", distributed={"fsdp_shard_size": 1})
    assert losses == pytest.approx(single["lora"][1], rel=1e-4, abs=1e-5)
    assert summary["param_numel_per_rank"] == [single["lora"][2]["param_numel_per_rank"][0]] * 2


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_gathered_adapter_loads_in_one_process_and_equals_the_trained_one(tmp_path, tiny_model_dir, single, two_process_runs, strategy):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, _, _ = two_process_runs(strategy)
    ids = torch.randint(5, 200, (2, 24))
    logits = []
    for adapter in (out, single["lora"][0]):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter).eval()
        with torch.no_grad():
            logits.append(model(input_ids=ids, use_cache=False).logits)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        untuned = base(input_ids=ids, use_cache=False).logits
    assert (logits[0] - logits[1]).abs().max() < 1e-4
    assert (logits[0] - untuned).abs().max() > 1e-3  # not an empty or partial adapter
    _merges_cleanly(out, tmp_path / "merged")


def test_fsdp_checkpoint_resumes_at_two_and_at_one_process(tmp_path, tiny_model_dir, two_process_runs):
    """DCP writes one shard file per rank, here in the background (DCP's async_save): the same bytes
    as the shared run's synchronous save. A 2-process and a 1-process run (same global batch: micro 2
    x accum 2) both resume from it and continue with the uninterrupted run's losses."""
    import shutil

    full, losses, _ = train_strategy(tmp_path, "full", tiny_model_dir, "lora", 2, "fsdp", checkpoint={"save_every": 2, "async_save": True})
    saved = full / "checkpoints" / "step-000002"
    assert sorted(p.name for p in (saved / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert "being written in the background" in (full / "console.log").read_text()
    written = {mode: json.loads((folder / "checkpoints" / "step-000002" / "manifest.json").read_text())
               for mode, folder in (("background", full), ("synchronous", two_process_runs("fsdp")[0]))}
    for files in written.values():
        assert files.pop("finetune_config.yaml")  # differs by the output_dir and async_save
        assert files.pop("sharded/.metadata")  # DCP's index records the folder it was written to
    assert written["background"] == written["synchronous"]  # every other file's size and sha256 (both ranks' shards)
    for nproc in (2, 1):
        out = tmp_path / f"resumed-{nproc}"
        shutil.copytree(saved, out / "checkpoints" / saved.name)
        extra = {"train": {"max_steps": 4, "micro_batch_size": 2, "grad_accum": 2 // nproc, "lr": 1e-2}}
        _, resumed, _ = train_strategy(tmp_path, f"resumed-{nproc}", tiny_model_dir, "lora", nproc, "fsdp", **extra)
        assert resumed == pytest.approx(losses[2:], rel=1e-5), (nproc, resumed, losses)
    _merges_cleanly(saved, tmp_path / "merged")  # the DCP shards, read in one process


def _merges_cleanly(adapter, out) -> None:
    """finetune merge of a sharded run's adapter or checkpoint: equal to base+adapter, and not empty."""
    from finetune.outputs.merge import merge

    report = merge(str(adapter), str(out), dtype="fp32")
    assert report["passed"] and report["merged_vs_tuned"]["max"] < 1e-4 and report["adapter_effect"]["max"] > 1e-3, report


def test_zero3_checkpoint_resumes_at_the_same_world_size_and_at_another(tmp_path, tiny_model_dir):
    """2 -> 2 through DeepSpeed's own files; 2 -> 1 through its universal-checkpoint conversion (into
    the resuming run's folder, removed after); 1 -> 2 from an unsharded checkpoint through DeepSpeed's
    safe_set_full_* routes. The same global batch each way, so the losses continue."""
    import shutil

    full, losses, _ = train_strategy(tmp_path, "full", tiny_model_dir, "lora", 2, "zero3", checkpoint={"save_every": 2})
    saved = full / "checkpoints" / "step-000002"
    assert sorted(p.name for p in (saved / "deepspeed" / "state").iterdir() if "optim_states" in p.name) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / saved.name)
    _, resumed, _ = train_strategy(tmp_path, "resumed", tiny_model_dir, "lora", 2, "zero3")
    assert resumed == pytest.approx(losses[2:], rel=1e-5), (resumed, losses)

    before = {p.name: p.read_bytes() for p in (saved / "deepspeed" / "state").iterdir()}
    one, at_one, _ = train_strategy(tmp_path, "one", tiny_model_dir, "lora", 1, "zero3", checkpoint={"resume": str(saved), "save_every": 3})
    assert at_one == pytest.approx(losses[2:], rel=1e-5), (at_one, losses)
    assert {p.name: p.read_bytes() for p in (saved / "deepspeed" / "state").iterdir()} == before  # converted elsewhere
    assert not [p.name for p in one.iterdir() if p.name.startswith(".universal")]  # and that copy removed

    _, at_two, _ = train_strategy(tmp_path, "two", tiny_model_dir, "lora", 2, "zero3", checkpoint={"resume": str(one / "checkpoints" / "step-000003")})
    assert at_two == pytest.approx(losses[3:], rel=1e-5), (at_two, losses)
    _merges_cleanly(saved, tmp_path / "merged")  # DeepSpeed's partitioned files, gathered in one process


def test_a_rank_that_raises_stops_the_whole_job_quickly(tmp_path, tiny_model_dir):
    cfg = base_config(tiny_model_dir, tmp_path / "out", train={"max_steps": 200, "micro_batch_size": 2})
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "FINETUNE_FAULT": "raise@3:rank=1"}
    # A hang would last until gloo's collective timeout, 1,800 s (torch's default; finetune sets none); the job takes ~20 s
    # here: the launch's own deadline (600 s, TimeoutExpired) tells the two apart on a machine 30x slower.
    result = subprocess.run([*torchrun(2), "finetune/train.py",
                             "--config", str(write_config(tmp_path / "c.yaml", cfg))], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode != 0
    assert "injected fault on rank 1 at step 3" in result.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


@pytest.mark.parametrize("accelerate_config", ["fsdp", "zero3"])
def test_accelerate_launch_config_leads_to_that_strategy(tmp_path, tiny_model_dir, single, accelerate_config):
    """accelerate launch --config_file gives the run torchrun gives (same losses)."""
    _, losses, summary = train_strategy(tmp_path, "acc", tiny_model_dir, "lora", 2, accelerate_config, accelerate_config=accelerate_config)
    assert summary["strategy"] == accelerate_config and summary["world_size"] == 2
    assert losses == pytest.approx(single["lora"][1], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("accelerate_config,strategy", [("fsdp", "ddp"), ("zero3_offload", "zero3")])
def test_an_accelerate_config_the_run_config_disagrees_with_is_refused(tmp_path, tiny_model_dir, monkeypatch, accelerate_config, strategy):
    """Never a silent fall-back to DDP: what accelerate launch --config_file hands its processes (read from a script it
    really launches, not from train.py: a refusal needs no model) makes the recipe's first check refuse the run."""
    from finetune.config.errors import UserError
    from finetune.parallel.runtime import launcher_strategy

    script = tmp_path / "env.py"
    script.write_text("import json, os, sys\njson.dump(dict(os.environ), open(sys.argv[1] + os.environ['RANK'], 'w'))\n")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"configs/accelerate/{accelerate_config}.yaml",
              "--main_process_port", str(free_port()), str(script), str(tmp_path / "env")]
    done = subprocess.run(launch, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "ACCELERATE_USE_CPU": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    cfg = validate_config(strategy_config(tiny_model_dir, tmp_path / "out", "lora", 2, strategy), "test")
    for rank in (0, 1):
        with monkeypatch.context() as patch:
            patch.setattr(os, "environ", json.loads((tmp_path / f"env{rank}").read_text()))
            with pytest.raises(UserError, match=f"accelerate config asks for {accelerate_config} but the run config has distributed.strategy: {strategy}"):
                launcher_strategy(cfg)


def test_a_nan_loss_on_one_rank_stops_every_rank(tmp_path, tiny_model_dir):
    """The first-steps guard looks at the loss reduced over ranks, so all ranks stop at the same step."""
    cfg = base_config(tiny_model_dir, tmp_path / "out", train={"max_steps": 6, "micro_batch_size": 2}, distributed={"strategy": "fsdp"})
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "FINETUNE_FAULT": "nan@1:rank=1"}
    result = subprocess.run([*torchrun(2), "finetune/train.py",
                             "--config", str(write_config(tmp_path / "c.yaml", cfg))], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    assert result.stderr.count("error: step 2: the training loss is nan") == 2, result.stderr[-3000:]


SP2 = {"train": {"micro_batch_size": 4}, "distributed": {"sequence_parallel": 2}}  # both processes share each row of 4
NF4 = {"model": {"quantization": {"bits": 4, "backend": "torchao"}}}  # FSDP + QLoRA: torchao's NF4 base in one process too


# Llama 3.2's LoRA under FSDP2 is its QLoRA case's path (the tie streamed into rank 0's skeleton) with a 16-bit base, and
# Gemma 3's LoRA case's: left out of the suite (30 s).
@pytest.mark.parametrize("name,method,strategy,sections", [("qwen3-0.6b", "full", "fsdp", {}),
                                                           ("gemma-3-1b", "lora", "fsdp", {}), ("qwen3-0.6b", "full", "zero3", {}),
                                                           ("qwen3-0.6b", "lora", "ddp", SP2), ("llama-3.2-1b", "lora", "fsdp", NF4)],
                         ids=["qwen3-0.6b-full-fsdp", "gemma-3-1b-lora-fsdp", "qwen3-0.6b-full-zero3", "qwen3-0.6b-lora-sp2",
                              "llama-3.2-1b-qlora-fsdp"])
def test_a_tied_head_trains_sharded_or_split_as_one_process(released, trained, name, method, strategy, sections):
    """Llama 3.2 1B/3B, Qwen 2.5 0.5-3B, Qwen3 0.6-4B and Gemma tie their head to the embeddings: the skeleton rank 0
    streams into keeps the tie (it failed with "no value for base_model.model.lm_head.weight"), and the full model
    saved from the shards holds the one trained tensor for both. Gemma 3 (the shipped gemma3-1b preset under fsdp)
    likewise; Qwen3 also under ZeRO-3 (fp32 states of a tied head) and with its rows split over 2 processes (sequence
    parallelism: heads of 128 with q/k norms, 4 query and 2 key/value heads shared out). Llama 3.2 also as QLoRA under
    FSDP2 (torchao's NF4 base, its real tokenizer's data), against the same 4-bit base in one process."""
    # NF4: widths whose scale groups (256 blocks of 64) split over 2 processes as over 1, as released models' do
    model = released(name, **({"hidden_size": 256, "intermediate_size": 512, "num_key_value_heads": 2} if sections is NF4 else {}))
    _, one, _ = trained(model, method, **(NF4 if sections is NF4 else {}))
    out, two, summary = trained(model, method, 2, strategy, **sections)
    assert summary["world_size"] == 2 and two == pytest.approx(one, rel=1e-4, abs=1e-5), (two, one)
    if method == "full":
        from safetensors import safe_open

        with safe_open(out / "model.safetensors", "pt") as f:  # trained as one tensor: the head, if saved apart, equals the embeddings
            assert "lm_head.weight" not in f.keys() or torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight"))
