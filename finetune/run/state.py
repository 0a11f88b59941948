"""One run's state, as the recipe's setup builds it and its loop and finish use it, and the small questions
every phase asks of it (is this step logged, which data windows are skipped, the eval at a step)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from finetune.checkpoint.resume import Progress
from finetune.config.schema import ModelConfig, RunConfig
from finetune.data.datasets import Datasets, Schedule
from finetune.objectives.evaluate import eval_loss
from finetune.objectives.objective import SFT, Objective
from finetune.parallel.engines import Engine
from finetune.parallel.sequence_parallel import RowShare
from finetune.run.guard import Guard, Verdict
from finetune.run.metrics import RunLog
from finetune.run.supervise import Watchdog

INITIAL_ADAPTER = "initial-adapter"  # where a PiSSA/OLoRA adapter started, for peft's conversion at the end


@dataclass
class RunResult:
    summary: dict
    model: torch.nn.Module  # the trained model, unwrapped (PEFT model for adapters)


@dataclass
class RunState:
    """One run, as setup builds it and the loop and finish use it. `progress.step` counts optimizer steps done."""

    cfg: RunConfig
    accelerator: object
    preemption: object  # supervise.Preemption: the signal, if one came
    model_cfg: ModelConfig  # where the base was loaded from (a RAM copy, maybe)
    tokenizer: object
    data: Datasets
    schedule: Schedule
    processor: object = None  # a vision-language model's (AutoProcessor): pictures to pixels; saved beside the adapter
    engine: Engine = None  # model, optimizer, scheduler and checkpoint layout of the strategy
    row_share: RowShare = field(default_factory=RowShare)  # the processes that share each row (sequence or tensor parallel), if any
    base: str = ""  # the base model as the saved adapter names it
    teacher: tuple[ModelConfig, str | None] | None = None  # distillation: the teacher's base and the adapter merged into it
    objective: Objective = field(default_factory=SFT)  # what a step minimises (train.objective)
    router_coef: float = 0.0
    rss_before_model: int = 0
    anonymous_before_model: int = 0
    peak_rss_since: str = ""  # when peak_rss_mib counts from: the kernel may refuse to reset the peak
    before: dict | None = None  # exact match on eval prompts before training
    background: bool = False  # checkpoints written in the background
    log: RunLog | None = None
    guard: Guard | None = None
    watchdog: Watchdog | None = None
    start_step: int = 0  # where this start of the run began (a resumed step, or 0)
    progress: Progress = field(default_factory=Progress)  # progress.step: optimizer steps done
    last: dict = field(default_factory=dict)  # the last logged step's metrics
    started: float = 0.0
    last_save: float = 0.0

    @property
    def out(self) -> Path:
        return Path(self.cfg.train.output_dir)

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    def say(self, message: str) -> None:
        if self.main:
            print(message)


@dataclass
class StepOutcome:
    epoch: int
    loss: float  # mean over the step's trained tokens, all ranks
    grad_norm: float
    verdict: Verdict
    moved: bool  # the weights moved (also where DeepSpeed stepped before the guard's verdict to skip)
    real_tokens: int  # non-padding tokens of the step, all ranks
    router_loss: float | None  # MoE: the router's auxiliary loss, mean over the step's forwards
    preempted: bool  # a rank has been signalled: save and stop
    time_due: bool  # checkpoint.save_every_minutes has passed
    metrics: dict[str, float]  # the objective's own (preference: rewards, margin, accuracy), means over the step's pairs
    samples: list[int] | None = None  # logging.sample_ids: the samples the step trained, all ranks', sorted


def logged(state: RunState, steps_done: int) -> bool:
    """Whether the step that makes `steps_done` writes a metrics row."""
    return steps_done % state.cfg.logging.log_every == 0 or steps_done == state.schedule.total_steps


def skipped(state: RunState) -> list[list[int]]:
    """The data windows steps skip: the guard's rollbacks' and train.skip_data."""
    return state.guard.state.skip_windows + [list(w) for w in state.cfg.train.skip_data]


def evaluate(state: RunState, step: int) -> dict | None:
    """The eval split's loss (and the objective's figures) at `step`, logged; None without an eval split."""
    if not state.data.eval:
        return None
    cfg = state.cfg
    result = eval_loss(state.engine.model, state.data.eval, cfg.train.micro_batch_size, state.tokenizer.pad_token_id, state.accelerator, cfg.eval.max_batches,
                       state.objective, state.row_share, state.tokenizer)
    state.log.write({"step": step, **result})
    state.log.print(f"step {step}: {state.objective.eval_line(result)}")
    return result
