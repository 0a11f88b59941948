"""GGUF export (finetune export): written by the gguf package, read back by transformers' GGUF loader
with the logits, greedy tokens and tokenization of the model it came from; bad input in one line."""

from __future__ import annotations

import pytest
from conftest import base_config, finetune_cli, write_config

pytest.importorskip("gguf")


# Mistral and Qwen2 as their larger releases ship (no sliding window in use), Qwen3 with its releases'
# head size of 128 (transformers 5.23's GGUF reader takes Qwen3's default head_dim, not the file's key
# length), Gemma 2 with heads of 256 scaled by 256 (the 2B and 9B releases') and a window of 8 tokens.
AS_RELEASED = {"mistral": {"sliding_window": None}, "qwen2": {"use_sliding_window": False}, "qwen3": {"head_dim": 128},
               "gemma2": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 8}}


@pytest.mark.parametrize("family,kind", [("llama-tied", "f16"), ("llama-tied", "q8_0"), ("mistral", "f16"), ("qwen2", "f16"), ("qwen3", "q8_0"),
                                         ("gemma2", "f16"), ("gemma2", "q8_0")])
def test_a_model_round_trips_through_gguf(tmp_path, family_dirs, family, kind, capsys):
    """Llama (tied head: no output tensor, llama.cpp ties it), Mistral (query/key rows reordered for
    llama.cpp's rotary layout, as Llama's), Qwen2 (q/k/v biases), Qwen3 (q/k norms), Gemma 2 (norms of
    1 + weight, soft-capping, a sliding window on alternate layers, tied head). f16 within 1e-3 of the
    fp32 model; q8_0 within 2e-2 (measured: 3e-4 and 7e-3 on the tiny Llama, 6e-4 and 1.4e-2 on Gemma 2)."""
    out = tmp_path / "model.gguf"
    folder = family_dirs(family, **AS_RELEASED.get(family, {}))
    result = finetune_cli(capsys, "export", "--model", str(folder), "--out", str(out), "--type", kind)
    assert result.returncode == 0, result.stderr
    assert out.is_file() and (tmp_path / "Modelfile").read_text() == "FROM ./model.gguf\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Modelfile", "model.gguf"]  # nothing else left behind
    line = next(line for line in result.stdout.splitlines() if "loaded back by transformers" in line)
    worst = float(line.split("within max ")[1].split()[0])
    assert worst < (1e-3 if kind == "f16" else 2e-2) and "greedy tokens the same" in line, line


def test_an_adapter_is_merged_then_exported(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "run"
    cfg = base_config(tiny_model_dir, out, data={"eval": None}, train={"max_steps": 2, "lr": 1e-2})
    assert finetune_cli(capsys, "train", "--config", str(write_config(tmp_path / "c.yaml", cfg))).returncode == 0
    result = finetune_cli(capsys, "export", "--adapter", str(out), "--out", str(tmp_path / "tuned.gguf"))
    assert result.returncode == 0, result.stderr
    assert "merged" in result.stdout and "greedy tokens the same" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Modelfile", "c.yaml", "run", "tuned.gguf"]  # the merged folder went


def test_bad_exports_say_why_in_one_line_and_leave_nothing(tmp_path, family_dirs, capsys):
    def refused(*args):
        result = finetune_cli(capsys, "export", *args)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        return result.stderr

    out = str(tmp_path / "x.gguf")
    assert "is a phi3 model; GGUF export covers gemma2, llama, mistral, qwen2, qwen3" in refused("--model", str(family_dirs("phi3")), "--out", out)
    assert "query_pre_attn_scalar 16 with heads of 16" in refused("--model", str(family_dirs("gemma2")), "--out", out)
    assert "has no config.json (not a HF model folder)" in refused("--model", str(tmp_path), "--out", out)
    assert "sliding window of 8 tokens, which GGUF's llama architecture does not carry" in refused("--model", str(family_dirs("mistral")), "--out", out)
    (tmp_path / "taken.gguf").write_text("mine")
    assert "exists; name a new file" in refused("--model", str(family_dirs("qwen2")), "--out", str(tmp_path / "taken.gguf"))
    assert (tmp_path / "taken.gguf").read_text() == "mine"
    assert "invalid choice: 'q4'" in refused("--model", str(family_dirs("qwen2")), "--out", out, "--type", "q4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.gguf"]
