"""Optimizer and learning-rate schedule. Steps are optimizer steps, whatever the world size."""

from __future__ import annotations

import importlib.util
import math
import warnings

import torch

from finetune.config.errors import UserError
from finetune.config.schema import TrainConfig

# Optimizers that bitsandbytes provides: config name -> class name in bitsandbytes.optim.
BNB_OPTIMIZERS = {
    "adamw_8bit": "AdamW8bit",
    "paged_adamw_8bit": "PagedAdamW8bit",
    "paged_adamw_32bit": "PagedAdamW32bit",
    "lion": "Lion",
    "lion_8bit": "Lion8bit",
}


def check_optimizer(cfg: TrainConfig) -> None:
    """Refuse, before loading, an optimizer this machine cannot run."""
    if cfg.optimizer in BNB_OPTIMIZERS and importlib.util.find_spec("bitsandbytes") is None:
        raise UserError(f"train.optimizer: {cfg.optimizer} needs bitsandbytes (pip install bitsandbytes)")
    if cfg.optimizer_offload:
        if not torch.cuda.is_available():
            raise UserError("train.optimizer_offload: offloading optimizer states to CPU needs a CUDA GPU (on a CPU they are already there)")
        if cfg.optimizer != "adamw":
            raise UserError("train.optimizer_offload: works with optimizer adamw only")
        if importlib.util.find_spec("torchao") is None:
            raise UserError("train.optimizer_offload: needs torchao (pip install torchao)")


def _dims(p: torch.nn.Parameter) -> int:
    return len(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 partitioned parameter keeps its true shape in ds_shape


def loraplus_params(model: torch.nn.Module, cfg: TrainConfig) -> set[int]:
    """The trained parameters LoRA+ gives lr x train.loraplus_lr_ratio, grouped as peft's
    create_loraplus_optimizer groups them: the B matrices and 1-D adapter weights (DoRA's magnitudes)."""
    if not cfg.loraplus_lr_ratio:
        return set()
    return {id(p) for name, p in model.named_parameters() if p.requires_grad and ("lora_B" in name or (_dims(p) == 1 and "lora_" in name))}


def param_groups(params: list[torch.nn.Parameter], cfg: TrainConfig, fast: set[int] = frozenset()) -> list[dict]:
    """Weight decay on matrices only (decaying norms and biases hurts and no peer does it); LoRA+'s
    `fast` parameters in groups of their own, whose lr_ratio set_peak_lr keeps."""
    groups = []
    for ratio, members in ((1.0, [p for p in params if id(p) not in fast]), (cfg.loraplus_lr_ratio, [p for p in params if id(p) in fast])):
        for decay, chosen in ((cfg.weight_decay, [p for p in members if _dims(p) >= 2]), (0.0, [p for p in members if _dims(p) < 2])):
            if chosen:
                groups.append({"params": chosen, "weight_decay": decay, "lr": cfg.lr * ratio, "lr_ratio": ratio})
    return groups


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, zero_offload: bool = False, fast: set[int] = frozenset()) -> torch.optim.Optimizer:
    groups = param_groups(params, cfg, fast)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.optimizer in BNB_OPTIMIZERS:
        import bitsandbytes as bnb

        if cfg.optimizer.startswith("paged") and not torch.cuda.is_available():
            print(f"note: {cfg.optimizer} pages its states only on CUDA; here it runs unpaged")
            warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        return getattr(bnb.optim, BNB_OPTIMIZERS[cfg.optimizer])(groups, lr=cfg.lr, betas=cfg.betas)
    if zero_offload and cfg.optimizer == "adamw":
        # DeepSpeed's vectorised CPU Adam, what ZeRO-Offload is built around (JIT-compiled on first use).
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=cfg.betas, adamw_mode=True)
    if cfg.optimizer_offload:
        try:
            from torchao.optim import CPUOffloadOptimizer
        except ImportError:  # torchao releases before the API left the prototype namespace
            from torchao.prototype.low_bit_optim import CPUOffloadOptimizer

        return CPUOffloadOptimizer(groups, torch.optim.AdamW, lr=cfg.lr, betas=cfg.betas, fused=True)
    try:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=True)
    except (RuntimeError, TypeError):  # fused kernels need float params on a supported device
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def set_peak_lr(scheduler, lr: float) -> None:
    """Make `lr` the schedule's peak from now on (the config's LR times the guard's back-off), also
    after restoring a checkpoint that stored another. transformers' schedules are LambdaLRs: each
    group's LR is its base LR times a factor of the step."""
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [lr * group.get("lr_ratio", 1.0) for group in groups]
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * factor(scheduler.last_epoch)


def current_lr(scheduler) -> float:
    """The LR the next optimizer step uses (the scheduler's get_last_lr() lags a set_peak_lr)."""
    return scheduler.optimizer.param_groups[0]["lr"]


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    return cfg.warmup_steps or math.ceil(cfg.warmup_ratio * total_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    """transformers' schedules (LambdaLRs): a linear warmup, then cosine or linear decay to lr x
    min_lr_ratio, constant, or warmup-stable-decay."""
    from transformers import get_scheduler

    warmup = warmup_steps(cfg, total_steps)
    after = max(0, total_steps - warmup)
    name, extra = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}.get(cfg.scheduler), {}
    if cfg.scheduler == "cosine" and cfg.min_lr_ratio:
        name, extra = "cosine_with_min_lr", {"min_lr_rate": cfg.min_lr_ratio}
    elif cfg.scheduler == "wsd" or (cfg.scheduler == "linear" and cfg.min_lr_ratio):
        # transformers' linear schedule has no floor: a linear decay with one is WSD without a stable part
        decay = after if cfg.scheduler == "linear" else max(1, round(cfg.decay_ratio * after))
        name, extra = "warmup_stable_decay", {"num_stable_steps": after - decay, "num_decay_steps": decay, "decay_type": "linear",
                                              "min_lr_ratio": cfg.min_lr_ratio}
    with warnings.catch_warnings():  # WSD notes that its stable steps, not the total, set its length: they agree here
        warnings.filterwarnings("ignore", message="Both num_training_steps and num_stable_steps are specified")
        return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps, scheduler_specific_kwargs=extra)
