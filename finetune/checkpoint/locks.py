"""One process per node does a shared job (stage a model, tokenize data); the others wait, then reuse it.

An flock on a file next to the result: the kernel releases it when its holder dies, so a killed
process never leaves the others waiting for nothing. flock is per node: on a file system shared by
several nodes each node may take its own (NFS may or may not pass flock on), which is why the results
are written under a temporary name and renamed into place, never half there.
"""

from __future__ import annotations

import fcntl
import time
from contextlib import contextmanager
from pathlib import Path

from finetune.config.errors import UserError, make_folder


@contextmanager
def exclusive(path: Path, waiting: str, timeout_s: float | None = None, timeout_hint: str = "", say=print):
    """Hold the lock at `path` for the block. While another process holds it, say `waiting` once and
    wait (at most timeout_s seconds, then a UserError ending with timeout_hint)."""
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(waiting)
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() > deadline:
                        raise UserError(f"{waiting.rstrip('.')}: still waiting after {timeout_s / 60:g} min; {timeout_hint}".rstrip("; "))
                    time.sleep(0.2)
        yield


def hold_output_dir(out: Path, say=print):
    """An exclusive lock on a run's output directory, for as long as the returned file stays open (the
    run's main process keeps it until it ends). A second run on the same directory is refused in one
    line naming the holder; the lock of a run that died is taken over, with a line saying so.

    On a file system shared by several nodes the lock holds where the file system passes flock on
    (local disks; NFSv4; Lustre mounted with -o flock); elsewhere two nodes could both take it. The
    directory is made first (preflight.check_output_dir has found it fit to use)."""
    import json
    import os
    import socket

    make_folder(out, "train.output_dir")
    path = out / LOCK_FILE
    handle = open(path, "a+")
    handle.seek(0)
    holder = _describe(handle.read())
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise _in_use(out, holder) from None
    if holder:
        say(f"train.output_dir: {out}: taking over the lock of a run that has ended ({holder})")
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}))
    handle.flush()
    return handle


LOCK_FILE = ".finetune.lock"


def check_free(out: Path) -> None:
    """Refuse, in one line, an output directory whose lock a live run holds (preflight: before a
    launcher's rendezvous, where a second launch of a running job would otherwise fail)."""
    path = out / LOCK_FILE
    if not path.is_file():
        return
    with open(path) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(out, _describe(handle.read())) from None
        fcntl.flock(handle, fcntl.LOCK_UN)


def _in_use(out: Path, holder: str) -> UserError:
    return UserError(f"train.output_dir: {out} is in use by another run ({holder or 'unknown holder'}); "
                     "wait for it to end, or choose another train.output_dir")


def release_output_dir(handle) -> None:
    """End of the run: empty the lock file (nobody holds it) and let go."""
    handle.seek(0)
    handle.truncate()
    handle.close()


def _describe(text: str) -> str:
    import json

    try:
        info = json.loads(text)
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (ValueError, KeyError, TypeError):
        return ""
