"""Launch N ranks of a script the way torchrun's workers see it (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...), forked from
a process that imported torch, transformers, peft, accelerate and DeepSpeed once, instead of N fresh interpreters
and an agent: a rank's start-up is ~6 s of imports here (docs/platform-notes.md), most of a tiny model's 2-process run.

It is multiprocessing's forkserver with those modules preloaded, one server per pytest worker. What a run proves
about several processes (gloo collectives, sharding, each rank's files) it proves here as under torchrun; what
torchrun itself does (its agent, restarts, exit codes, elastic membership) the tests that need it still get from
a real torchrun (conftest.torchrun)."""

from __future__ import annotations

import functools
import itertools
import multiprocessing
import multiprocessing.connection
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRELOAD = ["finetune", "torch", "torch._dynamo", "transformers", "transformers.modeling_utils", "peft", "accelerate", "deepspeed"]
_PORTS = itertools.count()
GRACE = 60  # seconds the other ranks get to end after one failed (train's stop waits at a 30 s barrier)


@functools.cache
def _server():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def free_port() -> int:
    """A TCP port nothing listens on now, from a range of this pytest-xdist worker's own (20000 + 4000 x its number, below
    the kernel's ephemeral ports), each handed out once: two workers never get the same port, as the kernel's port 0
    could give both between one's check and its use."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    for _ in range(4000):
        port = 20000 + 4000 * worker + next(_PORTS) % 4000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in worker {worker}'s range")


def _rank(script: str, args: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    """One rank: the test's environment and folder, its output appended to the launch's two files, the script as __main__."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    sys.argv = [script, *args]
    if "OMP_NUM_THREADS" in env:  # torch read it when the server imported it
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _wait(ranks: list, timeout: float, script: str) -> int:
    """Every rank's end; once one fails, the others get GRACE seconds (a rank waiting in a collective for the failed one
    would wait its whole timeout), then are killed, as torchrun's agent stops a failed job's workers."""
    deadline, code = time.monotonic() + timeout, 0
    while any(p.exitcode is None for p in ranks):
        if time.monotonic() > deadline:
            for p in ranks:
                p.kill()
            raise subprocess.TimeoutExpired(script, timeout)
        multiprocessing.connection.wait([p.sentinel for p in ranks if p.exitcode is None], timeout=1)
        failed = [p.exitcode for p in ranks if p.exitcode]
        if failed and not code:
            code, deadline = failed[0], min(deadline, time.monotonic() + GRACE)
    for p in ranks:
        p.join()
    return code


def run_ranks(nproc: int, script: str, *args: str, env: dict | None = None, cwd: str | Path = ".", timeout: float = 300):
    """`torchrun --standalone --nproc_per_node nproc script args` as subprocess.run(..., capture_output=True, text=True)
    gives it: the ranks' output together, return code 0 when every rank exited 0, else the first failure's code (-9 for a
    SIGKILL). One rank is `python script args`, without torchrun's variables."""
    env = {**(os.environ if env is None else env)}
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "out"), Path(tmp, "err")
        out.touch()
        err.touch()
        ranks = []
        for rank in range(nproc):
            rank_env = env if nproc == 1 else {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0"}
            process = _server().Process(target=_rank, args=(script, list(args), rank_env, str(cwd), str(out), str(err)))
            process.start()
            ranks.append(process)
        code = _wait(ranks, timeout, script)
        return subprocess.CompletedProcess([script, *args], code, out.read_text(), err.read_text())
