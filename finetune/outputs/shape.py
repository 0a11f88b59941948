"""A model's shape as the planner counts it, from its config.json alone: vocabulary, widths, depth, every
linear layer and expert weight (by family table, or from a skeleton on the meta device for other
architectures), norms and biases, and a vision-language model's tower."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from finetune.config.errors import UserError
from finetune.config.files import read_model_config
from finetune.model import experts, families, vision
from finetune.model.configs import language_only
from finetune.model.families import Linear

QWEN_VL_MAX_PIXELS = 12845056  # Qwen2-VL's image processor's default largest picture (16,384 merged tokens)


@dataclass(frozen=True)
class VisionShape:
    """A vision-language model's picture side: its tower's and projector's parameters, the tower's widths
    and depth, and the patches a picture becomes (the processor's largest picture where it resizes)."""

    params: int
    hidden: int
    intermediate: int
    layers: int
    patches: int
    patch: int  # pixels a patch's side

    def patches_of(self, processor: dict) -> int:
        """Patches a picture becomes with model.processor's settings (a largest picture, max_pixels, where given)."""
        return int(processor["max_pixels"]) // self.patch**2 if processor.get("max_pixels") else self.patches


@dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    layers: int
    kv_dim: int
    mlp_width: int  # the MLP's intermediate width a token passes through, averaged over layers (MoE: its experts' and the shared one's)
    attention_values: float  # what a layer keeps per token for its backward outside the MLP (families.saved_attention_values)
    tied: bool
    linears: tuple[Linear, ...]  # every linear layer and expert weight of the decoder (families.linear_layers)
    norms_and_biases: int
    config: dict  # the config.json read (families.buffer_bytes needs the weights' dtype, known only with the run's config)
    meta_buffers: int | None = None  # buffer bytes of the model built on the meta device (architectures outside the table)
    vision: VisionShape | None = None  # a vision-language model's tower and projector
    fp32_values: float = 0.0  # what a layer keeps per token in fp32 whatever the activations' dtype (families.saved_hybrid_values)
    norm_inputs: float = 0.0  # of attention_values, the norms' inputs: kept in fp32 whatever the activations' dtype (families.norm_inputs)

    def buffers(self, weight_bytes: int) -> int:
        return self.meta_buffers if self.meta_buffers is not None else families.buffer_bytes(self.config, weight_bytes)

    @property
    def linear_params(self) -> int:
        return sum(layer.params for layer in self.linears)

    @property
    def expert_params(self) -> int:
        """The experts' fused stacks' parameters (0 in a dense model)."""
        return sum(layer.params for layer in self.linears if layer.expert)

    @property
    def active_params(self) -> int:
        """Parameters a token passes through: with experts, only the routed ones."""
        return sum(layer.fan_in * layer.fan_out * layer.active for layer in self.linears) + self.other_params

    @property
    def other_params(self) -> int:
        """Embeddings, lm_head, norms and biases: never quantized."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.norms_and_biases

    def quantized(self, bits: int) -> list[Linear]:
        """The weights a `bits`-bit base packs as bitsandbytes or torchao do: the linear layers but the routers, and at
        4 bits the experts' fused weights too (torchao's NF4: model/experts.py; at 8 bits plan.base_weights counts the
        experts' int8 stacks itself)."""
        return [layer for layer in self.linears if not layer.router and (bits == 4 or not layer.expert)]

    def quantized_params(self, bits: int) -> int:
        return sum(layer.params for layer in self.quantized(bits))


def read_shape(model_path: str) -> Shape:
    """The model's shape from its config.json (one read per file version: a plan's alternatives and the
    longest-row search re-plan the same model dozens of times; other architectures build a skeleton)."""
    path = Path(model_path).expanduser() / "config.json"
    if not path.is_file():
        raise UserError(f"plan: {path} not found: the planner reads a local model folder's config.json")
    return _read_shape(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _read_shape(path: Path, version: int) -> Shape:
    return _model_shape(path, language_only(read_model_config(path.parent, "plan")))


def vision_shape(model, folder: Path, config: dict) -> VisionShape:
    """The tower and projector counted on the model built on the meta device; a picture's patches from the
    tower's image size, else the processor's largest picture (Qwen-VL: max_pixels; Gemma 4: its most soft tokens, each
    pooled from k x k patches)."""
    parts = vision.part_names(model)
    seen = {id(p): p.numel() for role in ("tower", "projector") if role in parts for p in model.get_submodule(parts[role]).parameters()}
    v = config["vision_config"]
    patch = v.get("patch_size") or 14
    saved = next((json.loads(f.read_text()) for f in (folder / "preprocessor_config.json", folder / "processor_config.json") if f.is_file()), {})
    saved = saved.get("image_processor", saved)
    if v.get("image_size"):
        patches = (v["image_size"] // patch) ** 2
    elif saved.get("max_soft_tokens"):
        patches = saved["max_soft_tokens"] * (saved.get("pooling_kernel_size") or v.get("pooling_kernel_size") or 1) ** 2
    else:
        largest = saved.get("max_pixels") or (saved.get("size") or {}).get("longest_edge") or QWEN_VL_MAX_PIXELS
        patches = int(largest // patch**2)
    hidden = v.get("embed_dim") or v["hidden_size"]  # Qwen2-VL: hidden_size is the projector's output, embed_dim the tower's width
    intermediate = v.get("intermediate_size") or int(hidden * v.get("mlp_ratio", 4))
    return VisionShape(sum(seen.values()), hidden, intermediate, v.get("num_hidden_layers") or v.get("depth") or 0, patches, patch)


def up_width(linears) -> int:
    """The intermediate width a token passes through the up projections of `linears`, over all layers (a fused gate_up
    counted once, each expert stack top_k times)."""
    return sum(layer.fan_out // (2 if "gate_up" in layer.name else 1) * layer.active for layer in linears if layer.name.endswith("up_proj"))


def _model_shape(path: Path, config: dict) -> Shape:
    c = families.text_config(config)
    if not c.get("model_type"):
        raise UserError(f"plan: {path} lacks model_type (the planner knows decoder-only transformers)")
    if c["model_type"] not in families.SPELLED_OUT or vision.is_vision(config):  # a nested text config leaves sizes to its class's defaults
        return skeleton_shape(path.parent)
    try:
        linears = families.linear_layers(config)
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        width = up_width(linears) // c["num_hidden_layers"]
        return Shape(vocab=c["vocab_size"], hidden=c["hidden_size"], layers=c["num_hidden_layers"],
                     kv_dim=(c.get("num_key_value_heads") or heads) * head_dim, mlp_width=width, attention_values=families.saved_attention_values(config),
                     norm_inputs=families.norm_inputs(config),
                     tied=bool(c.get("tie_word_embeddings", False)), linears=tuple(linears), norms_and_biases=families.small_params(config),
                     config=config)
    except KeyError as err:
        raise UserError(f"plan: {path} lacks {err.args[0]} (the planner knows decoder-only transformers)") from None
    except (TypeError, ValueError, ZeroDivisionError):
        raise UserError(f"plan: {path}: a size in it is not a positive number") from None


def skeleton_shape(folder: Path) -> Shape:
    """Any other architecture, read off the model built on the meta device (no weights, no memory): its
    linear layers (nn.Linear and GPT-2's Conv1D) grouped by name and shape, experts' fused 3-D weights
    (a token passes through num_experts_per_tok of them), and everything else (embeddings, learned
    positions, norms, biases) counted as it is."""
    from collections import Counter

    import torch

    from finetune.config.schema import ModelConfig
    from finetune.model.loading import linear_like, load_model, router_names

    try:
        model = load_model(ModelConfig(name_or_path=str(folder)), skeleton="meta", say=lambda _: None)
    except UserError as err:
        raise UserError(f"plan: {err}") from None
    except Exception as err:  # noqa: BLE001 - an architecture transformers cannot build from this config
        raise UserError(f"plan: {folder / 'config.json'}: transformers cannot build this model from it ({str(err).splitlines()[0]})") from None
    config, head, embed = model.config.get_text_config(), model.get_output_embeddings(), model.get_input_embeddings()
    routed = getattr(config, "num_experts_per_tok", None) or 1
    copies, active = Counter(), Counter()  # by (name, fan_in, fan_out, expert)
    pictures = tuple(f"{name}." for role, name in vision.part_names(model).items() if role != "language")  # counted by vision_shape
    stacks = {id(m) for _, m in experts.named_fused_experts(model)}
    for name, module in model.named_modules():
        if name.startswith(pictures):
            continue
        if linear_like(module) and module is not head:
            shape = (module.in_features, module.out_features) if isinstance(module, torch.nn.Linear) else tuple(module.weight.shape)
            key = (name.rsplit(".", 1)[-1], *shape, False)
            copies[key] += 1
            active[key] += 1
        elif id(module) in stacks:
            for weight_name, weight in module.named_parameters(recurse=False):
                if weight.dim() == 3:
                    key = (f"experts.{weight_name}", weight.shape[1], weight.shape[2], True)
                    copies[key] += weight.shape[0]
                    active[key] += min(routed, weight.shape[0])
    moe = any(expert for *_, expert in copies) or bool(families.num_experts(config.to_dict()))  # as model.lora_targets tells routers apart
    routers = router_names(model)
    linears = [Linear(name, fan_in, fan_out, n, active[name, fan_in, fan_out, expert], expert=expert, router=moe and not expert and name in routers)
               for (name, fan_in, fan_out, expert), n in copies.items()]
    vocab, hidden = embed.weight.shape
    tied = head is not None and head.weight is embed.weight
    heads = getattr(config, "num_attention_heads", None)  # none in a pure state-space model (Mamba)
    width = next((w for w in (getattr(config, key, None) for key in ("intermediate_size", "ffn_dim", "n_inner")) if isinstance(w, int)), 4 * hidden)
    language = [p for name, p in model.named_parameters() if not name.startswith(pictures)]
    other = sum(p.numel() for p in language) - sum(layer.params for layer in linears) - vocab * hidden * (1 if tied else 2)
    kv_dim = (getattr(config, "num_key_value_heads", None) or heads) * (hidden // heads) if heads else 0
    hybrid = families.saved_hybrid_values(config.to_dict())  # else a Llama block's (saved_attention_values), its two norms' inputs in fp32
    values, fp32_values = hybrid or (7 * hidden + 2 * kv_dim, 0.0)
    return Shape(vocab=vocab, hidden=hidden, layers=config.num_hidden_layers, kv_dim=kv_dim, fp32_values=fp32_values, norm_inputs=0 if hybrid else 2 * hidden,
                 mlp_width=width, attention_values=values, tied=tied, linears=tuple(linears), norms_and_biases=other,
                 config=config.to_dict(),
                 meta_buffers=sum(b.numel() * b.element_size() for b in model.buffers()),
                 vision=vision_shape(model, folder, model.config.to_dict()) if pictures else None)
