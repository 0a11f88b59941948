"""GGUF export (finetune export): written by the gguf package, read back by transformers' GGUF loader
with the logits, greedy tokens and tokenization of the model it came from; bad input in one line."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import base_config, finetune_cli, write_config

pytest.importorskip("gguf")
from gguf_header import read_header  # noqa: E402  (it imports gguf)
from released import released_config  # noqa: E402

# Released shapes (tests/released.py) with their families' real tokenizers. Llama 3.2's rope scaling is made to act
# within the check texts (original context 16 for 8192): written as llama.cpp's rope_freqs, or the logits part.
# Mistral v0.3 ships a SentencePiece vocabulary whose tokenizer.json llama.cpp reads otherwise (refused below): its
# architecture goes with Llama 3's byte-level BPE, as Gemma 2's.
LLAMA3_ROPE = {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                "original_max_position_embeddings": 16}}
LLAMA3 = {"tokenizer": "llama3", "vocab_size": 128256}
# DeepSeek-V3 made small: heads of 16 + 8 rotary dims over a latent of 32, 16 experts in 8 groups (4 picked from the best 4 groups)
LATENT = dict(first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
              qk_rope_head_dim=8, head_dim=8, qk_head_dim=24, v_head_dim=16, moe_intermediate_size=32)
# Llama 4 Scout's text side (llama3 rope scaling) in four layers: three chunked, the fourth without rotary positions; 4 experts
LLAMA4 = dict(LLAMA3, bos_token_id=128000, eos_token_id=128009, pad_token_id=None, num_hidden_layers=4, layer_types=None, no_rope_layers=[],
              num_local_experts=4)
CASES = [("llama-3.2-1b", "f16", LLAMA3_ROPE), ("qwen2.5-0.5b", "f16", {}), ("qwen3-0.6b", "q8_0", {}),
         ("mistral-7b-v0.3", "f16", {"tokenizer": "llama3", "vocab_size": 128256}), ("gemma-2-9b", "f16", {"tokenizer": "llama3", "vocab_size": 128256}),
         ("gemma-3-1b", "f16", {}),  # Gemma-3-4B (linear rope scaling) passes too: 1.3e-3, 44 s here, left out of make test
         ("qwen3-30b-a3b", "f16", {"num_local_experts": 16, "moe_intermediate_size": 128}),
         ("mixtral-8x7b", "f16", {"tokenizer": "llama3", "vocab_size": 128256}),
         ("deepseek-v3", "f16", dict(LLAMA3, **LATENT, rope_parameters=dict(released_config("deepseek-v3")["rope_parameters"],
                                                                            original_max_position_embeddings=16))),
         ("deepseek-v3", "f16", {**LLAMA3, **LATENT, "q_lora_rank": None, "rope_interleave": False,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 5e4}}),
         ("qwen3.5-27b", "f16", {}),
         ("glm-4.5-air", "f16", dict(LLAMA3, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, head_dim=16, use_qk_norm=True,
                                     pad_token_id=None, eos_token_id=128009)),
         ("llama-4-scout-text", "f16", LLAMA4),
         ("llama-4-scout-text", "f16", dict(LLAMA4, num_local_experts=128, interleave_moe_layer_step=2, use_qk_norm=False))]  # Maverick's
LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.mark.parametrize("name,kind,changes", CASES, ids=[f"{n}-{k}" + ("-moonlight" if c.get("q_lora_rank", 1) is None else "") +
                                                          ("-maverick" if c.get("num_local_experts") == 128 else "") for n, k, c in CASES])
def test_a_model_round_trips_through_gguf_and_llama_cpp_reads_it_as_transformers(tmp_path, released, name, kind, changes, capsys):
    """Llama 3.2 (tied head: no output tensor, llama.cpp ties it; 128k vocabulary split as llama-bpe; llama3 rope
    scaling), Qwen 2.5 and 3 (151,669 tokens for 151,936 rows: placeholders fill the rest; digits split one by one:
    qwen2), Mistral (query/key rows reordered for llama.cpp's rotary layout, as Llama's), Gemma 2 (norms of 1 +
    weight, soft-capping, heads of 256, tied head), Gemma 3 (SentencePiece vocabulary of 262k with scores from its
    merges; which layers slide, their own rope base; 1B's 262,144 rows for its tokenizer's 262,145 tokens: the image
    token left out), Qwen3-MoE (16 experts 128 wide, 8 routed: the fused gate/up weights split into llama.cpp's
    ffn_gate_exps and ffn_up_exps; within 2e-2 in f16: f16 weights move a router's near-ties, where the same file
    in f32 gave 3.4e-4), Mixtral (8 experts, 2 routed: llama.cpp's llama architecture with experts, its query/key rows
    reordered as Llama's; Llama 3's tokenizer, as Mistral's above), DeepSeek-V3 (latent attention split into llama.cpp's
    k_b/v_b, yarn as released acting within the texts, 16 experts in 8 groups, the router's score correction drawn
    random) and its Moonlight shape (one q_proj, rotary dims not interleaved: their rows reordered into pairs; without
    that, 7.8e-3), GLM-4.5 (partial rotary, q/k norms, biases): llama.cpp's deepseek2 and glm4moe, within 6e-4 in f16;
    Qwen3.5's text side (16 key and 48 value heads in its Gated DeltaNet layers: every value-head axis reordered into
    llama.cpp's tiled order; 0.05 without that on a 2-key, 4-value-head model): llama.cpp's qwen35, within 7e-4 in f16;
    Llama 4's text side (experts stored (E, in, out), a shared expert; Scout's shape, and Maverick's: 128 experts on every
    second layer, queries and keys not normed, which llama.cpp tells by the 128): llama.cpp's llama4, within 1e-3 in f16
    (Maverick's 1.4e-2: its router's near-ties, as Qwen3-MoE's).
    Read by llama.cpp itself (where llama-cpp-python is
    installed, as make test does; else read back by transformers' GGUF loader): the same token ids as transformers on
    12 hard strings, the special tokens, a text starting with a space and a chat turn, logits within 5e-3 (f16) and
    5e-2 (q8_0) on texts longer than the sliding windows, the same greedy tokens."""
    out = tmp_path / "model.gguf"
    result = finetune_cli(capsys, "export", "--model", str(released(name, **changes)), "--out", str(out), "--type", kind)
    assert result.returncode == 0, result.stderr
    assert out.is_file() and (tmp_path / "Modelfile").read_text() == "FROM ./model.gguf\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Modelfile", "model.gguf"]  # nothing else left behind
    line = next(line for line in result.stdout.splitlines() if "in llama.cpp itself" in line or "loaded back by transformers" in line)
    assert ("in llama.cpp itself" in line) == LLAMA_CPP and "greedy tokens the same" in line, line
    assert not LLAMA_CPP or "the same token ids as transformers on 15 strings" in line, line
    many = "a3b" in name or changes.get("num_local_experts") == 128  # f16 weights move a router's near-ties among 128 experts
    assert float(line.split("logits within max ")[1].split()[0]) < (2e-2 if many else 5e-3 if kind == "f16" else 5e-2), line
    assert read_header(out)[0]["tokenizer.ggml.pre"] == ("qwen2" if name.startswith("qwen") else "default" if name.startswith("gemma-3") else "llama-bpe")


def test_a_gemma4_whose_per_layer_embeddings_miss_tokens_is_refused(tmp_path, capsys):
    """llama.cpp's gemma4 takes a per-layer embedding for every token: a Gemma 4 whose per-layer inputs cover 1,024 tokens
    of 262,144 is refused in one line, before any weight is read (its config alone), nothing written. Gemma 4's export
    itself: tests/test_vision.py, with its projector file."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "gemma4_text", "vocab_size": 262144, "vocab_size_per_layer_input": 1024,
                                                                "hidden_size_per_layer_input": 8, "layer_types": ["sliding_attention", "full_attention"]}))
    result = finetune_cli(capsys, "export", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "m.gguf"))
    assert result.returncode == 2 and "per-layer embeddings cover 1024 tokens of its 262144" in result.stderr.splitlines()[-1], result.stderr
    assert not (tmp_path / "m.gguf").exists()


def test_the_tokenizers_split_is_what_llama_cpp_is_told(demo_tokenizer_dir):
    """Llama 3's split is llama.cpp's llama-bpe and Qwen3's its qwen2 (digits one by one), found from how each
    tokenizer splits the hard strings; the demo's tokenizer splits at every space and punctuation mark, as no
    pre-tokenizer of llama.cpp does: refused in one line."""
    from released import tokenizer_dir
    from transformers import AutoTokenizer

    from finetune.config.errors import UserError
    from finetune.outputs.gguf_vocab import pre_tokenizer

    for family, expected in (("llama3", "llama-bpe"), ("qwen3", "qwen2")):
        assert pre_tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir(family)), tokenizer_dir(family)) == expected
    with pytest.raises(UserError, match="splits text as none of llama.cpp's pre-tokenizers does"):
        pre_tokenizer(AutoTokenizer.from_pretrained(demo_tokenizer_dir), demo_tokenizer_dir)


@pytest.mark.skipif(not LLAMA_CPP, reason="llama-cpp-python is not installed (make test installs it)")
@pytest.mark.parametrize("kind,bound,block", [("q4_k_m", 0.5, "Q4_K"), ("q5_k_m", 0.35, "Q5_K"), ("q6_k", 0.2, "Q6_K")])
def test_k_quants_come_from_llama_cpps_quantizer_and_are_checked_in_it(tmp_path, released, kind, bound, block, capsys):
    """Llama 3.2's shape 256 wide (k-quants take rows of 256): the f16 file quantized by llama.cpp's own
    llama_model_quantize, its layers' weights in the k-quant's blocks, the same token ids as transformers,
    logits within `bound` of the fp32 model (measured 0.23 for q4_k_m, 0.08 for q6_k). Greedy tokens of a random
    model's near-ties are reported, not asserted."""
    out = tmp_path / "model.gguf"
    model = released("llama-3.2-1b", hidden_size=256, intermediate_size=512)
    result = finetune_cli(capsys, "export", "--model", str(model), "--out", str(out), "--type", kind)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if "in llama.cpp itself" in line)
    assert "the same token ids as transformers on 15 strings" in line and float(line.split("logits within max ")[1].split()[0]) < bound, line
    types = read_header(out)[1]
    assert types["blk.0.ffn_gate.weight"] in (block, "Q6_K") and block in set(types.values()), types
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Modelfile", "model.gguf"]


def test_an_adapter_is_merged_then_exported(tmp_path, released, capsys):
    out = tmp_path / "run"
    cfg = base_config(released("llama-3.2-1b"), out, data={"eval": None}, train={"max_steps": 2, "lr": 1e-2})
    assert finetune_cli(capsys, "train", "--config", str(write_config(tmp_path / "c.yaml", cfg))).returncode == 0
    result = finetune_cli(capsys, "export", "--adapter", str(out), "--out", str(tmp_path / "tuned.gguf"))
    assert result.returncode == 0, result.stderr
    # Greedy tokens are reported: a random model's near-ties may fall otherwise in f16.
    assert f"merged {out} into its base" in result.stdout and "logits within max" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Modelfile", "c.yaml", "run", "tuned.gguf"]  # the merged folder went


@pytest.mark.skipif(not LLAMA_CPP, reason="llama-cpp-python is not installed (make test installs it)")
def test_an_adapter_alone_as_a_gguf_lora_file_that_llama_cpp_applies(tmp_path, released, capsys):
    """The Llama 3.2 shape's LoRA adapter (query/key rows of B in llama.cpp's rotary order) as a GGUF LoRA file:
    llama.cpp running the base's f16 GGUF with it gives base + adapter's logits (the adapter moves them 100x more
    than the difference). A DoRA adapter is refused in one line."""
    cfg = _lora_file_checked(tmp_path, capsys, released("llama-3.2-1b"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter.gguf", "c.yaml", "run"]  # the base's GGUF was temporary
    fields, types = read_header(tmp_path / "adapter.gguf")
    assert fields["general.type"] == "adapter" and fields["adapter.lora.alpha"] == 16.0
    import gguf  # the header as gguf's own reader reads it (no vocabulary here: in a second)

    reader = gguf.GGUFReader(str(tmp_path / "adapter.gguf"))
    stored = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # the reader adds the header's counts as fields
    assert types == {t.name: t.tensor_type.name for t in reader.tensors} and set(fields) == set(stored)
    assert all(fields[k] == (bytes(f.parts[-1]).decode() if f.types == [gguf.GGUFValueType.STRING] else f.parts[-1][0])
               for k, f in stored.items() if len(f.types) == 1), fields
    cfg["adapter"]["method"], cfg["train"]["output_dir"] = "dora", str(tmp_path / "dora")
    assert finetune_cli(capsys, "train", "--config", str(write_config(tmp_path / "d.yaml", cfg))).returncode == 0
    refused = finetune_cli(capsys, "export", "--adapter", str(tmp_path / "dora"), "--lora", "--out", str(tmp_path / "dora.gguf"))
    assert refused.returncode == 2 and "set with use_dora; GGUF LoRA files carry plain LoRA" in refused.stderr, refused.stderr


@pytest.mark.skipif(not LLAMA_CPP, reason="llama.cpp's qwen35 is read back by llama.cpp only")
def test_a_qwen35_adapter_as_a_gguf_lora_file_keeps_llama_cpps_value_head_order(tmp_path, released, capsys):
    """Qwen3.5's text side (16 key and 48 value heads in its Gated DeltaNet layers) with LoRA on every linear layer: the
    GGUF LoRA file's B rows of the DeltaNet's input projections and A columns of its output projection in llama.cpp's
    tiled value-head order, as its weights: llama.cpp gives base + adapter's logits, the adapter moving them 100x more
    than the difference (in transformers' order: 0.24 for a move of 0.80, under the f16 bound of 0.25 that publishing
    checks, so this test holds the order)."""
    _lora_file_checked(tmp_path, capsys, released("qwen3.5-27b"))


def test_what_llama_cpp_applies_no_adapter_to_is_refused_as_a_gguf_lora_file(tmp_path, family_dirs, capsys):
    """A Gemma 4 adapter on its experts' fused weights, or on the per-layer inputs' model projection (which llama.cpp's gemma4
    multiplies with no adapter: 0.36 off base + adapter's where it went in), is refused as a GGUF LoRA file in one line
    (merge and export instead), nothing written."""
    for targets, said in ((["q_proj", "experts"], "its LoRA on model.layers.0.experts, the experts' fused weights, is not written"),
                          (["q_proj", "per_layer_model_projection"], "its LoRA on model.per_layer_model_projection cannot go in a GGUF LoRA file")):
        out = tmp_path / targets[-1]
        cfg = base_config(family_dirs("gemma4"), out, adapter={"target_modules": targets}, data={"eval": None}, train={"max_steps": 1})
        assert finetune_cli(capsys, "train", "--config", str(write_config(tmp_path / "c.yaml", cfg))).returncode == 0
        result = finetune_cli(capsys, "export", "--adapter", str(out), "--lora", "--out", str(tmp_path / "a.gguf"))
        assert result.returncode == 2 and said in result.stderr.splitlines()[-1], result.stderr[-500:]
        assert not (tmp_path / "a.gguf").exists()


def _lora_file_checked(tmp_path, capsys, model) -> dict:
    """A LoRA adapter trained 4 steps on `model` (at tmp_path/run) written as tmp_path/adapter.gguf with --lora: llama.cpp's
    logits with it applied within 5e-3 of base + adapter's, the adapter moving them 100x more. Returns the run's config."""
    cfg = base_config(model, tmp_path / "run", data={"eval": None}, train={"max_steps": 4, "lr": 1e-2})
    assert finetune_cli(capsys, "train", "--config", str(write_config(tmp_path / "c.yaml", cfg))).returncode == 0
    result = finetune_cli(capsys, "export", "--adapter", str(tmp_path / "run"), "--lora", "--out", str(tmp_path / "adapter.gguf"))
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if "applied by llama.cpp" in line)
    worst, effect = float(line.split("within max ")[1].split()[0]), float(line.split("moves them by max ")[1].rstrip(")"))
    assert worst < 5e-3 and effect > 100 * worst, line
    return cfg


@pytest.mark.skipif(not LLAMA_CPP, reason="llama-cpp-python is not installed (make test installs it)")
def test_a_gpt_oss_tuned_on_its_experts_merges_and_llama_cpp_reads_it(tmp_path, released, capsys):
    """gpt-oss's shape (8 experts, its o200k tokenizer: llama.cpp's gpt-4o split; the harmony template) with its biases,
    router bias and attention sinks drawn (they start at zero): LoRA on attention and experts, trained 2 steps, merged
    into the 3-D expert weights (checked against base + adapter) and exported. llama.cpp reads the interleaved gate/up
    columns split into ffn_gate_exps / ffn_up_exps, the expert biases in f32, the sinks, which layers slide and the
    YaRN rope: logits within 5e-3 of the merged model's (measured 8e-4 in f16; gate and up swapped gives 0.63)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(released("gpt-oss-20b", num_local_experts=8), dtype=torch.float32)
    draw = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1, generator=draw)
            elif name.endswith("sinks"):
                p.normal_(0, 1.0, generator=draw)
    model.save_pretrained(tmp_path / "base")
    AutoTokenizer.from_pretrained(released("gpt-oss-20b", num_local_experts=8)).save_pretrained(tmp_path / "base")
    cfg = base_config(tmp_path / "base", tmp_path / "run", data={"eval": None}, train={"max_steps": 2, "lr": 1e-2},
                      adapter={"target_modules": "all-linear", "dropout": 0.0})
    assert finetune_cli(capsys, "train", "--config", str(write_config(tmp_path / "c.yaml", cfg))).returncode == 0
    result = finetune_cli(capsys, "export", "--adapter", str(tmp_path / "run"), "--out", str(tmp_path / "tuned.gguf"))
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if "in llama.cpp itself" in line)
    assert "the same token ids as transformers on 15 strings" in line and float(line.split("logits within max ")[1].split()[0]) < 5e-3, line
    fields, types = read_header(tmp_path / "tuned.gguf")
    assert types["blk.0.ffn_gate_exps.bias"] == "F32" and types["blk.0.ffn_gate_exps.weight"] == "F16" and "blk.1.attn_sinks.weight" in types
    assert fields["tokenizer.ggml.pre"] == "gpt-4o"


def test_bad_exports_say_why_in_one_line_and_leave_nothing(tmp_path, family_dirs, released, capsys):
    def refused(*args):
        result = finetune_cli(capsys, "export", *args)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        return result.stderr

    from finetune.outputs.export import FAMILIES

    out = str(tmp_path / "x.gguf")
    covered = f"GGUF export covers {', '.join(sorted(FAMILIES))}"
    assert f"is a phi3 model; {covered}" in refused("--model", str(family_dirs("phi3")), "--out", out)
    assert "query_pre_attn_scalar 8 with heads of 16; llama.cpp scales by the head size" in refused(
        "--model", str(family_dirs("gemma2", query_pre_attn_scalar=8)), "--out", out)
    assert "has no config.json (not a HF model folder)" in refused("--model", str(tmp_path), "--out", out)
    assert "sliding window of 8 tokens, which GGUF's llama architecture does not carry" in refused("--model", str(family_dirs("mistral")), "--out", out)
    assert "sets attention_chunk_size 8; llama.cpp's llama4 architecture has 8192 built in" in refused(
        "--model", str(family_dirs("llama4")), "--out", out)
    (tmp_path / "taken.gguf").write_text("mine")
    assert "exists; name a new file" in refused("--model", str(family_dirs("qwen2")), "--out", str(tmp_path / "taken.gguf"))
    assert (tmp_path / "taken.gguf").read_text() == "mine"
    assert "invalid choice: 'q4'" in refused("--model", str(family_dirs("qwen2")), "--out", out, "--type", "q4")
    if LLAMA_CPP:  # Mistral's own SentencePiece tokenizer.json puts no "▁" before text that starts with a space; llama.cpp does
        line = refused("--model", str(released("mistral-7b-v0.3")), "--out", out)
        assert "llama.cpp would tokenize '  two leading spaces   and more' as [1, 259, 989" in line and "SentencePiece's" in line, line
    else:
        without = refused("--model", str(family_dirs("qwen2")), "--out", out, "--type", "q4_k_m")
        assert "made by llama.cpp's own quantizer; pip install llama-cpp-python" in without

    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.gguf"]


def test_a_lora_on_deepseeks_latent_key_value_weight_is_refused_as_a_gguf_lora_file(tmp_path):
    """llama.cpp's deepseek2 holds kv_b_proj split per head (k_b transposed, v_b): a LoRA file cannot follow it."""
    import gguf
    import torch

    from finetune.config.errors import UserError
    from finetune.outputs.export import _lora_tensors

    writer = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "deepseek2")
    stem = "base_model.model.model.layers.0.self_attn.kv_b_proj"
    weights = {f"{stem}.lora_A.weight": torch.zeros(4, 16), f"{stem}.lora_B.weight": torch.zeros(64, 4)}
    with pytest.raises(UserError, match=r"^--adapter: its LoRA on model.layers.0.self_attn.kv_b_proj cannot go in a GGUF LoRA file"):
        _lora_tensors(writer, weights, {"num_hidden_layers": 1, "num_attention_heads": 2}, gguf.MODEL_ARCH.DEEPSEEK2, False)
