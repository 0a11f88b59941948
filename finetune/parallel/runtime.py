"""The process around a run: what the launcher asked for, the process group after an elastic
restart and at the end, the CPU heap, and resident memory. No training happens here."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import os
import re
import sys
from pathlib import Path

import torch

from finetune.config.errors import Hung, UserError
from finetune.config.schema import RunConfig
from finetune.config.strategy import NAMES
from finetune.parallel import network

# A quantized base's dequantized weights from this size on come from fresh mappings on CPU runs
# (keep_freed_memory): freed, they leave no hole in the heap.
MAPPED_FROM = 64 << 20


def glibc_tuned_by_user() -> bool:
    """glibc's MALLOC_* variables set: finetune leaves the heap to them (keep_freed_memory)."""
    return any(key.startswith("MALLOC_") for key in os.environ)


def make_accelerator(cfg: RunConfig):
    """The run's Accelerator: the launcher's process group (rank 0's store checked first), mixed precision
    where the strategy's engine autocasts, fp8 through torchao's recipe, the trackers."""
    from accelerate import Accelerator

    mp = cfg.train.mixed_precision
    cuda = torch.cuda.is_available()
    if cfg.train.tf32 and cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    flag = launcher_strategy(cfg)
    if flag:
        os.environ[flag] = "false"  # the strategy agrees: finetune applies it, not accelerate's plugin
    network.check_store()  # rank 0's store answers, before the process group waits on it
    join_restarted_workers()
    from finetune.parallel.engines import engine_class  # the model layer behind it: not for what plan reads here

    if not engine_class(cfg, int(os.environ.get("WORLD_SIZE", "1")))[0].autocast:  # launchers set WORLD_SIZE
        mp = "no"
    from accelerate.utils import InitProcessGroupKwargs

    handlers = [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=cfg.distributed.collective_timeout))]
    if mp == "fp8" and importlib.util.find_spec("torchao"):
        from accelerate.utils import AORecipeKwargs
        from torchao.float8 import Float8LinearConfig

        # Rowwise scaling: a scale per token. One scale per tensor (accelerate's default) lets the largest
        # activation of a packed row set every sample's precision: the packed-row check saw a sample's
        # logits move 6% towards the previous sample's context (docs/platform-notes.md). Rowwise takes no
        # FSDP float8 all-gather, which only made weights that safetensors cannot save; fp8 runs unsharded.
        # pad_inner_dim: a micro-batch's token count is rarely a multiple of 16, and the weight gradient's
        # matmul runs over tokens.
        rowwise = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), pad_inner_dim=True)
        handlers.append(AORecipeKwargs(config=rowwise))
    return Accelerator(mixed_precision=mp, cpu=not cuda, log_with=list(cfg.logging.report_to) or None, project_dir=cfg.train.output_dir,
                       kwargs_handlers=handlers)


COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting \d+ ?ms for \w+ operation|collective operation timeout|before timing out")


def timed_out(err: RuntimeError, seconds: float, log, step: int) -> Hung | None:
    """A collective that waited past distributed.collective_timeout as the run's one line (exit 4, the event written), or
    None for any other error (a DataLoader's or a socket's timeout among them). The words are the backends' own: gloo's
    "Timed out waiting 15000ms for recv operation", NCCL's watchdog "caught collective operation timeout ... ran for N
    milliseconds before timing out"."""
    text = str(err)
    if not COLLECTIVE_TIMEOUT.search(text):
        return None
    message = (f"a collective waited over distributed.collective_timeout ({seconds:g} s) for another process at step {step + 1} (a stuck "
               f"peer or a lost link: {text.strip().splitlines()[-1][:160]}); the checkpoints saved are intact, the same command resumes")
    log.event("hang", step, f"rank {os.environ.get('RANK', '0')}: {message}", any_rank=True)
    return Hung(message)


def launcher_strategy(cfg: RunConfig) -> str | None:
    """An accelerate config that asks for FSDP or DeepSpeed must agree with the run config: never a
    silent fall-back to DDP. finetune applies the strategy itself: returns the environment flag that
    switches accelerate's own plugin off once the two agree (None where none was asked for)."""
    env = os.environ
    asked = None
    if env.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        asked, flag = "fsdp", "ACCELERATE_USE_FSDP"
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
        offload = any(env.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{k}_DEVICE", "none") not in ("", "none") for k in ("OPTIMIZER", "PARAM"))
        asked, flag = f"zero{stage}" + ("_offload" if offload else ""), "ACCELERATE_USE_DEEPSPEED"
    if asked is None:
        return None
    if cfg.distributed.strategy != asked:
        offered = [name for name in NAMES if name != "none"]
        fix = f"set distributed.strategy: {asked}" if asked in offered else f"use an accelerate config for one of: {', '.join(offered)}"
        raise UserError(f"accelerate config asks for {asked} but the run config has distributed.strategy: {cfg.distributed.strategy}; "
                        f"{fix} (finetune applies the strategy itself)")
    return flag


def join_restarted_workers() -> None:
    """After torchrun restarts its workers, join them through a store prefix of their own.

    Seen with torch 2.13 + gloo (docs/platform-notes.md): restarted workers read the dead workers'
    addresses, left in the agent's store under the same keys, and fail or hang in connectFullMesh.
    A prefix per restart keeps every attempt's keys apart. accelerate then adopts this group.
    """
    import torch.distributed as dist

    restart, world = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if restart == 0 or world == 1 or dist.is_initialized() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    from datetime import timedelta

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timedelta(minutes=10))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=dist.PrefixStore(f"finetune/restart-{restart}/", store),
                            rank=int(os.environ["RANK"]), world_size=world)


def finish_distributed(accelerator) -> None:
    """Every rank waits for the others, then the process group goes. Called before accelerate's
    end_training, which would tear the group down without waiting (a rank with nothing to save would
    leave while the main one still writes). The rank's exit itself is `cli.exit_rank`."""
    if torch.distributed.is_initialized():
        accelerator.wait_for_everyone()
        torch.distributed.destroy_process_group()


def stop_together(timeout_s: float = 30.0) -> None:
    """A rank that stops the run (the guard, a preemption: every rank stops at the same step) waits up
    to `timeout_s` for the others to stop too before it exits: torchrun SIGTERMs the rest as soon as one
    rank exits non-zero, and a slower rank then never says why it stopped. Gloo's monitored barrier
    gives up after the timeout; under NCCL a barrier could hang on a rank that went on, so none is taken."""
    import datetime

    dist = torch.distributed
    if dist.is_initialized() and dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError:
            pass  # a rank did not come: exit all the same


# From this many tokens a micro-batch per process, blocks of 1 MiB and more are mapped and handed back when freed on CPU
# runs (keep_freed_memory), as under FSDP/ZeRO-3; the plan then counts no heap row.
LONG_ROWS = 4096


def keep_freed_memory(gathers: bool = False, quantized: bool = False, long_rows: bool = False) -> None:
    """CPU runs: tune glibc's heap for the allocations a training step repeats.

    One process or DDP: keep freed memory for reuse instead of returning it to the kernel. A step
    allocates and frees the same large activations every time; served by mmap, each comes back as
    fresh pages whose first touch faults: on the VMs measured (docs/platform-notes.md) that made large
    elementwise ops 4-8x slower than on reused memory, and a QLoRA step of a 1.1B model 1.4x slower.
    A quantized base (quantized) dequantizes each weight for its matmul and frees it; the small
    tensors kept between layers split those blocks, and at 8B widths (224 MiB in fp32) the heap grew by
    several GB, not in proportion to the layers: an 8-layer model held 11.5 GB instead of 7.5, and the
    32-layer one was killed for memory at 23.6 GB. Blocks of MAPPED_FROM and more then come from fresh
    mappings and go back when freed: the 32-layer run trained at a 15.7 GB peak, 152 s a step (the
    8-layer one: 1.28x the step time); smaller models' weights stay under it.
    FSDP and ZeRO-3 (gathers): there the gathered layers and the small tensors saved between them
    fragment a heap (glibc's default raises its mmap threshold to the largest block freed, up to 32 MB),
    so blocks of 1 MiB and more come from mmap and go back when freed: a 1.1B LoRA rank then peaked
    at 3.9 GB under FSDP (4.6 with the defaults, 12.5 with the tuning above) and 4.0 GB under ZeRO-3
    (5.8), within the plan (that setting is made before loading too: map_large_blocks). Long rows
    (long_rows: LONG_ROWS tokens and more a micro-batch per process) likewise: a row of 6,208 tokens
    through two layers of the 1.1B model's widths held 4,970 MiB with the tuning for speed and 2,186
    with this one, for 1.12x the step time (bench/long.py, docs/platform-notes.md). Set just
    before the loop, after what loading freed is handed back (always), so RSS then tracks what
    training holds; left alone when the user set glibc's MALLOC_* variables (their choice wins).
    """
    libc = _libc()
    if libc is None:
        return
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)  # what loading freed goes back first, whatever the settings
    if gathers or long_rows:
        map_large_blocks()
    elif _ours_to_tune(libc):
        if quantized:  # as MALLOC_MMAP_THRESHOLD_ sets it: fixed (glibc no longer raises it as blocks are freed)
            libc.mallopt(M_MMAP_THRESHOLD, MAPPED_FROM)
            return
        libc.mallopt(M_MMAP_MAX, 0)  # large blocks from the heap, not from fresh mmaps
        libc.mallopt(M_TRIM_THRESHOLD, 2**30 - 1)  # do not hand freed heap back (which would fault again)


def map_large_blocks() -> None:
    """FSDP/ZeRO-3 on a CPU, from before loading on (see keep_freed_memory): blocks of 1 MiB and more
    come from mmap and go back when freed, at a fixed threshold that glibc no longer raises as large
    blocks are freed. Loading a 1.1B model under ZeRO-3 (weight after weight converted and partitioned)
    with glibc's default left a rank ~0.8 GB above its training peak."""
    libc = _libc()
    if libc is not None and _ours_to_tune(libc):
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # mallopt's parameters (malloc.h)


def _libc():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name and sys.platform.startswith("linux") else None


def _ours_to_tune(libc) -> bool:
    """glibc's heap on a CPU run, unless the user set glibc's MALLOC_* variables (their choice wins)."""
    return not torch.cuda.is_available() and not glibc_tuned_by_user() and hasattr(libc, "mallopt")


def _proc_status(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def current_rss() -> int:
    """Resident memory of this process now, in bytes (Linux; 0 elsewhere)."""
    return _proc_status("VmRSS")


def current_anonymous() -> int:
    """Anonymous resident memory of this process now (RSS less mapped files' pages, which the kernel can drop), bytes."""
    return _proc_status("RssAnon")


def peak_rss() -> int:
    """Highest resident memory since the last reset_peak_rss(), in bytes (Linux; 0 elsewhere)."""
    return _proc_status("VmHWM")


def peak_gpu() -> int | None:
    """Most GPU memory this process's tensors held since the last reset_peak_rss(), in bytes; None without CUDA."""
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def reset_peak_rss() -> bool:
    """Start measuring the peaks afresh (excludes loading transients, such as quantizing a checkpoint).
    False where the kernel would not reset the RSS peak (not Linux, or /proc/self/clear_refs refused):
    peak_rss() then counts from the process's start, loading included."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
