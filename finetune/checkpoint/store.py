"""Checkpoints: atomic, verified, and enough to resume a run exactly; what is the same whatever the
strategy's format (the engine's checkpointer, checkpointers.py, writes and reads the trained state).

A checkpoint is a folder `OUTPUT/checkpoints/step-NNNNNN` holding the trained weights
(safetensors), optimizer and scheduler states, every rank's RNG states, the trainer state (step,
tokens, guard state) and the resolved config. The weights and optimizer state of a sharded run are
written by every rank in its engine's format instead: `sharded/` (torch.distributed.checkpoint,
FSDP), which any world size can load, or `deepspeed/` (ZeRO). It is written under a temporary name,
fsynced, given a manifest of every file's size and sha256, and only then renamed into place: a
folder with that name and a matching manifest is complete; anything else is skipped (and reported)
when resuming.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from finetune.checkpoint.diskio import HashedFile, sha256_file, write_safetensors

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
# Writing: what every checkpointer's save ends with (checkpointers.py writes the state itself)


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


def complete(tmp: Path, root: Path, step: int, files: dict, keep_last: int, after_file=None) -> Path:
    """Rank 0's part: its files (hashed as they are written), then fsync, the manifest last, and the
    atomic rename. `after_file(step)` runs after each file (the tests' kill-saving fault)."""
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
        if after_file is not None:
            after_file(step)
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
    what a run that ended worse points to), the newest good one from no later than the last step whose KL
    was calm (where a KL blow-up rolls back to) and the start (step 0: where a hot start rolls back to);
    never delete the only valid one."""
    complete = [p for p in step_dirs(root) if verify(p, checksums=False) is None]
    good = [p for p in complete if _is_good(p)]
    guard = trainer_state(complete[-1]).get("guard", {}) if complete else {}
    best, calm = guard.get("best"), guard.get("calm_kl_step")
    before_best = [p for p in good if best and step_of(p) <= best[0]]
    before_calm = [p for p in good if calm is not None and step_of(p) <= calm]
    start = [p for p in good if step_of(p) == 0]
    keep = set(complete[-max(1, keep_last):]) | set(good[-1:]) | set(before_best[-1:]) | set(before_calm[-1:]) | set(start)
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


def trainer_state(path: Path) -> dict:
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return state if isinstance(state, dict) else {}


def _is_good(path: Path) -> bool:
    state = trainer_state(path)
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
    rollback target). A save in flight must be complete first (the checkpointer's wait())."""
    for path in reversed(step_dirs(checkpoint_root(output_dir))):
        if step_of(path) <= before_step and _is_good(path) and verify(path) is None:
            return path
    return None
