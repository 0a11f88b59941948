"""`finetune plan --simulate`: rank 0's own training step at N processes, run on fake tensors.

torch's `FakeTensorMode` gives every tensor its shape, dtype and device but no storage, and the `fake`
process group answers every collective at once, so this machine can take rank 0 of an N-process run
(FSDP2, DDP, or one process) through finetune's own setup (the model built as `finetune train` builds it, the
adapter, the sharding, the optimizer) and one optimizer step (a micro-batch through the packed attention and the
loss, backward, the optimizer's step) for a model of any size, in seconds to minutes and without its
weights. torch's `MemTracker` (`FSDPMemTracker` under FSDP2: what torchtitan's memory estimator uses) records what the
rank holds at its peak, by role, and the collectives it calls are counted as they pass.

The simulated batch is the planner's worst case: micro_batch_size rows of max_seq_len tokens, one sample
a row, every token trained (a preference objective: one pair a row, each answer after a one-token prompt). One
micro-batch a step: memory is the same with more, and the collectives of grad_accum micro-batches repeat the
gathers of one.

The step is a later one, and its micro-batch not the first: the optimizer's states exist, and gradients
accumulated from an earlier micro-batch, as in every step after the first.

Simulated: one process (distributed.strategy none: torch's `MemTracker`), DDP (its reducer runs on no fake tensor: its
buckets, a copy of every trained gradient, and their all-reduce are counted beside the step, not run) and FSDP (FSDP2:
the tracker follows its modules); LoRA, DoRA or full, on a bf16 or torchao NF4 base (quantized once the adapter is on, or
layer by layer as finetune shards it); the SFT loss, the preference pairs'
(DPO with its reference: the adapter switched off, or under full fine-tuning a frozen copy sharded as the policy; ORPO,
CPO, SimPO), KTO's (one example a row, the reference's and the mismatched pairs' forwards without gradients), GRPO's
training step (its group rows of the longest prompts and completions; the KL term's reference forward), and
distillation's (the teacher sharded as the policy, its forward and the divergence); a mixture of experts with each
expert taking an equal share of the routed tokens; tensor parallelism's split layers on the 2-D mesh.
Not simulated, each refused in one line: ZeRO (DeepSpeed's engine does not run on fake tensors: bench/scale.py checks
the plan against DeepSpeed's own estimator), a bitsandbytes base (its kernels take no fake tensors), sequence
parallelism, expert parallelism, GRPO's environment episodes, and distillation's on-policy, sequence-level, cross-tokenizer or
quantized-teacher variants. GRPO's sampling (its key/value cache, a moment of the plan's) is not simulated: the step is.
A reward model's step (its score head) is refused too. Loading (the plan's `loading:` line)
is not simulated either: the simulation starts from the model as placed.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

from finetune.config.errors import UserError
from finetune.config.schema import PRECISIONS, RunConfig
from finetune.model import experts, nf4
from finetune.model.loading import DTYPES, adapter_input_casting_off, apply_adapter, load_model, quantize_layers
from finetune.objectives.loss import to_device
from finetune.parallel import tensor_parallel
from finetune.parallel.distributed import fsdp_settings, shard_fsdp2, shard_layers
from finetune.parallel.engines import trained
from finetune.parallel.optim import build_optimizer

# FSDPMemTracker's roles -> the words the plan uses
ROLES = {"PARAM": "weights", "GRAD": "gradients", "OTH": "other",  # MemTracker's (one process, DDP), then FSDPMemTracker's
         "SHARDED_PARAM": "weights (this rank's shards)", "UNSHARDED_PARAM": "weights gathered for compute", "BUFFER": "buffers",
         "SHARDED_GRAD": "gradients (shards)", "UNSHARDED_GRAD": "gradients before reduce-scatter", "ACT": "activations",
         "TEMP": "temporaries", "ALL_GATHER": "all-gather buffers", "REDUCE_SCATTER": "reduce-scatter buffers", "OPT": "optimizer states",
         "INP": "inputs"}


BUCKETS = "DDP's buckets (counted, not run)"
NOT_TENSORS = ("CUDA context + allocator slack", "process runtime (CPU)")  # the plan's rows that no tensor fills
# The plan's rows and the tracker's roles that hold the same tensors (the plan counts full fine-tuning's unsharded
# gradients, and their fp32 copies for the reduce-scatter, with what is gathered)
BY_ROLE = {"weights": (("weights", "reference model", "distill teacher weights", "vision tower + projector"),
                       ("weights", "weights (this rank's shards)", "buffers")),
           "gathered": (("gathered for compute",), ("weights gathered for compute", "all-gather buffers", "gradients before reduce-scatter",
                                                   "reduce-scatter buffers")),
           "gradients": (("gradients", "gradient buckets (DDP)"), ("gradients", "gradients (shards)", BUCKETS)),
           "optimizer states": (("optimizer states",), ("optimizer states",)),
           "activations": (("activations", "dense weight temporaries", "distill teacher outputs", "vision tower activations"),
                           ("activations", "temporaries", "inputs"))}
PAIRS = ("dpo", "orpo", "cpo", "simpo")  # the preference objectives whose step is simulated (objectives.objective.Preference)


@dataclass
class Simulated:
    devices: int
    peak: dict[str, float]  # bytes rank 0 holds at its peak, by role (ROLES' words)
    total: float
    collectives: dict[str, tuple[int, float]]  # collective -> (calls, bytes this rank sends in them)
    seconds: float

    @property
    def moved(self) -> float:
        """Bytes each rank sends, as the planner counts them."""
        return sum(size for _, size in self.collectives.values())


def refusal(cfg: RunConfig, devices: int) -> str | None:
    strategy = cfg.distributed.strategy
    if strategy not in ("none", "ddp", "fsdp") or (strategy == "fsdp" and devices < 2) or (strategy == "none" and devices > 1):
        return "simulates one process (--strategy none), DDP or FSDP over 2 or more devices (--strategy ddp|fsdp --gpus N); not DeepSpeed's ZeRO"
    if cfg.model.quantization is not None and not nf4.used(cfg.model):
        return ("a bitsandbytes base is not simulated (its kernels take no fake tensors): set model.quantization.backend torchao "
                "(FSDP's auto) to simulate a 4-bit base")
    if cfg.distributed.sequence_parallel > 1:
        return "sequence parallelism is not simulated yet"
    if cfg.distributed.expert_parallel > 1:
        return "expert parallelism is not simulated (its all-to-alls are planned: finetune plan --bandwidth)"
    if cfg.train.objective == "reward":
        return "a reward model's step (its score head) is not simulated"
    if cfg.train.objective == "grpo" and cfg.grpo.environment:
        return "simulates GRPO's single-turn step; an environment's episodes (grpo.environment) are not simulated"
    d = cfg.distill
    if cfg.train.objective == "distill" and (d.lmbda or d.sequence_level or d.cross_tokenizer or d.teacher_quantization):
        return ("simulates distillation on the data's answers by a teacher of the student's tokenizer, loaded unquantized; not "
                "distill.lmbda, sequence_level, cross_tokenizer or teacher_quantization")
    return None


def simulate(cfg: RunConfig, devices: int, fake: bool = True) -> Simulated:
    """One step of rank 0 of `devices` FSDP2 processes (see the module's docstring). fake=False takes the
    same step on real (uninitialized) tensors in a process group already started, each rank its own:
    what the tests hold the simulation to."""
    why = refusal(cfg, devices)
    if why:
        raise UserError(f"--simulate: {why}")
    sharded, started = cfg.distributed.strategy == "fsdp", time.perf_counter()
    with _fake_group(devices) if fake and sharded else contextlib.nullcontext(), warnings.catch_warnings():
        # torchao's NF4 reads its storages' addresses, which fake tensors do not have (nor need here)
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        settings = fsdp_settings(cfg, "cpu", devices) if sharded else {}  # the mesh reads its tensor back: made before the fake mode
        split = settings.pop("tensor_parallel", None)
        model = load_model(cfg.model, skeleton="meta", say=lambda _: None)
        model = apply_adapter(model, cfg.adapter, cfg.train.gradient_checkpointing, say=lambda _: None)
        batch = {"kto": _unpaired, "grpo": _groups}.get(cfg.train.objective, _pairs if cfg.train.objective in PAIRS else _batch)(cfg, model.config.vocab_size)
        beside = _frozen(cfg)
        step = _step_loss(cfg, batch, beside)  # its counts read the batch's data: before the fake mode
        if split is not None:  # on the meta device, before the fake mode: FSDP2 makes the 2-D mesh's DTensor specs, which read it back
            tensor_parallel.parallelize(model, split)
            shard_layers(model, settings)
        with _TrainedPositions(int(batch["keep"].sum()), allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            _to_empty(model)  # rank 0's model as loaded
            if beside is not None:
                _to_empty(beside)
            tracker, optimizer = _placed(model, beside, cfg, devices, settings, split, fake, sharded)
            counted = _Collectives(settings["mesh"].size() if sharded else 1, split.size() if split else 1)
            # balanced: fake tensors hold no router choices; peft's adapter inputs uncast under bf16, as train.py runs the step
            with tracker, counted, experts.balanced_routing(), _autocast(cfg, sharded), adapter_input_casting_off(model, cfg.train.mixed_precision):
                _forward_again(model, tracker)  # inside: the tracker puts FSDP's own hooks first as it starts
                step(model).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    by_role = {ROLES[str(role).rsplit(".", 1)[-1]]: float(size) for role, size in peak.items() if role != "Total" and size}
    total, calls = float(peak["Total"]), counted.calls
    if cfg.distributed.strategy == "ddp":  # its reducer runs on no fake tensor: a bucket for every trained gradient, all-reduced
        buckets = sum(p.numel() * p.element_size() for p in trained(model))
        by_role[BUCKETS], total = buckets, total + buckets
        calls["all_reduce"] = (1, 2 * (devices - 1) / devices * buckets)
    return Simulated(devices, by_role, total, calls, time.perf_counter() - started)


def _placed(model, beside, cfg: RunConfig, devices: int, settings: dict, split, fake: bool, sharded: bool):
    """The model placed as training places it, the optimizer midway through the run, and the memory tracker over
    them: FSDP's sharded (each layer quantized first where the base is 4-bit), or one process's whole model (its
    4-bit parts quantized once the adapter is on, as engines.Engine.prepare does); `beside` (DPO's frozen copy, the
    teacher) as the policy."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed._tools.mem_tracker import MemTracker

    if not sharded and nf4.after_adapter(cfg.model):
        quantize_layers(model, cfg.model)
    elif sharded and nf4.used(cfg.model):  # each layer quantized, then sharded, as in training
        model = shard_fsdp2(model, cfg, torch.device("cpu"), devices, settings=settings)
    elif sharded and split is None:  # sharded as in training; sending rank 0's values (data-dependent: not under fake tensors) left out
        shard_layers(model, settings)
    if beside is not None and sharded:  # DPO's frozen copy or the teacher, sharded as the policy (engines.FSDP.reference)
        shard_layers(beside, settings)
    optimizer = build_optimizer(trained(model), cfg.train)
    if fake:
        _one_tensor_at_a_time(optimizer)
    _midway(optimizer, trained(model))
    if not sharded:
        tracker = MemTracker()
        tracker.track_external(*(m for m in (model, optimizer, beside) if m is not None))
        # It hooks every parameter's gradient, which torch refuses on a frozen one: those are marked as hooked already
        for param in (p for m in (model, beside) if m is not None for p in m.parameters() if not p.requires_grad):
            tracker._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
        return tracker, optimizer
    tracker = FSDPMemTracker(model, optimizer)
    if beside is not None:  # its shards, made before the tracker, among this rank's (FSDPMemTracker's track_external does nothing)
        for param in beside.parameters():
            tracker._update_and_maybe_create_winfos(param._local_tensor, _FSDPRefType.SHARDED_PARAM)
    return tracker, optimizer


def _autocast(cfg: RunConfig, sharded: bool):
    """One process or DDP compute in train.mixed_precision under accelerate's autocast (FSDP2 casts the weights itself)."""
    mp = cfg.train.mixed_precision
    if sharded or mp not in ("bf16", "fp16"):
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=DTYPES[PRECISIONS[mp]])


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def _to_empty(model: torch.nn.Module) -> None:
    """Room for the model's tensors on the CPU (fake ones, under the fake mode), a tied head tied again: `to_empty` makes a
    parameter of its own for each module's (the simulation once gathered and reduced Llama-3.2-1B's embedding twice)."""
    model.to_empty(device="cpu")
    model.tie_weights()


def _midway(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    """Make the step a later one, and its micro-batch not the first: the optimizer's states made (by a
    step), and gradients accumulated from an earlier micro-batch, as every step after the first holds them."""
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()


def _one_tensor_at_a_time(optimizer: torch.optim.Optimizer) -> None:
    """Fake tensors have no fused AdamW kernel: its fallback made ten times the states' size of temporaries
    (docs/platform-notes.md). Stepped one tensor at a time, the same states hold no more than one tensor's
    temporaries, as the fused kernel does."""
    for group in optimizer.param_groups:
        if "fused" in group:
            group.update(fused=False, foreach=False)


def _batch(cfg: RunConfig, vocab: int) -> dict[str, torch.Tensor]:
    """micro_batch_size rows of max_seq_len tokens, one sample a row, every token trained; moved as the
    loop moves a batch (the sample bounds and trained positions worked out here, on real tensors)."""
    rows, length = cfg.train.micro_batch_size, cfg.data.max_seq_len
    ids = torch.randint(0, vocab, (rows, length))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(length).repeat(rows, 1),
             "keep": torch.ones(rows, length, dtype=torch.bool), "targets": ids.flatten()}
    return to_device(batch, "cpu")


def _pairs(cfg: RunConfig, vocab: int) -> dict[str, torch.Tensor]:
    """micro_batch_size rows of max_seq_len tokens, each a preference pair (packing.Split's layout: prompt + chosen answer,
    then prompt + rejected answer, positions restarting), every answer token trained after a one-token prompt."""
    rows, half = cfg.train.micro_batch_size, cfg.data.max_seq_len // 2
    ids = torch.randint(0, vocab, (rows, 2 * half))
    labels = ids.clone()
    labels[:, [0, half]] = -100  # each sequence's prompt
    return to_device({"input_ids": ids, "labels": labels, "position_ids": torch.arange(half).repeat(rows, 2)}, "cpu")


def _unpaired(cfg: RunConfig, vocab: int) -> dict[str, torch.Tensor]:
    """KTO's micro-batch (packing.Unpaired's layout): micro_batch_size rows of max_seq_len tokens, one example each, every
    completion token trained after a one-token prompt, desirable and not in turn; the mismatched pairs its reference point
    is taken on as long."""
    rows, length = cfg.train.micro_batch_size, cfg.data.max_seq_len
    batch = {}
    for prefix in ("", "kl_"):
        ids = torch.randint(0, vocab, (rows, length))
        labels = ids.clone()
        labels[:, 0] = -100
        batch.update({f"{prefix}input_ids": ids, f"{prefix}labels": labels, f"{prefix}position_ids": torch.arange(length).repeat(rows, 1)})
    return to_device({**batch, "desirable": torch.arange(rows) % 2 == 0}, "cpu")


def _groups(cfg: RunConfig, vocab: int) -> dict[str, torch.Tensor]:
    """GRPO's training micro-batch (grpo.group_row's layout): micro_batch_size rows, each a prompt's num_generations sequences
    of the longest prompt (max_seq_len) and completion (max_completion_length), positions restarting, every completion token
    trained; each completion's advantage and reward columns."""
    g, rows, prompt = cfg.grpo, cfg.train.micro_batch_size, cfg.data.max_seq_len
    length, n = prompt + g.max_completion_length, cfg.train.micro_batch_size * g.num_generations
    ids = torch.randint(0, vocab, (rows, g.num_generations * length))
    labels = ids.clone()
    labels.view(rows, g.num_generations, length)[:, :, :prompt] = -100
    columns = {"advantages": torch.randn(n), "rewards": torch.zeros(n, 0), "reward": torch.zeros(n), "reward_std": torch.ones(n),
               "zero_std": torch.zeros(n)}
    return to_device({"input_ids": ids, "labels": labels, "position_ids": torch.arange(length).repeat(rows, g.num_generations), **columns}, "cpu")


def _frozen(cfg: RunConfig) -> torch.nn.Module | None:
    """The frozen model beside the policy, on the meta device: DPO's reference under full fine-tuning (a copy of the base),
    distillation's teacher (read as training reads it: model/teacher.teacher_source); None where there is none."""
    from finetune.model.teacher import frozen, teacher_source

    if cfg.needs_reference:
        return frozen(load_model(cfg.model, skeleton="meta", say=lambda _: None))
    if cfg.train.objective == "distill":
        teacher, _ = teacher_source(cfg.distill.teacher, cfg.model, None, sharded="fsdp", across=True)  # no tokenizer read: not compared
        return frozen(load_model(teacher, skeleton="meta", say=lambda _: None))
    return None


def _step_loss(cfg: RunConfig, batch: dict[str, torch.Tensor], frozen: torch.nn.Module | None):
    """The micro-batch's loss as the loop computes it: SFT's, distillation's against the teacher, KTO's, GRPO's over its group
    rows, or the preference objective's over the batch's pairs (`frozen`: the reference or the teacher, if any)."""
    from finetune.objectives.distill import Distill
    from finetune.objectives.grpo import GRPO
    from finetune.objectives.objective import KTO, SFT, Preference

    if cfg.train.objective == "grpo":
        objective = GRPO(cfg.grpo, [], cfg.train.seed, reference=frozen)
    elif cfg.train.objective == "distill":
        objective = Distill(cfg.distill, cfg.train.seed, synced=True, teacher=frozen)
    elif cfg.train.objective == "kto":
        objective = KTO(cfg.preference, frozen)
    elif cfg.train.objective in PAIRS:
        objective = Preference(cfg.train.objective, cfg.preference, frozen)
    else:
        objective = SFT()
    totals = objective.counts(batch)
    return lambda model: objective.losses(model, batch, totals).tokens


def _forward_again(model: torch.nn.Module, tracker) -> None:
    """DPO's reference with an adapter is the policy's own model called again (adapters off), which FSDPMemTracker takes
    for the next step's forward and refuses: its per-module stats are cleared first (the step's peak is kept apart)."""
    calls = []

    def again(module, args):
        if calls:
            tracker.reset_mod_stats()
        calls.append(1)

    model.register_forward_pre_hook(again, prepend=True)


@contextlib.contextmanager
def _fake_group(devices: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UserError("--simulate: run it outside a launched job (it starts a process group of its own)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=devices)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _TrainedPositions(FakeTensorMode):
    """Fake tensors whose `nonzero` answers `count` elements (no data to count): the loss and the head select the
    trained positions with the batch's mask (made on real tensors, then faked), so that is its true size. An op on the
    batch's real tensors alone runs for real: the objectives read their pairs from the batch's data (where each answer
    starts), which fake tensors do not have."""

    def __init__(self, count: int, **kwargs):
        super().__init__(**kwargs)
        self.count = count

    def _dispatch_impl(self, func, types, args, kwargs):
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and all(type(t) is torch.Tensor and t.device.type != "meta" for t in tensors):  # plain, real ones (no DTensor)
            with no_dispatch():
                return func(*args, **kwargs)
        if func is torch.ops.aten.nonzero.default:
            mask = args[0]
            return super()._dispatch_impl(torch.ops.aten.empty.memory_format, types, ((min(self.count, mask.numel()), mask.dim()),),
                                          {"dtype": torch.long, "device": mask.device})
        return super()._dispatch_impl(func, types, args, kwargs)


class _Collectives(TorchDispatchMode):
    """Each collective called, with the bytes this rank sends in it (ring collectives): FSDP2's c10d ones over the
    `shards` processes sharding the weights ((n-1)/n of an all-gather's output or a reduce-scatter's input); DTensor's
    functional all-reduces over the `split` processes of tensor parallelism (2 (n-1)/n of the tensor)."""

    def __init__(self, shards: int, split: int = 1):
        super().__init__()
        self.calls: dict[str, tuple[int, float]] = {}
        self.shards, self.split = shards, split

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "c10d" and ("gather" in name or "scatter" in name or "reduce" in name):
            whole = args[1] if "reduce_scatter" in name else args[0]
            self._count(name, whole[0] if isinstance(whole, (list, tuple)) else whole, (self.shards - 1) / self.shards)
        elif func.namespace == "_c10d_functional" and name == "all_reduce":
            self._count("tensor_parallel_all_reduce", args[0], 2 * (self.split - 1) / self.split)
        return func(*args, **(kwargs or {}))

    def _count(self, name: str, whole: torch.Tensor, share: float) -> None:
        calls, size = self.calls.get(name, (0, 0.0))
        self.calls[name] = (calls + 1, size + share * whole.numel() * whole.element_size())


def render(sim: Simulated, plan, planned_bytes: float) -> str:
    """The simulated peak by role beside the plan's total and roles, and the collectives beside the plan's formula.
    `plan`: outputs.plan's Plan for the same setup; `planned_bytes`: its step_time's bytes each device moves."""
    unit, scale = ("GiB", 2**30) if sim.total >= 2**30 else ("MiB", 2**20)
    rows = [f"| {role:<32} | {size / scale:9.2f} |" for role, size in sorted(sim.peak.items(), key=lambda item: -item[1])]
    tensors = plan.total - sum(plan.rows.get(row, 0.0) for row in NOT_TENSORS)
    lines = [f"simulated: rank 0 of {sim.devices} processes, one step on fake tensors ({sim.seconds:.0f} s here)", "",
             f"| {'at its peak':<32} | {unit:>9} |", f"| {'-' * 32} | {'-' * 9} |", *rows, f"| {'total':<32} | {sim.total / scale:9.2f} |", "",
             f"plan: {tensors / scale:.2f} {unit} of tensors per device at {plan.moment}; simulated {sim.total / scale:.2f} {unit} "
             f"({_apart(sim.total, tensors)})",
             "by role, planned / simulated: " + "; ".join(f"{role} {ours / scale:.2f} / {theirs / scale:.2f}" for role, (ours, theirs) in
                                                         by_role(sim, plan).items()),
             f"collectives per device and step (one micro-batch): simulated {sim.moved / 1e9:.3g} GB, planned {planned_bytes / 1e9:.3g} GB "
             f"({_apart(sim.moved, planned_bytes)}); " + ", ".join(f"{name.strip('_')} x{calls}" for name, (calls, _) in sorted(sim.collectives.items()))]
    return "\n".join(lines)


def by_role(sim: Simulated, plan) -> dict[str, tuple[float, float]]:
    """(planned, simulated) bytes of each role at the peak (BY_ROLE's words)."""
    return {role: (sum(plan.rows.get(row, 0.0) for row in ours), sum(sim.peak.get(row, 0.0) for row in theirs))
            for role, (ours, theirs) in BY_ROLE.items()}


def _apart(simulated: float, planned: float) -> str:
    return f"{(simulated - planned) / planned:+.0%} against the plan" if planned else "nothing planned"
