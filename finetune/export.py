"""`finetune export --format gguf`: a model folder (merged, or fully fine-tuned) as one GGUF file for
llama.cpp and Ollama, verified before it is published.

The file is written by the `gguf` package, the llama.cpp project's own writer on PyPI: its tensor names
(`get_tensor_name_map`), its metadata keys and its Q8_0 quantization. What the package leaves to
llama.cpp's conversion script, and this module does for the families it names, is the per-family
glue: which architecture a config is, which metadata it needs, and Llama's query/key rows reordered
for llama.cpp's rotary layout. The tokenizer goes in as llama.cpp's "gpt2" byte-level BPE (tokens,
types, merges, special ids, chat template).

The tokenizer's pre-tokenizer name (`tokenizer.ggml.pre`, from which llama.cpp takes its splitting regex)
is found by the tokenizer's behaviour. Before the file lands at --out it is read by llama.cpp itself
(llama-cpp-python, where installed: token ids on hard strings, logits, greedy tokens), else loaded back
through transformers' GGUF loader (`from_pretrained(..., gguf_file=...)`), and its logits compared with
the folder's on a few texts; above the tolerance nothing is published. An Ollama `Modelfile` is written beside it.
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

from finetune.config import read_model_config
from finetune.errors import EXIT_MERGE_CHECK, Stopped, UserError

# model_type -> (the gguf package's architecture, query/key rows reordered for llama.cpp's rotary layout)
FAMILIES = {"llama": ("LLAMA", True), "mistral": ("LLAMA", True), "qwen2": ("QWEN2", False), "qwen3": ("QWEN3", False),
            "gemma2": ("GEMMA2", False)}
# llama.cpp's k-quants, made from the f16 file by llama.cpp's own quantizer (llama-cpp-python): its ftype names
K_QUANTS = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}
TYPES = ("f16", "q8_0", *K_QUANTS)
# largest |logit difference| published: f16 as a bf16 merge; the quantized types are reported, bounded loosely
TOLERANCE = {"f16": 0.25, "q8_0": 1.0, "q6_k": 1.0, "q5_k_m": 1.5, "q4_k_m": 2.0}
CHECK_TEXTS = ["What kind of word is this?\n\nrabbit", "The quick brown fox jumps over the lazy dog.", "In the river there was a castle."]


def export(model_dir: str | None, adapter: str | None, out: str, kind: str = "f16", say=print) -> dict:
    """A model folder, or an adapter merged first (finetune merge, verified, into a folder beside --out
    that goes afterwards), written as GGUF at `out`."""
    if importlib.util.find_spec("gguf") is None:
        raise UserError("--format gguf: needs the gguf package (pip install 'finetune-kit[gguf]')")
    if adapter is None:
        return export_gguf(model_dir, out, kind, say)
    from finetune.merge import merge

    merged = check_out(out).with_name(f".{Path(out).name}.merged.tmp")  # before the merge's minutes
    try:
        merge(adapter, str(merged), dtype="fp32", say=say)
        say(f"merged {adapter} into its base (checked against base + adapter) for the export")
        return export_gguf(str(merged), out, kind, say)
    finally:
        shutil.rmtree(merged, ignore_errors=True)


def export_gguf(model_dir: str, out: str, kind: str = "f16", say=print) -> dict:
    """Write `model_dir` as GGUF at `out` (a new file), verified; returns the report."""
    import gguf

    folder, target = Path(model_dir).expanduser(), check_out(out)
    config = read_model_config(folder, "--model")
    family = config.get("model_type")
    if family not in FAMILIES:
        raise UserError(f"--model: {folder} is a {family} model; GGUF export covers {', '.join(sorted(FAMILIES))} (merge first, then export)")
    if family == "gemma2" and not config.get("head_dim") == config.get("query_pre_attn_scalar") == 256:
        raise UserError(f"--model: {folder} scales attention by query_pre_attn_scalar {config.get('query_pre_attn_scalar')} with heads of "
                        f"{config.get('head_dim')}; GGUF export takes Gemma 2 with both 256 (as the 2B and 9B releases; llama.cpp and "
                        "transformers' GGUF reader assume it)")
    window = config.get("sliding_window") if family == "mistral" or config.get("use_sliding_window") else None
    if window and window < config.get("max_position_embeddings", 0):
        raise UserError(f"--model: {folder} attends within a sliding window of {window} tokens, which GGUF's "
                        f"{FAMILIES[family][0].lower()} architecture does not carry (llama.cpp would attend over the whole context)")
    if kind not in TYPES:
        raise UserError(f"--type {kind}: expected one of {', '.join(TYPES)}")
    if kind in K_QUANTS and importlib.util.find_spec("llama_cpp") is None:
        raise UserError(f"--type {kind}: made by llama.cpp's own quantizer; pip install llama-cpp-python (or export f16 and run llama-quantize)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    arch, permuted = FAMILIES[family]
    tmp, unquantized = target.with_name(f".{target.name}.tmp"), target.with_name(f".{target.name}.f16.tmp")
    written = "f16" if kind in K_QUANTS else kind
    try:
        writer = gguf.GGUFWriter(str(unquantized if kind in K_QUANTS else tmp), gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch)])
        _metadata(writer, config, folder.name, written)
        _vocabulary(writer, tokenizer, folder, config.get("vocab_size") or 0)
        _tensors(writer, model, config, getattr(gguf.MODEL_ARCH, arch), permuted, written)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        if kind in K_QUANTS:
            _quantize(unquantized, tmp, kind)
        if importlib.util.find_spec("llama_cpp") is not None:  # the client the file is for
            report = _verify_in_llama_cpp(model, tokenizer, tmp, kind, target)
            say(f"GGUF ({kind}) in llama.cpp itself (llama-cpp-python {report['version']}): the same token ids as transformers on "
                f"{report['token_checks']} strings, logits within max {report['max']:.3g} of the model's on {len(CHECK_TEXTS)} texts, "
                f"greedy tokens {'the same' if report['same_greedy'] else 'DIFFERENT'}")
        else:  # transformers' GGUF reader, a minute for a 128k vocabulary: read it back through llama.cpp's own where installed
            report = _verify(model, tokenizer, tmp, kind)
            say(f"GGUF ({kind}) loaded back by transformers: logits within max {report['max']:.3g} (mean {report['mean']:.3g}) of the model's "
                f"on {len(CHECK_TEXTS)} texts, greedy tokens {'the same' if report['same_greedy'] else 'DIFFERENT'} (llama.cpp itself: not "
                "checked; pip install llama-cpp-python)")
        if report["max"] > TOLERANCE[kind]:
            raise Stopped(f"GGUF check failed: logits differ by up to {report['max']:.4g} (tolerance {TOLERANCE[kind]:g}); nothing written to {target}",
                          exit_code=EXIT_MERGE_CHECK)
        report.update(model=str(folder), out=str(target), type=kind, family=family, bytes=tmp.stat().st_size)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
        unquantized.unlink(missing_ok=True)
    modelfile = target.with_name("Modelfile")
    if not modelfile.exists():  # Ollama's recipe: `ollama create NAME -f Modelfile`
        modelfile.write_text(f"FROM ./{target.name}\n")
    return report


def export_lora(adapter_path: str, out: str, say=print) -> dict:
    """A LoRA adapter as a GGUF LoRA file that llama.cpp applies to its base's GGUF (`llama-cli -m base.gguf --lora
    out.gguf`), checked in llama.cpp itself: the base written as f16 GGUF (a temporary file) with the adapter applied
    gives base + adapter's logits. Needs llama-cpp-python for the check."""
    import gguf
    from safetensors.torch import load_file

    from finetune.adapters import attach, find_adapter, load_base

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
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        export_gguf(str(folder), str(base_file), "f16", say=lambda _: None)
        tuned = attach(load_base(adapter, False), adapter)
        worst, effect = _applied_in_llama_cpp(tuned, base_file, tmp, target)
        say(f"GGUF LoRA applied by llama.cpp to its base (f16): logits within max {worst:.3g} of base + adapter's on {len(CHECK_TEXTS)} texts "
            f"(the adapter moves them by max {effect:.3g})")
        if worst > TOLERANCE["f16"]:
            raise Stopped(f"GGUF LoRA check failed: logits differ by up to {worst:.4g} (tolerance {TOLERANCE['f16']:g}); nothing written to {target}",
                          exit_code=EXIT_MERGE_CHECK)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
        scratch.cleanup()
    return {"out": str(target), "type": "lora", "bytes": target.stat().st_size, "max": worst, "adapter_effect": effect, "base": str(folder)}


def _lora_tensors(writer, weights: dict, config: dict, arch, permuted: bool) -> None:
    """Each adapted layer's A (r x in) and B (out x r) under its GGUF name + .lora_a / .lora_b; B's rows of a query or
    key projection in llama.cpp's rotary order, as the base's weight."""
    import gguf

    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    for key in sorted(k for k in weights if ".lora_A." in k):
        layer = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        name = names.get_name(layer, try_suffixes=(".weight",))
        if name is None:
            raise UserError(f"--adapter: no GGUF name for the adapted layer {layer}")
        a, b = weights[key].float().numpy(), weights[key.replace(".lora_A.", ".lora_B.")].float().numpy()
        if permuted and layer.endswith(("q_proj.weight", "k_proj.weight")):
            b = _rotary_rows(b, heads if "q_proj" in layer else kv)
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


def _metadata(writer, config: dict, name: str, kind: str) -> None:
    import gguf

    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("model_type") == "gemma2":  # its alternate layers attend within a window; logits soft-capped
        writer.add_sliding_window(config["sliding_window"])
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if kind == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0)


def _vocabulary(writer, tokenizer, folder: Path, embedding_rows: int) -> None:
    """llama.cpp's "gpt2" tokenizer: every token by id (byte-level strings), their types, the merges."""
    import gguf

    data = json.loads(tokenizer.backend_tokenizer.to_str())
    if data["model"]["type"] != "BPE" or "ByteLevel" not in json.dumps(data.get("pre_tokenizer")):
        raise UserError(f"--model: {folder}'s tokenizer is not a byte-level BPE; GGUF export writes llama.cpp's gpt2 tokenizer only")
    vocab = tokenizer.get_vocab()
    # Rows of the embedding beyond the tokenizer's (Qwen: 151,936 rows, 151,669 tokens) get placeholder tokens:
    # llama.cpp takes one token per row.
    rows = max(len(vocab), embedding_rows)
    tokens = [f"[PAD{i}]" for i in range(rows)]
    for token, index in vocab.items():
        tokens[index] = token
    unused = set(range(rows)) - set(vocab.values())
    special = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer(tokenizer, folder))
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.UNUSED if i in unused else gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                            for i, t in enumerate(tokens)])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])
    for key, value in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id), ("pad", tokenizer.pad_token_id)):
        if value is not None:
            getattr(writer, f"add_{key}_token_id")(value)
    probe = tokenizer("a").input_ids  # whether encoding adds BOS/EOS, as llama.cpp is to
    writer.add_add_bos_token(tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id])
    writer.add_add_eos_token(tokenizer.eos_token_id is not None and probe[-1:] == [tokenizer.eos_token_id])
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


# Strings where byte-level pre-tokenizers part ways: contractions, digit runs, leading and repeated spaces,
# tabs and newlines, accents, CJK, emoji, code, punctuation runs.
HARD_STRINGS = ["It isn't red, it's BLUE and they'll see.", "Hello world 12345! 3.14159 and 1,000,000", "  two leading spaces   and more",
                "\ttab\tseparated\nnew line\n\n\nthree", "naïve café résumé Ångström", "東京は日本の首都です。", "emoji 🤗🚀 here 👍🏽",
                "def f(x):\n    return x**2  # squared", "I'm, you're, we've, I'd, he'll", "...!!! ??? --- ###", "CamelCaseWord mixed123abc 42nd",
                " \n leading newline"]


def pre_tokenizer(tokenizer, folder: Path) -> str:
    """llama.cpp's name for how this byte-level BPE splits text before merging (its `tokenizer.ggml.pre`), found
    by behaviour: the tokenizer's own splits of HARD_STRINGS against each split llama.cpp implements (the table of
    them transformers' GGUF reader keeps, and GPT-2's). A split llama.cpp has none for is refused in one line."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    own = tokenizer.backend_tokenizer.pre_tokenizer
    if own is None:
        raise UserError(f"--model: {folder}'s tokenizer does not split text before merging; llama.cpp has no pre-tokenizer for that")
    candidates = {"gpt-2": pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)}
    for name in ("llama-bpe", "qwen2", "tekken", "gpt-4o", "qwen35"):  # one llama.cpp name for each distinct split
        candidates[name] = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[name]), behavior="isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    splits = [[piece for piece, _ in own.pre_tokenize_str(text)] for text in HARD_STRINGS]
    for name, candidate in candidates.items():
        if all([piece for piece, _ in candidate.pre_tokenize_str(text)] == split for text, split in zip(HARD_STRINGS, splits)):
            return name
    raise UserError(f"--model: {folder}'s tokenizer splits text as none of llama.cpp's pre-tokenizers does ({', '.join(candidates)}); "
                    "llama.cpp would tokenize it otherwise, so it is not exported")


def _tensors(writer, model, config: dict, arch, permuted: bool, kind: str) -> None:
    import gguf

    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue  # llama.cpp ties the output to token_embd when output.weight is missing
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise UserError(f"--model: no GGUF name for the tensor {name}")
        data = tensor.float().numpy()
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _rotary_rows(data, heads if "q_proj" in name else kv)
        if config.get("model_type") == "gemma2" and name.endswith("norm.weight"):
            data = data + 1  # Gemma's norms scale by (1 + weight); llama.cpp's by the weight stored
        if data.ndim == 1 or kind == "f16" and data.ndim != 2:
            writer.add_tensor(target, data.astype(np.float32))
        elif kind == "f16":
            writer.add_tensor(target, data.astype(np.float16))
        else:
            writer.add_tensor(target, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)


def _rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Llama's query/key rows in llama.cpp's order: within each head the two rotary halves interleaved
    (as convert_hf_to_gguf.py permutes them; transformers' GGUF loader undoes it)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


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
def _verify_in_llama_cpp(model, tokenizer, path: Path, kind: str, target: Path) -> dict:
    """The file as llama.cpp reads it (llama-cpp-python): the token ids of HARD_STRINGS and of the special tokens
    against transformers', logits on CHECK_TEXTS and 8 greedy tokens."""
    import llama_cpp

    llm = _open_in_llama_cpp(path, target)
    adds_bos = tokenizer.bos_token_id is not None and tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id]
    texts = HARD_STRINGS + ["special tokens: " + "".join(t for t in tokenizer.all_special_tokens if t != tokenizer.pad_token) + " and after them"]
    for text in texts:
        ours, theirs = tokenizer(text).input_ids, llm.tokenize(text.encode(), add_bos=adds_bos, special=True)
        if ours != theirs:
            raise Stopped(f"GGUF check failed: llama.cpp tokenizes {text!r} as {theirs[:12]}..., transformers as {ours[:12]}...; nothing written "
                          f"to {target}", exit_code=EXIT_MERGE_CHECK)
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
    return {"version": llama_cpp.__version__, "token_checks": len(texts), "max": worst, "same_greedy": same}


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
