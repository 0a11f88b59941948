"""What an adapter path is (a PEFT adapter folder or a finetune checkpoint mid-run), its base, and
base + adapter as trained: shared by `finetune merge` and `finetune generate`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from finetune.checkpoint import store
from finetune.config.errors import UserError
from finetune.config.files import load_config, read_json_object
from finetune.config.schema import CONFIG_FILE, ModelConfig, RunConfig
from finetune.model import nf4
from finetune.model.loading import apply_adapter, load_model, quantize_layers


@dataclass
class Adapter:
    path: Path
    base: str
    run: RunConfig | None  # the training run's config, when the folder carries it (finetune outputs)
    from_checkpoint: bool

    @property
    def quantized(self) -> bool:
        return self.run is not None and self.run.model.quantization is not None


def find_adapter(path: str, base: str | None) -> Adapter:
    """What --adapter points at: a PEFT adapter folder, or a finetune checkpoint mid-run."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"--adapter: no such folder: {path}")
    run = load_config(folder / CONFIG_FILE, check_model=False, check_paths=False) if (folder / CONFIG_FILE).is_file() else None
    if run is not None and run.train.objective == "reward":
        raise UserError(f"--adapter: {folder} is a reward model (train.objective: reward): it scores, it does not generate; "
                        "score rows with finetune score --model, or use it as a GRPO reward (grpo.rewards: [reward_model:PATH])")
    if (folder / "adapter_config.json").is_file():
        saved = read_json_object(folder / "adapter_config.json", "--adapter")
        if saved.get("task_type") == "SEQ_CLS":
            raise UserError(f"--adapter: {folder} is a sequence-classification adapter (a reward model); score rows with finetune score --model")
        saved_base = saved.get("base_model_name_or_path")
        chosen = base or saved_base
        if not chosen:
            raise UserError(f"--adapter: {folder}/adapter_config.json names no base model; give --base")
        if not any((folder / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
            raise UserError(f"--adapter: {folder} has adapter_config.json but no adapter_model.safetensors")
        return Adapter(folder, chosen, run, False)
    if (folder / store.MANIFEST).is_file() and run is not None:
        problem = store.verify(folder)
        if problem:
            raise UserError(f"--adapter: checkpoint {folder} is damaged: {problem}")
        if run.adapter.method == "full":
            raise UserError(f"--adapter: {folder} is a full fine-tuning checkpoint: it holds the trained weights, there is no adapter to merge")
        return Adapter(folder, base or run.model.name_or_path, run, True)
    raise UserError(f"--adapter: {folder} is neither a PEFT adapter (adapter_config.json) nor a finetune checkpoint")


def load_base(adapter: Adapter, quantized: bool, dtype: str = "float32"):
    """The base model: as the run trained it (quantized, with its dtype) or in `dtype`."""
    if quantized:
        return load_model(adapter.run.model.model_copy(update={"name_or_path": adapter.base, "ramdisk": False}))
    overrides = adapter.run.model.config_overrides if adapter.run else {}  # e.g. the RoPE scaling the adapter was trained with
    return load_model(ModelConfig(name_or_path=adapter.base, dtype=dtype, config_overrides=overrides))


def as_trained(adapter: Adapter, dtype: str = "float32"):
    """base + adapter as the run computed with them: on the 4-bit base where it trained on one (torchao's
    quantized after the adapter is attached, as in training, so the adapter keeps its own dtype)."""
    model = attach(load_base(adapter, quantized=adapter.quantized, dtype=dtype), adapter)
    if adapter.quantized and nf4.after_adapter(adapter.run.model):
        quantize_layers(model.get_base_model(), adapter.run.model)
    return model


def attach(base, adapter: Adapter):
    """base + the trained adapter weights, as a PeftModel in eval mode."""
    from peft import PeftModel

    from finetune.checkpoint.checkpointers import load_trainable

    try:
        if not adapter.from_checkpoint:
            return PeftModel.from_pretrained(base, adapter.path).eval()
        model = apply_adapter(base, adapter.run.adapter, gradient_checkpointing=False)
        load_trainable(adapter.path, model)
        return model.eval()
    except (RuntimeError, ValueError, KeyError) as err:  # shape or name mismatch with this base
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        why = next((line for line in lines if "mismatch" in line), lines[0] if lines else type(err).__name__)
        raise UserError(f"--adapter: {adapter.path} does not fit the base {adapter.base}: {why[:300]}") from None


def tokenizer_source(adapter: Adapter) -> str:
    """The tokenizer the run saved next to its adapter (with any chat template it set), else the base's."""
    for folder in (adapter.path, adapter.path.parent.parent):  # an adapter folder, or OUTPUT/checkpoints/step-N
        if (folder / "tokenizer_config.json").is_file():
            return str(folder)
    return adapter.base
