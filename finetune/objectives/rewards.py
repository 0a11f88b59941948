"""GRPO's reward functions: the built-ins and users' own, called as TRL's GRPOTrainer calls them.

A reward function takes `prompts`, `completions` and `completion_ids` (lists, one entry per completion)
and every other column of the rows as keyword lists (e.g. `answer`), and returns one number per
completion. Chat prompts come as their messages and completions as `[{"role": "assistant", "content":
text}]`, text prompts and completions as strings. Users name theirs as `module:function` (importable)
or `path/to/file.py:function`. A function that raises, or returns anything but a finite number per
completion, stops the run with one line naming it and the row.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from finetune.config.errors import UserError
from finetune.config.schema import GRPOConfig


@dataclass
class Reward:
    name: str  # as the config names it
    metric: str  # its metric's name: reward_<function>
    weight: float
    function: Callable


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def exact_match(completions: list, answer: list | None = None, **_) -> list[float]:
    """1.0 where the completion, whitespace-trimmed, equals the row's answer (as text)."""
    if answer is None:
        raise ValueError("the rows have no 'answer' column to compare with")
    return [float(_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def format_match(completions: list, pattern: str, **_) -> list[float]:
    """1.0 where the whole completion matches the pattern (grpo.format_pattern)."""
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(_text(c)) is not None) for c in completions]


def final_answer(completions: list, answer: list | None = None, **_) -> list[float]:
    """exact_match on the last assistant message of each completion (an episode's final answer)."""
    last = [c if isinstance(c, str) else next((m["content"] or "" for m in reversed(c) if m["role"] == "assistant"), "") for c in completions]
    return exact_match(last, answer)


def tool_call_success(completions: list, tool_calls: list[int] | None = None, tool_failures: list[int] | None = None, **_) -> list[float]:
    """The share of an episode's tool calls that were read and ran without error (0 for one without calls, or outside grpo.environment)."""
    calls, failures = tool_calls or [0] * len(completions), tool_failures or [0] * len(completions)
    return [(n - failed) / n if n else 0.0 for n, failed in zip(calls, failures)]


def length_penalty(completion_ids: list, max_length: int, **_) -> list[float]:
    """Minus the share of the completion budget used: shorter answers score higher."""
    return [-len(ids) / max_length for ids in completion_ids]


def load_rewards(cfg: GRPOConfig) -> list[Reward]:
    """The configured reward functions, imported now: a name that does not resolve is one line, before any model loads."""
    built_in = {"exact_match": exact_match, "final_answer": final_answer, "tool_call_success": tool_call_success,
                "format": functools.partial(format_match, pattern=cfg.format_pattern),
                "length": functools.partial(length_penalty, max_length=cfg.max_completion_length)}
    weights = cfg.reward_weights or [1.0] * len(cfg.rewards)
    out = []
    for name, weight in zip(cfg.rewards, weights):
        if name.startswith("reward_model:"):  # a trained reward model (train.objective: reward)
            from finetune.objectives.score import RewardModelReward

            out.append(Reward(name, "reward_model", weight, RewardModelReward(name.removeprefix("reward_model:"))))
            continue
        function = built_in.get(name) or import_named(name, built_in)
        out.append(Reward(name, "reward_" + re.sub(r"\W", "_", name.rsplit(":", 1)[-1].removesuffix(".py")), weight, function))
    if len({r.metric for r in out}) < len(out):
        raise UserError(f"grpo.rewards: {cfg.rewards} names a function twice (or two with the same name); give each once")
    return out


def import_named(name: str, built_in: dict, key: str = "grpo.rewards", kind: str = "function") -> Callable:
    """`module:attribute` or `path/to/file.py:attribute`, imported (kind: what the attribute must be, for the messages)."""
    where, _, attribute = name.rpartition(":")
    if not where or not attribute:
        known = f"a built-in ({', '.join(built_in)}) nor " if built_in else ""
        raise UserError(f"{key}: {name!r} is not {known}module:{kind} or path/to/file.py:{kind}")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise UserError(f"{key}: {name}: no file {path}")
            spec = importlib.util.spec_from_file_location(f"finetune_user_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except UserError:
        raise
    except Exception as err:  # the user's module failed to import: say which and why, in one line
        raise UserError(f"{key}: {name}: importing {where} failed: {type(err).__name__}: {err}") from None
    function = getattr(module, attribute, None)
    if not callable(function) or (kind == "class") != isinstance(function, type):
        raise UserError(f"{key}: {name}: {where} has no {kind} {attribute}")
    return function


def score(rewards: list[Reward], prompts: list, completions: list, completion_ids: list[list[int]], rows: list[dict],
          where: Callable[[int], str]) -> list[list[float]]:
    """Each function's reward of each completion ([completion][function]); `rows[i]` is completion i's
    prompt row (its columns but `prompt` go to the functions), `where(i)` names that row for errors."""
    columns = {key: [row.get(key) for row in rows] for key in dict.fromkeys(k for row in rows for k in row) if key != "prompt"}
    table = []
    for reward in rewards:
        try:
            values = reward.function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as err:  # a user's function: its failure is bad input, named with the rows it scored
            raise UserError(f"grpo.rewards: {reward.name} raised {type(err).__name__}: {err} (scoring completions of {where(0)})") from None
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            got = f"a {type(values).__name__}" + (f" of {len(values)}" if hasattr(values, "__len__") else "")
            raise UserError(f"grpo.rewards: {reward.name} returned {got}; expected a list of {len(completions)} numbers, one per completion "
                            f"(scoring completions of {where(0)})")
        table.append([finite(v, f"grpo.rewards: {reward.name}", f"a completion of {where(i)}") for i, v in enumerate(values)])
    return [list(column) for column in zip(*table)]


def finite(value, who: str, what: str) -> float:
    """A reward as a float, or one line: `who` returned `value` for `what`, not a finite number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise UserError(f"{who} returned {value!r} for {what}; expected a finite number")
    return float(value)
