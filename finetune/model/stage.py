"""Stage a model folder on a RAM-backed filesystem once, so later runs (and restarts) load in seconds.

Under the staging root (default /dev/shm/finetune) each source gets:
  <name>-<hash>/             a complete copy; its manifest `.staged.json` is written last, so a copy
                             without one is never trusted
  <name>-<hash>.lock         an flock: one process per node copies, the others wait, then reuse it
  .partial-<name>-<hash>-*   a copy in progress (or a killed one), removed by the next stager

A staged copy is reused while every source file keeps its size and mtime (a stat, no read);
`finetune stage --verify` compares checksums too. Removing a copy (to re-stage or evict it) does not
disturb runs that have its files memory-mapped: they keep the pages until they exit.

transformers memory-maps safetensors: weights loaded in their stored dtype are the staged pages
themselves (copied only when written), so ranks on a node share one copy of a frozen base.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from finetune.checkpoint.diskio import sha256_file
from finetune.checkpoint.locks import exclusive
from finetune.config import faults
from finetune.config.errors import UserError, make_folder
from finetune.config.schema import DEFAULT_RAMDISK, ModelConfig, looks_local

MANIFEST = ".staged.json"
PARTIAL = ".partial-"
# What a model folder needs to load: weights (safetensors only), configs, tokenizer, chat template,
# and remote code for models that ship it. Sub-folders (checkpoints, logs) stay behind.
PATTERNS = ("*.safetensors", "*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.py")
CHUNK = 8 << 20
RAM_FILESYSTEMS = ("tmpfs", "ramfs")


@dataclass
class Staged:
    path: Path
    copied: bool  # False: an existing copy was reused
    seconds: float
    nbytes: int


def resolve_source(name_or_path: str, revision: str | None = None) -> Path:
    """The local folder holding the model: the path itself, or the hub snapshot (downloaded once)."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return local.resolve()
    if looks_local(name_or_path):
        raise UserError(f"model.name_or_path: folder not found: {name_or_path}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, revision=revision, allow_patterns=list(PATTERNS)))
    except Exception as err:  # no hub, unknown id, no network: all one answer to the user
        raise UserError(f"model.name_or_path: '{name_or_path}' is not a local folder and the hub did not provide it: "
                        f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None


def source_files(src: Path) -> list[Path]:
    files = sorted(p for p in src.iterdir() if p.is_file() and any(fnmatch(p.name, pat) for pat in PATTERNS))
    if not any(p.suffix == ".safetensors" for p in files):
        raise UserError(f"model.ramdisk: {src} holds no .safetensors weights; only safetensors are staged and loaded")
    return files


def staged_name(src: Path) -> str:
    return f"{src.name}-{hashlib.sha256(str(src).encode()).hexdigest()[:12]}"


def _stat(path: Path) -> dict:
    st = path.stat()  # follows symlinks: hub snapshots link to blobs
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def read_manifest(dest: Path) -> dict | None:
    try:
        manifest = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def is_current(dest: Path, src: Path, files: list[Path]) -> bool:
    """The staged copy is complete and the source has not changed since (sizes and mtimes)."""
    manifest = read_manifest(dest)
    if manifest is None or set(manifest["files"]) != {p.name for p in files}:
        return False
    for p in files:
        want = manifest["files"][p.name]
        staged = dest / p.name
        if _stat(p) != {"size": want["size"], "mtime_ns": want["mtime_ns"]} or not staged.is_file() or staged.stat().st_size != want["size"]:
            return False
    return True


def checksums_match(dest: Path, src: Path) -> bool:
    """Both the source and the staged copy hash to what the manifest recorded."""
    manifest = read_manifest(dest)
    return manifest is not None and all(
        sha256_file(src / name) == want["sha256"] == sha256_file(dest / name) for name, want in manifest["files"].items())


def is_ram_backed(path: Path) -> bool:
    """Whether the filesystem holding `path` keeps its files in RAM (the longest matching mount wins)."""
    best, fstype = "", ""
    target = str(path.resolve())
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, mount, kind = line.split()[:3]
            if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, fstype = mount, kind
    return fstype in RAM_FILESYSTEMS


def available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def check_room(root: Path, nbytes: int, reserve_gib: float) -> None:
    gib = 2**30
    free = shutil.disk_usage(root).free
    if nbytes > free:
        raise UserError(f"model.ramdisk: the model needs {nbytes / gib:.2f} GiB but {root} has {free / gib:.2f} GiB free")
    if is_ram_backed(root):
        left = available_ram() - nbytes
        if left < reserve_gib * gib:
            raise UserError(f"model.ramdisk: staging {nbytes / gib:.2f} GiB in {root} would leave {max(left, 0) / gib:.2f} GiB of RAM "
                            f"available, less than model.ramdisk_reserve_gib={reserve_gib:g}")


def locked(root: Path, name: str, say=print):
    return exclusive(root / f"{name}.lock", f"ramdisk: another process is staging {name}; waiting for it", say=say)


def stage(name_or_path: str, root: str | Path, reserve_gib: float, revision: str | None = None, verify: bool = False,
          say=print) -> Staged:
    """A current, verified copy of the model folder under `root`: reused if there is one, else made."""
    started = time.perf_counter()
    src = resolve_source(name_or_path, revision)
    files = source_files(src)
    root = Path(root)
    make_folder(root, "model.ramdisk")
    name = staged_name(src)
    dest = root / name
    with locked(root, name, say):
        for stale in root.glob(f"{PARTIAL}{name}-*"):  # whoever wrote it is gone: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        nbytes = sum(p.stat().st_size for p in files)
        if is_current(dest, src, files) and (not verify or checksums_match(dest, src)):
            return Staged(dest, False, time.perf_counter() - started, nbytes)
        # A stale copy goes first: runs that mapped its files keep them until they exit.
        shutil.rmtree(dest, ignore_errors=True)
        check_room(root, nbytes, reserve_gib)
        tmp = root / f"{PARTIAL}{name}-{os.getpid()}"
        tmp.mkdir()
        try:
            _copy_verified(src, files, tmp, nbytes)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(err, OSError):  # e.g. the mount filled up meanwhile
                raise UserError(f"model.ramdisk: copying {src} to {root} failed: {err.strerror or err}") from None
            raise
        tmp.rename(dest)
    return Staged(dest, True, time.perf_counter() - started, nbytes)


def _copy_verified(src: Path, files: list[Path], tmp: Path, nbytes: int) -> None:
    """Copy while hashing the source, then re-read the copy and compare: the manifest, written last,
    records what both hashed to."""
    from tqdm import tqdm

    manifest = {"source": str(src), "staged_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "bytes": nbytes, "files": {}}
    chunks = 0
    with tqdm(total=nbytes, unit="B", unit_scale=True, desc=f"staging {src.name}", file=sys.stderr, disable=None) as bar:
        for p in files:
            before = _stat(p)
            h = hashlib.sha256()
            with open(p, "rb") as f, open(tmp / p.name, "wb") as out:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
                    chunks += 1
                    faults.inject_staging(chunks)
                out.flush()
                os.fsync(out.fileno())
            if _stat(p) != before:
                raise UserError(f"model.ramdisk: {p} changed while it was being staged; run again once it is complete")
            manifest["files"][p.name] = {**before, "sha256": h.hexdigest()}
    for name, want in manifest["files"].items():
        if sha256_file(tmp / name) != want["sha256"]:
            raise UserError(f"model.ramdisk: the staged copy of {name} does not match its source (bad memory or a full disk?)")
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def staged_model(cfg: ModelConfig, say=print) -> ModelConfig:
    """The model config a run loads with: pointing at the staged copy, or, when staging is off or
    refused (no room, no safetensors), the config as given, after a warning."""
    if cfg.ramdisk_root is None:
        return cfg
    try:
        staged = stage(cfg.name_or_path, cfg.ramdisk_root, cfg.ramdisk_reserve_gib, cfg.revision, say=say)
    except UserError as err:
        print(f"warning: {err}; loading from {cfg.name_or_path} instead", file=sys.stderr)
        return cfg
    gib = staged.nbytes / 2**30
    say(f"ramdisk: staged {gib:.2f} GiB to {staged.path} in {staged.seconds:.1f} s (verified)" if staged.copied
        else f"ramdisk: reusing the staged copy {staged.path} ({gib:.2f} GiB)")
    return cfg.model_copy(update={"name_or_path": str(staged.path), "revision": None})


def listing(root: str | Path = DEFAULT_RAMDISK) -> list[dict]:
    """What is under the staging root: each copy with its source, size and state."""
    root = Path(root)
    if not root.is_dir():
        return []
    rows = []
    for dest in sorted(p for p in root.iterdir() if p.is_dir()):
        manifest = read_manifest(dest)
        size = sum(p.stat().st_size for p in dest.iterdir() if p.is_file())
        if dest.name.startswith(PARTIAL) or manifest is None:
            rows.append({"name": dest.name, "source": "?", "bytes": size, "staged_at": "", "state": "partial (removed by the next stage)"})
            continue
        src = Path(manifest["source"])
        if not src.is_dir():
            state = "source gone"
        else:
            try:
                state = "current" if is_current(dest, src, source_files(src)) else "stale (source changed)"
            except UserError:
                state = "stale (source changed)"
        rows.append({"name": dest.name, "source": str(src), "bytes": size, "staged_at": manifest["staged_at"], "state": state})
    return rows


def evict(root: str | Path, which: str | None, say=print) -> list[str]:
    """Remove staged copies: the one named (its folder name or its source path), or all when None."""
    root = Path(root)
    removed = []
    source = str(Path(which).expanduser().resolve()) if which else None
    for row in listing(root):
        if which is not None and which != row["name"] and source != row["source"]:
            continue
        name = row["name"].removeprefix(PARTIAL).rsplit("-", 1)[0] if row["name"].startswith(PARTIAL) else row["name"]
        with locked(root, name, say):  # not while another process is staging it
            shutil.rmtree(root / row["name"], ignore_errors=True)
        removed.append(row["name"])
    if which is not None and not removed:
        raise UserError(f"stage --evict: nothing staged under {root} matches '{which}' (see finetune stage --list)")
    return removed
