"""Which objective a run config asks for (train.objective): the one registry over every objective
module, so that the base module (objective.py) never imports what builds on it (grpo.py)."""

from __future__ import annotations

import functools

from finetune.config.strategy import Strategy
from finetune.data import images
from finetune.objectives.agent import agent_objective
from finetune.objectives.distill import Distill
from finetune.objectives.grpo import GRPO
from finetune.objectives.objective import KTO, SFT, Objective, Preference, RewardModel
from finetune.objectives.rewards import load_rewards


def objective_for(cfg, locate=None, world: int = 1, processor=None) -> Objective:
    """The run config's objective over `world` processes (`locate`: a prompt row's file:line, for GRPO's reward errors;
    `processor`: a vision-language model's, for GRPO's prompts with pictures)."""
    train, preference = cfg.train, cfg.preference
    synced = Strategy.of(cfg.distributed.strategy, world).shards_weights
    if train.objective == "distill":
        return Distill(cfg.distill, train.seed, synced)
    if train.objective == "grpo":
        if cfg.grpo.environment:
            return agent_objective(cfg.grpo, load_rewards(cfg.grpo), train.seed, locate=locate, synced=synced)
        pictures = {} if processor is None else {"vision": functools.partial(images.image_inputs, processor),
                                                 "placeholders": tuple(images.placeholders(processor))}
        return GRPO(cfg.grpo, load_rewards(cfg.grpo), train.seed, locate=locate, synced=synced, **pictures)
    if train.objective == "kto":
        return KTO(preference)
    if train.objective == "reward":
        return RewardModel(preference)
    return SFT() if train.objective == "sft" else Preference(train.objective, preference)
