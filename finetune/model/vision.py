"""Vision-language models: which configs are one, the processor, and which parts train.

A vision-language model is a folder whose config.json has a `vision_config`; it loads through
AutoModelForImageTextToText and AutoProcessor (its tokenizer is the processor's). Its parts, by the names
transformers gives them: the vision tower (`vision_tower`, Qwen-VL's `visual`), the projector
(`multi_modal_projector`, Qwen-VL's `visual.merger`) and the language model (`language_model`). By
default LoRA adapts the language model's linear layers only; the tower and projector stay frozen unless
adapter.vision / adapter.projector say otherwise.
"""

from __future__ import annotations

import re

from finetune.config.errors import UserError
from finetune.config.schema import AdapterConfig, ModelConfig
from finetune.model.configs import model_config

# The families whose batches are their processor's (tests/test_vision.py: LLaVA with a CLIP or SigLIP tower, Gemma 3, Mistral 3,
# Idefics3 (SmolVLM's first version is one) and SmolVLM2 with their grid of crops, Mllama with its cross-attention masks, Qwen2-VL and
# Qwen2.5-VL with their 3-D positions; without torchvision, their processor for pictures only: pictures_only_class); others
# are refused in one line.
FAMILIES = {"llava": "LLaVA", "gemma3": "Gemma 3", "qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL", "idefics3": "Idefics3 / SmolVLM",
            "smolvlm": "SmolVLM2", "mllama": "Mllama", "qwen3_vl": "Qwen3-VL", "qwen3_vl_moe": "Qwen3-VL-MoE",
            "qwen3_5": "Qwen3.5", "qwen3_5_moe": "Qwen3.5-MoE", "gemma4": "Gemma 4",
            "llava_onevision": "LLaVA-OneVision", "internvl": "InternVL", "mistral3": "Mistral 3 (Pixtral)"}
# Those whose packed rows are exact (tests/test_vision.py: packed equals one sample a row): the language model takes
# restarting positions as a text model does (Qwen-VL: its 3-D positions each sample's own, attention.packed_positions), the
# pictures' features fill their tokens in order. Gemma 3's picture-wide attention and Mllama's per-row pictures
# (cross-attended) are not packed; Gemma 4 packs where its pictures' attention is causal (packable).
PACKABLE = {"llava", "llava_onevision", "internvl", "mistral3", "idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
            "qwen3_5_moe", "gemma4"}
# Towers FSDP2 shards as units of their own (tests/test_vision.py: Qwen-VL, 2 processes equal 1). LLaVA's stays in the
# root unit: it reads the tower's hidden states through transformers' output capture, which came back empty from a
# unit of its own; the other families are not run under FSDP2 here.
TOWER_UNIT = {"qwen2_vl", "qwen2_5_vl"}
TOWERS = ("vision_tower", "visual", "vision_model")
PROJECTORS = ("multi_modal_projector", "visual.merger", "connector", "embed_vision")


def is_vision(config: dict) -> bool:
    return config.get("vision_config") is not None


def packable(config: dict) -> bool:
    """Whether rows with pictures pack exactly: a PACKABLE family, and not a Gemma 4 whose pictures' tokens see each other both
    ways in its sliding layers (use_bidirectional_attention: "vision")."""
    text = config.get("text_config") or {}
    return config.get("model_type") in PACKABLE and text.get("use_bidirectional_attention") != "vision"


def refusal(config: dict) -> str | None:
    """Why this vision-language model cannot be fine-tuned here, or None."""
    kind = config.get("model_type")
    if kind in FAMILIES:
        return None
    return (f"model: {kind} is a vision-language model finetune does not fine-tune yet; it fine-tunes "
            f"{', '.join(FAMILIES.values())} (docs/vision.md)")


def processor_for(cfg: ModelConfig, model: str | None = None):
    """The processor in cfg's folder if the model (`model`, else that folder's) is a vision-language model;
    None for a text model. A config that does not read stops in one line, as loading the model would."""
    config = model_config(cfg if model is None else cfg.model_copy(update={"name_or_path": model})).to_dict()
    return load_processor(cfg, config.get("model_type")) if is_vision(config) else None


def load_processor(cfg: ModelConfig, model_type: str | None = None):
    from transformers import AutoProcessor

    settings = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code, **cfg.processor)
    try:
        return AutoProcessor.from_pretrained(cfg.name_or_path, **settings)
    except Exception as err:  # noqa: BLE001 - a missing file, a bad setting or a missing library (torchvision): one line
        failed = err
    pictures_only = pixtral_processor() if model_type == "mistral3" else pictures_only_class(model_type)
    if pictures_only is not None:
        try:
            processor = pictures_only.from_pretrained(cfg.name_or_path, **settings)
            processor.source = cfg.name_or_path
            return processor
        except Exception as err:  # noqa: BLE001 - as above
            failed = err
    first = str(failed).strip().splitlines()[0] if str(failed).strip() else type(failed).__name__
    hint = " (its processor needs torchvision: pip install torchvision, the build matching your torch)" if "orchvision" in str(failed) else ""
    raise UserError(f"model.name_or_path: cannot load the processor of '{cfg.name_or_path}': {first}{hint}")


def pictures_only_class(model_type: str | None) -> type | None:
    """The family's processor class without its video half, where torchvision is missing (no wheel matches the CPU
    torch here: docs/platform-notes.md); None where that is not what stops it. Qwen-VL's and SmolVLM2's processors
    take a video processor, which needs torchvision, and transformers will not build them without one; their
    pictures need only the image processor, whose PIL version transformers picks then. The class keeps the
    family's name, so that a saved processor is the family's, and saves its video settings as the source had them."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    from transformers.utils import is_torchvision_available

    family = getattr(transformers, PROCESSOR_MAPPING_NAMES.get(model_type) or "", None)
    if is_torchvision_available() or family is None or "video_processor" not in family.get_attributes():
        return None
    return type(family.__name__, (family, _without_video()), {
        "__module__": __name__, "__doc__": f"{family.__name__} for pictures only (no torchvision here for its videos).",
        "__init__": _video_optional(family.__init__),
        "get_attributes": classmethod(lambda cls: [a for a in family.get_attributes() if a != "video_processor"]),
        "save_pretrained": _save_with_video_settings})


def pixtral_processor() -> type:
    """Mistral 3's processor class (Pixtral's). transformers declares it torchvision's, and its module imports one helper from
    the torchvision image processor's, though the class itself uses none; without torchvision, the module is imported with
    that helper taken from the PIL image processor's module (the same function), and the PIL image processor serves it."""
    import importlib
    import sys
    import types

    from transformers.utils import is_torchvision_available

    name = "transformers.models.pixtral.processing_pixtral"
    if is_torchvision_available() or name in sys.modules:
        return importlib.import_module(name).PixtralProcessor
    from transformers.models.pixtral import image_processing_pil_pixtral as pil

    helper = "transformers.models.pixtral.image_processing_pixtral"
    sys.modules[helper] = types.SimpleNamespace(get_resize_output_image_size=pil.get_resize_output_image_size)
    try:
        return importlib.import_module(name).PixtralProcessor
    finally:
        del sys.modules[helper]


def _without_video() -> type:
    """A base that sits between the family's class and ProcessorMixin: it drops the video processor a family's __init__ hands on
    by name (Gemma 4's), which ProcessorMixin would refuse as an attribute the pictures-only class does not have."""
    from transformers.processing_utils import ProcessorMixin

    def init(self, *args, **kwargs):
        kwargs.pop("video_processor", None)
        ProcessorMixin.__init__(self, *args, **kwargs)

    return type("PicturesOnly", (ProcessorMixin,), {"__init__": init, "__module__": __name__})


def _video_optional(init):
    """The family's own __init__ with its video processor defaulting to None (SmolVLM2's requires one). The same
    code, not a wrapper: transformers reads the settings a processor takes off its __init__'s code."""
    import types

    names = init.__code__.co_varnames[1 : init.__code__.co_argcount]
    defaults = init.__defaults__ or ()
    wanted = len(names) - names.index("video_processor")
    defaults = (None,) * max(0, wanted - len(defaults)) + defaults
    return types.FunctionType(init.__code__, init.__globals__, init.__name__, defaults, init.__closure__)


def _save_with_video_settings(self, out, **kwargs):
    """A pictures-only processor saved as the family's: where torchvision is, the video processor reads the source's
    video settings, or (as for a release that has none) the image processor's."""
    import shutil
    from pathlib import Path

    made = super(type(self), self).save_pretrained(out, **kwargs)
    self.image_processor.save_pretrained(out)
    video = Path(getattr(self, "source", "")) / "video_preprocessor_config.json"
    if video.is_file():
        shutil.copyfile(video, Path(out) / video.name)
    return made


def part_names(model) -> dict[str, str]:
    """Module names of the tower, the projector and the language model in this model (those it has)."""
    names = {name for name, _ in model.named_modules()}
    found = {}
    for role, candidates in (("tower", TOWERS), ("projector", PROJECTORS), ("language", ("language_model", "text_model"))):
        found[role] = next((n for n in sorted(names, key=len) if any(n == c or n.endswith("." + c) for c in candidates)), None)
    return {role: name for role, name in found.items() if name}


def lora_pattern(model, linear_layers: list[str], wanted: set[str], cfg: AdapterConfig) -> str:
    """peft's target_modules as a regular expression: the language model's linear layers (of the model's
    `linear_layers`) whose names end in one of `wanted`, and with adapter.vision: lora the tower's too
    (never the projector's)."""
    parts = part_names(model)
    inside = [parts["language"]] + ([parts["tower"]] if cfg.vision == "lora" and "tower" in parts else [])
    projector = parts.get("projector")
    chosen = [name for name in linear_layers if name.rsplit(".", 1)[-1] in wanted
              and any(name.startswith(p + ".") for p in inside) and not (projector and name.startswith(projector + "."))]
    if not chosen:
        raise UserError(f"adapter.target_modules: no linear layer of this {model.config.model_type} model's language model is named "
                        f"{', '.join(sorted(wanted))}")
    suffixes = sorted({name.rsplit(".", 1)[-1] for name in chosen})
    return rf"^(?:{'|'.join(map(re.escape, inside))})\..*\.(?:{'|'.join(suffixes)})$" if projector is None else \
        rf"^(?!{re.escape(projector)}\.)(?:{'|'.join(map(re.escape, inside))})\..*\.(?:{'|'.join(suffixes)})$"


def trained_whole(model, cfg: AdapterConfig) -> list[str]:
    """The parts adapter.vision / adapter.projector train whole (peft's modules_to_save names)."""
    parts = part_names(model)
    return [parts[role] for role, choice in (("tower", cfg.vision), ("projector", cfg.projector)) if choice == "full" and role in parts]


def freeze(model, cfg: AdapterConfig) -> None:
    """Full fine-tuning: the tower and projector stay as they are unless configured to train."""
    parts = part_names(model)
    for role, choice in (("tower", cfg.vision), ("projector", cfg.projector)):
        if role in parts and choice != "full":
            # Qwen-VL's projector sits inside its tower: the tower trains whole only with projector: full too
            keep = parts["projector"] if role == "tower" and cfg.projector == "full" and "projector" in parts else None
            for name, p in model.get_submodule(parts[role]).named_parameters():
                if keep is None or not f"{parts[role]}.{name}".startswith(keep + "."):
                    p.requires_grad_(False)
