"""Rows: read them from files, check them, and turn one into token ids with a loss mask.

Local JSONL is read line by line (never a list of every row), so a bad row is reported with its file
and line; JSON lists, Parquet (in record batches) and hub datasets are read through their libraries.
A row becomes `input_ids` and `labels` (-100 where no loss is taken): completion rows train on every
token, alpaca and chat rows on the answers, as the chat template marks them (finetune/chat.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from finetune.chat import assistant_masks, render
from finetune.errors import UserError

IGNORE = -100

ALPACA_PROMPT = (
    "Below is an instruction that describes a task{with_input}. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
)
CHAT_ROLES = {"system", "user", "assistant", "tool"}
FORMATS = ("alpaca", "chat", "completion")


# ----------------------------------------------------------------------------------------------
# Reading and checking rows


def _row_problem(row: object, fmt: str) -> str | None:
    """Why a row can't be used in this format, or None."""
    if not isinstance(row, dict):
        return "expected a JSON object"

    def text(key: str, required: bool = True) -> str | None:
        value = row.get(key)
        if value is None:
            return f"missing field '{key}'" if required else None
        if not isinstance(value, str):
            return f"field '{key}' must be a string"
        if required and not value.strip():
            return f"field '{key}' is empty"
        return None

    if fmt == "completion":
        return text("text")
    if fmt == "alpaca":
        return text("instruction") or text("input", required=False) or text("output")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        return "missing or empty field 'messages'"
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in CHAT_ROLES or not isinstance(msg.get("content"), str):
            return f"messages[{i}] must be {{role: system|user|assistant|tool, content: string}}"
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return "no non-empty assistant message"
    return None


@dataclass
class _Invalid:
    problem: str


def located(source: str, split: str = "train") -> Iterator[tuple[int, object]]:
    """(line or row number, row) of one source, streamed; a line that is not JSON comes as _Invalid."""
    path = Path(source).expanduser()
    if path.is_dir():
        raise UserError(f"{path}: is a folder; expected a .jsonl, .json or .parquet file")
    if not path.exists():
        yield from _hub_rows(source, split)
    elif path.suffix == ".jsonl":
        with path.open("rb") as fh:
            for number, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    yield number, _Invalid("not UTF-8 text")
                    continue
                if line.strip():
                    try:
                        yield number, json.loads(line)
                    except json.JSONDecodeError as err:
                        yield number, _Invalid(f"invalid JSON ({err.msg})")
    elif path.suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise UserError(f"{path}: not UTF-8 text") from None
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
        if isinstance(rows, dict) and isinstance(rows.get("data"), list):
            rows = rows["data"]
        if not isinstance(rows, list):
            raise UserError(f"{path}: expected a JSON list of rows (or JSONL)")
        yield from enumerate(rows, 1)
    elif path.suffix == ".parquet":
        yield from _parquet_rows(path)
    else:
        raise UserError(f"{path}: unsupported data file type '{path.suffix}' (expected .jsonl, .json or .parquet)")


def _parquet_rows(path: Path) -> Iterator[tuple[int, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        number = 0
        for batch in batches:
            for row in batch.to_pylist():
                number += 1
                yield number, row
    except (pa.ArrowException, OSError) as err:
        raise UserError(f"{path}: not a readable Parquet file ({str(err).splitlines()[0]})") from None


def _hub_rows(source: str, split: str) -> Iterator[tuple[int, object]]:
    import datasets

    try:
        ds = datasets.load_dataset(source, split=split)
    except Exception as err:  # noqa: BLE001 - any failure here means "can't get this dataset"
        raise UserError(f"data: cannot load dataset '{source}': {str(err).splitlines()[0]}") from None
    yield from enumerate(ds, 1)


def where(source: str, number: int) -> str:
    """How an error names a row: file:line in JSONL, the row number elsewhere."""
    return f"{source}:{number}" if source.endswith(".jsonl") else f"{source}: row {number}"


class Skipped:
    """Bad rows skipped so far (data.bad_rows: skip): how many, and where the first was."""

    def __init__(self):
        self.count, self.first = 0, None

    def add(self, location: str) -> None:
        self.count += 1
        self.first = self.first or location


def checked_rows(source: str, fmt: str, bad_rows: str, skipped: Skipped, split: str = "train") -> Iterator[tuple[int, dict]]:
    """The usable rows of one source with their numbers; a bad row fails with its location, or is
    skipped and counted."""
    for number, row in located(source, split):
        problem = row.problem if isinstance(row, _Invalid) else _row_problem(row, fmt)
        if problem is None:
            yield number, row
        elif bad_rows == "fail":
            other = [f for f in FORMATS if f != fmt and not isinstance(row, _Invalid) and _row_problem(row, f) is None]
            hint = f"this row looks like format '{other[0]}': set data.format: {other[0]}" if other else "set data.bad_rows: skip to skip bad rows"
            raise UserError(f"{where(source, number)}: {problem} (format '{fmt}'; {hint})")
        else:
            skipped.add(f"{where(source, number)}: {problem}")


# ----------------------------------------------------------------------------------------------
# Turning rows into token ids with a loss mask


def _alpaca_messages(row: dict) -> list[dict]:
    user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]


def _alpaca_prompt(row: dict) -> str:
    has_input = bool(row.get("input"))
    return ALPACA_PROMPT.format(
        with_input=", paired with an input that provides further context" if has_input else "",
        instruction=row["instruction"],
        input_block=f"### Input:\n{row['input']}\n\n" if has_input else "",
    )


def tokenize_row(row: dict, tokenizer, fmt: str, train_on_prompt: bool) -> dict:
    """One row -> {'input_ids', 'labels'} (not yet truncated)."""
    result = tokenize_rows([row], tokenizer, fmt)[0]
    if isinstance(result, str):
        raise UserError(result)
    ids, trained = result
    return {"input_ids": ids, "labels": [t if (train_on_prompt or keep) else IGNORE for t, keep in zip(ids, trained)]}


def tokenize_rows(rows: list[dict], tokenizer, fmt: str) -> list[tuple[list[int], list[bool]] | str]:
    """Rows -> (input_ids, which tokens are trained) each, through the tokenizer's batch calls; a row the
    chat template refuses gets the reason instead."""
    if fmt == "completion":
        eos = tokenizer.eos_token_id
        out = []
        for ids in tokenizer([r["text"] for r in rows], add_special_tokens=True)["input_ids"]:
            if eos is not None and (not ids or ids[-1] != eos):
                ids = ids + [eos]
            out.append((ids, [True] * len(ids)))
        return out
    if fmt == "chat" or tokenizer.chat_template:
        return assistant_masks(tokenizer, [r["messages"] if fmt == "chat" else _alpaca_messages(r) for r in rows])
    # alpaca without a chat template: the classic Alpaca prompt
    prompts = tokenizer([_alpaca_prompt(r) for r in rows], add_special_tokens=True)["input_ids"]
    answers = tokenizer([r["output"] for r in rows], add_special_tokens=False)["input_ids"]
    return [(p + a + [tokenizer.eos_token_id], [False] * len(p) + [True] * (len(a) + 1)) for p, a in zip(prompts, answers)]


def prompt_and_answer(row: dict, tokenizer, fmt: str) -> tuple[str, str]:
    """The prompt text a model should complete, and the reference answer (alpaca and chat rows)."""
    if fmt == "chat":
        last = max(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant")
        msgs = row["messages"]
        return render(tokenizer, msgs[:last], add_generation_prompt=True), msgs[last]["content"]
    if fmt == "alpaca":
        if tokenizer.chat_template:
            return render(tokenizer, _alpaca_messages(row)[:1], add_generation_prompt=True), row["output"]
        return _alpaca_prompt(row), row["output"]
    raise ValueError("completion rows have no prompt/answer split")


