"""Optimizer and learning-rate schedule. Steps are optimizer steps, whatever the world size."""

from __future__ import annotations

import torch

from finetune.config import TrainConfig


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    # Weight decay on matrices only: decaying norms and biases hurts and no peer does it.
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    try:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=True)
    except (RuntimeError, TypeError):  # fused kernels need float params on a supported device
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total_steps)
