"""Merge an adapter into its base, write an ordinary HF model folder, and prove it equals base+adapter.

The steps, holding at most one full-precision copy of the weights at a time:
  1. the tuned model as trained (base, 4-bit for QLoRA, + adapter): reference logits on a few texts,
     and the base's own logits with the adapter switched off (how far the adapter moves them)
  2. the merged model: LoRA/DoRA merged into a float32 base (for QLoRA: the dequantized 4-bit base,
     or the original weights; both are measured, the closer one is written unless chosen)
  3. saved (sharded safetensors + index, config, generation config, tokenizer) under a temporary
     name, reloaded with plain transformers, compared with the reference, and only then renamed to
     the output folder; a failed check leaves no output folder
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.config.errors import EXIT_MERGE_CHECK, Stopped, UserError
from finetune.config.schema import PRECISIONS, ModelConfig
from finetune.data import images
from finetune.model import experts, nf4, vision
from finetune.model.adapters import Adapter, as_trained, attach, find_adapter, load_base, tokenizer_source
from finetune.model.configs import override_config
from finetune.model.loading import DTYPES, auto_class, load_tokenizer, quantize_layers, weight_files
from finetune.model.stage import resolve_source
from finetune.outputs import model_card

# Max |logit difference| allowed between the saved model and base+adapter, by the dtype written: the
# rounding of the weights to that dtype, over a few hundred tokens, stays well inside these.
TOLERANCE = {"fp32": 1e-3, "bf16": 0.25, "fp16": 0.05}
REPORT = "merge_report.json"
FALLBACK_PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Question: what is two plus two?\nAnswer:",
                    "Once upon a time, in a small village,"]


def check_texts(adapter: Adapter, tokenizer, prompts_file: str | None, n: int = 4, say=print) -> tuple[list[str], list[list[bytes]]]:
    """Texts to compare logits on, and each one's pictures: --check-prompts (one per line), else the run's
    first training samples (prompt and answer, with the row's pictures), else a few generic sentences (and
    a line saying why)."""
    if prompts_file:
        path = Path(prompts_file).expanduser()
        if not path.is_file():
            raise UserError(f"--check-prompts: no such file: {prompts_file}")
        texts = [line for line in path.read_text().splitlines() if line.strip()]
        if not texts:
            raise UserError(f"--check-prompts: {prompts_file} holds no prompts (one per line expected)")
        return texts, [[] for _ in texts]
    if adapter.run is not None:
        from itertools import islice

        from finetune.config.schema import data_sources
        from finetune.data.encoding import prompt_and_answer
        from finetune.data.readers import Skipped, checked_rows

        source = data_sources(adapter.run.data.train, adapter.run.data)[0]
        try:
            rows = [row for _, row in islice(checked_rows(source.path, source.format, "skip", Skipped(), source.split, source.columns), n)]  # the first n
            if rows and source.format == "completion":
                return [row["text"] for row in rows], [[] for _ in rows]
            if rows:
                return (["".join(prompt_and_answer(row, tokenizer, source.format)) for row in rows],
                        [images.read(row["images"])[0] if images.has_images(row) else [] for row in rows])
        except (UserError, OSError) as err:
            say(f"check texts: the run's training data is not readable ({str(err).splitlines()[0]}); checking on {len(FALLBACK_PROMPTS)} "
                "generic sentences (--check-prompts FILE names your own)")
    return FALLBACK_PROMPTS, [[] for _ in FALLBACK_PROMPTS]


@torch.no_grad()
def logits_on(model, tokenizer, texts: list[str], pictures: list[list[bytes]], processor=None) -> list[torch.Tensor]:
    """Each text's logits; a text with pictures through the vision-language model's processor, whole (a
    picture's tokens are not cut)."""
    out = []
    for text, shown in zip(texts, pictures):
        if shown and processor is not None:
            inputs = dict(processor(text=[text], images=images.decoded(shown), return_tensors="pt"))
        else:
            inputs = {"input_ids": tokenizer(text, return_tensors="pt").input_ids[:, :256]}
        out.append(model(**inputs, use_cache=False).logits[0].float())
    return out


def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    diffs = [(x - y).abs() for x, y in zip(a, b)]
    return {"max": max(float(d.max()) for d in diffs), "mean": sum(float(d.sum()) for d in diffs) / sum(d.numel() for d in diffs)}


def merged_model(adapter: Adapter, qlora_base: str):
    """The whole model in float32 with the adapter merged in, by peft's merge_and_unload (the path for
    what the shard-by-shard merge does not handle). qlora_base: 'dequantized' merges into the 4-bit
    weights the adapter was trained against, 'original' into the base's own weights."""
    if adapter.quantized and qlora_base == "dequantized":
        base = load_base(adapter, quantized=True).requires_grad_(False)
        if nf4.after_adapter(adapter.run.model):  # torchao's 4-bit weights, as training quantized them
            quantize_layers(base, adapter.run.model)
            base = experts.dequantize_model(base)
        base = (base if nf4.used(adapter.run.model) else base.dequantize(dtype=torch.float32)).float()
    else:
        base = load_base(adapter, quantized=False)
    return attach(base, adapter).merge_and_unload()


def merge(adapter_path: str, out: str, base: str | None = None, dtype: str | None = None, max_shard_size: str = "5GB",
          qlora_base: str | None = None, prompts_file: str | None = None, tolerance: float | None = None, overwrite: bool = False,
          say=print) -> dict:
    """Merge, save, verify; returns the report (also written as OUT/merge_report.json).

    overwrite: OUT may hold an earlier merge: its files (listed in its report) are replaced, nothing else."""
    adapter = find_adapter(adapter_path, base)
    final, tmp = _output_folders(out, overwrite)
    try:
        processor = vision.processor_for(ModelConfig(name_or_path=tokenizer_source(adapter)), adapter.base)
        tokenizer = load_tokenizer(ModelConfig(name_or_path=tokenizer_source(adapter)), processor)
        texts, pictures = check_texts(adapter, tokenizer, prompts_file, say=say)
        dtype = dtype or _stored_dtype(adapter.base)
        tolerance = tolerance if tolerance is not None else max(TOLERANCE[dtype], TOLERANCE["bf16"] if _bf16_compute(adapter) else 0)

        # 1. The reference: base + adapter as trained (a float base in the output dtype: one copy of
        # the size the merged model will have).
        tuned = as_trained(adapter, dtype=PRECISIONS[dtype])
        reference = logits_on(tuned, tokenizer, texts, pictures, processor)
        with tuned.disable_adapter():
            untuned = logits_on(tuned, tokenizer, texts, pictures, processor)
        report = {"adapter": str(adapter.path), "base": adapter.base, "dtype": dtype, "check_texts": len(texts),
                  "check_pictures": sum(map(len, pictures)),
                  "adapter_effect": distance(untuned, reference), "tolerance_max": tolerance}

        # 2. Each variant written to its own folder: shard by shard where it can be (the adapter's
        # weights taken out of the reference, which then goes), else the whole model in float32.
        variants, written = ["original", "dequantized"] if adapter.quantized else ["merged"], DTYPES[PRECISIONS[dtype]]
        targets, why_not = Targets.of(tuned, adapter)
        del tuned
        gc.collect()
        report["by_shard"] = why_not is None
        if why_not:
            say(f"merging the whole model in memory (about 2x its size in float32): {why_not}")
        for variant in variants:
            if why_not:
                _save_whole(merged_model(adapter, variant).to(written), tmp / variant, max_shard_size)
                gc.collect()
            else:
                write_by_shard(targets, variant, written, tmp / variant, max_shard_size)
        del targets

        # 3. Reloaded with plain transformers and compared; for QLoRA the closer base (or the one asked for) is kept.
        found = {variant: distance(logits_on(_reload(tmp / variant, written), tokenizer, texts, pictures, processor), reference)
                 for variant in variants}
        chosen = qlora_base or min(variants, key=lambda v: found[v]["max"])
        if adapter.quantized:
            report["qlora_bases"], report["qlora_base"] = found, chosen
            for variant, d in found.items():
                say(f"QLoRA merged into the {variant} base: logits differ from the 4-bit model + adapter by max {d['max']:.4g}, mean {d['mean']:.4g}")
        report["merged_vs_tuned"] = m = found[chosen]
        for made in (tmp / chosen).iterdir():
            made.rename(tmp / made.name)
        for variant in variants:
            shutil.rmtree(tmp / variant)
        (processor or tokenizer).save_pretrained(tmp)
        effect = report["adapter_effect"]
        report["passed"] = m["max"] <= tolerance and m["max"] < effect["max"]
        (tmp / model_card.CARD).write_text(model_card.merged_card({**report, "out": str(final)}))
        report["files"] = sorted(p.name for p in tmp.iterdir()) + [REPORT]
        (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        if not report["passed"]:
            fix = "Raise --tolerance to accept it" if dtype == "fp32" else \
                (f"Rounding W + BA to {dtype} drops the adapter's updates smaller than half a {dtype} step: --dtype fp32 keeps them, "
                 "or raise --tolerance to accept it")
            raise Stopped(f"merge check failed: the saved model's logits differ from base+adapter by up to {m['max']:.4g} "
                          f"(tolerance {tolerance:g}; the adapter itself moves them by up to {effect['max']:.4g}); nothing "
                          f"written to {final}. {fix}", exit_code=EXIT_MERGE_CHECK)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when it became the output
    return report


def _reload(folder: Path, dtype: torch.dtype):
    from transformers import AutoConfig

    return auto_class(AutoConfig.from_pretrained(folder)).from_pretrained(folder, dtype=dtype).eval()


@dataclass
class Targets:
    """What a shard-by-shard merge needs from base+adapter once the base itself is gone: each adapted
    linear layer (a peft LoRA/DoRA layer, its base weight dropped), the trained copies of
    modules_to_save, and the 4-bit/8-bit weights of a quantized base (a fraction of its size)."""
    base: Path
    files: dict[str, list[str]]  # the base's safetensors files and their keys
    config: object  # the adapter's LoraConfig
    layers: dict[str, torch.nn.Module]  # file key of the base weight -> peft LoRA layer
    replaced: dict[str, torch.Tensor]  # file key -> trained tensor (modules_to_save)
    quantized: dict[str, tuple]  # file key -> (bnb weight, its int8 state)
    load_dtype: torch.dtype | None  # the dtype the quantized run loaded the base's other weights in
    config_overrides: dict  # model.config_overrides the run trained with (e.g. RoPE scaling): the merged config keeps them

    @classmethod
    def of(cls, tuned, adapter: Adapter) -> tuple["Targets | None", str | None]:
        """(targets, None), or (None, why the shard-by-shard merge cannot do this adapter)."""
        from peft.tuners.lora import LoraLayer
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import ModulesToSaveWrapper

        folder = resolve_source(adapter.base)
        files = weight_files(folder)
        if not files:
            return None, f"{adapter.base} holds no safetensors weights"
        keys = {key for keys in files.values() for key in keys}
        layers, replaced, quantized = {}, {}, {}
        for name, module in tuned.get_base_model().named_modules():
            if isinstance(module, ModulesToSaveWrapper):
                if getattr(tuned.config, "tie_word_embeddings", False):
                    return None, "modules_to_save in a model with tied embeddings"
                trained = module.modules_to_save[module.active_adapter]
                replaced.update({f"{name}.{k}": v.detach().clone() for k, v in trained.state_dict().items()})
            elif isinstance(module, BaseTunerLayer):
                linear = isinstance(module, LoraLayer) and type(module).__name__ in ("Linear", "Linear4bit", "Linear8bitLt")
                if not linear or any(module.lora_bias.values()) or module.fan_in_fan_out:
                    return None, f"{name} is a {type(module).__name__} layer (only LoRA/DoRA on linear layers merge shard by shard)"
                layers[f"{name}.weight"] = module
            elif type(module).__name__ in ("Linear4bit", "Linear8bitLt") or nf4.is_nf4(getattr(module, "weight", None)):
                quantized[f"{name.removesuffix('.base_layer')}.weight"] = (module.weight, getattr(module, "state", None))
        named, failed = _file_keys(tuned.get_base_model(), set(layers) | set(replaced) | set(quantized), keys)
        layers, replaced, quantized = ({named[k]: v for k, v in found.items()} for found in (layers, replaced, quantized))
        missing = sorted((set(layers) | set(replaced)) - keys)
        if missing:
            why = f"transformers' conversion to the files' names failed: {failed[missing[0]]}" if missing[0] in failed else \
                "the model renames its weights when loading"
            return None, f"{missing[0]} is not a key of the base's weight files ({why})"
        if not quantized:  # keep the adapter's weights; the float base weight goes with the model
            for layer in layers.values():
                layer.base_layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        run_dtype = adapter.run.model.dtype if adapter.quantized else "auto"
        return cls(folder, files, tuned.peft_config[tuned.active_adapter], layers, replaced, quantized,
                   None if run_dtype == "auto" else DTYPES[run_dtype], adapter.run.model.config_overrides if adapter.run else {}), None

    def _dequantized(self, key: str) -> torch.Tensor:
        """The values the 4-bit run computed with, in float32."""
        from transformers.integrations.bitsandbytes import dequantize_bnb_weight

        weight, state = self.quantized[key]
        return (weight.get_original_weight() if nf4.is_nf4(weight) else dequantize_bnb_weight(weight, state)).float()

    def tensor(self, key: str, stored: torch.Tensor, variant: str) -> torch.Tensor:
        """The merged value of one weight of the base, in float32 or its stored dtype."""
        if key in self.replaced:
            return self.replaced[key]
        if variant == "dequantized":  # the values the 4-bit run computed with
            weight = self._dequantized(key) if key in self.quantized else stored.to(self.load_dtype or stored.dtype).float()
        else:
            weight = stored
        layer = self.layers.get(key)
        return weight if layer is None else merge_layer(layer, weight.float(), self.config)


def _file_keys(model, names: set[str], keys: set[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Each weight's name in the model -> its key in the base's files, and why transformers' conversion failed for a name
    (which then stays as it is). transformers renames some checkpoints' weights as it loads them (a vision-language model's
    language model under model.language_model) and reverts that as it saves; so does this, a name at a time."""
    from transformers.core_model_loading import revert_weight_conversion

    out, failed = {}, {}
    for name in names:
        try:
            renamed = list(revert_weight_conversion(model, {name: torch.empty(0)})) if name not in keys else [name]
        except (RuntimeError, ValueError, IndexError) as err:  # a conversion that computes (fused experts), not a rename
            renamed, failed[name] = [name], f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        out[name] = renamed[0] if len(renamed) == 1 else name
    return out, failed


def merge_layer(layer, weight: torch.Tensor, config) -> torch.Tensor:
    """peft's own merge of one LoRA/DoRA layer into a float32 base weight: a fresh layer of the same
    kind around that weight, given the trained adapter weights, merged."""
    from peft.tuners.lora import Linear as LoraLinear

    name = layer.active_adapters[0]
    with torch.device("meta"):
        base = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    base.weight = torch.nn.Parameter(weight, requires_grad=False)
    one = LoraLinear(base, name, config=dataclasses.replace(config, init_lora_weights=True), r=layer.r[name], lora_alpha=layer.lora_alpha[name])
    one.scaling[name] = layer.scaling[name]  # rslora, rank and alpha patterns: as trained
    one.load_state_dict({k: v for k, v in layer.state_dict().items() if k.startswith("lora_")}, strict=False)
    one.merge(adapter_names=[name])
    return base.weight.data


def write_by_shard(targets: Targets, variant: str, dtype: torch.dtype, folder: Path, max_shard_size: str) -> None:
    """The merged model as an HF folder, one base shard at a time in memory: each weight read from the
    base's safetensors files, merged where the adapter touches it, cast, and written in shards of at
    most max_shard_size (the model's config and generation config beside them)."""
    from safetensors import safe_open
    from tqdm.auto import tqdm
    from transformers.utils.hub import convert_file_size_to_int

    limit = convert_file_size_to_int(max_shard_size)
    folder.mkdir()
    shards, pending, size = [], {}, 0
    with tqdm(total=sum(len(k) for k in targets.files.values()), desc=f"merging ({variant})", unit=" tensors", delay=2) as bar:
        for file, keys in targets.files.items():
            with safe_open(targets.base / file, "pt") as weights:
                for key in keys:
                    value = targets.tensor(key, weights.get_tensor(key), variant).to(dtype).contiguous()
                    if pending and size + value.nbytes > limit:
                        shards.append(_write_shard(pending, folder, len(shards)))
                        size = 0
                    pending[key] = value
                    size += value.nbytes
                    bar.update(1)
    shards.append(_write_shard(pending, folder, len(shards)))
    _name_shards(folder, shards)
    _write_configs(targets.base, folder, dtype, targets.config_overrides)


def _write_shard(tensors: dict[str, torch.Tensor], folder: Path, number: int) -> tuple[str, list[str], int]:
    """Streamed to disk: `safetensors.torch.save_file` would build the whole shard in memory first, a
    second 5 GB beside the merged tensors (an 8B merge peaked 1.7 GiB over its target so)."""
    from finetune.checkpoint.diskio import HashedFile, write_safetensors

    name = f".shard-{number}"
    with HashedFile(folder / name) as out:
        write_safetensors(tensors, out, metadata={"format": "pt"})
    written = (name, list(tensors), sum(t.nbytes for t in tensors.values()))
    tensors.clear()
    return written


def _name_shards(folder: Path, shards: list[tuple[str, list[str], int]]) -> None:
    """transformers' names: model.safetensors, or model-0000i-of-0000n.safetensors with an index."""
    if len(shards) == 1:
        (folder / shards[0][0]).rename(folder / "model.safetensors")
        return
    weight_map = {}
    for i, (name, keys, _) in enumerate(shards, 1):
        final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        (folder / name).rename(folder / final)
        weight_map.update(dict.fromkeys(keys, final))
    index = {"metadata": {"total_size": sum(size for *_, size in shards)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_configs(base: Path, folder: Path, dtype: torch.dtype, overrides: dict) -> None:
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(base)
    override_config(config, overrides)
    config.dtype, config.use_cache = dtype, True  # a merged model is for generation
    config.save_pretrained(folder)
    try:
        generation = GenerationConfig.from_pretrained(base)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(folder)


def _output_folders(out: str, overwrite: bool) -> tuple[Path, Path]:
    """The output folder (new, empty, or with --overwrite an earlier merge's) and the temporary one written first."""
    final = Path(out).expanduser()
    if final.exists() and not final.is_dir():
        raise UserError(f"--out: {final} is a file; expected a new folder")
    if final.is_dir() and any(final.iterdir()) and not (overwrite and _earlier_merge(final)):
        why = "holds files that are not a finetune merge's" if overwrite else "already exists and is not empty"
        raise UserError(f"--out: {final} {why}; choose a new folder" + ("" if overwrite else " (or --overwrite an earlier merge there)"))
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.partial-{os.getpid()}"
        tmp.mkdir()
    except OSError as err:
        raise UserError(f"--out: cannot write to {final.parent}: {err.strerror or err}") from None
    return final, tmp


def _earlier_merge(folder: Path) -> list[str]:
    """The files an earlier merge wrote into `folder`, as its report lists them ([] if there is none)."""
    try:
        files = json.loads((folder / REPORT).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return []
    return [name for name in files if isinstance(name, str) and "/" not in name] if isinstance(files, list) else []


def _publish(tmp: Path, final: Path) -> None:
    """The checked merge takes its place: renamed to `final`, or (--overwrite) file by file into it,
    after the earlier merge's own files, and only those, are removed."""
    if not final.is_dir() or not any(final.iterdir()):
        if final.is_dir():
            final.rmdir()
        tmp.rename(final)
        return
    for name in _earlier_merge(final):
        (final / name).unlink(missing_ok=True)
    for made in tmp.iterdir():
        os.replace(made, final / made.name)


def _stored_dtype(base: str) -> str:
    """The dtype the base was saved in, as a --dtype name (float32 if its config does not say)."""
    from transformers import AutoConfig

    saved = AutoConfig.from_pretrained(base).dtype
    saved = DTYPES.get(saved, saved) if isinstance(saved, str) else saved
    return next((short for short, name in PRECISIONS.items() if DTYPES[name] == saved), "fp32")


def _bf16_compute(adapter: Adapter) -> bool:
    """Whether the reference itself ran in bf16 (a 4-bit base computing in bf16): its own rounding
    then bounds how close any merged model can get."""
    return adapter.quantized and adapter.run.model.quantization.compute_dtype != "float32"


def _save_whole(model, folder: Path, max_shard_size: str) -> None:
    model.config.use_cache = True  # a merged model is for generation
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
