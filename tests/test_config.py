"""Config validation: every bad config fails before any model loads, in one line, with exit code 2."""

from __future__ import annotations

import pytest
import yaml
from conftest import REPO, base_config, finetune_cli, write_config


def _bad(cfg: dict, keys: list[str], value) -> dict:
    node = cfg
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value is _DELETE:
        node.pop(keys[-1])
    else:
        node[keys[-1]] = value
    return cfg


_DELETE = object()

BAD = [
    # (keys, value, words the one-line error must contain)
    (["train", "lr"], -1, ["train.lr", "greater than 0", "-1"]),
    (["adapter", "r"], 0, ["adapter.r", "greater than 0"]),
    (["train", "lr_typo"], 1e-4, ["train.lr_typo", "unknown key"]),
    (["trainer"], {"lr": 1}, ["trainer", "unknown key"]),
    (["train", "micro_batch_size"], "four", ["train.micro_batch_size", "integer"]),
    (["adapter", "method"], "qlora2", ["adapter.method", "'lora'"]),
    (["data", "train"], "no/such/file.jsonl", ["data", "file not found", "no/such/file.jsonl"]),
    (["data", "max_seq_len"], 4096, ["data.max_seq_len", "max_position_embeddings (256)"]),
    (["model", "name_or_path"], "./missing-model", ["model.name_or_path", "folder not found"]),
    (["model"], _DELETE, ["model", "required key is missing"]),
    (["data", "eval_fraction"], 0.1, ["either data.eval or data.eval_fraction"]),
    (["train", "mixed_precision"], "fp4", ["train.mixed_precision"]),
]


@pytest.mark.parametrize("keys,value,words", BAD, ids=[".".join(k) + "=" + str(v)[:12] for k, v, _ in BAD])
def test_bad_config_one_line_exit_2(tmp_path, tiny_model_dir, keys, value, words, capsys):
    cfg = _bad(base_config(tiny_model_dir, tmp_path / "out"), keys, value)
    path = write_config(tmp_path / "bad.yaml", cfg)
    result = finetune_cli(capsys, "validate", "--config", str(path))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # one line, no traceback
    assert lines[0].startswith(f"error: {path}: "), lines[0]  # the file first, then the key and what was expected
    for word in words:
        assert word in lines[0], lines[0]


def test_invalid_yaml_names_the_line(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  name_or_path: x\ntrain: [unclosed\n")
    result = finetune_cli(capsys, "validate", "--config", str(path))
    assert result.returncode == 2
    assert f"{path}:" in result.stderr and "not valid YAML" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_missing_config_file(tmp_path, capsys):
    result = finetune_cli(capsys, "validate", "--config", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and "config file not found" in result.stderr


def test_overrides_are_typed_and_flags_map_to_keys(tmp_path, tiny_model_dir, capsys):
    path = write_config(tmp_path / "ok.yaml", base_config(tiny_model_dir, tmp_path / "out"))
    result = finetune_cli(
        capsys, "validate", "--config", str(path), "--set", "train.lr=1e-4", "--set", "adapter.target_modules=[q_proj, v_proj]",
        "--set", "data.packing=false", "--max-steps", "7", "--output-dir", str(tmp_path / "elsewhere"),
    )
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["train"]["lr"] == pytest.approx(1e-4) and isinstance(resolved["train"]["lr"], float)
    assert resolved["adapter"]["target_modules"] == ["q_proj", "v_proj"]
    assert resolved["data"]["packing"] is False
    assert resolved["train"]["max_steps"] == 7
    assert resolved["train"]["output_dir"] == str(tmp_path / "elsewhere")
    # Defaults are filled in from the schema.
    assert resolved["train"]["scheduler"] == "cosine" and resolved["model"]["trust_remote_code"] is False


def test_bad_override_is_one_line(tmp_path, tiny_model_dir, capsys):
    path = write_config(tmp_path / "ok.yaml", base_config(tiny_model_dir, tmp_path / "out"))
    result = finetune_cli(capsys, "validate", "--config", str(path), "--set", "train.lr")
    assert result.returncode == 2 and "expected KEY=VALUE" in result.stderr


def test_every_command_has_help(capsys):
    for cmd in ([], ["train"], ["validate"], ["data"], ["plan"], ["export"], ["eval"], ["make-demo-model"]):
        result = finetune_cli(capsys, *cmd, "--help")
        assert result.returncode == 0 and "usage:" in result.stdout


def test_the_configuration_reference_matches_the_schema():
    from finetune.config.reference import reference_markdown

    readme = (REPO / "docs" / "configuration.md").read_text()
    start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
    assert readme[readme.index(start) + len(start) : readme.index(end)].strip() == reference_markdown().strip(), (
        "docs/configuration.md is stale: regenerate it from finetune.config.reference.reference_markdown()"
    )
