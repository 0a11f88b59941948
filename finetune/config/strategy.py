"""What a distributed strategy does, as one value: asked by the config checks, the planner, the
launcher checks, the engines and the checkpoint code instead of each keeping its own list of names.

Torch-free (the planner and `validate` import it before anything heavy). One process is `none`
everywhere, whatever the config asks: sharding over one process shards nothing.

>>> Strategy.of("zero3").shards_weights, Strategy.of("zero3", world=1).name
(True, 'none')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Name = Literal["none", "ddp", "fsdp", "zero2", "zero3", "zero3_offload"]
NAMES: tuple[str, ...] = get_args(Name)  # one vocabulary: the config, `finetune plan --strategy`, the engines, summary.json
ZERO_STAGES = {"zero2": 2, "zero3": 3, "zero3_offload": 3}


@dataclass(frozen=True)
class Strategy:
    name: str  # one of NAMES, as run
    replicated: bool  # every process holds the whole trained model (none, ddp)
    shards_states: bool  # gradients and optimizer states split over the processes (fsdp, zero*)
    shards_weights: bool  # the weights split too, gathered layer by layer to compute (fsdp, zero3*)
    zero_stage: int | None  # DeepSpeed's ZeRO stage, None for the others
    offload: bool  # sharded states kept in CPU RAM by the strategy itself (zero3_offload)
    layout: str  # how its checkpoints are laid out: full (one set of files) | dcp (torch.distributed.checkpoint shards) | deepspeed

    @classmethod
    def of(cls, name: str, world: int | None = None) -> Strategy:
        """distributed.strategy over `world` processes (None: as asked, before the count is known)."""
        if name not in NAMES:
            raise ValueError(f"unknown strategy {name!r}: expected one of {', '.join(NAMES)}")
        name = "none" if world == 1 else name
        stage = ZERO_STAGES.get(name)
        return cls(name=name, replicated=name in ("none", "ddp"), shards_states=name not in ("none", "ddp"),
                   shards_weights=name == "fsdp" or stage == 3, zero_stage=stage, offload=name == "zero3_offload",
                   layout="dcp" if name == "fsdp" else "deepspeed" if stage else "full")

    @property
    def deepspeed(self) -> bool:
        return self.zero_stage is not None
