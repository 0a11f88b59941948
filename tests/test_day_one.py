"""What users of axolotl, LLaMA-Factory and TRL reach for on day one: shipped configs by name, the
schedules and knobs every peer has, a finished run kept safe, merge/generate from anywhere, a file of
prompts answered in batches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from conftest import DEMO_DATA, REPO, base_config, read_jsonl
from safetensors.torch import load_file

from finetune.cli import main
from finetune.config.errors import UserError
from finetune.config.files import SHIPPED_CONFIGS, load_config
from finetune.config.schema import TrainConfig, validate_config
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


def test_installed_without_the_repository_a_config_is_named_by_its_path_and_a_bare_name_says_so(tmp_path):
    """A wheel carries the package alone (pyproject.toml: finetune*): there `finetune configs` and a bare name say in one line
    that there are no shipped configs, exit 2; a config named by its path still loads."""
    site = tmp_path / "site"
    shutil.copytree(REPO / "finetune", site / "finetune", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(site)}
    listed = subprocess.run([sys.executable, "-m", "finetune", "configs"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 2 and "this finetune has no shipped configs" in listed.stderr, listed.stderr[-2000:]
    assert len(listed.stderr.strip().splitlines()) == 1 and "Traceback" not in listed.stderr
    shutil.copy(REPO / "configs" / "lora.yaml", tmp_path / "mine.yaml")
    code = ("from finetune.config.files import load_config; import sys\n"
            "print(load_config(sys.argv[1], check_model=False, check_paths=False).adapter.method)")
    by_path = subprocess.run([sys.executable, "-c", code, "mine.yaml"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert by_path.returncode == 0 and by_path.stdout.strip() == "lora", by_path.stderr[-2000:]
    bare = subprocess.run([sys.executable, "-c", code, "qlora"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "qlora: config file not found; this finetune has no shipped configs" in bare.stderr, bare.stderr[-2000:]


# --- schedules and knobs ----------------------------------------------------------------------


def _lrs(total=100, **train):
    from finetune.parallel.optim import build_optimizer, build_scheduler

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
    from finetune.parallel.optim import build_optimizer, build_scheduler, set_peak_lr

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


def test_a_run_folder_has_a_model_card_of_the_run(plain_run):
    """README.md in the Hub's model-card format (huggingface_hub reads it): the base, peft, the data,
    no license chosen for the user; the run's eval loss, the reproducing command and its config."""
    from huggingface_hub import ModelCard

    out, cfg = plain_run
    summary = json.loads((out / "summary.json").read_text())
    card = ModelCard.load(out / "README.md")
    # a local base is named in the text, not in the header (the Hub rejects a path as base_model); a hub id goes there
    assert card.data.base_model is None and f"of `{summary['base_model']}`" in card.text
    assert card.data.library_name == "peft" and card.data.license is None
    from finetune.outputs.model_card import hub_id

    assert hub_id("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B" and hub_id(str(out)) is None
    assert card.data.datasets == ["train.jsonl"] and {"finetune", "sft", "lora"} <= set(card.data.tags)
    assert f"| eval loss | {summary['eval_loss']:.4g} |" in card.text and "finetune train --config finetune_config.yaml" in card.text
    assert (out / "finetune_config.yaml").read_text().strip() in card.text and "![loss curve]" not in card.text  # plots off here


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


def test_model_compile_compiles_every_decoder_layer_and_trains_and_evaluates_the_same(tmp_path, tiny_model_dir, plain_run):
    plain, cfg = plain_run
    compiled = base_config(tiny_model_dir, tmp_path / "compiled", data={"train": str(DEMO_DATA / "train.jsonl"), "eval": str(DEMO_DATA / "eval.jsonl")},
                           train={"max_steps": 3}, eval={"on_start": True, "max_batches": 2})
    compiled["model"]["compile"] = True
    result = run(validate_config(compiled, "test"))
    layers = result.model.get_base_model().model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)  # each layer, in place: parameter names unchanged
    rows = {name: read_jsonl(out / "metrics.jsonl") for name, out in (("plain", plain), ("compiled", tmp_path / "compiled"))}
    for key in ("loss", "eval_loss"):
        assert [r[key] for r in rows["compiled"] if key in r] == pytest.approx([r[key] for r in rows["plain"] if key in r], abs=1e-5)
    ours, theirs = (load_file(out / "adapter_model.safetensors") for out in (tmp_path / "compiled", plain))
    assert ours.keys() == theirs.keys() and all(torch.allclose(ours[k], theirs[k], atol=1e-5) for k in ours)


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
    # validate checks the config: the finished run is named in a warning, not refused.
    assert main(["validate", "--config", config]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: train.output_dir: {out} holds a finished run (summary.json); start a new run with --output-dir NEW_DIR; "
                        f"or continue it on purpose with --resume {out / 'checkpoints' / 'step-000002'} (and a higher --max-steps) "
                        "(train refuses this folder)"]


def test_a_worker_torchrun_starts_again_after_its_job_finished_ends_with_nothing_to_do(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """A node joining an elastic job in the moment between the last save and the workers' exit: torchrun starts the workers
    again on the finished run (seen in CI: refused with exit 2, restarted up to --max-restarts while the other node's rank
    waited for rank 0). The same job's workers (rendezvous id and config, grad_accum aside) end with 0 and say so; another
    job id, another config or no torchrun meet the refusal, as before; nothing in the folder changes."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    out = _train(tmp_path, tiny_model_dir, "run", train={"max_steps": 2}, data={"eval": None})
    config = str(out / "finetune_config.yaml")
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["train", "--config", config]) == 0
    assert capsys.readouterr().out.strip() == f"done: {out} holds this job's finished run (rendezvous id job-1, summary.json): nothing left to do"
    assert main(["train", "--config", config, "--set", "train.grad_accum=4"]) == 0  # what an elastic resize re-derives
    assert main(["train", "--config", config, "--set", "train.max_steps=3"]) == 2
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")
    assert main(["train", "--config", config]) == 2
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert main(["train", "--config", config]) == 2
    assert "holds a finished run" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files


@pytest.mark.parametrize("name", ["lora", "dora", "full", "demo", "qlora-fsdp"])
def test_shipped_configs_validate_after_make_demo(plain_run, name, tmp_path, monkeypatch, capsys):
    """The README's order, `make demo` then `make test`, in a copy of the repo: the shipped configs
    validate with a finished demo run in outputs/demo (validate names it; train would refuse it)."""
    finished, _ = plain_run
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    shutil.copytree(DEMO_DATA, tmp_path / "demo" / "data")
    shutil.copytree(finished, tmp_path / "outputs" / "demo")  # what `make demo` leaves
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "--config", f"configs/{name}.yaml", "--set", "model.name_or_path=hub-org/some-model"]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["data"]["train"]
    warnings = [line.split(" holds ")[0].split(": cannot read")[0] for line in err.splitlines() if line.startswith("warning: ")]
    assert warnings == ["warning: model.name_or_path"] + (["warning: train.output_dir: outputs/demo"] if name == "demo" else [])
    assert "(validate skips the checks that need the model's config; train stops here)" in err  # a hub id not downloaded here
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["demo"]  # validate wrote nothing


def test_merge_and_generate_work_from_another_directory(plain_run, tmp_path, monkeypatch, capsys):
    """From another folder: generate streams the adapter's own greedy text; a checkpoint merged there generates the text
    that checkpoint's base + adapter generate."""
    from finetune.outputs.generate import generate, load

    out, _ = plain_run  # trained with data paths relative to its own folder
    monkeypatch.chdir(tmp_path)
    expected = generate(*load(None, str(out)), "The", max_new_tokens=6, stream=False)
    checkpoint = out / "checkpoints" / "step-000002"
    at_checkpoint = generate(*load(None, str(checkpoint)), "The", max_new_tokens=6, stream=False)
    capsys.readouterr()
    assert main(["generate", "--adapter", str(out), "--prompt", "The", "--max-new-tokens", "6"]) == 0
    assert expected.strip() and expected in capsys.readouterr().out
    assert main(["merge", "--adapter", str(checkpoint), "--out", "merged", "--dtype", "fp32"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", "merged", "--prompt", "The", "--max-new-tokens", "6"]) == 0
    assert at_checkpoint.strip() and at_checkpoint in capsys.readouterr().out


def test_a_file_of_prompts_is_answered_in_batches_as_one_at_a_time(plain_run, tmp_path, capsys):
    from finetune.outputs.generate import generate, load

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
        f'error: {path}:2: expected a JSON object with a "prompt" string (and an "image" path, for a picture), e.g. {{"prompt": "Name a colour."}}')


# --- the data shapes people have ----------------------------------------------------------------

CHAT = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What kind of word is this?\n\nrabbit"},
                      {"role": "assistant", "content": "noun"}]},
        {"messages": [{"role": "user", "content": "What kind of word is this?\n\nquickly"}, {"role": "assistant", "content": "adverb"},
                      {"role": "user", "content": "And run?"}, {"role": "assistant", "content": "verb"}]}]
ALPACA = [{"instruction": "What kind of word is this?", "input": "rabbit", "output": "noun"},
          {"instruction": "Name a colour.", "input": "", "output": "red"}]


def _sharegpt(row):
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": speakers[m["role"]], "value": m["content"]} for m in row["messages"]]}


def _parts(row):
    return {"messages": [{**m, "content": [{"type": "text", "text": m["content"][:5]}, {"type": "text", "text": m["content"][5:]}]}
                         for m in row["messages"]]}


def _tokens(tmp_path, tokenizer_dir, path, fmt, **data):
    """Every sample of a file as the training loop gets it: (input_ids, labels), one per row."""
    from finetune.config.schema import DataConfig, ModelConfig
    from finetune.data.chat import choose_template
    from finetune.data.datasets import load_data
    from finetune.model.loading import load_tokenizer

    tok = load_tokenizer(ModelConfig(name_or_path=str(tokenizer_dir)))
    choose_template(tok, None, fmt, say=lambda _: None)
    cfg = DataConfig(train=str(path), format=fmt, packing=False, cache_dir=str(tmp_path / "cache"), max_seq_len=256, **data)
    split = load_data(cfg, tok, seed=0).train
    return sorted((r.input_ids.tolist(), r.labels.tolist()) for r in split.rows(range(len(split))))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sharegpt_openai_parts_and_mapped_columns_train_as_the_canonical_rows(tmp_path, tiny_model_dir):
    chat = _tokens(tmp_path, tiny_model_dir, _write(tmp_path / "chat.jsonl", CHAT), "chat")
    assert len(chat) == 2 and all(any(label != -100 for label in labels) for _, labels in chat)
    assert _tokens(tmp_path, tiny_model_dir, _write(tmp_path / "sharegpt.jsonl", [_sharegpt(r) for r in CHAT]), "chat") == chat
    assert _tokens(tmp_path, tiny_model_dir, _write(tmp_path / "parts.jsonl", [_parts(r) for r in CHAT]), "chat") == chat
    renamed = [{"dialog": r["messages"]} for r in CHAT]
    assert _tokens(tmp_path, tiny_model_dir, _write(tmp_path / "renamed.jsonl", renamed), "chat", columns={"messages": "dialog"}) == chat
    alpaca = _tokens(tmp_path, tiny_model_dir, _write(tmp_path / "alpaca.jsonl", ALPACA), "alpaca")
    mapped = [{"question": r["instruction"], "context": r["input"], "answer": r["output"]} for r in ALPACA]
    assert _tokens(tmp_path, tiny_model_dir, _write(tmp_path / "qa.jsonl", mapped), "alpaca",
                   columns={"instruction": "question", "input": "context", "output": "answer"}) == alpaca


def test_csv_and_text_files_are_rows_too(tmp_path, tiny_model_dir):
    import csv

    alpaca = _tokens(tmp_path, tiny_model_dir, _write(tmp_path / "alpaca.jsonl", ALPACA), "alpaca")
    with (tmp_path / "alpaca.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["instruction", "input", "output"])
        writer.writeheader()
        writer.writerows(ALPACA)
    assert _tokens(tmp_path, tiny_model_dir, tmp_path / "alpaca.csv", "alpaca") == alpaca
    texts = ["The needle looked wise.", "A red fox, then a blue one."]
    completion = _tokens(tmp_path, tiny_model_dir, _write(tmp_path / "texts.jsonl", [{"text": t} for t in texts]), "completion")
    (tmp_path / "texts.txt").write_text(texts[0] + "\n\n" + texts[1] + "\n")
    assert _tokens(tmp_path, tiny_model_dir, tmp_path / "texts.txt", "completion") == completion


@pytest.mark.parametrize("rows,fmt,message", [
    ([_sharegpt(CHAT[0])], "alpaca", ":1: missing field 'instruction' (format 'alpaca'; this row looks like format 'chat': set data.format: chat)"),
    ([ALPACA[0]], "chat", ":1: missing or empty field 'messages' (format 'chat'; this row looks like format 'alpaca': set data.format: alpaca)"),
    ([{"conversations": [{"from": "narrator", "value": "x"}]}], "chat", ":1: conversations[0] must be {from: human|gpt|system|tool, value: string}"),
    ([{"messages": [{"role": "user", "content": [{"type": "audio", "audio": {"path": "x.wav"}}]}]}], "chat",
     ":1: messages[0].content: only text and image parts can be trained on (got audio)"),
])
def test_rows_of_another_shape_are_named_in_one_line(tmp_path, tiny_model_dir, rows, fmt, message):
    path = _write(tmp_path / "rows.jsonl", rows)
    with pytest.raises(UserError) as err:
        _tokens(tmp_path, tiny_model_dir, path, fmt)
    assert str(err.value).startswith(f"{path}{message}")


# --- long documents and long prompts ------------------------------------------------------------


def _load(tmp_path, tiny_model_dir, path, fmt, **data):
    from finetune.config.schema import DataConfig, ModelConfig
    from finetune.data.datasets import load_data
    from finetune.model.loading import load_tokenizer

    tok = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    cfg = DataConfig(train=str(path), format=fmt, cache_dir=str(tmp_path / "cache"), **data)
    return load_data(cfg, tok, seed=0), tok


@pytest.mark.parametrize("overlap", [0, 16])
def test_a_long_document_trains_as_windows_with_every_token_once(tmp_path, tiny_model_dir, overlap):
    text = " ".join(json.loads(line)["text"] for line in (DEMO_DATA / "corpus.jsonl").read_text().splitlines()[:40])
    path = _write(tmp_path / "doc.jsonl", [{"text": text}])
    data, tok = _load(tmp_path, tiny_model_dir, path, "completion", max_seq_len=128, packing=False, chunk_overlap=overlap)
    doc = tok(text, add_special_tokens=True)["input_ids"] + [tok.eos_token_id]
    assert len(doc) > 600
    windows = [data.train.rows([r])[0] for r in range(len(data.train))]
    assert all(len(w.input_ids) <= 128 for w in windows)
    stride = 128 - overlap
    for k, w in enumerate(windows):  # each window is the document's tokens from k x stride on, its context not trained
        assert w.input_ids.tolist() == doc[k * stride : k * stride + 128]
        assert (w.labels[: max(overlap, 1)] == -100).all() if k else w.labels[0] == -100
    covered = sorted(k * stride + i for k, w in enumerate(windows) for i in np.flatnonzero(w.labels != -100).tolist())
    assert covered == (list(range(1, len(doc))) if overlap else sorted(set(range(1, len(doc))) - {k * stride for k in range(len(windows))}))
    assert data.stats["train"]["chunked"] == 1 and data.stats["train"]["windows"] == len(windows) and data.stats["train"]["truncated"] == 0
    truncated, _ = _load(tmp_path, tiny_model_dir, path, "completion", max_seq_len=128, packing=False, long_documents="truncate")
    assert len(truncated.train) == 1 and truncated.stats["train"]["truncated"] == 1


def test_prompts_longer_than_max_seq_len_are_named_with_what_to_raise(tmp_path, tiny_model_dir):
    long_prompt = {"instruction": "word " * 80, "input": "", "output": "noun"}
    path = _write(tmp_path / "long.jsonl", [long_prompt, long_prompt])
    with pytest.raises(UserError, match=rf"data: no sample of {path} has a trained token within data.max_seq_len=32: the prompts of 2 of 2 "
                                        rf"samples are that long or longer \(e.g. {path}:1, whose answer starts at token (\d+)\); "
                                        r"raise data.max_seq_len above \1"):
        _load(tmp_path, tiny_model_dir, path, "alpaca", max_seq_len=32)
    _write(path, [ALPACA[0], long_prompt, ALPACA[1]])
    data, _ = _load(tmp_path, tiny_model_dir, path, "alpaca", max_seq_len=32)
    assert data.stats["train"]["dropped_no_target"] == 1 and data.stats["train"]["first_dropped"] == f"{path}:2"


# --- what a glance at a run tells -----------------------------------------------------------------


def test_the_loss_curve_shows_the_learning_rate_and_the_guards_events_and_trackers_get_the_whole_config(tmp_path, tiny_model_dir, monkeypatch):
    import yaml

    from finetune.config import faults
    from finetune.run.metrics import curve_data

    monkeypatch.setattr(faults, "FAULT", faults.parse("nan@12"))  # a poisoned batch (FINETUNE_FAULT, in-process): the guard skips that step
    out = tmp_path / "out"
    cfg = base_config(tiny_model_dir, out, data={"eval": None}, train={"max_steps": 15, "warmup_steps": 3},
                      logging={"report_to": ["tensorboard"], "plot": True, "project": "wordkinds", "run_name": "try-7"})
    run(validate_config(cfg, "test"))
    curve = curve_data(out)
    assert curve["events"] == [(12, "skip")]
    lrs = dict(curve["lr"])
    assert lrs[1] < lrs[3] and lrs[15] < lrs[4] and len(curve["train"]) == 14  # warmup then decay; the skipped step has no loss
    assert (out / "loss_curve.png").stat().st_size > 10_000
    logged = yaml.safe_load(next((out / "wordkinds").rglob("hparams.yml")).read_text())  # TensorBoard, under the project's name
    assert logged["adapter.r"] == 8 and logged["model.name_or_path"] == str(tiny_model_dir) and logged["logging.run_name"] == "try-7"
    assert logged["data.format"] == "alpaca" and logged["train.skip_data"] == "[]" and len(logged) > 90  # every key, not only train's


def _wandb_records(path):
    """The records of an offline W&B run file: a 7-byte header, then LevelDB's log format (32 KiB blocks
    of chunks with a 7-byte header each: crc, length, type) around protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data, pos, record = path.read_bytes(), 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        record, pos = record + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            record = b""
            yield parsed


def test_wandb_offline_and_mlflow_get_the_run_names_the_whole_config_and_the_metrics(tmp_path, tiny_model_dir, monkeypatch):
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    out = tmp_path / "out"
    cfg = base_config(tiny_model_dir, out, data={"eval": None}, train={"max_steps": 4},
                      logging={"report_to": ["wandb", "mlflow"], "project": "wordkinds", "run_name": "try-7", "tags": ["lora", "demo"]})
    run(validate_config(cfg, "test"))
    losses = {r["step"]: r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r}
    assert len(losses) == 4

    records = list(_wandb_records(next(out.glob("wandb/offline-run-*/run-*.wandb"))))  # W&B writes under the run's folder
    started = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (started.display_name, started.project, list(started.tags)) == ("try-7", "wordkinds", ["lora", "demo"])
    config = {u.key: json.loads(u.value_json) for r in records if r.WhichOneof("record_type") == "config" for u in r.config.update}
    assert config["adapter.r"] == 8 and config["logging.run_name"] == "try-7" and len(config) > 90
    history = [{"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert {h["_step"]: h["loss"] for h in history if "loss" in h} == pytest.approx(losses, abs=1e-6)

    client = mlflow.MlflowClient()
    (logged,) = client.search_runs([client.get_experiment_by_name("wordkinds").experiment_id])
    assert logged.info.run_name == "try-7" and {"lora", "demo"} <= set(logged.data.tags)
    assert logged.data.params["adapter.r"] == "8" and len(logged.data.params) > 90
    history = {m.step: m.value for m in client.get_metric_history(logged.info.run_id, "loss")}
    assert history == pytest.approx(losses, abs=1e-6)


def test_mlflow_without_a_database_driver_is_refused_in_one_line(tmp_path, tiny_model_dir, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sqlalchemy" else real(name, *a))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = base_config(tiny_model_dir, tmp_path / "out", logging={"report_to": ["mlflow"]})
    with pytest.raises(UserError, match=r"sqlite:///mlflow.db needs sqlalchemy and alembic \(pip install finetune-kit\[mlflow\]\)"):
        run(validate_config(cfg, "test"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")  # a server needs no driver here
    from finetune.run.preflight import check_trackers

    check_trackers(validate_config(cfg, "test"))


def test_wandb_without_a_key_or_offline_mode_is_refused_in_one_line(tmp_path, tiny_model_dir, monkeypatch):
    """wandb installed, no API key and not offline: refused before loading (it failed after the model
    loaded, with 33 lines from inside wandb); offline mode or a key in the netrc file pass."""
    from finetune.run.preflight import check_trackers

    for name in ("WANDB_MODE", "WANDB_DISABLED", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    cfg = validate_config(base_config(tiny_model_dir, tmp_path / "out", logging={"report_to": ["wandb"]}), "test")
    with pytest.raises(UserError, match=r"^logging.report_to: wandb has no API key here .* set WANDB_MODE=offline"):
        check_trackers(cfg)
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    check_trackers(cfg)
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_trackers(cfg)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_pissa_and_olora_start_at_the_base_train_differently_and_save_an_adapter_for_the_original_base(tmp_path, tiny_model_dir, init):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    train = {"max_steps": 3, "lr": 1e-2}
    default = _losses(_train(tmp_path, tiny_model_dir, "default", data={"eval": None}, train=train))
    cfg = base_config(tiny_model_dir, tmp_path / init, data={"eval": None}, train=train, adapter={"init": init})
    result = run(validate_config(cfg, "test"))
    losses = _losses(tmp_path / init)
    assert losses[0] == pytest.approx(default[0], abs=1e-4)  # W_res + BA = W: the run starts from the base model
    assert abs(losses[2] - default[2]) > 1e-3  # then trains another way
    saved = json.loads((tmp_path / init / "adapter_config.json").read_text())
    assert saved["r"] == 2 * 8 and saved["init_lora_weights"] is True  # peft's conversion: plain LoRA for the original base
    ids = torch.randint(5, 200, (2, 24))
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / init).eval()
    with torch.no_grad():
        trained = result.model.eval()(input_ids=ids, use_cache=False).logits
        assert (plain(input_ids=ids, use_cache=False).logits - trained).abs().max() < 1e-4


def test_loftq_is_refused_without_a_gpu_in_one_line(tmp_path, tiny_model_dir):
    """peft's replace_lora_weights_loftq computes on CUDA; tests/test_gpu.py runs it where there is one."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/test_gpu.py runs LoftQ")
    cfg = base_config(tiny_model_dir, tmp_path / "out", adapter={"init": "loftq"})
    cfg["model"]["quantization"] = {"bits": 4}
    with pytest.raises(UserError, match="adapter.init: loftq needs an NVIDIA GPU"):
        run(validate_config(cfg, "test"))


def test_pissa_is_refused_where_it_cannot_be_converted(tmp_path, tiny_model_dir):
    for sections, why in (({"adapter": {"init": "pissa", "method": "dora"}}, "not with adapter.method lora"),
                          ({"adapter": {"init": "olora"}, "distributed": {"strategy": "fsdp"}}, "not with distributed.strategy fsdp"),
                          ({"adapter": {"init": "loftq"}}, "loftq fits LoRA to a 4-bit base's quantization error, in one process or under "
                                                           "ddp; it needs model.quantization bits: 4")):
        with pytest.raises(UserError, match=why):
            validate_config(base_config(tiny_model_dir, tmp_path / "out", **sections), "test")
