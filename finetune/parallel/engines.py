"""One engine per strategy: how the model is loaded, wrapped, stepped and saved under it.

The training loop calls the same methods whatever the strategy; what differs between one process or
DDP, FSDP2 and DeepSpeed ZeRO lives here. `engine.load(model_cfg, say)` loads the base as the
strategy wants it (FSDP: a skeleton on ranks > 0; ZeRO-3: partitioned while loading); once prepared,
an engine holds the model, optimizer, LR schedule and the checkpointer of its format. With one process (whatever the strategy):

>>> import torch
>>> from accelerate import Accelerator
>>> from finetune.config.schema import validate_config
>>> cfg = validate_config({"model": {"name_or_path": "org/model"}, "data": {"train": "org/dataset"},
...                        "train": {"output_dir": "unused", "lr": 0.1, "max_steps": 3}}, "example")
>>> engine = engine_for(cfg, Accelerator(cpu=True))
>>> engine.name, engine.layout
('none', 'full')
>>> _ = torch.manual_seed(0)
>>> engine.prepare(torch.nn.Linear(4, 1), total_steps=3)  # engine.model, .optimizer, .scheduler
>>> x, y, losses = torch.ones(8, 4), torch.zeros(8, 1), []
>>> for step in range(3):
...     with engine.accumulating(last=True):  # gradients are reduced across ranks at a step's last micro-batch
...         loss = torch.nn.functional.mse_loss(engine.model(x), y)
...         engine.backward(loss)
...     norm = engine.clip(1.0)
...     moved = engine.apply(True)  # the guard's verdict: apply (ZeRO has stepped inside backward already)
...     losses.append(loss.item())
>>> losses[-1] < losses[0] / 10
True
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from finetune.checkpoint.checkpointers import Checkpointer, DcpCheckpointer, DeepSpeedCheckpointer, bare
from finetune.config.schema import ModelConfig, RunConfig
from finetune.config.strategy import Strategy
from finetune.model import nf4
from finetune.model.configs import model_config
from finetune.model.loading import load_model, quantize_layers
from finetune.model.teacher import frozen, merged
from finetune.parallel import expert_parallel
from finetune.parallel.distributed import clip_sharded, full_state_dict, gathered_trainable_state, init_deepspeed, shard_fsdp2, stream_source, zero3_loading
from finetune.parallel.optim import build_optimizer, build_scheduler, loraplus_params


class Engine:
    """One process, or DDP through accelerate: every rank holds the whole model. FSDP and Zero override what sharding
    changes (loading, preparing, saving, gathering the trained weights)."""

    background_saves = True  # checkpoints may be written while training goes on (DeepSpeed writes its own files, synchronously)
    autocast = True  # accelerate's autocast (FSDP's MixedPrecisionPolicy and DeepSpeed's bf16 mode do its job when sharded)

    def __init__(self, cfg: RunConfig, accelerator, strategy: Strategy):
        self.cfg, self.accelerator, self.strategy = cfg, accelerator, strategy
        # name as run; layout: how checkpoint.save/restore lay out its state; replicated: every rank holds
        # the same trained weights (the end-of-run replica check); gathers: weights gathered layer by
        # layer while computing (the CPU heap tuning is then off)
        self.name, self.layout, self.replicated, self.gathers = strategy.name, strategy.layout, strategy.replicated, strategy.shards_weights
        self.world, self.rank = accelerator.num_processes, accelerator.process_index
        self.model = self.optimizer = self.scheduler = self.checkpointer = None
        self.params: list[torch.nn.Parameter] = []  # the trained ones, as this rank holds them (after prepare)

    def load(self, model_cfg: ModelConfig, say, policy: bool = False) -> torch.nn.Module:
        """The base as loaded (policy: the model trained, whose quantized expert stacks are quantized as they load: not a
        reference or teacher, which has an adapter merged into it first)."""
        size = self.cfg.distributed.expert_parallel
        if policy and size > 1:
            expert_parallel.check(model_config(model_cfg).to_dict(), size)
        return load_model(model_cfg, self.accelerator.device, say=say, head="score" if self.cfg.train.objective == "reward" else "causal",
                          experts_as_loaded=policy, expert_share=(self.rank % size, size) if policy and size > 1 else None)

    def prepare(self, model: torch.nn.Module, total_steps: int) -> None:
        """Wrap the model, then build the optimizer on what this rank holds, and the LR schedule on that
        optimizer before any wrapper (it then drives the groups a wrapper holds too)."""
        split = expert_parallel.split(model, self.cfg.distributed.expert_parallel, self.rank, self.world) if self.cfg.distributed.expert_parallel > 1 else []
        if nf4.after_adapter(self.cfg.model):  # before accelerate places it: the device only ever holds the 4-bit weights
            quantize_layers(model, self.cfg.model)
        # DDP broadcasts rank 0's weights at the start: not each process's share of the experts, nor NF4 weights (its copy
        # into one quantizes the values again: other codes), which every process loaded and quantized the same
        model._ddp_params_and_buffers_to_ignore = split + [name for name, p in model.named_parameters() if nf4.is_nf4(p)]
        self.model = self.accelerator.prepare(model)
        self.params = trained(self.model)
        optimizer = build_optimizer(self.params, self.cfg.train, fast=loraplus_params(self.model, self.cfg.train))
        self.scheduler = build_scheduler(optimizer, self.cfg.train, total_steps)
        self.optimizer = self.accelerator.prepare(optimizer)
        self.checkpointer = Checkpointer(self.model, self.optimizer, self.scheduler, self.accelerator)

    def accumulating(self, last: bool):
        """Before the last micro-batch of a step, no gradient reduction across ranks."""
        return nullcontext() if last else self.accelerator.no_sync(self.model)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def clip(self, max_norm: float) -> torch.Tensor | float:
        """The gradients' norm before clipping; a device tensor where the engine has one (no host sync)."""
        return self.accelerator.clip_grad_norm_(self.params, max_norm)

    def apply(self, apply: bool) -> bool:
        """After the guard's verdict on a computed step: step the optimizer and the LR schedule where it
        says apply, drop the gradients either way. True where the weights moved."""
        if apply:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return apply

    def unwrap(self) -> torch.nn.Module:
        return bare(self.model)

    def final_state(self) -> dict[str, torch.Tensor] | None:
        """What save_pretrained writes when the model's own state dict would not do (a collective)."""
        return None

    def reference(self, model_cfg: ModelConfig, say, adapter: str | None = None) -> torch.nn.Module:
        """A frozen model held as the policy is (DPO's reference under full fine-tuning: a copy of the base; a
        distillation teacher, `adapter` merged into it): whole on every rank here, with accelerate's autocast like
        the policy, no DDP wrapper."""
        model = frozen(merged(self.load(model_cfg, say), adapter))
        if nf4.after_adapter(model_cfg):  # a teacher in torchao's NF4 (distill.teacher_quantization), or its experts
            quantize_layers(model, model_cfg)
        return self.accelerator.prepare_model(model, evaluation_mode=True)


class FSDP(Engine):
    """FSDP2 (`fully_shard` per decoder layer): rank 0 loads or streams the weights, every rank keeps its shards."""

    autocast = False

    def load(self, model_cfg: ModelConfig, say, policy: bool = False) -> torch.nn.Module:
        self.stream_from = stream_source(self.cfg.model_copy(update={"model": model_cfg}), say)
        skeleton = "meta" if self.rank != 0 else "empty" if self.stream_from else None
        return load_model(model_cfg, self.accelerator.device, skeleton=skeleton, say=say)

    def prepare(self, model: torch.nn.Module, total_steps: int) -> None:
        self.model = shard_fsdp2(model, self.cfg, self.accelerator.device, self.world, self.stream_from)
        self.params = trained(self.model)
        self.optimizer = build_optimizer(self.params, self.cfg.train, fast=loraplus_params(self.model, self.cfg.train))
        self.scheduler = build_scheduler(self.optimizer, self.cfg.train, total_steps)
        self.checkpointer = DcpCheckpointer(self.model, self.optimizer, self.scheduler, self.accelerator)

    def accumulating(self, last: bool):
        self.model.set_requires_gradient_sync(last)
        return nullcontext()

    def clip(self, max_norm: float) -> torch.Tensor:
        return clip_sharded(self.params, max_norm)

    def final_state(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model, self.cfg.adapter.method != "full")

    def reference(self, model_cfg: ModelConfig, say, adapter: str | None = None) -> torch.nn.Module:
        """Sharded as the policy, loaded (streamed) the same way."""
        model = frozen(self.load(model_cfg, say))  # an adapter teacher is refused before (teacher_source)
        return shard_fsdp2(model, self.cfg.model_copy(update={"model": model_cfg}), self.accelerator.device, self.world, self.stream_from)


class Zero(Engine):
    """DeepSpeed ZeRO-2/3 (offload too): its engine reduces, clips and steps inside backward."""

    autocast, background_saves = False, False

    def __init__(self, cfg: RunConfig, accelerator, strategy: Strategy):
        super().__init__(cfg, accelerator, strategy)
        self.partitioning = zero3_loading(cfg, self.world)  # ZeRO-3: weights partitioned as they load, while this lives

    def load(self, model_cfg: ModelConfig, say, policy: bool = False) -> torch.nn.Module:
        """ZeRO-3 builds each module for real before partitioning it, where a plain load builds it on the meta device:
        a module that draws its own weights (CLIP's class embedding) would move the random generators, and with them
        the adapter's initial weights, drawn next. They are put back after the load."""
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            return super().load(model_cfg, say)

    def prepare(self, model: torch.nn.Module, total_steps: int) -> None:
        self.params = trained(model)  # the same objects once DeepSpeed wraps the module
        optimizer = build_optimizer(self.params, self.cfg.train, zero_offload=self.strategy.offload, fast=loraplus_params(model, self.cfg.train))
        self.scheduler = build_scheduler(optimizer, self.cfg.train, total_steps)  # drives the groups DeepSpeed wraps
        self.model, self.optimizer = init_deepspeed(model, optimizer, self.cfg, self.world)
        self.checkpointer = DeepSpeedCheckpointer(self.model, self.optimizer, self.scheduler, self.accelerator)

    def accumulating(self, last: bool):
        return nullcontext()  # DeepSpeed reduces at the last micro-batch of its own accord

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss, scale_wrt_gas=False)  # already normalised over the whole step
        self.model.step()  # a no-op but at the last micro-batch

    def clip(self, max_norm: float) -> float:
        return float(self.model.get_global_grad_norm())  # clipped inside step, at distributed.deepspeed_config's norm

    def apply(self, apply: bool) -> bool:
        """DeepSpeed stepped inside backward: a step the guard would skip has moved the weights already
        (only a rollback undoes it), and the LR schedule follows the optimizer."""
        self.scheduler.step()
        return True

    def unwrap(self) -> torch.nn.Module:
        return self.model.module

    def reference(self, model_cfg: ModelConfig, say, adapter: str | None = None) -> torch.nn.Module:
        """ZeRO-3: partitioned while it loads, then a DeepSpeed engine without an optimizer (gathers each
        layer for its forward, as the policy's does); ZeRO-2 shards no weights: whole on every rank."""
        model = frozen(merged(self.load(model_cfg, say), adapter))  # an adapter teacher under ZeRO-3 is refused before (teacher_source)
        return init_deepspeed(model, None, self.cfg, self.world)[0] if self.gathers else model

    def final_state(self) -> dict[str, torch.Tensor]:
        # Training is over and any checkpoint is written: the optimizer's states (momentum, Adam's
        # moments) make room for the gathered copy rank 0 builds.
        self.optimizer.optimizer.state.clear()
        return gathered_trainable_state(self.unwrap(), keep=self.accelerator.is_main_process)


def trained(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def engine_class(cfg: RunConfig, world: int) -> tuple[type[Engine], Strategy]:
    """The engine of distributed.strategy and the strategy as run: sharding applies with several processes only."""
    strategy = Strategy.of(cfg.distributed.strategy, world)
    return (FSDP if strategy.layout == "dcp" else Zero if strategy.deepspeed else Engine), strategy


def engine_for(cfg: RunConfig, accelerator) -> Engine:
    cls, strategy = engine_class(cfg, accelerator.num_processes)
    return cls(cfg, accelerator, strategy)

