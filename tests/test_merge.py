"""finetune merge / generate: real adapters merged, reloaded by plain transformers in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, base_config, finetune_cli, finetune_in_process, write_config

from finetune.cli import main
from finetune.config.schema import validate_config
from finetune.outputs.merge import merge
from finetune.train import run

IDS = torch.tensor([[5, 17, 42, 99, 7, 250, 13, 61, 88, 120, 3, 77]])
# Loads the merged folder with nothing but transformers, and says whether peft or finetune came along.
PLAIN_LOAD = """
import sys, torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
with torch.no_grad():
    logits = model(input_ids=torch.tensor(eval(sys.argv[2]))).logits
save_file({"logits": logits.contiguous()}, sys.argv[3])
print(sorted(m for m in ("peft", "finetune") if m in sys.modules))
"""


def _train(tmp_path, model_dir, name, **sections):
    cfg = base_config(model_dir, tmp_path / name, data={"eval": None}, **sections)
    cfg["train"] = {**cfg["train"], "max_steps": 4, "lr": 1e-2, **sections.get("train", {})}
    run(validate_config(cfg, "test"))
    return tmp_path / name


def _same_as_whole_model_merge(adapter_dir, tmp_path, variants=("merged",)) -> None:
    """The shard-by-shard merge writes, tensor for tensor, what peft's merge_and_unload of the whole
    float32 model gives (the merge before shards, and still the fallback)."""
    from safetensors.torch import load_file

    from finetune.outputs.merge import Targets, attach, find_adapter, load_base, merged_model, write_by_shard

    adapter = find_adapter(str(adapter_dir), None)
    targets, why_not = Targets.of(attach(load_base(adapter, adapter.quantized), adapter), adapter)
    assert why_not is None and targets.layers
    base = load_base(adapter, False).state_dict()
    (tmp_path / "by-shard").mkdir()
    for variant in variants:
        write_by_shard(targets, variant, torch.float32, tmp_path / "by-shard" / variant, "50KB")
        shards = list((tmp_path / "by-shard" / variant).glob("model-*.safetensors"))
        by_shard = {k: v for shard in shards for k, v in load_file(shard).items()}
        whole = merged_model(adapter, variant).state_dict()
        assert len(shards) > 2 and set(by_shard) == set(whole), variant
        worst = max((by_shard[k] - whole[k]).abs().max().item() for k in whole)
        assert worst < 1e-5, (variant, worst)
        assert all((by_shard[k] - base[k]).abs().max() > 1e-6 for k in targets.layers), "a layer the adapter trained came out unchanged"


def _tuned_logits(base_dir, adapter_dir) -> tuple[torch.Tensor, torch.Tensor]:
    """(base + adapter, base alone) logits on IDS, through peft directly."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    with torch.no_grad():
        tuned = model(input_ids=IDS).logits
        with model.disable_adapter():
            base = model(input_ids=IDS).logits
    return tuned, base


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir):
    return _train(tmp_path_factory.mktemp("lora"), tiny_model_dir, "out", checkpoint={"save_every": 2})


def test_merged_lora_loads_with_plain_transformers_in_shards_and_generates_the_same(tmp_path, tiny_model_dir, lora_run, capsys):
    from safetensors.torch import load_file

    merged = tmp_path / "merged"
    assert main(["merge", "--adapter", str(lora_run), "--out", str(merged), "--dtype", "fp32", "--max-shard-size", "100KB"]) == 0
    assert "check on 4 texts" in capsys.readouterr().out
    index = json.loads((merged / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in merged.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert {"config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja", "merge_report.json"} <= {p.name for p in merged.iterdir()}
    report = json.loads((merged / "merge_report.json").read_text())
    assert report["passed"] and report["merged_vs_tuned"]["max"] < 1e-4
    assert not any(k.startswith("base_model") or "lora" in k for k in index["weight_map"])
    from huggingface_hub import ModelCard

    card = ModelCard.load(merged / "README.md")  # the Hub's model-card format
    assert card.data.library_name == "transformers" and card.data.base_model is None and f"`{report['base']}`" in card.text and "merged" in card.data.tags
    assert f"max {report['merged_vs_tuned']['max']:.3g}" in card.text and card.data.license is None

    out = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(merged), str(IDS.tolist()), str(tmp_path / "logits.safetensors")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"  # neither peft nor finetune was needed
    plain = load_file(tmp_path / "logits.safetensors")["logits"]
    tuned, base = _tuned_logits(tiny_model_dir, lora_run)
    assert (plain - tuned).abs().max() < 1e-4
    assert (plain - base).abs().max() > 1e-3  # the adapter is in there

    prompt = ["--prompt", "What kind of word is this?", "--max-new-tokens", "8"]
    assert main(["generate", "--model", str(merged), *prompt]) == 0
    from_merged = capsys.readouterr().out  # streamed token by token
    assert main(["generate", "--adapter", str(lora_run), *prompt]) == 0
    assert from_merged == capsys.readouterr().out
    # The same 8 tokens from both, EOS held back (four steps on random weights may well answer EOS first).
    from finetune.outputs.generate import load

    tokens = [model.generate(input_ids=IDS, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
              for model, tok in (load(str(merged), None, None), load(None, str(lora_run), None))]
    assert tokens[0].shape[1] == IDS.shape[1] + 8 and torch.equal(tokens[0], tokens[1])


def test_dora_merges_and_so_does_a_checkpoint_mid_run(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out = _train(tmp_path, tiny_model_dir, "dora", adapter={"method": "dora", "rslora": True, "modules_to_save": ["lm_head"]},
                 checkpoint={"save_every": 2})
    _same_as_whole_model_merge(out, tmp_path)
    logits, effects = {}, {}
    for name, adapter in (("final", out), ("step 2", out / "checkpoints" / "step-000002")):
        report = merge(str(adapter), str(tmp_path / name.replace(" ", "-")), dtype="fp32")
        assert report["passed"] and report["merged_vs_tuned"]["max"] < 1e-4, report
        effects[name] = report["adapter_effect"]["max"]
        with torch.no_grad():
            logits[name] = AutoModelForCausalLM.from_pretrained(tmp_path / name.replace(" ", "-"))(input_ids=IDS).logits
    tuned, base = _tuned_logits(tiny_model_dir, out)
    assert (logits["final"] - tuned).abs().max() < 1e-4
    assert (logits["final"] - base).abs().max() > 1e-3
    # The checkpoint's own trained weights were merged: not the untrained adapter (no effect at all)
    # and not the final one.
    assert effects["step 2"] > 1e-3 and (logits["step 2"] - logits["final"]).abs().max() > 1e-4


def test_qlora_merges_into_the_closer_base_and_reports_both(tmp_path, demo_model_dir):
    out = _train(tmp_path, demo_model_dir, "qlora", train={"max_steps": 10, "lr": 3e-3},
                 model={"quantization": {"bits": 4, "quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16"}})
    _same_as_whole_model_merge(out, tmp_path, variants=("original", "dequantized"))
    report = merge(str(out), str(tmp_path / "merged"))
    bases = report["qlora_bases"]
    print(json.dumps(report, indent=1))
    assert report["qlora_base"] == "dequantized" and bases["dequantized"]["max"] < bases["original"]["max"]
    assert report["passed"] and report["merged_vs_tuned"]["max"] <= report["tolerance_max"]
    # Not the untuned base in disguise: far closer to the trained model than the base is.
    assert report["merged_vs_tuned"]["mean"] < 0.1 * report["adapter_effect"]["mean"]
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config  # written in full precision, never re-quantized

    # Asked for, the farther base is written, and checked at the distance the comparison measured for it.
    forced = merge(str(out), str(tmp_path / "original"), qlora_base="original", tolerance=1.001 * bases["original"]["max"])
    assert forced["qlora_base"] == "original" and forced["passed"]
    assert forced["merged_vs_tuned"]["max"] == pytest.approx(bases["original"]["max"], rel=1e-6)


def test_bad_merges_say_why_in_one_line_and_leave_nothing(tmp_path, tiny_model_dir, demo_model_dir, lora_run, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "something").write_text("x")
    cases = [
        (["--adapter", str(tmp_path / "nope"), "--out", str(tmp_path / "a")], "no such folder"),
        (["--adapter", str(lora_run), "--base", str(demo_model_dir), "--out", str(tmp_path / "b")], "does not fit the base"),
        (["--adapter", str(lora_run), "--out", str(tmp_path / "taken")], "already exists and is not empty"),
        (["--adapter", str(lora_run), "--out", "/proc/finetune-merged"], "cannot write to /proc"),
        (["--adapter", str(lora_run), "--out", str(tmp_path / "c"), "--tolerance", "1e-12", "--dtype", "bf16"], "merge check failed"),
    ]
    for args, words in cases:
        code = main(["merge", *args])
        err = capsys.readouterr().err  # in this process, libraries' loading bars may come first
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code in (2, 5) and len(errors) == 1 and words in errors[0] and "Traceback" not in err, (args, err)
    assert code == 5  # the failed check
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no half-written output anywhere
    assert finetune_in_process("generate", "--model", str(tmp_path / "nope"), "--prompt", "x").returncode == 2


def test_check_serving_says_whether_vllm_loads_the_adapter(tmp_path, tiny_model_dir, lora_run, capsys):
    """vLLM's LoRA rules (its PEFTHelper): a LoRA of rank 8 loads with --max-lora-rank 8; DoRA and
    modules_to_save do not, each named, exit 5; nothing is merged either way."""
    result = finetune_cli(capsys, "merge", "--adapter", str(lora_run), "--check-serving")
    assert result.returncode == 0 and "vLLM loads this adapter" in result.stdout and "--max-lora-rank 8 " in result.stdout
    assert json.loads((lora_run / "summary.json").read_text())["vllm"] == {"loads": True, "max_lora_rank": 8, "problems": []}
    out = tmp_path / "dora"
    cfg = base_config(tiny_model_dir, out, adapter={"method": "dora", "modules_to_save": ["lm_head"]}, data={"eval": None}, train={"max_steps": 1})
    trained = finetune_cli(capsys, "train", "--config", str(write_config(tmp_path / "c.yaml", cfg)))
    assert trained.returncode == 0 and "serving: vLLM would not load this adapter" in trained.stdout  # said at the save
    result = finetune_cli(capsys, "merge", "--adapter", str(out), "--check-serving")
    assert result.returncode == 5 and "DoRA (vLLM does not support it)" in result.stdout and "modules_to_save ['lm_head']" in result.stdout
    assert "merge it first" in result.stdout and not list(tmp_path.glob("*merged*"))


def test_merge_help_explains_the_check():
    out = subprocess.run([sys.executable, "-m", "finetune", "merge", "--help"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "merge_report.json" in out.stdout and "--qlora-base" in out.stdout


def test_overwrite_replaces_an_earlier_merge_and_nothing_else(tmp_path, lora_run, capsys):
    out = tmp_path / "merged"
    assert main(["merge", "--adapter", str(lora_run), "--out", str(out), "--dtype", "fp32", "--max-shard-size", "100KB"]) == 0
    first_shards = {p.name for p in out.glob("model-*.safetensors")}
    (out / "notes.txt").write_text("mine")
    assert main(["merge", "--adapter", str(lora_run), "--out", str(out)]) == 2
    assert "already exists and is not empty; choose a new folder (or --overwrite an earlier merge there)" in capsys.readouterr().err
    assert main(["merge", "--adapter", str(lora_run), "--out", str(out), "--dtype", "fp32", "--overwrite"]) == 0  # one 5GB shard now
    assert (out / "notes.txt").read_text() == "mine"
    assert not first_shards & {p.name for p in out.iterdir()} and (out / "model.safetensors").is_file()
    report = json.loads((out / "merge_report.json").read_text())
    assert set(report["files"]) == {p.name for p in out.iterdir()} - {"notes.txt"}
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "a.txt").write_text("x")
    assert main(["merge", "--adapter", str(lora_run), "--out", str(stranger), "--overwrite"]) == 2
    assert "holds files that are not a finetune merge's" in capsys.readouterr().err


def test_a_run_whose_data_moved_is_checked_on_generic_sentences_and_says_so(tmp_path, lora_run, capsys):
    import shutil

    import yaml

    moved = tmp_path / "run"
    shutil.copytree(lora_run, moved, ignore=shutil.ignore_patterns("checkpoints"))
    config = yaml.safe_load((moved / "finetune_config.yaml").read_text())
    config["data"]["train"] = str(tmp_path / "gone.jsonl")
    (moved / "finetune_config.yaml").write_text(yaml.safe_dump(config))
    result = finetune_cli(capsys, "merge", "--adapter", str(moved), "--out", str(tmp_path / "merged"))
    assert result.returncode == 0, result.stderr
    assert "the run's training data is not readable" in result.stdout and "checking on 3 generic sentences" in result.stdout, result.stdout
    assert json.loads((tmp_path / "merged" / "merge_report.json").read_text())["check_texts"] == 3
