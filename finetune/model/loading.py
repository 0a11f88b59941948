"""Model: load the tokenizer and base model through the ordinary Auto* path, then add the adapter.

Any local HF folder or hub id goes through the same calls; nothing here knows about the demo model.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from contextlib import contextmanager, nullcontext
from importlib.metadata import version
from pathlib import Path

import torch

from finetune.config.errors import UserError
from finetune.config.files import read_model_config
from finetune.config.schema import DTYPE_BYTES, AdapterConfig, ModelConfig, RunConfig, looks_local
from finetune.model import experts, families, mixers, nf4, vision
from finetune.model.attention import register as register_packed_sdpa
from finetune.model.configs import LANGUAGE_ONLY, first_line, model_config

DTYPES = {**{name: getattr(torch, name) for name in DTYPE_BYTES}, "auto": "auto"}  # model.dtype -> torch


def load_tokenizer(cfg: ModelConfig, processor=None):
    """The model's tokenizer; a vision-language model's is its processor's, with the processor's chat template."""
    from transformers import AutoTokenizer

    try:
        tok = processor.tokenizer if processor is not None else \
            AutoTokenizer.from_pretrained(cfg.name_or_path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except Exception as err:  # noqa: BLE001 - a missing, garbage or unreadable tokenizer raises many types; all mean "this folder's tokenizer"
        raise UserError(f"model.name_or_path: cannot load a tokenizer from '{cfg.name_or_path}': {first_line(err)}") from None
    if processor is not None and getattr(processor, "chat_template", None) and not tok.chat_template:
        tok.chat_template = processor.chat_template
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def end_tokens(model, tokenizer) -> list[int]:
    """The tokens where sampling stops: the tokenizer's EOS and every one the model's generation_config names (Llama 3.1's
    <|eom_id|> after a tool call and <|eot_id|>, Gemma's <end_of_turn> beside its tokenizer's <eos>), the tokenizer's first."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    return list(dict.fromkeys(t for t in [tokenizer.eos_token_id, *configured] if isinstance(t, int)))


def check_supported(cfg: RunConfig) -> None:
    """Refuse, before anything loads, what this machine's hardware or libraries cannot run."""
    check_attention(cfg.model)
    check_quantized(cfg.model, "model.quantization", cfg.adapter.method)
    if _shipped_quantization(cfg.model) == "mxfp4" and cfg.distributed.strategy in ("fsdp", "zero3"):
        raise UserError(f"distributed.strategy: {cfg.model.name_or_path} ships its experts in MXFP4, which finetune dequantizes as one process "
                        f"loads it; {cfg.distributed.strategy} places the weights as the files store them: save a 16-bit copy first "
                        "(load it in one process, save_pretrained), or use ddp")
    teacher = Path(cfg.distill.teacher or "").expanduser()
    if cfg.distill.teacher_quantization is not None and (teacher / "config.json").is_file():  # an adapter's base: checked as it loads
        check_quantized(cfg.model.model_copy(update={"name_or_path": str(teacher), "quantization": cfg.distill.teacher_quantization}),
                        "distill.teacher_quantization", "frozen")


def check_quantized(cfg: ModelConfig, key: str, method: str) -> None:
    """What bitsandbytes cannot run here: `key` names the setting."""
    q, cuda = cfg.quantization, torch.cuda.is_available()
    shipped = _shipped_quantization(cfg)
    if q is not None and shipped == "mxfp4" and not nf4.used(cfg):
        raise UserError(f"{key}: {cfg.name_or_path} ships its experts in MXFP4, which transformers does not load through bitsandbytes; "
                        "set model.quantization.backend: torchao (it quantizes after loading: the experts dequantized once, re-quantized to NF4)")
    if q is not None and shipped not in (None, "mxfp4"):
        raise UserError(f"{key}: {cfg.name_or_path} ships its weights quantized ({shipped}: DeepSeek's FP8 blocks, a GPTQ or AWQ release); "
                        "finetune quantizes from 16-bit weights: load it without model.quantization, or from a 16-bit copy")
    if q is None or nf4.used(cfg):
        return
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError(f"{key}: needs bitsandbytes (pip install bitsandbytes)")
    if not cuda:
        if q.bits == 8 and method == "dora":
            raise UserError(f"{key}: 8-bit + DoRA fails inside bitsandbytes' int8 matmul on CPU; use bits: 4 (QDoRA) or adapter.method: lora")
        if "float16" in (q.compute_dtype, cfg.dtype):
            raise UserError(f"{key}: float16 compute with a quantized base is GPU-only; use bfloat16 or float32 on CPU")
        if q.bits == 4:
            # bitsandbytes' CPU 4-bit kernel repacks weights in blocks of 32 output features (at eval).
            dims = _linear_out_dims(cfg)
            odd = sorted(k for k, v in dims.items() if v % 32)
            if odd:
                raise UserError(f"{key}: 4-bit on CPU needs layer widths divisible by 32; {', '.join(f'{k}={dims[k]}' for k in odd)} is not")


def _shipped_quantization(cfg: ModelConfig) -> str | None:
    """The quant_method a local model's config.json says its weights are stored in, or None."""
    if not (Path(cfg.name_or_path).expanduser() / "config.json").is_file():
        return None
    shipped = read_model_config(Path(cfg.name_or_path), "model.name_or_path").get("quantization_config")
    return (shipped or {}).get("quant_method") or ("quantized" if shipped else None)


def _linear_out_dims(cfg: ModelConfig) -> dict[str, int]:
    """Output widths of a decoder's linear layers, from config.json (empty if not a local folder)."""
    if not (Path(cfg.name_or_path).expanduser() / "config.json").is_file():
        return {}
    c = families.text_config(read_model_config(Path(cfg.name_or_path), "model.name_or_path"))
    head_dim = c.get("head_dim") or c.get("hidden_size", 0) // max(1, c.get("num_attention_heads", 1))
    kv = c.get("num_key_value_heads") or c.get("num_attention_heads", 0)
    dims = {"hidden_size": c.get("hidden_size"), "intermediate_size": c.get("intermediate_size"), "kv_heads*head_dim": kv * head_dim}
    return {k: v for k, v in dims.items() if v}


def check_attention(cfg: ModelConfig) -> None:
    if cfg.attn_implementation.startswith("flash_attention"):
        if not torch.cuda.is_available():
            raise UserError(f"model.attn_implementation: {cfg.attn_implementation} needs a CUDA GPU; use sdpa here")
        package = "flash_attn_interface" if cfg.attn_implementation.endswith("3") else "flash_attn"
        if importlib.util.find_spec(package) is None:
            raise UserError(f"model.attn_implementation: {cfg.attn_implementation} needs the '{package}' package installed")


def quantization_config(cfg: ModelConfig, partitioned: bool = False, pictures: bool = False):
    """partitioned: ZeRO-3 will split the weights over processes. The packed 4-bit values are then
    stored in the dtype of the other weights (bnb_4bit_quant_storage), as the bitsandbytes and
    transformers docs prescribe for sharded QLoRA, so they are partitioned like any other weight.
    pictures: a vision-language model, whose tower and projector stay in the compute dtype (transformers
    would quantize them too)."""
    from transformers import BitsAndBytesConfig

    q = cfg.quantization
    # transformers matches a skipped name from the start of a module's name, or as a pattern: at any depth here
    skip = [*(q.skip_modules or []), *(rf".*\b{name}" for name in (*vision.TOWERS, *vision.PROJECTORS)), "lm_head"] if pictures else q.skip_modules
    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=DTYPES[q.compute_dtype],
        bnb_4bit_quant_storage=(DTYPES[cfg.dtype] if cfg.dtype != "auto" else torch.float32) if partitioned else torch.uint8,
        llm_int8_skip_modules=skip,
    )


def attention_for(cfg: ModelConfig, config) -> tuple[str, str | None]:
    """The attn_implementation to load with, and a notice where it is not the one configured.

    sdpa is finetune's packed attention (finetune/model/attention.py) for models whose attention goes through
    transformers' AttentionInterface; others keep their own sdpa, or eager where they have none (a
    model class says which it supports). Models that soft-cap attention logits (Gemma 2) run eager
    attention, which does it."""
    if cfg.attn_implementation != "sdpa":
        return cfg.attn_implementation, None
    kind = config.model_type
    if vision.is_vision(config.to_dict()):  # its own sdpa: the attention mask of unpacked rows, or packed rows' restarting positions
        return "sdpa", None
    if families.attention_softcap(config.to_dict()):
        return "eager", (f"model: {kind} soft-caps its attention logits, which sdpa cannot do: "
                         "using eager attention (model.attn_implementation: flash_attention_2 on a GPU also does it)")
    model_class = _causal_lm_class(config)
    if kind in families.ATTENTION_SINKS and getattr(model_class, "_supports_attention_backend", False) is True:
        return register_packed_sdpa(sinks=True), None  # no sdpa in transformers, for its sinks: finetune's kernel takes them
    if model_class is not None and getattr(model_class, "_supports_sdpa", False) is not True:
        return "eager", f"model: {kind} has no sdpa attention in transformers: using eager attention"
    if getattr(model_class, "_supports_attention_backend", False) is True:
        return register_packed_sdpa(), None
    return "sdpa", None  # its own attention code (or remote code): whether packed samples stay apart is measured at the start


def _causal_lm_class(config):
    """The transformers class the Auto class would build for this config (None: remote code or unknown)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    try:
        return (MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING if vision.is_vision(config.to_dict()) else MODEL_FOR_CAUSAL_LM_MAPPING)[type(config)]
    except KeyError:
        return None


def auto_class(config):
    """AutoModelForImageTextToText for a vision-language model, else AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if vision.is_vision(config.to_dict()) else AutoModelForCausalLM


def load_model(cfg: ModelConfig, device: torch.device | str = "cpu", skeleton: str | None = None, say=print, head: str = "causal",
               experts_as_loaded: bool = False, expert_share: tuple[int, int] | None = None):
    """The base model. A quantized base is placed on `device` while loading (bitsandbytes quantizes
    as it places); a plain one is moved later by accelerate.

    skeleton: build the architecture without reading any weight: "meta" allocates none (the FSDP
    ranks that receive their shards from rank 0); "empty" allocates them on the CPU uninitialized,
    pages the kernel only provides once written (FSDP's rank 0 when it streams the weights from the
    files: peft then creates and initializes the adapter on real tensors, as it would on a loaded model).
    head: "causal" (the LM head), or "score" (a reward model: AutoModelForSequenceClassification with one
    label, its score head initialized as transformers does).
    experts_as_loaded: a quantized base's fused expert stacks quantized as they load (experts.quantized_as_loaded), not
    once the adapter is on; the whole model in one process only (a ZeRO-3 base is partitioned as it loads; FSDP2 quantizes
    each layer in blocks its processes split). expert_share (index, size): only this process's share of each expert stack
    kept as it loads (expert parallelism), then quantized where the base is."""
    config = model_config(cfg, say=say)
    if head == "score":
        return _reward_model(cfg, config)
    attn, notice = attention_for(cfg, config)
    if notice:
        say(notice)
    if skeleton:
        from transformers.initialization import no_init_weights

        dtype = (getattr(config, "dtype", None) or torch.float32) if cfg.dtype == "auto" else DTYPES[cfg.dtype]
        with torch.device("meta") if skeleton == "meta" else no_init_weights():
            model = auto_class(config).from_config(config, dtype=dtype, attn_implementation=attn, trust_remote_code=cfg.trust_remote_code)
        model.tie_weights()  # under no_init_weights transformers leaves a tied head (Llama 3.2, Qwen 2.5/3 small, Gemma) a weight of its own
        model.config.use_cache = False
        mixers.register(model)
        return model
    from transformers.integrations import is_deepspeed_zero3_enabled

    extra, q, partitioned = _dequantized_on_load(cfg, say), cfg.quantization, is_deepspeed_zero3_enabled()
    if q is not None and not nf4.used(cfg):  # torchao's: the weights are quantized after the adapter is applied
        extra = {"quantization_config": quantization_config(cfg, partitioned, vision.is_vision(config.to_dict()))}
        if not partitioned:  # ZeRO-3 places the weights itself: no device_map
            extra["device_map"] = {"": str(device)}
    as_loaded = (experts_as_loaded and q is not None and not partitioned) or expert_share is not None
    try:
        with _weights_read_on_demand(cfg, config) as (cls, name, state), _tower_left_unread(config), \
                experts.quantized_as_loaded(q and DTYPES[q.compute_dtype], q and q.bits, expert_share) if as_loaded else nullcontext():
            model = cls.from_pretrained(
                name,
                config=config,
                state_dict=state,
                revision=cfg.revision,
                dtype=DTYPES[cfg.dtype],
                attn_implementation=attn,
                trust_remote_code=cfg.trust_remote_code,
                use_safetensors=True,
                **extra,
            )
        if state is not None:
            _as_if_read_from(model, Path(cfg.name_or_path))
        if as_loaded:
            experts.group(model)
    except Exception as err:  # noqa: BLE001 - missing, truncated, garbage or mis-shaped weights: the folder's fault, said in one line
        why = "its weights have other shapes than its config.json says" if "mismatched_sizes" in str(err) else first_line(err)
        raise UserError(f"model.name_or_path: cannot load '{cfg.name_or_path}': {why}") from None
    if cfg.quantization is not None and not nf4.used(cfg):
        # The base frozen, its unquantized parts (embeddings, norms, lm_head, expert stacks) left in model.dtype. peft's
        # prepare_model_for_kbit_training would upcast 16-bit ones to fp32, and with the norms the residual stream: twice
        # their memory (axolotl casts embeddings and lm_head back). Checkpointing is set up in apply_adapter.
        model.requires_grad_(False)
        if torch.device(device).type == "cpu":  # "cpu:0" in a multi-process run
            _own_unquantized_weights(model)
            _keep_one_cpu_4bit_path(model)
    model.config.use_cache = False  # no KV cache while training; generation turns it on per call
    mixers.register(model)  # packed samples start each SSM, linear-attention or convolution layer afresh
    return model


def _reward_model(cfg: ModelConfig, config):
    """A sequence-classification model with one label over the base's weights (its score head new): a reward
    model. The pad token is set where the config has none (transformers' pooling asks for one; finetune
    takes each sequence's score at its last token itself)."""
    from transformers import AutoModelForSequenceClassification

    config.num_labels = 1
    if config.pad_token_id is None:
        eos = config.eos_token_id
        config.pad_token_id = eos[0] if isinstance(eos, list) else eos
    attn, _ = attention_for(cfg, config)
    try:
        return AutoModelForSequenceClassification.from_pretrained(cfg.name_or_path, config=config, revision=cfg.revision, dtype=DTYPES[cfg.dtype],
                                                                  attn_implementation=attn, trust_remote_code=cfg.trust_remote_code,
                                                                  use_safetensors=True)
    except ValueError as err:  # no sequence-classification class for this architecture
        raise UserError(f"train.objective: reward: {config.model_type} has no sequence-classification model in transformers "
                        f"({first_line(err)})") from None


def _dequantized_on_load(cfg: ModelConfig, say) -> dict:
    """gpt-oss's releases ship their experts in MXFP4: transformers' own dequantization turns them into the model's dtype
    as they load, on every device (its MXFP4 kernels would leave experts that neither finetune's grouped LoRA nor a 4-bit
    re-quantization can take), said once."""
    if _shipped_quantization(cfg) != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    then = ", then re-quantized to 4-bit NF4 by torchao with the linear layers" if cfg.quantization is not None else ""
    dtype = cfg.dtype if cfg.dtype != "auto" else "the dtype config.json names"
    say(f"model: {cfg.name_or_path} ships its experts in MXFP4: dequantized to {dtype} as transformers loads them{then}")
    return {"quantization_config": Mxfp4Config(dequantize=True)}


@contextmanager
def _weights_read_on_demand(cfg: ModelConfig, config):
    """What `from_pretrained` reads from: (class, name, state_dict). A quantized base in a local folder
    is handed over as lazily read slices of its safetensors files, read with pread: from the folder
    itself transformers memory-maps every shard and keeps each mapped until the whole load ends, so the
    pages of every bf16 shard it has read stay in the process's RSS (21 GB at an 8B load's peak for a
    7.4 GB 4-bit model; docs/platform-notes.md) though each weight is quantized as it is read. The
    same loader then holds about one tensor at a time. A plain load keeps the memory map: weights in
    the stored dtype are then zero-copy views of the files (the staged ramdisk copy's point). A hub id
    goes through the library's own path."""
    from safetensors import safe_open

    cls = _causal_lm_class(config)
    folder = Path(cfg.name_or_path).expanduser()
    files = weight_file_names(folder) if cfg.quantization is not None and cls is not None and looks_local(cfg.name_or_path) else []
    if not files:
        yield auto_class(config), cfg.name_or_path, None
        return
    handles = []
    try:
        for name in files:
            handles.append(safe_open(folder / name, "pt", device="cpu", backend="pread"))
        yield cls, None, {key: handle.get_slice(key) for handle in handles for key in handle.keys()}
    finally:
        for handle in handles:
            handle.__exit__(None, None, None)


@contextmanager
def _tower_left_unread(config):
    """A LANGUAGE_ONLY family's causal LM loading from its released checkpoint (model/configs.py): the tower's and projector's
    weights, which it leaves unread by design, kept out of transformers' load report (a line for each of them), which still
    names any other weight left unread or missing."""
    cls = _causal_lm_class(config) if config.model_type.removesuffix("_text") in LANGUAGE_ONLY else None
    if cls is None:
        yield
        return
    before = cls.__dict__.get("_keys_to_ignore_on_load_unexpected")
    cls._keys_to_ignore_on_load_unexpected = [*(before or []), *(rf"^{re.escape(part)}\." for part in (*vision.TOWERS, *vision.PROJECTORS))]
    try:
        yield
    finally:
        if before is None:
            del cls._keys_to_ignore_on_load_unexpected
        else:
            cls._keys_to_ignore_on_load_unexpected = before


def _as_if_read_from(model, folder: Path) -> None:
    """What from_pretrained takes from a folder besides the weights: its name (adapters record it as
    their base) and its generation settings."""
    from transformers import GenerationConfig

    model.config._name_or_path = model.name_or_path = str(folder)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)


def weight_file_names(folder: Path) -> list[str]:
    """A model folder's safetensors files, from its index ([] if it has none); reads no weight file."""
    index = folder / "model.safetensors.index.json"
    return sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        ["model.safetensors"] if (folder / "model.safetensors").is_file() else []


def weight_files(folder: Path) -> dict[str, list[str]]:
    """A model folder's safetensors files and the keys each holds ({} if it has none); reads headers only."""
    from safetensors import safe_open

    files = {}
    for name in weight_file_names(folder):
        with safe_open(folder / name, "pt") as f:
            files[name] = list(f.keys())
    return files


def _keep_one_cpu_4bit_path(model) -> None:
    """bitsandbytes 0.50 on an avx512-bf16 CPU repacks a 4-bit weight in place the first time it runs
    in eval mode without grad, and from then on computes that layer with a bf16 kernel that has no
    autograd support, in training too: the first eval would silently change the logits (~4e-2) and
    the gradients of every later step. Keeping every layer on the training path avoids both."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def _own_unquantized_weights(model) -> None:
    """On CPU the parts left unquantized (embeddings, norms, lm_head) can still be views of the
    safetensors file's memory map, which then keeps the whole file resident: the full-precision
    weights that were just quantized. Own copies of those few tensors let the mapping go."""
    import bitsandbytes as bnb

    for param in model.parameters():
        if param.is_floating_point() and not isinstance(param, (bnb.nn.Params4bit, bnb.nn.Int8Params)) and not hasattr(param, "ds_id") \
                and not nf4.is_nf4(param):  # an expert stack quantized as it loaded: its own tensors
            param.data = param.data.clone()  # ZeRO-3 owns its shards (ds_id)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks: the unit FSDP shards and gathers one at a time."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def quantize_layers(model: torch.nn.Module, cfg: ModelConfig, shards: int = 1) -> int:
    """What is quantized once the adapter is on (nf4.after_adapter): the frozen linear weights of every decoder layer
    of a torchao base (model/nf4.py), and the frozen expert weights of any 4-bit or 8-bit base (model/experts.py), in
    blocks `shards` processes can split. Returns how many weights."""
    experts.group(model)  # what reads the 4-bit expert stacks
    return sum(quantize_layer(layer, cfg, shards) for layer in decoder_layers(model))


def quantize_layer(layer: torch.nn.Module, cfg: ModelConfig, shards: int = 1) -> int:
    """quantize_layers for one decoder layer of a model whose experts `experts.group` runs."""
    q = cfg.quantization
    count = nf4.quantize_frozen_linears(layer, DTYPES[q.compute_dtype], q.skip_modules, shards) if nf4.used(cfg) else 0
    return count + experts.quantize(layer, DTYPES[q.compute_dtype], shards, q.bits)


def apply_adapter(model, cfg: AdapterConfig, gradient_checkpointing: bool, say=print):
    """Wrap the model for the chosen method. Returns the model to train. Expert stacks quantized as they loaded show peft
    (and the targets chosen for it) their own shapes meanwhile."""
    with experts.shaped_for_peft(model):
        return _wrapped(model, cfg, gradient_checkpointing, say)


def _wrapped(model, cfg: AdapterConfig, gradient_checkpointing: bool, say):
    if gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if cfg.method == "full":
        if vision.is_vision(model.config.to_dict()):
            vision.freeze(model, cfg)
        return model
    from peft import LoraConfig, get_peft_model

    if gradient_checkpointing:
        # With a frozen embedding nothing before the first checkpointed block needs grad.
        model.enable_input_require_grads()
    modules, parameters = lora_targets(model, cfg.target_modules)
    modules = without_names_peft_moves(model, modules, parameters, say)
    whole = cfg.modules_to_save
    if vision.is_vision(model.config.to_dict()):
        head = model.get_output_embeddings()
        layers = [name for name, m in model.named_modules() if linear_like(m) and m is not head]
        wanted = {name.rsplit(".", 1)[-1] for name in layers} if modules == "all-linear" else set(modules)
        modules = vision.lora_pattern(model, layers, wanted, cfg)
        whole = (cfg.modules_to_save or []) + vision.trained_whole(model, cfg) or None
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    unknown = [m for m in cfg.modules_to_save or [] if m.rsplit(".", 1)[-1] not in names]
    if unknown:
        raise UserError(f"adapter.modules_to_save: {', '.join(unknown)} matches no module of this {model.config.model_type} model "
                        f"(e.g. {', '.join(sorted(n for n in names if n and not n.isdigit())[:6])})")
    if parameters and cfg.method == "dora":
        if cfg.target_modules != "all-linear":
            raise UserError("adapter.target_modules: DoRA cannot adapt fused expert weights (peft); use adapter.method: lora for the experts")
        say("adapter: DoRA cannot adapt the experts' fused weights (peft): the experts stay frozen; adapter.method: lora adapts them")
        parameters = []
    if parameters and cfg.dropout:
        say(f"adapter: dropout {cfg.dropout} on the dense layers' LoRA, none on the experts' (peft's LoRA on fused expert weights takes none)")
    lora = LoraConfig(
        # A reward model's score head is new: peft trains it whole (modules_to_save) beside the adapter
        task_type="SEQ_CLS" if type(model).__name__.endswith("ForSequenceClassification") else "CAUSAL_LM",
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=0.0 if parameters else cfg.dropout,  # peft refuses dropout beside expert weights: set per layer below
        target_modules=modules,
        target_parameters=parameters or None,
        use_dora=cfg.method == "dora",
        init_lora_weights={"default": True, "loftq": True}.get(cfg.init, cfg.init),  # loftq: replaced after (loftq_init)
        use_rslora=cfg.rslora,
        modules_to_save=whole,
    )
    try:
        model = get_peft_model(model, lora)
    except (ValueError, TypeError) as err:
        raise UserError(f"adapter: {str(err).splitlines()[0]}") from None
    if parameters and cfg.dropout:
        dense_dropout(model, cfg.dropout)
    experts.group(model)
    return model


def without_names_peft_moves(model, modules: str | list[str], parameters: list[str], say) -> str | list[str]:
    """`modules` without the names peft would map onto the experts (mapped_onto_experts), said with the layers
    they leave unadapted: peft would adapt none of them and double the experts' rank besides."""
    lost = set(modules if isinstance(modules, list) else []) & mapped_onto_experts(model.config.model_type)
    if not lost:
        return modules
    kept, kind = [m for m in modules if m not in lost], model.config.model_type
    if not kept and not parameters:
        raise UserError(f"adapter.target_modules: peft {version('peft')} maps {', '.join(sorted(lost))} onto the experts of {kind} models "
                        "(huggingface/peft#3711); name the experts (experts) or attention layers")
    left = [name for name, m in model.named_modules() if linear_like(m) and name.rsplit(".", 1)[-1] in lost]
    say(f"adapter: peft {version('peft')} maps {', '.join(sorted(lost))} onto the experts of {kind} models (huggingface/peft#3711): "
        f"{len(left)} dense or shared-expert layers stay unadapted ({', '.join(left[:3])}{', ...' if len(left) > 3 else ''})")
    return kept


@functools.cache  # the planner asks for each of its candidate runs
def mapped_onto_experts(model_type: str) -> frozenset[str]:
    """The layer names peft's conversion of transformers-v4 adapters maps onto the experts of a `model_type`
    MoE (its tables; huggingface/peft#3711): named in target_modules, such layers get no LoRA and the
    experts' rank doubles. Empty where peft converts nothing (Qwen2-MoE, dense models)."""
    try:
        from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN, _MOE_TARGET_MODULE_MAPPING
    except ImportError:  # a peft without the conversion
        return frozenset()
    return frozenset(_MOE_TARGET_MODULE_MAPPING.get(_MODEL_TO_CONVERSION_PATTERN.get(model_type), {})) - ROUTERS


def dense_dropout(model, p: float) -> None:
    """Dropout `p` before the LoRA of every adapted linear layer (what lora_dropout gives where no expert weight is adapted)."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    for module in model.modules():
        if isinstance(module, LoraLayer) and not isinstance(module, ParamWrapper):
            for name in module.lora_dropout:
                module.lora_dropout[name] = torch.nn.Dropout(p)


def loftq_init(model, cfg: ModelConfig) -> None:
    """LoftQ through peft (replace_lora_weights_loftq): each 4-bit layer's A and B become the best
    rank-r approximation of its quantization error, W - dequantize(Q(W)), with W read from the model's
    safetensors files, so training starts nearer the full-precision model than QLoRA's B = 0."""
    from peft import replace_lora_weights_loftq

    from finetune.model.stage import resolve_source

    replace_lora_weights_loftq(model, model_path=str(resolve_source(cfg.name_or_path, cfg.revision)))


def compile_layers(model) -> None:
    """torch.compile the model in place, one region at a time (accelerate's regional compilation): the
    decoder layers share one compiled graph, so compiling costs about one layer's time. In place, the
    parameter names (checkpoints, adapters) and the hooks FSDP or ZeRO add later stay as without it."""
    from accelerate.utils import compile_regions_fsdp2 as compile_in_place  # in place, whatever the strategy

    compile_in_place(model)


ROUTERS = {"gate", "router", "shared_expert_gate"}  # in an MoE model, the linear layers that pick experts


def linear_like(module) -> bool:
    """A linear layer as peft adapts it: nn.Linear, or the Conv1D of GPT-2-era models (its weight transposed)."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (torch.nn.Linear, Conv1D))


def router_names(model) -> set[str]:
    """The names (last parts) of an MoE model's layers that pick experts: the routers by name, and a linear layer inside
    a router (Gemma 4's router.proj)."""
    return ROUTERS | {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                      if linear_like(m) and name.count(".") and name.split(".")[-2] in ROUTERS}


def lora_targets(model, wanted: str | list[str]) -> tuple[str | list[str], list[str]]:
    """(target_modules, target_parameters) for peft.

    all-linear: peft's own, except in mixture-of-experts models, where peft's choice varies by family
    (Mixtral's router and experts but Qwen2-MoE's shared-expert gate and no experts): there every
    linear layer but the head and the routers, and the experts' fused 3-D weights (experts.named_fused_experts). In a list, the name
    `experts` stands for those expert weights; any other name must match some linear layer."""
    head = model.get_output_embeddings()
    linears = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if linear_like(m) and m is not head}
    if wanted == "all-linear" or "experts" in wanted:
        _refuse_other_experts(model, linears)
    stacks = sorted({f"{module.rsplit('.', 1)[-1]}.{p}" for module, m in experts.named_fused_experts(model)
                     for p, w in m.named_parameters(recurse=False) if w.dim() == 3})
    picking = router_names(model) if stacks or families.num_experts(model.config.to_dict()) else set()
    if wanted == "all-linear":
        return (sorted(linears - picking), stacks) if picking else ("all-linear", [])
    named = [t for t in wanted if t != "experts"]
    routers = [t for t in named if t.rsplit(".", 1)[-1] in picking]
    if routers:
        raise UserError(f"adapter.target_modules: {', '.join(routers)} is this {model.config.model_type} model's router, which takes no LoRA "
                        "(a changed routing undoes what the experts learned); name the experts, attention or shared-expert layers")
    missing = [t for t in named if t.rsplit(".", 1)[-1] not in linears]
    if missing or ("experts" in wanted and not stacks):
        kind = model.config.model_type
        raise UserError(f"adapter.target_modules: {', '.join(missing) or 'experts'} matches no layer of this {kind} model; its linear layers are "
                        f"{', '.join(sorted(linears))}" + (" and its experts (name: experts)" if stacks else
                                                           " (experts, if it has any, are not fused 3-D weights)" if "experts" in wanted else "")
                        + (" (Phi-3 fuses q/k/v into qkv_proj and gate/up into gate_up_proj)" if kind == "phi3" else ""))
    return named, stacks if "experts" in wanted else []


def _refuse_other_experts(model, linears: set[str]) -> None:
    """One line for experts held as 3-D weights outside transformers' experts modules (JetMoE's, LongCat-Flash's with its
    identity experts): neither peft's LoRA nor the grouped path (experts.named_fused_experts) reaches them, so the
    adapter would leave them frozen without a word."""
    fused = {id(m) for _, m in experts.named_fused_experts(model)}
    other = [(name, type(m).__name__) for name, m in model.named_modules() if id(m) not in fused and "xpert" in type(m).__name__
             and any(p.dim() == 3 for p in m.parameters(recurse=False))]
    if other:
        raise UserError(f"adapter.target_modules: this {model.config.model_type} model's experts ({other[0][0]}, {other[0][1]}) are 3-D weights "
                        "outside transformers' experts modules, which LoRA here does not reach; to train the rest with them frozen, "
                        f"list the layers to adapt (its linear layers: {', '.join(sorted(linears))})")


def adapter_input_casting_off(model, mixed_precision: str):
    """Context for training under accelerate's autocast. peft casts each adapter input to the adapter's
    fp32; under bf16 autocast the adapter's matmuls then run in bf16 all the same, so that cast is a
    copy of every activation for nothing. Only where every forward is autocast: without it the cast is needed."""
    if mixed_precision != "bf16":
        return nullcontext()
    from peft.helpers import disable_input_dtype_casting

    return disable_input_dtype_casting(model)


def describe(model) -> dict:
    """Parameter counts, bytes in memory and, for a quantized base, what stayed unquantized."""
    total = trainable = nbytes = 0
    for p in model.parameters():
        # A 4-bit weight is stored as packed uint8 (two values a byte): count values, not bytes.
        numel = getattr(p, "ds_numel", p.numel())  # a ZeRO-3 partitioned parameter is empty here
        if getattr(p, "quant_state", None) is not None:  # packed 4-bit values: two per byte of storage
            numel = numel * p.element_size() * 2
        total += numel
        nbytes += getattr(p, "ds_numel", p.numel()) * p.element_size()
        if p.requires_grad:
            trainable += numel
    info = {"total_params": total, "trainable_params": trainable, "param_bytes": nbytes}
    quantized, kept, dtypes = 0, {}, set()
    stacks = {id(m) for m in model.modules() if experts.is_experts(m)}  # a quantized base's: quantized by model/experts.py
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)) or "lora_" in name or "magnitude" in name or id(module) in stacks:
            continue  # containers, the adapter itself, and the expert stacks
        if type(module).__name__ in ("Linear4bit", "Linear8bitLt"):
            quantized += 1
        else:
            short = name.split(".")[-1]
            kept[short] = kept.get(short, 0) + 1
            dtypes |= {str(p.dtype).removeprefix("torch.") for p in module.parameters(recurse=False)}
    if quantized:
        info["quantized_linears"], info["expert_modules"] = quantized, len(stacks)
        info["unquantized"] = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in sorted(kept.items()))
        info["unquantized_dtype"] = "/".join(sorted(dtypes))  # peft's k-bit preparation upcasts them to float32
    return info
