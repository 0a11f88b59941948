"""Checkpoints: atomic, verified, and enough to resume a run exactly.

A checkpoint is a folder `OUTPUT/checkpoints/step-NNNNNN` holding the trained weights
(safetensors), optimizer and scheduler states, every rank's RNG states, the trainer state (step,
tokens, guard state) and the resolved config. The weights and optimizer state of a sharded run are
written by every rank in its engine's format instead: `sharded/` (torch.distributed.checkpoint,
FSDP), which any world size can load, or `deepspeed/` (ZeRO), which loads at the same world size.
It is written under a temporary name, fsynced, given a manifest of every file's size and sha256,
and only then renamed into place: a folder with that name and a matching manifest is complete;
anything else is skipped (and reported) when resuming.

A checkpoint can be written in the background (`checkpoint.async_save`; not for ZeRO). Unsharded,
a writer thread on rank 0 first copies the trained weights and optimizer state to host memory while
training computes its next forward and backward (`staged()`, called before each optimizer step,
waits for that copy), then writes, fsyncs, hashes, adds the manifest last and renames; under FSDP every
rank hands its shards to DCP's `async_save` (its own gloo group, so that its collectives never meet
training's), and rank 0's writer waits for DCP to finish (all ranks' files written and synced) before
the rest. One save is in flight at a time; `wait()` blocks on it (the next save, a rollback,
preemption and the end of the run call it), so a kill mid-write leaves a folder without a manifest
that resuming skips.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from finetune.config import CONFIG_FILE
from finetune.diskio import HashedFile, sha256_file, write_safetensors

MANIFEST = "manifest.json"
WEIGHTS = "trainable.safetensors"
SHARDED = "sharded"
DEEPSPEED = "deepspeed"
CHECKPOINTS = "checkpoints"  # under a run's output_dir
STEP = "step-"  # a checkpoint folder's name: STEP + the step, six digits


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------
# RNG states: plain tensors and lists only, so they load with torch.load(weights_only=True).


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------------
# Saving

_writer: threading.Thread | None = None  # the background save in flight (rank 0)
_staged = threading.Event()  # set while no background save still needs the live weights and optimizer state
_staged.set()
_writer_error: list[BaseException] = []
_shards_written = None  # DCP's future for this rank's shards of the save in flight
_dcp_group = None  # the gloo group DCP's background collectives use


def wait() -> None:
    """Block until the background save in flight, if any, is complete; raise what made it fail."""
    global _writer, _shards_written
    if _writer is not None:
        _writer.join()
        _writer = None
    if _shards_written is not None:
        future, _shards_written = _shards_written, None
        try:
            future.result()
        except BaseException as err:  # rank 0's writer records the same failure; other ranks learn it here
            _writer_error.append(err)
    if _writer_error:
        err = _writer_error.pop()
        raise RuntimeError(f"the background checkpoint save failed: {err}") from err


def staged() -> float:
    """Block until the background save in flight holds its own copy of what an optimizer step changes
    in place; the seconds waited."""
    began = time.perf_counter()
    _staged.wait()
    return time.perf_counter() - began


def host_copy(state):
    """A copy in host memory of every tensor in a (nested) state dict, so training can go on."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: host_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(host_copy(v) for v in state)
    return state


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained weights on the host; on a CPU these are the live parameters, not a copy (host_copy makes one)."""
    return {name: p.detach().contiguous().cpu() for name, p in model.named_parameters() if p.requires_grad}


def _sharded_state(model, optimizer) -> dict:
    """Trainable weights and optimizer state keyed by parameter name, as this rank holds them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    weights, optim = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": weights, "optimizer": optim}


def save(output_dir: str | Path, step: int, model, optimizer, scheduler, trainer_state: dict, config_yaml: str,
         accelerator, keep_last: int, layout: str = "full", background: bool = False) -> Path | None:
    """Write the checkpoint of `step` (every rank calls this; rank 0 writes all but the RNG files and,
    for layout "dcp" or "deepspeed", each rank its own shards). `background` (layouts "full" and
    "dcp"): every rank returns once its state is copied, and rank 0's writer thread completes the
    checkpoint."""
    import torch.distributed.checkpoint as dcp

    global _writer, _shards_written
    wait()
    shards = None  # DCP's future for this rank's shards, when written in the background
    root = checkpoint_root(output_dir)
    tmp = root / f".{step_dir(root, step).name}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(rng_state(), tmp / f"rng-rank{accelerator.process_index}.pt")
    if layout == "dcp" and background:
        shards = dcp.async_save(_sharded_state(model, optimizer), checkpoint_id=tmp / SHARDED, process_group=_dcp_process_group())
    elif layout == "dcp":
        dcp.save(_sharded_state(model, optimizer), checkpoint_id=tmp / SHARDED)
    elif layout == "deepspeed":
        model.save_checkpoint(tmp / DEEPSPEED, tag="state", save_latest=False, exclude_frozen_parameters=True)
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        _shards_written = shards  # wait() joins it
        return None
    state = {**trainer_state, "step": step, "world_size": accelerator.num_processes}
    files = {"scheduler.pt": scheduler.state_dict(), CONFIG_FILE: config_yaml}
    if getattr(accelerator, "scaler", None) is not None:  # fp16 on a GPU: the dynamic loss scale
        files["scaler.pt"] = accelerator.scaler.state_dict()
    if layout == "full":
        files[WEIGHTS] = trainable_state(accelerator.unwrap_model(model))
        files["optimizer.pt"] = optimizer.state_dict()
        # torch numbers the optimizer's parameters; their names let a ZeRO run at any count resume from it
        names = {id(p): n for n, p in accelerator.unwrap_model(model).named_parameters()}
        state["optimizer_params"] = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    files["trainer_state.json"] = json.dumps(state)
    if not background:
        return _complete(tmp, root, step, files, keep_last)
    live = {name: files.pop(name) for name in (WEIGHTS, "optimizer.pt") if name in files}  # the writer copies these
    _staged.clear()
    _writer = threading.Thread(target=_complete_or_record, args=(shards, tmp, root, step, host_copy(files), live, keep_last),
                               name="checkpoint-writer")
    _writer.start()
    return step_dir(root, step)


def _dcp_process_group():
    """A gloo group of every rank, made once (by every rank, at its first background save)."""
    global _dcp_group
    if _dcp_group is None:
        import torch.distributed as dist

        _dcp_group = dist.new_group(backend="gloo")
    return _dcp_group


def _complete_or_record(shards, tmp: Path, root: Path, step: int, files: dict, live: dict, keep_last: int) -> None:
    try:
        try:
            files = {**files, **host_copy(live)}
        finally:
            _staged.set()
        if shards is not None:
            shards.result()  # DCP's metadata is written once every rank's files are: they are all there
        _complete(tmp, root, step, files, keep_last)
    except BaseException as err:  # raised in the training thread at its next wait()
        _writer_error.append(err)


def _complete(tmp: Path, root: Path, step: int, files: dict, keep_last: int) -> Path:
    """Rank 0's part: its files (hashed as they are written), then fsync, the manifest last, and the
    atomic rename."""
    from finetune import faults

    hashes = {}
    for name, value in files.items():
        with HashedFile(tmp / name) as out:
            if name.endswith(".safetensors"):
                write_safetensors(value, out)
            elif isinstance(value, str):
                out.write(value.encode())
            else:
                torch.save(value, out)
        hashes[name] = out.sha256
        faults.inject_saving(step)
    written = {str(p.relative_to(tmp)): p for p in sorted(tmp.rglob("*")) if p.is_file()}
    for name, path in written.items():
        if name not in hashes:  # every rank's RNG states and shards: written by torch and DCP
            _fsync(path)
    manifest = {name: {"size": p.stat().st_size, "sha256": hashes.get(name) or sha256_file(p)} for name, p in written.items()}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / MANIFEST)
    final = step_dir(root, step)
    if final.exists():  # the same step saved again (a resumed run): replace it only now it is complete
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    _retain(root, keep_last)
    return final


def _retain(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints, the newest one the guard called good, the
    newest good one from no later than the run's best loss level (where a drift rolls back to, and
    what a run that ended worse points to) and the start (step 0: where a hot start rolls back to);
    never delete the only valid one."""
    complete = [p for p in step_dirs(root) if verify(p, checksums=False) is None]
    good = [p for p in complete if _is_good(p)]
    best = _trainer_state(complete[-1]).get("guard", {}).get("best") if complete else None
    before_best = [p for p in good if best and step_of(p) <= best[0]]
    start = [p for p in good if step_of(p) == 0]
    keep = set(complete[-max(1, keep_last):]) | set(good[-1:]) | set(before_best[-1:]) | set(start)
    for old in complete:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)


def step_dir(root: Path, step: int) -> Path:
    return root / f"{STEP}{step:06d}"


def step_of(path: Path) -> int | None:
    """The step a checkpoint folder holds, from its name; None for any other folder."""
    number = path.name.removeprefix(STEP)
    return int(number) if path.name.startswith(STEP) and number.isdigit() else None


def step_dirs(root: Path) -> list[Path]:
    """The checkpoint folders under `root` (complete or not), oldest first."""
    return sorted((p for p in root.glob(f"{STEP}*") if step_of(p) is not None), key=step_of)


def _trainer_state(path: Path) -> dict:
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return state if isinstance(state, dict) else {}


def _is_good(path: Path) -> bool:
    state = _trainer_state(path)
    return bool(state) and state.get("good", True) is not False


# ----------------------------------------------------------------------------------------------
# Finding and restoring


def verify(path: Path, checksums: bool = True) -> str | None:
    """None when the checkpoint is complete and intact, else why not. Without checksums: complete
    and of the right sizes (cheap enough to run after every save)."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return "no manifest (an interrupted save)"
    try:
        entries = json.loads(manifest.read_text())
    except (ValueError, UnicodeDecodeError, OSError):
        return "unreadable manifest"
    if not isinstance(entries, dict) or not entries:
        return "manifest is not a list of files with their sizes and checksums"
    for name, want in entries.items():
        if not isinstance(want, dict) or not isinstance(want.get("size"), int) or not isinstance(want.get("sha256"), str):
            return f"manifest entry {name} lacks its size or checksum"
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != want["size"]:
            return f"{name} has {file.stat().st_size} bytes, expected {want['size']}"
        if checksums and sha256_file(file) != want["sha256"]:
            return f"{name} fails its checksum"
    return None


@dataclass
class Found:
    path: Path
    skipped: list[str]  # one line per newer checkpoint that could not be used


def find_latest(output_dir: str | Path) -> Found | None:
    """The newest complete checkpoint, with a line for every newer one that is incomplete or corrupt."""
    skipped = []
    for path in reversed(step_dirs(checkpoint_root(output_dir))):
        problem = verify(path)
        if problem is None:
            return Found(path, skipped)
        skipped.append(f"checkpoint {path} skipped: {problem}")
    return Found(None, skipped) if skipped else None


def find_good(output_dir: str | Path, before_step: int) -> Path | None:
    """The newest complete checkpoint at or before `before_step` that the guard called good (a
    rollback target)."""
    wait()
    for path in reversed(step_dirs(checkpoint_root(output_dir))):
        if step_of(path) <= before_step and _is_good(path) and verify(path) is None:
            return path
    return None


# ----------------------------------------------------------------------------------------------
# Restart-loop detection: how many starts in a row resumed from the same place with the same config.

def starts_file(output_dir: str | Path) -> Path:
    return Path(output_dir) / "starts.json"


def count_starts(output_dir: str | Path, step: int, config_yaml: str) -> int:
    """Which start in a row from `step` with this config this one is (1 for the first)."""
    try:
        record = json.loads(starts_file(output_dir).read_text())
    except (OSError, json.JSONDecodeError):
        return 1
    same = record.get("step") == step and record.get("config") == hashlib.sha256(config_yaml.encode()).hexdigest()
    return record.get("count", 0) + 1 if same else 1


def record_start(output_dir: str | Path, step: int, config_yaml: str, count: int) -> None:
    path = starts_file(output_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"step": step, "config": hashlib.sha256(config_yaml.encode()).hexdigest(), "count": count}))


def clear_starts(output_dir: str | Path) -> None:
    starts_file(output_dir).unlink(missing_ok=True)


def restore(path: Path, model, optimizer, scheduler, accelerator, layout: str, scratch: Path) -> dict:
    """Load a checkpoint into the run; returns its trainer state.

    A DCP checkpoint loads into a run of any world size, sharded or not (DCP reshards). A ZeRO one
    loads into ZeRO at its own process count, and through DeepSpeed's universal-checkpoint
    conversion (written under `scratch`, the resuming run's folder, then removed) into ZeRO at another count or one process.
    An unsharded one loads into an unsharded run."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    written = json.loads((path / "trainer_state.json").read_text())
    if (path / SHARDED).is_dir():
        if layout == "deepspeed":
            raise ValueError(f"{path} was written by an FSDP run; resume it with distributed.strategy: fsdp (any process count)")
        state = _sharded_state(model, optimizer)
        try:
            dcp.load(state, checkpoint_id=path / SHARDED)
        except Exception as err:  # DCP names the first key it cannot match
            raise ValueError(f"{path}: its weights do not match this model's trainable parameters ({str(err).splitlines()[0][:200]})") from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(ignore_frozen_params=True, strict=False))  # frozen weights come from the base
        return _restore_rest(path, scheduler, accelerator, written)
    if (path / DEEPSPEED).is_dir():
        if layout == "dcp":
            raise ValueError(f"{path} was written by DeepSpeed ZeRO with {written['world_size']} processes; resume it with a "
                             "zero strategy (any process count) or in one process")
        # DeepSpeed unpickles its own files (torch.load weights_only=False): only ever files this
        # package wrote, whose checksums verify() has just matched against the manifest.
        if layout == "deepspeed" and written["world_size"] == accelerator.num_processes:
            model.load_checkpoint(path / DEEPSPEED, tag="state", load_module_strict=False, load_lr_scheduler_states=False)
        else:
            with universal(path, scratch, accelerator) as folder:
                if layout == "deepspeed":
                    # DeepSpeed reads a universal checkpoint where its config says so; set for this one load.
                    model._config.load_universal_checkpoint = True
                    try:
                        model.load_checkpoint(folder, tag="state", load_module_strict=False, load_lr_scheduler_states=False)
                    finally:
                        model._config.load_universal_checkpoint = False
                else:
                    _restore_universal(folder / "state" / "zero", accelerator.unwrap_model(model), optimizer, written["step"], path)
        return _restore_rest(path, scheduler, accelerator, written)
    if layout == "deepspeed":
        _restore_unsharded_into_zero(path, model, optimizer, written)
        return _restore_rest(path, scheduler, accelerator, written)
    if layout != "full":
        raise ValueError(f"{path} was written by an unsharded run; resume it with distributed.strategy: ddp or zero2/zero3 (or start afresh)")
    _copy_trainable(load_file(path / WEIGHTS), accelerator.unwrap_model(model), path)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    return _restore_rest(path, scheduler, accelerator, written)


@contextlib.contextmanager
def universal(path: Path, scratch: Path, accelerator):
    """DeepSpeed's universal form of the ZeRO checkpoint at `path` (its ds_to_universal: one folder
    per parameter with its fp32 value and optimizer states, whole), converted once by the main process
    into a folder of ours under `scratch`, removed after the load."""
    folder = Path(scratch) / f".universal-{path.name}"
    if accelerator.is_main_process:
        shutil.rmtree(folder, ignore_errors=True)
        convert = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(path / DEEPSPEED / "state"),
                   "--output_folder", str(folder / "state"), "--num_extract_workers", "1", "--num_merge_workers", "1",
                   "--inject_missing_state"]  # ZeRO-2 files lack a version record that only Megatron writes (in memory: the files stay as they are)
        done = subprocess.run(convert, capture_output=True, text=True)
        if done.returncode != 0:
            shutil.rmtree(folder, ignore_errors=True)
            raise ValueError(f"{path}: DeepSpeed's universal-checkpoint conversion failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        (folder / "latest_universal").write_text("state")
    accelerator.wait_for_everyone()
    try:
        yield folder
    finally:
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)


def _restore_universal(zero: Path, model, optimizer, step: int, path: Path) -> None:
    """A universal checkpoint's trained weights and optimizer states into an unsharded model and its
    torch optimizer. Its files hold each parameter flattened, one file per state (exp_avg, ...)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    _check_trainable({d.name for d in zero.iterdir() if d.is_dir()}, params, path)
    state = optimizer.state_dict()
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    with torch.no_grad():
        for name, param in params.items():
            files = {f.stem: _universal_tensor(f).view(param.shape) for f in (zero / name).glob("*.pt") if f.stem != "step"}
            param.copy_(files.pop("fp32"))
            # Adam's step is the run's: ZeRO steps the optimizer at every step (DeepSpeed applies even a skipped one).
            state["state"][index[id(param)]] = {**files, "step": torch.tensor(float(step))}
    optimizer.load_state_dict(state)


def _universal_tensor(file: Path) -> torch.Tensor:
    value = torch.load(file, weights_only=True)
    return value["param"] if isinstance(value, dict) else value  # ZeRO-2's conversion wraps each tensor in a dict


def _restore_unsharded_into_zero(path: Path, engine, optimizer, written: dict) -> None:
    """An unsharded run's checkpoint into a ZeRO engine: every rank reads the whole trained state and
    keeps its partition, through DeepSpeed's documented routes (GatheredParameters for the weights the
    forward uses, safe_set_full_* for the fp32 master copy and the optimizer's states)."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    from safetensors.torch import load_file

    names = written.get("optimizer_params")
    if names is None:
        raise ValueError(f"{path} was written by one process before checkpoints named the optimizer's parameters; resume it in one process")
    params = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    _check_trainable(names, params, path)
    weights, saved = load_file(path / WEIGHTS), torch.load(path / "optimizer.pt", weights_only=True)
    states = [saved["state"].get(i, {}) for group in saved["param_groups"] for i in group["params"]]
    _create_zero_optimizer_states(optimizer, next((state for state in states if state), {}))
    for name, state in zip(names, states):
        param = params[name]
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            param.copy_(weights[name])
        safe_set_full_fp32_param(param, weights[name])
        for key, value in state.items():
            if key != "step":
                safe_set_full_optimizer_state(param, value, key)


def _create_zero_optimizer_states(optimizer, example: dict) -> None:
    """DeepSpeed's torch optimizer creates its states at the first step; create them now, zero, with
    the saved step count, so that safe_set_full_optimizer_state has somewhere to write. Its optimizer
    steps flat fp32 partitions: ZeRO-3 keeps them in fp32_partitioned_groups_flat, ZeRO-2 in
    single_partition_of_fp32_groups (what DeepSpeed's own universal loader writes to)."""
    flats = getattr(optimizer, "fp32_partitioned_groups_flat", None) or optimizer.single_partition_of_fp32_groups
    cpu_adam = type(optimizer.optimizer).__name__ == "DeepSpeedCPUAdam"  # counts its steps in a Python int
    for flat in flats:
        state = optimizer.optimizer.state[flat]
        for key, value in example.items():
            if key == "step":
                state[key] = int(value) if cpu_adam else value.clone().to(flat.device)
            else:
                state.setdefault(key, torch.zeros_like(flat))
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-2 links each parameter's fragment of them after its first step
        optimizer._lazy_init_hp_params_optimizer_state()


def _check_trainable(saved, params: dict, path: Path) -> None:
    """The names a checkpoint holds against the model's trainable parameters: the same set, or one line."""
    differ = sorted(set(saved) ^ set(params))
    if differ:
        raise ValueError(f"{path}: its weights do not match this model's trainable parameters (e.g. {differ[0]})")


def _copy_trainable(weights: dict[str, torch.Tensor], model, path: Path) -> None:
    params = dict(model.named_parameters())
    _check_trainable(weights, {n: p for n, p in params.items() if p.requires_grad}, path)
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)


def load_trainable(path: Path, model) -> None:
    """Only the trained weights of a checkpoint of any layout, into an unsharded model in this
    process (finetune merge / generate on a checkpoint mid-run)."""
    from safetensors.torch import load_file

    if (path / SHARDED).is_dir():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

        state = {"model": get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))}
        dcp.load(state, checkpoint_id=path / SHARDED)  # reads only these keys: no optimizer state
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    elif (path / DEEPSPEED).is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # Unpickles DeepSpeed's own files: callers verify() the manifest first, as restore does.
        weights = get_fp32_state_dict_from_zero_checkpoint(path / DEEPSPEED, tag="state", exclude_frozen_parameters=True)
        _copy_trainable(weights, model, path)
    else:
        _copy_trainable(load_file(path / WEIGHTS), model, path)


def _restore_rest(path: Path, scheduler, accelerator, written: dict) -> dict:
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    if (path / "scaler.pt").exists() and getattr(accelerator, "scaler", None) is not None:
        accelerator.scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=True))
    rng_file = path / f"rng-rank{accelerator.process_index}.pt"
    if rng_file.exists():  # absent when resuming at a larger world size: that rank starts fresh
        set_rng_state(torch.load(rng_file, weights_only=True))
    return written
