"""Optimizer and learning-rate schedule. Steps are optimizer steps, whatever the world size."""

from __future__ import annotations

import importlib.util
import warnings

import torch

from finetune.config import TrainConfig
from finetune.errors import UserError

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


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, zero_offload: bool = False) -> torch.optim.Optimizer:
    # Weight decay on matrices only: decaying norms and biases hurts and no peer does it.
    # (A ZeRO-3 partitioned parameter keeps its true shape in ds_shape.)
    matrix = {id(p) for p in params if len(getattr(p, "ds_shape", p.shape)) >= 2}
    decay = [p for p in params if id(p) in matrix]
    no_decay = [p for p in params if id(p) not in matrix]
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
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
    scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)


def current_lr(scheduler) -> float:
    """The LR the next optimizer step uses (the scheduler's get_last_lr() lags a set_peak_lr)."""
    return scheduler.optimizer.param_groups[0]["lr"]


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total_steps)
