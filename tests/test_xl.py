"""Llama-3-8B's widths and vocabulary with 2 layers (1.5B parameters, 3 GB of bf16 in 1 GB shards):
what `make bench-xl` shows at full size, checked in `make test`: the planner's arithmetic equals the
bytes the loaded model holds, and the 4-bit load streams shard by shard."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import DEMO_DATA, REPO, base_config, write_config

from finetune.config.schema import validate_config
from finetune.outputs.plan import make_plan

SHARD_BYTES = 10**9


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    from transformers import LlamaConfig

    from finetune.model.tiny import byte_level_bpe, write_random_model

    texts = [json.loads(line)["text"] for line in (DEMO_DATA / "corpus.jsonl").read_text().splitlines()[:1500]]
    tok = byte_level_bpe(texts, 128256)
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=len(tok), max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return write_random_model(tmp_path_factory.mktemp("wide") / "model", config, tok, SHARD_BYTES, say=lambda _: None)


def held_bytes(model) -> int:
    """Every byte of the model's parameters and buffers, and of its 4-bit layers' quantization state
    (kept beside the weight, neither parameter nor buffer)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(b.numel() * b.element_size() for b in model.buffers())
    weights = {id(w): w for w in (getattr(module, "weight", None) for module in model.modules())}  # peft's layer shows its base's weight too
    for weight in weights.values():
        state = getattr(weight, "quant_state", None)
        if state is not None:
            nested = [state.state2.absmax, state.state2.code, state.offset] if state.nested else []
            total += sum(t.numel() * t.element_size() for t in (state.absmax, state.code, *nested))
    return total


def wide_config(wide_model_dir, out, **model_section) -> dict:
    return base_config(wide_model_dir, out, model={"dtype": "bfloat16", **model_section}, adapter={"r": 16, "target_modules": "all-linear"})


QLORA = {"quantization": {"bits": 4, "compute_dtype": "float32"}}  # double quantization, the default


@pytest.mark.parametrize("model_section", [{}, {"quantization": {"bits": 4, "double_quant": False, "compute_dtype": "float32"}}],
                         ids=["lora-bf16", "qlora-nf4"])
def test_the_plan_counts_every_byte_the_loaded_model_holds(wide_model_dir, tmp_path, model_section):
    """The third case, QLoRA with double quantization, is the 4-bit load below."""
    from finetune.model.loading import apply_adapter, load_model

    cfg = validate_config(wide_config(wide_model_dir, tmp_path / "out", **model_section), "test")
    model = apply_adapter(load_model(cfg.model, say=lambda _: None), cfg.adapter, gradient_checkpointing=True, say=lambda _: None)
    assert held_bytes(model) == make_plan(cfg).rows["weights"]


LOAD = """
import json, sys
from finetune.config.files import load_config
from finetune.model.loading import apply_adapter, load_model

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))

cfg = load_config(sys.argv[1])
import transformers.modeling_utils, bitsandbytes  # their import is not the load's
before = status("VmRSS")
model = load_model(cfg.model, say=lambda _: None)
peak, loaded = status("VmHWM"), held_bytes(model)
model = apply_adapter(model, cfg.adapter, gradient_checkpointing=True, say=lambda _: None)
print(json.dumps({"before": before, "peak": peak, "loaded": loaded, "held": held_bytes(model)}))
"""


def test_the_4bit_load_holds_the_4bit_model_and_one_shard_at_most(wide_model_dir, tmp_path):
    """transformers quantizes each weight as it reads it: the load's peak RSS (the kernel's high-water
    mark: every page the process held, the shards' file pages included) is the 4-bit model (its fp32
    embeddings and lm_head included, as peft's k-bit preparation leaves them) and at most one shard's
    worth of bf16 being read, within 1 GiB. From the folder itself transformers would keep every shard
    memory-mapped until the load ends (model._weights_read_on_demand). With the adapter applied, the
    model then holds the very bytes the plan counts."""
    import inspect

    raw = wide_config(wide_model_dir, tmp_path / "out", **QLORA)
    result = subprocess.run([sys.executable, "-c", inspect.getsource(held_bytes) + LOAD, str(write_config(tmp_path / "c.yaml", raw))], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["held"] == make_plan(validate_config(raw, "test")).rows["weights"]
    model_4bit, shard = measured["loaded"], max(p.stat().st_size for p in wide_model_dir.glob("*.safetensors"))
    held = measured["peak"] - measured["before"]
    print(f"4-bit load: peak RSS {held / 2**20:.0f} MiB over the start; 4-bit model {model_4bit / 2**20:.0f} MiB, largest shard {shard / 2**20:.0f} MiB")
    assert model_4bit <= held <= model_4bit + shard + 2**30


HEAP = """
import sys, torch
from finetune.parallel import runtime

runtime.keep_freed_memory(quantized=sys.argv[1] == "quantized")
before, kept = runtime.current_rss(), []
for _ in range(4):
    weight = torch.ones(224 << 18)  # a dequantized 4096 x 14336 weight in fp32 (224 MiB), used, then freed
    kept.append(torch.ones(2 << 18))  # a small tensor kept for the backward, allocated after it
    del weight
print((runtime.current_rss() - before) / 2**20)
"""


@pytest.mark.parametrize("mode, at_most, at_least", [("quantized", 64, 0), ("plain", None, 224)])
def test_a_quantized_bases_dequantized_weights_go_back_when_freed(mode, at_most, at_least):
    """runtime.keep_freed_memory: with a quantized base the weights dequantized for each matmul (224 MiB
    at 8B widths) come from fresh mappings and go back when freed, so the small tensors kept between
    them split no heap block (the 8B QLoRA run was killed for memory at 23.6 GB that way); a plain run
    keeps freed blocks in the heap for speed (its temporaries are reused, not faulted in again)."""
    result = subprocess.run([sys.executable, "-c", HEAP, mode], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")})
    assert result.returncode == 0, result.stderr[-2000:]
    held = float(result.stdout.strip().splitlines()[-1])
    print(f"{mode}: {held:.0f} MiB held after 4 freed 224 MiB weights and 4 small tensors kept")
    assert held >= at_least and (at_most is None or held <= at_most), held


def test_a_random_model_with_a_tied_head_loads_tied(tmp_path, demo_tokenizer_dir):
    """Released small models tie their head (bench/released.py builds them so): written apart with other values,
    the head would load untied (transformers keeps both), and the model would be another, larger one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from finetune.model.tiny import write_random_model

    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, vocab_size=len(tok), tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(write_random_model(tmp_path / "model", config, tok, SHARD_BYTES, say=lambda _: None))
    assert model.lm_head.weight is model.model.embed_tokens.weight
