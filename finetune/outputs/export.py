"""`finetune export --format gguf`: a model folder (merged, or fully fine-tuned) as one GGUF file for
llama.cpp and Ollama (a vision-language model: two, finetune/outputs/mmproj.py), verified before it is published.

The file is written by the `gguf` package, the llama.cpp project's own writer on PyPI: its tensor names
(`get_tensor_name_map`), its metadata keys and its Q8_0 quantization. What the package leaves to
llama.cpp's conversion script, and this module does for the families it names, is the per-family
glue: which architecture a config is, which metadata it needs (Gemma 3's sliding layers and their rope
base, rope scaling), Llama's query/key rows reordered for llama.cpp's rotary layout and Llama 3's rope
scaling as the `rope_freqs` tensor. The tokenizer is finetune/outputs/gguf_vocab.py's: byte-level BPE or
SentencePiece, its token ids checked in llama.cpp before any weight is written.

Before the file lands at --out it is read by llama.cpp itself (llama-cpp-python, where installed: logits,
greedy tokens), else loaded back through transformers' GGUF loader (`from_pretrained(..., gguf_file=...)`),
and its logits compared with the folder's on a few texts; above the tolerance nothing is published. An
Ollama `Modelfile` is written beside it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from finetune.config.errors import EXIT_MERGE_CHECK, Stopped, UserError
from finetune.config.files import read_model_config
from finetune.model import families
from finetune.outputs import mmproj
from finetune.outputs.gguf_vocab import check_in_llama_cpp, quiet_stderr, write_vocabulary

# model_type -> (the gguf package's architecture, query/key rows reordered for llama.cpp's rotary layout)
FAMILIES = {"llama": ("LLAMA", True), "mistral": ("LLAMA", True), "qwen2": ("QWEN2", False), "qwen3": ("QWEN3", False),
            "gemma2": ("GEMMA2", False), "gemma3_text": ("GEMMA3", False), "qwen3_moe": ("QWEN3MOE", False), "gpt_oss": ("GPT_OSS", False),
            "mixtral": ("LLAMA", True),  # llama.cpp's llama architecture with experts, as its converter writes Mixtral
            "deepseek_v3": ("DEEPSEEK2", False), "glm4_moe": ("GLM4_MOE", False),
            "qwen3_5_text": ("QWEN35", False), "qwen3_5_moe_text": ("QWEN35MOE", False), "gemma4_text": ("GEMMA4", False),
            "llama4_text": ("LLAMA4", False)}
LINEAR_ATTENTION = ("qwen3_5_text", "qwen3_5_moe_text")  # Gated DeltaNet layers beside gated full attention
# families transformers' GGUF reader does not read back: checked in llama.cpp itself or not written
LLAMA_CPP_ONLY = ("deepseek_v3", "glm4_moe", "llama4_text", *LINEAR_ATTENTION)
# what llama.cpp's llama4 builds in, as the releases set it: chunks of 8,192 positions, and from 8,192 tokens on a temperature
# on the queries of the layers without rotary positions (every 4th: no_rope_layers)
LLAMA4_BUILT_IN = {"attention_chunk_size": 8192, "floor_scale": 8192, "attn_scale": 0.1, "attn_temperature_tuning": True}
GEMMAS = ("gemma2", "gemma3_text")  # norms that scale by (1 + weight), heads scaled by query_pre_attn_scalar
# families not written, and llama.cpp's reason
NOT_WRITTEN = {"phi3": "llama.cpp's phi3 turns Phi-3-mini-4k's 2,047-token sliding window off, and Phi-3.5/4's longrope would need "
                       "its factor tensors, which this export does not write"}
# llama.cpp's k-quants, made from the f16 file by llama.cpp's own quantizer (llama-cpp-python): its ftype names
K_QUANTS = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}
TYPES = ("f16", "q8_0", *K_QUANTS)
# largest |logit difference| published: f16 as a bf16 merge; the quantized types are reported, bounded loosely
TOLERANCE = {"f16": 0.25, "q8_0": 1.0, "q6_k": 1.0, "q5_k_m": 1.5, "q4_k_m": 2.0}
# the last one longer than the test models' sliding windows (16 tokens), and than Llama 3's rope scaling's short wavelengths
CHECK_TEXTS = ["What kind of word is this?\n\nrabbit", "The quick brown fox jumps over the lazy dog.",
               "In the river there was a castle, and in the castle there lived an old king who counted his coins every night by the light "
               "of one candle, until the candle burned down and the king fell asleep over his table."]


def export(model_dir: str | None, adapter: str | None, out: str, kind: str = "f16", say=print) -> dict:
    """A model folder, or an adapter merged first (finetune merge, verified, into a folder beside --out
    that goes afterwards), written as GGUF at `out`."""
    if importlib.util.find_spec("gguf") is None:
        raise UserError("--format gguf: needs the gguf package (pip install 'finetune-kit[gguf]')")
    pictures = _pictures(model_dir, adapter, out)
    write = (lambda folder: mmproj.export_vision(Path(folder), check_out(out), kind, export_gguf, say)) if pictures else \
        (lambda folder: export_gguf(folder, out, kind, say))
    if adapter is None:
        return write(model_dir)
    from finetune.outputs.merge import merge

    merged = check_out(out).with_name(f".{Path(out).name}.merged.tmp")  # before the merge's minutes
    try:
        merge(adapter, str(merged), dtype="fp32", say=say)
        say(f"merged {adapter} into its base (checked against base + adapter) for the export")
        return write(str(merged))
    finally:
        shutil.rmtree(merged, ignore_errors=True)


def _pictures(model_dir: str | None, adapter: str | None, out: str) -> bool:
    """Whether the model (or the adapter's base) is a vision-language model, refused before any merge where its projector
    file is not written (mmproj.refusal) or would land on a file already there."""
    from finetune.model import vision
    from finetune.model.adapters import find_adapter

    folder = Path(model_dir).expanduser() if model_dir else Path(find_adapter(adapter, None).base)
    config = read_model_config(folder, "--model") if (folder / "config.json").is_file() else {}
    if not vision.is_vision(config):
        return False
    why = mmproj.refusal(config)
    if why:
        raise UserError(f"--format gguf: {why}")
    mmproj.projector_path(check_out(out))
    return True


def export_gguf(model_dir: str, out: str, kind: str = "f16", say=print) -> dict:
    """Write `model_dir` as GGUF at `out` (a new file), verified; returns the report."""
    import gguf

    folder, target = Path(model_dir).expanduser(), check_out(out)
    config = read_model_config(folder, "--model")
    family = config.get("model_type")
    _refuse_unwritable(config, folder)
    if kind not in TYPES:
        raise UserError(f"--type {kind}: expected one of {', '.join(TYPES)}")
    if kind in K_QUANTS and importlib.util.find_spec("llama_cpp") is None:
        raise UserError(f"--type {kind}: made by llama.cpp's own quantizer; pip install llama-cpp-python (or export f16 and run llama-quantize)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    # a Qwen-VL's language model (mmproj.text_folder): llama.cpp's qwen2vl or qwen3vl, with its rotary sections
    arch, permuted = ({"qwen2": "QWEN2VL", "qwen3": "QWEN3VL", "qwen3_moe": "QWEN3VLMOE"}[family], False) if config.get("mrope_section") else FAMILIES[family]
    arch_name = gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch)]
    written = "f16" if kind in K_QUANTS else kind

    made = gguf.GGUFWriter(None, arch_name)  # the metadata and vocabulary, made once for the token check's file and the export's
    _metadata(made, config, folder.name, written)
    write_vocabulary(made, tokenizer, folder, config.get("vocab_size") or 0)

    def header(writer) -> None:
        writer.kv_data[0].update(made.kv_data[0])

    in_llama_cpp = importlib.util.find_spec("llama_cpp") is not None  # the client the file is for
    token_checks = check_in_llama_cpp(arch_name, header, tokenizer, folder, config["vocab_size"]) if in_llama_cpp else 0
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tmp, unquantized = target.with_name(f".{target.name}.tmp"), target.with_name(f".{target.name}.f16.tmp")
    try:
        writer = gguf.GGUFWriter(str(unquantized if kind in K_QUANTS else tmp), arch_name)
        header(writer)
        _tensors(writer, model, config, getattr(gguf.MODEL_ARCH, arch), permuted, written)
        _finish(writer)
        if kind in K_QUANTS:
            _quantize(unquantized, tmp, kind)
        if in_llama_cpp:
            report = _verify_in_llama_cpp(model, tokenizer, tmp, target)
            say(f"GGUF ({kind}) in llama.cpp itself (llama-cpp-python {report['version']}): the same token ids as transformers on "
                f"{token_checks} strings, logits within max {report['max']:.3g} of the model's on {len(CHECK_TEXTS)} texts, "
                f"greedy tokens {'the same' if report['same_greedy'] else 'DIFFERENT'}")
        else:  # transformers' GGUF reader, a minute for a 128k vocabulary: read it back through llama.cpp's own where installed
            report = _verify(model, tokenizer, tmp, kind)
            say(f"GGUF ({kind}) loaded back by transformers: logits within max {report['max']:.3g} (mean {report['mean']:.3g}) of the model's "
                f"on {len(CHECK_TEXTS)} texts, greedy tokens {'the same' if report['same_greedy'] else 'DIFFERENT'} (llama.cpp itself: not "
                "checked; pip install llama-cpp-python)")
        report.update(model=str(folder), out=str(target), type=kind, family=family, bytes=tmp.stat().st_size)
        _publish(tmp, target, report["max"], TOLERANCE[kind], "GGUF")
    finally:
        tmp.unlink(missing_ok=True)
        unquantized.unlink(missing_ok=True)
    modelfile = target.with_name("Modelfile")
    if not modelfile.exists():  # Ollama's recipe: `ollama create NAME -f Modelfile`
        modelfile.write_text(f"FROM ./{target.name}\n")
    return report


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _publish(tmp: Path, target: Path, worst: float, tolerance: float, what: str) -> None:
    """The checked file in its place, or nothing written (exit 5) where llama.cpp's logits differ beyond the tolerance."""
    if worst > tolerance:
        raise Stopped(f"{what} check failed: logits differ by up to {worst:.4g} (tolerance {tolerance:g}); nothing written to {target}",
                      exit_code=EXIT_MERGE_CHECK)
    os.replace(tmp, target)


def _refuse_unwritable(config: dict, folder: Path) -> None:
    """One line for a model llama.cpp's architecture for its family would run otherwise than transformers."""
    family = config.get("model_type")
    if family not in FAMILIES:
        why = f" ({NOT_WRITTEN[family]})" if family in NOT_WRITTEN else ""
        raise UserError(f"--model: {folder} is a {family} model; GGUF export covers {', '.join(sorted(FAMILIES))}{why} (merge first, then export)")
    if family in GEMMAS and config.get("query_pre_attn_scalar") != config.get("head_dim"):
        raise UserError(f"--model: {folder} scales attention by query_pre_attn_scalar {config.get('query_pre_attn_scalar')} with heads of "
                        f"{config.get('head_dim')}; llama.cpp scales by the head size (GGUF export takes the two equal, as the Gemma 1B-9B releases)")
    if family == "gemma3_text" and (config.get("attn_logit_softcapping") or config.get("final_logit_softcapping")):
        raise UserError(f"--model: {folder} soft-caps its logits, which llama.cpp's gemma3 architecture does not")
    window = config.get("sliding_window") if family in ("mistral", "mixtral") or config.get("use_sliding_window") else None
    if window and window < config.get("max_position_embeddings", 0):
        raise UserError(f"--model: {folder} attends within a sliding window of {window} tokens, which GGUF's "
                        f"{FAMILIES[family][0].lower()} architecture does not carry (llama.cpp would attend over the whole context)")
    if family == "qwen3_moe" and (not config.get("norm_topk_prob") or config.get("mlp_only_layers") or (config.get("decoder_sparse_step") or 1) != 1):
        raise UserError(f"--model: {folder} has dense layers or leaves its routed experts' weights unnormalized (norm_topk_prob); "
                        "llama.cpp's qwen3moe architecture has every layer routed and normalizes them, as the Qwen3-MoE releases")
    if family == "gpt_oss" and (config.get("swiglu_alpha"), config.get("swiglu_limit")) != (1.702, 7.0):
        raise UserError(f"--model: {folder}'s experts gate with alpha {config.get('swiglu_alpha')} and limit {config.get('swiglu_limit')}; "
                        "llama.cpp's gpt-oss architecture has the releases' 1.702 and 7.0 built in")
    if family == "gemma4_text" and config.get("hidden_size_per_layer_input") and config.get("vocab_size_per_layer_input") != config["vocab_size"]:
        raise UserError(f"--model: {folder}'s per-layer embeddings cover {config.get('vocab_size_per_layer_input')} tokens of its "
                        f"{config['vocab_size']}; llama.cpp's gemma4 architecture takes one per token (as the releases)")
    kinds = config.get("layer_types") or []
    if family in LINEAR_ATTENTION and "full_attention" in kinds:
        every = kinds.index("full_attention") + 1
        if kinds != ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(len(kinds))]:
            raise UserError(f"--model: {folder}'s full-attention layers are not every n-th layer, the pattern llama.cpp's qwen35 architecture "
                            "takes (the releases': every 4th)")
    if family == "llama4_text":
        _refuse_unlike_llama4(config, folder)
    if family in LLAMA_CPP_ONLY and importlib.util.find_spec("llama_cpp") is None:
        raise UserError(f"--model: {folder} is a {family} model, which only llama.cpp itself reads back to check the file; "
                        "pip install llama-cpp-python (make install does)")
    scaling = _rope(config).get("rope_type", "default")
    if scaling not in ("default", "llama3", "linear") and not (scaling == "yarn" and family in ("gpt_oss", "deepseek_v3")) \
            and not (scaling == "proportional" and family == "gemma4_text"):
        raise UserError(f"--model: {folder} scales rope as {scaling}; GGUF export writes llama3 and linear scaling (and gpt-oss's and DeepSeek-V3's yarn)")


def export_lora(adapter_path: str, out: str, say=print) -> dict:
    """A LoRA adapter as a GGUF LoRA file that llama.cpp applies to its base's GGUF (`llama-cli -m base.gguf --lora
    out.gguf`), checked in llama.cpp itself: the base written as f16 GGUF (a temporary file) with the adapter applied
    gives base + adapter's logits. Needs llama-cpp-python for the check."""
    import gguf
    from safetensors.torch import load_file

    from finetune.model.adapters import attach, find_adapter, load_base

    target = check_out(out)
    if importlib.util.find_spec("llama_cpp") is None:
        raise UserError("--lora: the file is checked by applying it in llama.cpp itself; pip install llama-cpp-python")
    adapter = find_adapter(adapter_path, None)
    settings = json.loads((Path(adapter.path) / "adapter_config.json").read_text())
    odd = [k for k in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern") if settings.get(k)]
    if odd or adapter.quantized:
        raise UserError(f"--adapter: {adapter.path} is {'a QLoRA adapter' if adapter.quantized else 'set with ' + ', '.join(odd)}; "
                        "GGUF LoRA files carry plain LoRA on an unquantized base (merge, then export the model)")
    folder = Path(adapter.base).expanduser()
    config = read_model_config(folder, "--adapter's base")
    if config.get("model_type") not in FAMILIES:
        raise UserError(f"--adapter: its base is a {config.get('model_type')} model; GGUF export covers {', '.join(sorted(FAMILIES))}")
    arch, permuted = FAMILIES[config["model_type"]]
    r = settings["r"]
    scaling = settings["lora_alpha"] / (r ** 0.5 if settings.get("use_rslora") else r)  # llama.cpp scales by alpha / r
    tmp, scratch = target.with_name(f".{target.name}.tmp"), tempfile.TemporaryDirectory(prefix="finetune-lora-base-")
    base_file = Path(scratch.name) / "base.gguf"  # with its Modelfile, gone with the folder
    try:
        writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch)])
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, scaling * r)
        _lora_tensors(writer, load_file(Path(adapter.path) / "adapter_model.safetensors"), config, getattr(gguf.MODEL_ARCH, arch), permuted)
        _finish(writer)
        export_gguf(str(folder), str(base_file), "f16", say=lambda _: None)
        tuned = attach(load_base(adapter, False), adapter)
        worst, effect = _applied_in_llama_cpp(tuned, base_file, tmp, target)
        say(f"GGUF LoRA applied by llama.cpp to its base (f16): logits within max {worst:.3g} of base + adapter's on {len(CHECK_TEXTS)} texts "
            f"(the adapter moves them by max {effect:.3g})")
        _publish(tmp, target, worst, TOLERANCE["f16"], "GGUF LoRA")
    finally:
        tmp.unlink(missing_ok=True)
        scratch.cleanup()
    return {"out": str(target), "type": "lora", "bytes": target.stat().st_size, "max": worst, "adapter_effect": effect, "base": str(folder)}


def _lora_tensors(writer, weights: dict, config: dict, arch, permuted: bool) -> None:
    """Each adapted layer's A (r x in) and B (out x r) under its GGUF name + .lora_a / .lora_b; B's rows of a query or
    key projection in llama.cpp's rotary order, and of a Gated DeltaNet projection (A's columns of its output
    projection) in llama.cpp's value-head order, as the base's weight."""
    import gguf

    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    for key in sorted(k for k in weights if ".lora_A." in k):
        layer = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        if ".experts." in layer:
            raise UserError(f"--adapter: its LoRA on {layer.split('.experts.')[0]}.experts, the experts' fused weights, is not written as a GGUF LoRA "
                            "file here; export the merged model instead (without --lora)")
        if layer == "model.per_layer_model_projection.weight":
            raise UserError("--adapter: its LoRA on model.per_layer_model_projection cannot go in a GGUF LoRA file: llama.cpp's gemma4 "
                            "multiplies that weight with no adapter; export the merged model instead (without --lora)")
        if layer.endswith("kv_b_proj.weight"):
            raise UserError(f"--adapter: its LoRA on {layer.removesuffix('.weight')} cannot go in a GGUF LoRA file: llama.cpp's deepseek2 splits that "
                            "weight per head into k_b (transposed) and v_b; export the merged model instead (without --lora)")
        name = names.get_name(layer, try_suffixes=(".weight",))
        if name is None:
            raise UserError(f"--adapter: no GGUF name for the adapted layer {layer}")
        a, b = weights[key].float(), weights[key.replace(".lora_A.", ".lora_B.")].float()
        if config.get("model_type") in LINEAR_ATTENTION and ".linear_attn." in layer:  # B's rows (out_proj: A's columns) as the weight's
            if layer.endswith("out_proj.weight"):
                a = _delta_net_weights({layer: a}, config)[layer]
            else:
                b = _delta_net_weights({layer: b}, config)[layer]
        a, b = a.numpy(), b.numpy()
        if permuted and layer.endswith(("q_proj.weight", "k_proj.weight")):
            b = mmproj.rotary_rows(b, heads if "q_proj" in layer else kv)
        writer.add_tensor(f"{name}.lora_a", a)
        writer.add_tensor(f"{name}.lora_b", b)


@torch.no_grad()
def _applied_in_llama_cpp(tuned, base_file: Path, lora_file: Path, target: Path) -> tuple[float, float]:
    """The largest |logit difference| between llama.cpp running the base GGUF with the LoRA file and `tuned` (base +
    adapter in transformers) on CHECK_TEXTS, and how far the adapter moves the base's logits there."""
    llm = _open_in_llama_cpp(base_file, target, lora=lora_file)
    worst = effect = 0.0
    for text in CHECK_TEXTS:
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        theirs = _llama_cpp_logits(llm, ids)
        ours = tuned(input_ids=torch.tensor([ids])).logits[0].float()
        with tuned.disable_adapter():
            effect = max(effect, (ours - tuned(input_ids=torch.tensor([ids])).logits[0].float()).abs().max().item())
        worst = max(worst, (ours - theirs).abs().max().item())
    return worst, effect


def _open_in_llama_cpp(path: Path, target: Path, lora: Path | None = None):
    """llama.cpp's model over the file (with a LoRA file applied), every position's logits kept; a file it refuses
    stops the export (exit 5, nothing written to `target`)."""
    from llama_cpp import Llama

    try:
        with quiet_stderr():
            return Llama(model_path=str(path), lora_path=str(lora) if lora else None, n_ctx=256, logits_all=True, verbose=False,
                         n_threads=max(1, torch.get_num_threads()))
    except ValueError as err:
        raise Stopped(f"GGUF check failed: llama.cpp does not load the file ({err}); nothing written to {target}", exit_code=EXIT_MERGE_CHECK) from None


def _llama_cpp_logits(llm, ids: list[int]) -> torch.Tensor:
    llm.reset()
    llm.eval(ids)
    return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))


def check_out(out: str) -> Path:
    target = Path(out).expanduser()
    if target.exists():
        raise UserError(f"--out: {target} exists; name a new file")
    if not target.parent.is_dir():
        raise UserError(f"--out: {target.parent} is not a folder")
    return target


def _refuse_unlike_llama4(config: dict, folder: Path) -> None:
    """One line for a Llama 4 whose attention llama.cpp's llama4 would run otherwise (LLAMA4_BUILT_IN, its layers without
    rotary positions every 4th and the others chunked, its experts every interleave_moe_layer_step-th layer, its queries and keys normed unless
    it has 128 experts: Scout's and Maverick's, told apart by that count)."""
    layers, step = config["num_hidden_layers"], config.get("interleave_moe_layer_step") or 1
    seen = {key: config.get(key) for key in LLAMA4_BUILT_IN} | {"no_rope_layers": config.get("no_rope_layers") or None,
                                                               "use_qk_norm": config.get("use_qk_norm", True)}
    built_in = LLAMA4_BUILT_IN | {"no_rope_layers": [int((i + 1) % 4 != 0) for i in range(layers)],
                                  "use_qk_norm": config.get("num_local_experts") != 128}
    built_in["layer_types"] = ["chunked_attention" if rope else "full_attention" for rope in built_in["no_rope_layers"]]
    seen["layer_types"] = config.get("layer_types") or built_in["layer_types"]  # transformers' defaults where unset
    if seen["no_rope_layers"] is None:  # transformers' default: every 4th layer without
        seen["no_rope_layers"] = built_in["no_rope_layers"]
    if config.get("moe_layers") not in (None, list(range(step - 1, layers, step))):
        seen["moe_layers"], built_in["moe_layers"] = config["moe_layers"], list(range(step - 1, layers, step))
    for key, value in seen.items():
        if value != built_in[key]:
            raise UserError(f"--model: {folder} sets {key} {value}; llama.cpp's llama4 architecture has {built_in[key]} built in "
                            f"(the releases'{', with its ' + str(config.get('num_local_experts')) + ' experts' if key == 'use_qk_norm' else ''})")


def _metadata(writer, config: dict, name: str, kind: str) -> None:
    import gguf

    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    if not config.get("use_double_wide_mlp"):  # Gemma 4's, per layer; Llama 4's dense layers', its experts' apart
        writer.add_feed_forward_length(config.get("intermediate_size_mlp") or config["intermediate_size"])
    writer.add_head_count(heads)
    if config.get("model_type") == "deepseek_v3":
        _latent_attention(writer, config)
    elif config.get("model_type") == "gemma4_text":
        _gemma4(writer, config)
    else:
        writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
        writer.add_rope_dimension_count(int(head_dim * _rope(config).get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))))
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope = _rope(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if config.get("mrope_section"):  # the rotary dimensions of time, height and width (llama.cpp takes four sections)
        writer.add_rope_dimension_sections([*config["mrope_section"], 0, 0, 0, 0][:4])
    if config.get("model_type") in LINEAR_ATTENTION:
        _delta_net(writer, config)
    if "deepstack_layers" in config:  # Qwen3-VL: how many tower layers' features join the picture's
        writer.add_num_deepstack_layers(config["deepstack_layers"])
    if rope["rope_type"] == "linear":  # llama3's scaling goes in as the rope_freqs tensor
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if rope["rope_type"] == "yarn":
        _yarn(writer, rope)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("model_type") == "gemma2":  # its alternate layers attend within a window; logits soft-capped
        writer.add_sliding_window(config["sliding_window"])
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if config.get("model_type") == "gpt_oss":  # which layers attend within the window; its experts
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern([k == "sliding_attention" for k in config["layer_types"]])
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["intermediate_size"])
    if config.get("model_type") == "gemma3_text":  # which layers attend within the window, and their own rope base
        pattern = config.get("sliding_window_pattern") or 6
        kinds = config.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(config["num_hidden_layers"])]
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern([k == "sliding_attention" for k in kinds])
        writer.add_rope_freq_base_swa(float(_rope(config, "sliding_attention")["rope_theta"]))
    if config.get("model_type") == "qwen3_moe":
        writer.add_expert_count(families.num_experts(config))
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("model_type") == "mixtral":  # each expert as wide as feed_forward_length
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("model_type") in ("deepseek_v3", "glm4_moe"):
        _routed_experts(writer, config)
    if config.get("model_type") == "llama4_text":  # experts (and a shared one) every interleave_moe_layer_step-th layer
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["intermediate_size"])
        writer.add_interleave_moe_layer_step(config.get("interleave_moe_layer_step") or 1)
    if config.get("model_type") == "qwen3_5_moe_text":
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if kind == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0)


def _latent_attention(writer, config: dict) -> None:
    """DeepSeek's multi-head latent attention as llama.cpp runs it: one shared key/value head (MQA) over the latent and
    the rotary part, keys of kv_lora_rank + rope dims, values of kv_lora_rank; each head's own sizes as the _mla keys."""
    writer.add_head_count_kv(1)
    writer.add_q_lora_rank(config.get("q_lora_rank") or 0)  # none: one q_proj (Moonlight), not two
    writer.add_kv_lora_rank(config["kv_lora_rank"])
    writer.add_rope_dimension_count(config["qk_rope_head_dim"])
    writer.add_key_length(config["kv_lora_rank"] + config["qk_rope_head_dim"])
    writer.add_value_length(config["kv_lora_rank"])
    writer.add_key_length_mla(config["qk_nope_head_dim"] + config["qk_rope_head_dim"])
    writer.add_value_length_mla(config["v_head_dim"])
    rope = _rope(config)
    if rope["rope_type"] == "yarn" and rope.get("mscale_all_dim"):  # the softmax scale's mscale², as llama.cpp's converter writes it
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _gemma4(writer, config: dict) -> None:
    """Gemma 4 as llama.cpp's gemma4 reads it: heads of global_head_dim on the full layers and head_dim on the sliding
    ones (key/value heads per layer where the full layers have their own count), the full layers' partial rotary dims
    given as rope_freqs (the rest held still), their own rope bases, the last layers reading earlier layers' keys and
    values, per-layer inputs, MLPs twice as wide on the sharing layers where the config says so, the logits' soft cap."""
    kinds, layers = config["layer_types"], config["num_hidden_layers"]
    full, sliding = _gemma4_head_size(config, "full_attention"), _gemma4_head_size(config, "sliding_attention")
    writer.add_key_length(full)
    writer.add_value_length(full)
    writer.add_key_length_swa(sliding)
    writer.add_value_length_swa(sliding)
    counts = [kv for _, kv in _gemma4_heads(config)]
    writer.add_head_count_kv(counts if len(set(counts)) > 1 else counts[0])
    writer.add_rope_dimension_count(full)
    writer.add_rope_dimension_count_swa(int(sliding * _rope(config, "sliding_attention").get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base_swa(float(_rope(config, "sliding_attention")["rope_theta"]))
    writer.add_sliding_window(config["sliding_window"])
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in kinds])
    writer.add_shared_kv_layers(config.get("num_kv_shared_layers") or 0)
    writer.add_embedding_length_per_layer_input(config.get("hidden_size_per_layer_input") or 0)
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if config.get("use_double_wide_mlp"):
        first_sharing = layers - (config.get("num_kv_shared_layers") or 0)
        writer.add_feed_forward_length([config["intermediate_size"] * (2 if i >= first_sharing else 1) for i in range(layers)])
    if config.get("enable_moe_block"):
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["top_k_experts"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


def _gemma4_heads(config: dict) -> list[tuple[int, int]]:
    """Each layer's (head size, key/value heads): the full layers' own, from transformers 5's per_layer_config or the
    releases' global_head_dim and num_global_key_value_heads (where attention_k_eq_v says the keys are the values)."""
    size, kv = config["head_dim"], config.get("num_key_value_heads") or config["num_attention_heads"]
    per_layer = {int(i): values for i, values in (config.get("per_layer_config") or {}).items()}
    if not per_layer:
        wide = {"head_dim": config.get("global_head_dim") or 512}
        if config.get("attention_k_eq_v") and config.get("num_global_key_value_heads"):
            wide["num_key_value_heads"] = config["num_global_key_value_heads"]
        per_layer = {i: wide for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"}
    return [(per_layer.get(i, {}).get("head_dim", size), per_layer.get(i, {}).get("num_key_value_heads", kv)) for i in range(config["num_hidden_layers"])]


def _gemma4_head_size(config: dict, kind: str) -> int:
    """The head size of Gemma 4's layers of one kind (llama.cpp takes one per kind)."""
    return next(size for (size, _), layer in zip(_gemma4_heads(config), config["layer_types"]) if layer == kind)


def _gemma4_weights(state: dict) -> dict:
    """Gemma 4's experts as llama.cpp's gemma4 reads them: gate and up kept as one tensor (ffn_gate_up_exps), the router's
    input scale and each expert's output scale as scales of the router and the experts' down projection."""
    renamed = {".experts.gate_up_proj": ".experts.gate_up_proj.weight", ".router.scale": ".router.proj.scale",
               ".router.per_expert_scale": ".experts.down_proj.scale"}
    out = {}
    for name, tensor in state.items():
        ending = next((end for end in renamed if name.endswith(end)), None)
        out[name.removesuffix(ending) + renamed[ending] if ending else name] = tensor
    return out


def _gemma4_rope_factors(config: dict) -> np.ndarray:
    """Gemma 4's full layers rotate the first partial_rotary_factor of each half-head and leave the rest: llama.cpp's
    rotary factors, 1 for a rotated pair and 1e30 (no rotation) for the others, as its converter writes them."""
    full = _gemma4_head_size(config, "full_attention")
    turned = int(full * _rope(config).get("partial_rotary_factor", 1.0) / 2)
    return np.array([1.0] * turned + [1e30] * (full // 2 - turned), dtype=np.float32)


def _delta_net(writer, config: dict) -> None:
    """Qwen3.5's Gated DeltaNet layers as llama.cpp's qwen35 reads them (its ssm keys), every n-th layer full attention,
    and the rotary sections of time, height and width (a text's three positions are equal; the sections need only cover
    the rotary dims, in the releases' 11 : 11 : 10 where the config names none)."""
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    kinds = config["layer_types"]
    writer.add_full_attention_interval(kinds.index("full_attention") + 1)
    rope = _rope(config)
    pairs = int(config["head_dim"] * rope.get("partial_rotary_factor", 1.0)) // 2
    sections = rope.get("mrope_section") or [pairs * 11 // 32, pairs * 11 // 32, pairs - 2 * (pairs * 11 // 32)]
    writer.add_rope_dimension_sections([*sections, 0][:4])


def _routed_experts(writer, config: dict) -> None:
    """DeepSeek-V3's and GLM-4.5's experts: dense leading layers, shared experts, sigmoid scores with a correction bias,
    picked within the best groups, weights normalized and scaled."""
    import gguf

    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_weights_scale(float(config["routed_scaling_factor"]))
    writer.add_expert_weights_norm(bool(config["norm_topk_prob"]))
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if (config.get("n_group") or 1) > 1:
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])


def _yarn(writer, rope: dict) -> None:
    """YaRN as llama.cpp reads it. llama.cpp rounds the band of blended frequencies outward, as transformers does with
    `truncate` true; gpt-oss's releases set it false, so a few frequencies at the band's edges differ (within the
    check's tolerance, measured in tests/test_export.py)."""
    import gguf

    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast), ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
                     ("attention_factor", writer.add_rope_scaling_yarn_attn_factor)):
        if rope.get(key) is not None:
            add(float(rope[key]))


def _rope(config: dict, layers: str = "full_attention") -> dict:
    """rope_theta and scaling for one kind of layer: from transformers 5's rope_parameters (per kind of layer where
    they differ, as Gemma 3's), else the older rope_theta / rope_scaling / rope_local_base_freq."""
    params = config.get("rope_parameters") or {}
    if isinstance(params.get(layers), dict):
        params = params[layers]
    older = dict(config.get("rope_scaling") or {})
    older["rope_type"] = older.get("rope_type", older.get("type", "default"))
    theta = config.get("rope_local_base_freq") if layers == "sliding_attention" else config.get("rope_theta")
    return {**older, "rope_theta": theta or 10000.0, **params}


def _tensors(writer, model, config: dict, arch, permuted: bool, kind: str) -> None:
    import gguf

    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    state = model.state_dict()
    if config.get("model_type") == "gemma4_text":
        state = _gemma4_weights(state)
    state = _split_experts(state, config.get("model_type") in ("gpt_oss", "llama4_text"), interleaved=config.get("model_type") == "gpt_oss")
    if config.get("model_type") == "deepseek_v3":
        state = _latent_heads(state, config)
    if config.get("model_type") in LINEAR_ATTENTION:
        state = _delta_net_weights(state, config)
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue  # llama.cpp ties the output to token_embd when output.weight is missing
        target = names.get_name(name, try_suffixes=(".weight", ".bias", ".scale"))
        if target is None:
            raise UserError(f"--model: no GGUF name for the tensor {name}")
        data = tensor.float().numpy()
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = mmproj.rotary_rows(data, heads if "q_proj" in name else kv)
        if config.get("model_type") in GEMMAS and name.endswith("norm.weight"):
            data = data + 1  # Gemma's norms scale by (1 + weight); llama.cpp's by the weight stored
        # llama.cpp adds biases in f32 (gpt-oss's experts' are 2-D) and runs a short convolution's kernels in f32 only
        if data.ndim == 1 or target.endswith(".bias") or ".ssm_conv1d." in target:
            writer.add_tensor(target, data.astype(np.float32))
        elif kind == "f16":
            writer.add_tensor(target, data.astype(np.float16))
        else:
            writer.add_tensor(target, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    if _rope(config)["rope_type"] == "llama3":
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", _llama3_rope_factors(model, config))
    if config.get("model_type") == "gemma4_text":
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", _gemma4_rope_factors(config))


def _split_experts(state: dict, transposed: bool = False, interleaved: bool = False) -> dict:
    """transformers' fused expert weights as GGUF holds them: gate_up_proj (E, 2m, h) as gate_proj and up_proj
    (E, m, h) each (llama.cpp's ffn_gate_exps and ffn_up_exps); down_proj (E, h, m) as it is; each named as a weight.
    gpt-oss and Llama 4 store them (E, in, out) (transposed), gpt-oss with gate and up columns interleaved, and biases
    beside them (its sinks too are named as weights). DeepSeek-V3's and GLM-4.5's routers' score corrections are named
    as biases."""
    out = {}
    for name, tensor in state.items():
        if transposed and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensor = tensor.transpose(-1, -2)
        if name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
            axis = -2 if tensor.dim() == 3 else -1  # a weight's output rows, a bias's entries
            gate, up = tensor.unflatten(axis, (-1, 2)).unbind(axis) if interleaved else tensor.chunk(2, dim=axis)
            suffix = ".bias" if name.endswith("_bias") else ".weight"
            stem = name.removesuffix("_bias").removesuffix("gate_up_proj")
            out[f"{stem}gate_proj{suffix}"], out[f"{stem}up_proj{suffix}"] = gate, up
        elif name.endswith(("experts.down_proj_bias", "gate.e_score_correction_bias")):  # the router's correction: exp_probs_b
            out[name.removesuffix("_bias") + ".bias"] = tensor
        else:
            out[name + (".weight" if name.endswith(("experts.down_proj", "self_attn.sinks", "layer_scalar")) else "")] = tensor
    return out


def _latent_heads(state: dict, config: dict) -> dict:
    """MLA's weights as llama.cpp's deepseek2 reads them: kv_b_proj split per head into the key part, transposed (k_b:
    queries absorbed into the latent), and the value part (v_b). Where the
    rotary dims are not interleaved pairs (rope_interleave false), their rows reordered into pairs, as Llama's."""
    heads, nope, rope = config["num_attention_heads"], config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    out = {}
    for name, tensor in state.items():
        if name.endswith("self_attn.kv_b_proj.weight"):
            per_head = tensor.unflatten(0, (heads, -1))  # (heads, nope + v, kv_lora_rank)
            out[name.replace("kv_b_proj", "k_b_proj")] = per_head[:, :nope].transpose(1, 2).contiguous()
            out[name.replace("kv_b_proj", "v_b_proj")] = per_head[:, nope:].contiguous()
            continue
        if not config.get("rope_interleave", True) and name.endswith(("q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight")):
            rows = tensor.unflatten(0, (heads, -1)).clone() if "q_" in name else tensor.clone()[None]
            rows[:, -rope:] = torch.from_numpy(mmproj.rotary_rows(rows[:, -rope:].flatten(0, 1).numpy(), len(rows))).unflatten(0, (len(rows), -1))
            tensor = rows.flatten(0, 1)
        out[name] = tensor
    return out


def _delta_net_weights(state: dict, config: dict) -> dict:
    """Qwen3.5's weights as llama.cpp's qwen35 reads them: its norms' (1 + weight) stored whole (the gated norm inside the
    DeltaNet scales by its weight as it is), the decay as -exp(A_log), dt_bias as the time step's bias, the short
    convolution's kernels (channels, width). Where value heads outnumber key heads, transformers keeps each key head's
    value heads together and llama.cpp takes them tiled (each key head's first value head, then each one's second): every
    value-head axis reordered so (without it, logits 0.05 apart on a 2-key, 4-value-head model)."""
    keys, values = config["linear_num_key_heads"], config["linear_num_value_heads"]
    key_width, value_width = keys * config["linear_key_head_dim"], config["linear_value_head_dim"]

    def tiled(tensor, dim: int = 0, width: int = value_width):  # (keys, values per key, width) -> (values per key, keys, width)
        return tensor.unflatten(dim, (keys, values // keys, width)).transpose(dim, dim + 1).flatten(dim, dim + 2)

    out = {}
    for name, tensor in state.items():
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            tensor = tensor + 1
        elif name.endswith(".A_log"):
            tensor = -torch.exp(tiled(tensor, width=1))
        elif name.endswith(".dt_bias"):
            name, tensor = name.removesuffix("dt_bias") + "dt_proj.bias", tiled(tensor, width=1)
        elif name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # queries and keys, then the value heads
            tensor = torch.cat([tensor[:2 * key_width], tiled(tensor[2 * key_width:])])
            tensor = tensor.squeeze(1) if name.endswith("conv1d.weight") else tensor
        elif name.endswith("in_proj_z.weight"):
            tensor = tiled(tensor)
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight")):
            tensor = tiled(tensor, width=1)
        elif name.endswith("linear_attn.out_proj.weight"):
            tensor = tiled(tensor, dim=1)
        out[name] = tensor
    return out


def _llama3_rope_factors(model, config: dict) -> np.ndarray:
    """Llama 3's rope scaling as llama.cpp takes it: per frequency, the factor it divides by (plain rope's inverse
    frequencies over the ones transformers' llama3 scaling made)."""
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    plain = 1.0 / (_rope(config)["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return (plain / model.model.rotary_emb.inv_freq.double()).float().numpy()


def _quantize(source: Path, out: Path, kind: str) -> None:
    """llama.cpp's quantizer (llama_model_quantize, as its llama-quantize tool runs it) from the f16 file."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, K_QUANTS[kind])
    params.nthread = max(1, torch.get_num_threads())
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise Stopped(f"--type {kind}: llama.cpp's quantizer failed on {source}", exit_code=EXIT_MERGE_CHECK)


@torch.no_grad()
def _verify_in_llama_cpp(model, tokenizer, path: Path, target: Path) -> dict:
    """The file as llama.cpp reads it (llama-cpp-python): logits on CHECK_TEXTS and 8 greedy tokens (its tokens
    were checked before the weights were written)."""
    import llama_cpp

    llm = _open_in_llama_cpp(path, target)
    worst, same = 0.0, True
    for text in CHECK_TEXTS:
        ids = tokenizer(text).input_ids
        worst = max(worst, (model(input_ids=torch.tensor([ids])).logits[0] - _llama_cpp_logits(llm, ids)).abs().max().item())
        greedy = []
        for _ in range(8):
            greedy.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(greedy[-1:])
        grow = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
        same = same and model.generate(torch.tensor([ids]), **grow)[0, len(ids):].tolist() == greedy
    llm.close()
    return {"version": llama_cpp.__version__, "max": worst, "same_greedy": same}


@torch.no_grad()
def _verify(model, tokenizer, path: Path, kind: str) -> dict:
    """Logits of the file loaded back by transformers against the model's, greedy tokens, and the
    file's tokenizer against the folder's on the same texts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    back = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    its_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    worst, total, count, same = 0.0, 0.0, 0, True
    for text in CHECK_TEXTS:
        ids = tokenizer(text, return_tensors="pt").input_ids
        if its_tokenizer(text).input_ids != ids[0].tolist():
            raise Stopped(f"GGUF check failed: the file's tokenizer encodes {text!r} otherwise than the model's; nothing written",
                          exit_code=EXIT_MERGE_CHECK)
        a, b = model(input_ids=ids).logits, back(input_ids=ids).logits
        worst, total, count = max(worst, (a - b).abs().max().item()), total + (a - b).abs().sum().item(), count + a.numel()
        grow = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
        same = same and torch.equal(model.generate(ids, **grow), back.generate(ids, **grow))
    return {"max": worst, "mean": total / count, "same_greedy": same, "check_texts": len(CHECK_TEXTS)}
