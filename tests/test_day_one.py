"""What users of axolotl, LLaMA-Factory and TRL reach for on day one: shipped configs by name, the
schedules and knobs every peer has, a finished run kept safe, merge/generate from anywhere, a file of
prompts answered in batches."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import DEMO_DATA, REPO, base_config, read_jsonl
from finetune.cli import main
from finetune.config import SHIPPED_CONFIGS, TrainConfig, load_config, validate_config
from finetune.errors import UserError
from finetune.train import run


def _train(tmp_path, model_dir, name, **sections):
    cfg = base_config(model_dir, tmp_path / name, **sections)
    run(validate_config(cfg, "test"))
    return tmp_path / name


def _losses(out):
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]


# --- shipped configs by name ------------------------------------------------------------------


def test_a_bare_config_name_is_the_shipped_config(tiny_model_dir, monkeypatch):
    monkeypatch.chdir(REPO)  # the shipped configs name the demo data relative to the repo
    for name in ("qlora.yaml", "qlora"):
        cfg = load_config(name, [f"model.name_or_path={tiny_model_dir}", "data.max_seq_len=128"])
        assert cfg.model.quantization.bits == 4 and cfg.train.output_dir == "outputs/qlora"
    assert load_config("llama3-8b", [f"model.name_or_path={tiny_model_dir}"], check_model=False).model.dtype == "bfloat16"  # a preset
    with pytest.raises(UserError, match=r"nope.yaml: config file not found \(nor a shipped config: finetune configs lists them\)"):
        load_config("nope.yaml")


def test_finetune_configs_lists_every_shipped_config_with_a_line_on_it(capsys):
    assert main(["configs"]) == 0
    listed = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    shipped = sorted(str(p.relative_to(REPO)) for p in [*SHIPPED_CONFIGS.glob("*.yaml"), *SHIPPED_CONFIGS.glob("presets/*.yaml")])
    assert sorted(listed) == shipped and len(shipped) >= 15
    assert all(len(about) > 10 for about in listed.values())
    assert listed["configs/qlora.yaml"].startswith("QLoRA: the base model loaded in 4-bit NF4")


# --- schedules and knobs ----------------------------------------------------------------------


def _lrs(total=100, **train):
    from finetune.optim import build_optimizer, build_scheduler

    cfg = TrainConfig(lr=1.0, **train)
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2, 2))], cfg)
    scheduler = build_scheduler(optimizer, cfg, total)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_schedules_warm_up_by_ratio_and_decay_to_the_floor():
    cosine = _lrs(scheduler="cosine", warmup_ratio=0.1, min_lr_ratio=0.1)
    assert cosine[0] == 0 and cosine[5] == pytest.approx(0.5) and cosine[10] == pytest.approx(1.0)  # 10 warmup steps
    assert cosine[-1] == pytest.approx(0.1, abs=1e-3) and min(cosine[10:]) >= 0.1 - 1e-9
    assert _lrs(scheduler="cosine")[-1] < 1e-3  # no floor by default
    linear = _lrs(scheduler="linear", warmup_steps=10, min_lr_ratio=0.2)
    assert linear[10] == pytest.approx(1.0) and linear[55] == pytest.approx(0.6, abs=0.01) and linear[-1] == pytest.approx(0.2, abs=0.01)
    assert all(a >= b for a, b in zip(linear[10:], linear[11:]))
    wsd = _lrs(scheduler="wsd", warmup_steps=10, decay_ratio=0.2, min_lr_ratio=0.0)
    assert all(lr == 1.0 for lr in wsd[10:82]) and wsd[90] == pytest.approx(0.5, abs=0.06) and wsd[-1] < 0.06  # last 18 steps decay
    assert all(lr == 1.0 for lr in _lrs(scheduler="constant", warmup_steps=5)[5:])


@pytest.mark.parametrize("train,message", [
    ({"warmup_steps": 5, "warmup_ratio": 0.1}, "warmup_steps and warmup_ratio: set one of them"),
    ({"scheduler": "constant", "min_lr_ratio": 0.1}, "min_lr_ratio: a constant schedule does not decay"),
    ({"warmup_ratio": 1.5}, "train.warmup_ratio: Input should be less than 1"),
])
def test_knob_mistakes_are_one_line(tiny_model_dir, tmp_path, train, message):
    with pytest.raises(UserError, match=message):
        validate_config(base_config(tiny_model_dir, tmp_path / "out", train=train), "test")


def test_loraplus_steps_the_b_matrices_with_the_larger_learning_rate(tmp_path, tiny_model_dir):
    """After one AdamW step each weight moves by about the LR (Adam normalizes); B starts at 0 and A
    gets no gradient through a zero B, so B alone moves: by lr x 16 with LoRA+, by lr without."""
    moved = {}
    for ratio in (None, 16.0):
        out = _train(tmp_path, tiny_model_dir, f"loraplus-{ratio}", data={"eval": None},
                     train={"max_steps": 1, "lr": 1e-3, "scheduler": "constant", "loraplus_lr_ratio": ratio})
        weights = load_file(out / "adapter_model.safetensors")
        moved[ratio] = max(v.abs().max().item() for k, v in weights.items() if "lora_B" in k)
    assert moved[None] == pytest.approx(1e-3, rel=0.05) and moved[16.0] == pytest.approx(16e-3, rel=0.05)


def test_loraplus_ratio_survives_a_new_peak_lr():
    from finetune.optim import build_optimizer, build_scheduler, set_peak_lr

    cfg = TrainConfig(lr=1e-3, loraplus_lr_ratio=8.0, scheduler="constant")
    a, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2, 2))
    optimizer = build_optimizer([a, b], cfg, fast={id(b)})
    scheduler = build_scheduler(optimizer, cfg, 10)
    set_peak_lr(scheduler, 5e-4)  # what the guard does after a rollback
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([5e-4, 4e-3])


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, tiny_model_dir):
    """3 LoRA steps with an eval before the first, data paths relative to another folder than the
    tests run from (tests below merge and generate from elsewhere)."""
    import os

    tmp = tmp_path_factory.mktemp("plain")
    shutil.copytree(DEMO_DATA, tmp / "data")
    before = os.getcwd()
    os.chdir(tmp)
    try:
        cfg = base_config(tiny_model_dir, tmp / "out", data={"train": "data/train.jsonl", "eval": "data/eval.jsonl"},
                          train={"max_steps": 3}, eval={"on_start": True, "max_batches": 2}, checkpoint={"save_every": 2})
        run(validate_config(cfg, "test"))
    finally:
        os.chdir(before)
    return tmp / "out", cfg


def test_neftune_noise_changes_training_but_not_evaluation(tmp_path, tiny_model_dir, plain_run):
    plain, cfg = plain_run
    noisy = base_config(tiny_model_dir, tmp_path / "noisy", data={"train": str(DEMO_DATA / "train.jsonl"), "eval": str(DEMO_DATA / "eval.jsonl")},
                        train={"max_steps": 3, "neftune_alpha": 5.0}, eval={"on_start": True, "max_batches": 2})
    run(validate_config(noisy, "test"))
    evals = {name: [r["eval_loss"] for r in read_jsonl(out / "metrics.jsonl") if "eval_loss" in r] for name, out in
             (("plain", plain), ("noisy", tmp_path / "noisy"))}
    assert evals["noisy"][0] == evals["plain"][0]  # before any step: the model in eval mode gets no noise
    steps = {name: _losses(out) for name, out in (("plain", plain), ("noisy", tmp_path / "noisy"))}
    assert abs(steps["noisy"][0] - steps["plain"][0]) > 1e-4  # the first step's forward already saw noisy embeddings


def test_config_overrides_reach_the_model_the_merge_and_the_length_check(tmp_path, tiny_model_dir):
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    out = _train(tmp_path, tiny_model_dir, "rope", data={"eval": None, "max_seq_len": 128},
                 model={"config_overrides": {"rope_parameters": rope}}, train={"max_steps": 2, "lr": 1e-2})
    merged = tmp_path / "merged"
    assert main(["merge", "--adapter", str(out), "--out", str(merged), "--dtype", "fp32"]) == 0
    assert json.loads((merged / "config.json").read_text())["rope_parameters"] == rope  # the merge's check then ran with it too
    # a longer context than config.json's max_position_embeddings (256) passes once that is overridden
    raw = base_config(tiny_model_dir, tmp_path / "x", data={"max_seq_len": 512})
    with pytest.raises(UserError, match="larger than the model's max_position_embeddings"):
        _check(raw, tmp_path)
    raw["model"]["config_overrides"] = {"max_position_embeddings": 1024}
    _check(raw, tmp_path)
    with pytest.raises(UserError, match="model.config_overrides: rope_typo is not a setting of LlamaConfig"):
        _train(tmp_path, tiny_model_dir, "typo", model={"config_overrides": {"rope_typo": 1}})


def _check(raw, tmp_path):
    from conftest import write_config

    return load_config(write_config(tmp_path / "c.yaml", raw))


# --- a finished run, merge and generate from anywhere -------------------------------------------


def test_a_finished_run_is_not_trained_over_by_accident(plain_run, monkeypatch, capsys):
    out, cfg = plain_run
    monkeypatch.chdir(out.parent)  # where its data paths lead
    config = str(out / "finetune_config.yaml")
    adapter = (out / "adapter_model.safetensors").read_bytes()
    assert main(["train", "--config", config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: train.output_dir: {out} holds a finished run (summary.json); start a new run with --output-dir NEW_DIR; "
                   f"or continue it on purpose with --resume {out / 'checkpoints' / 'step-000002'} (and a higher --max-steps)"]
    assert (out / "adapter_model.safetensors").read_bytes() == adapter


def test_merge_and_generate_work_from_another_directory(plain_run, tmp_path, monkeypatch, capsys):
    out, _ = plain_run  # trained with data paths relative to its own folder
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--adapter", str(out), "--prompt", "The", "--max-new-tokens", "3"]) == 0
    assert main(["merge", "--adapter", str(out / "checkpoints" / "step-000002"), "--out", "merged", "--dtype", "fp32"]) == 0
    assert (tmp_path / "merged" / "model.safetensors").is_file()


def test_a_file_of_prompts_is_answered_in_batches_as_one_at_a_time(plain_run, tmp_path, capsys):
    from finetune.generate import generate, load

    out, _ = plain_run
    prompts = ["The", "Name a colour of the sea at night", "What kind of word is this? apple", "A"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts)))
    assert main(["generate", "--adapter", str(out), "--prompts", str(path), "--out", str(tmp_path / "answers.jsonl"),
                 "--batch-size", "3", "--max-new-tokens", "6"]) == 0
    answers = read_jsonl(tmp_path / "answers.jsonl")
    model, tokenizer = load(None, str(out))
    assert [a["id"] for a in answers] == [0, 1, 2, 3]
    assert [a["completion"] for a in answers] == [generate(model, tokenizer, p, max_new_tokens=6, stream=False) for p in prompts]  # as --prompt
    path.write_text('{"prompt": "fine"}\n{"text": "no prompt"}\n')
    assert main(["generate", "--adapter", str(out), "--prompts", str(path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f'error: {path}:2: expected a JSON object with a "prompt" string, e.g. {{"prompt": "Name a colour."}}')
