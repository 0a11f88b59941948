"""How a run ends when it cannot go on: one line on stderr and a documented exit code, never a traceback.

  2   bad input (config, data, paths): UserError
  3   the loss-divergence guard gave up after its rollbacks: Stopped
  4   the hang watchdog found a step stuck far longer than the recent ones (stacks are in the log), or a
      collective waited past distributed.collective_timeout for another process: Hung
  5   finetune merge: the saved model's logits are not those of base+adapter (nothing was written)
  75  preempted (SIGTERM/SIGUSR1): a checkpoint was saved first; start the same command to resume
"""

import os
import sys
from pathlib import Path

EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_HUNG = 4
EXIT_MERGE_CHECK = 5
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later", what a requeue does
EXIT_FILE_VAR = "FINETUNE_EXIT_FILE"


def record_exit(code: int) -> None:
    """Leave a rank's documented exit code where the launch scripts read it: torchrun reports any
    failed worker as its own exit 1, and a preempted job must still end with 75 to be requeued."""
    path = os.environ.get(EXIT_FILE_VAR)
    if path and code:
        # Whole or not at all: every rank that fails writes its code, and one killed by the launcher while it wrote
        # (a rank that stopped first ends the others) must not leave the file empty, which the script reads as none.
        part = f"{path}.{os.getpid()}"
        try:
            with open(part, "w") as fh:
                fh.write(f"{code}\n")
            os.replace(part, path)
        except OSError as err:  # the launcher then reports torchrun's 1: say so, with the code it should have been
            print(f"error: exit code {code} not recorded in {EXIT_FILE_VAR}={path} ({err.strerror or err}); the launch script will "
                  f"report 1 (torchrun's) instead of {code}", file=sys.stderr, flush=True)


def clear_recorded_exit() -> None:
    """Workers torchrun starts (again: an elastic job re-formed after a failure or around a node that joined, whose
    SIGTERM left 75; --max-restarts): the code an earlier start left is not this start's, so the launch script's grace
    (launch/common.sh) counts only from a code no start followed. The node's first local worker clears it as it starts
    (torchrun's restart count does not move on a membership change: every start clears)."""
    path = os.environ.get(EXIT_FILE_VAR)
    if path and os.environ.get("LOCAL_RANK", "0") == "0":
        try:
            Path(path).write_text("")
        except OSError:
            pass  # the script then keeps the earlier code, as before


class UserError(Exception):
    """Bad input from the user (config, data, paths). The message names the file/key and what was expected."""

    exit_code = EXIT_USAGE


def make_folder(path: Path, setting: str) -> Path:
    """`path` created with its parents, or one line naming the setting that chose it and why it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"{setting}: cannot create {path} ({err.strerror})") from None
    return path


class Hung(UserError):
    """Another process stopped answering (a stuck peer, a lost link): this one ends at once, without waiting for it."""

    exit_code = EXIT_HUNG


class Stopped(UserError):
    """The run stopped itself (diverged beyond what the guard repairs, or preempted): the message
    says what was seen and where to start again."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
