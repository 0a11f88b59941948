"""Rows: read them from files, check them, and turn one into token ids with a loss mask.

Local JSONL, CSV and text files (gzip-compressed too) are read line by line (never a list of every
row), so a bad row is reported with its file and line; JSON lists, Parquet (in record batches) and hub
datasets are read through their libraries. A folder is read as `datasets.load_dataset` reads one: the
files of the split (train-*, data/train-*, a train/ folder; else every data file is train), or a
folder written by `save_to_disk`. Rows are brought to their format's own shape first (`canonical`: mapped
columns, ShareGPT conversations, OpenAI content parts).
A row becomes `input_ids` and `labels` (-100 where no loss is taken): completion rows train on every
token, alpaca and chat rows on the answers, as the chat template marks them (finetune/data/chat.py).
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from finetune.config.errors import UserError
from finetune.data import images
from finetune.data.chat import assistant_masks, render

IGNORE = -100

ALPACA_PROMPT = (
    "Below is an instruction that describes a task{with_input}. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
)
CHAT_ROLES = {"system", "user", "assistant", "tool"}
FORMATS = ("alpaca", "chat", "completion", "preference", "prompt", "unpaired")
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt")  # and .jsonl.gz, .json.gz, .csv.gz, .txt.gz
LINE_BITS = 40  # a row of a folder is numbered (file index << LINE_BITS) | line, so that errors can name file:line
# ShareGPT's speakers (`from`) as chat roles: its own names, OpenAI's, and those of LLaMA-Factory's tool rows.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant", "system": "system",
                  "tool": "tool", "function": "tool", "observation": "tool", "function_call": "assistant"}


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
    if fmt == "preference":
        return _pair_problem(row, text)
    if fmt == "prompt":
        return _prompt_problem(row, text)
    if fmt == "unpaired":
        return _unpaired_problem(row, text)
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        return "missing or empty field 'messages'"
    for i, msg in enumerate(messages):
        parts = images.has_images(row) and isinstance(msg, dict) and isinstance(msg.get("content"), list)
        if not isinstance(msg, dict) or msg.get("role") not in CHAT_ROLES or not (isinstance(msg.get("content"), str) or parts):
            return f"messages[{i}] must be {{role: system|user|assistant|tool, content: string}}"
        calls = msg.get("tool_calls")
        if calls is not None and (msg["role"] != "assistant" or not isinstance(calls, list) or not all(_is_call(c) for c in calls)):
            return f"messages[{i}].tool_calls must be an assistant's list of {{function: {{name: string, arguments: object or JSON string}}}}"
    if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls")) for m in messages):
        return "no non-empty assistant message"
    if row.get("tools") is not None and not isinstance(row["tools"], list):
        return "field 'tools' must be a list of function schemas"
    return None


def _pair_problem(row: dict, text) -> str | None:
    """A preference pair: prompt, chosen and rejected all text, or all chat messages (chosen and
    rejected the assistant's answers to the prompt's conversation)."""
    return _text_or_messages(row, text, ("prompt", "chosen", "rejected"), "chosen and rejected")


def _prompt_problem(row: dict, text) -> str | None:
    """A prompt to sample completions for (GRPO): text, or chat messages to answer; `answer` (what the
    exact_match reward compares with) a string or a number if present."""
    problem = _text_or_messages(row, text, ("prompt",), None)
    if problem:
        return problem
    answer = row.get("answer")
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        return "field 'answer' must be a string or a number"
    return None


def _unpaired_problem(row: dict, text) -> str | None:
    """An unpaired example (KTO): a prompt, one completion, and whether it is desirable (a boolean label)."""
    if "label" not in row:
        return "missing field 'label' (true: a desirable completion, false: an undesirable one)"
    if not isinstance(row["label"], bool):
        return "field 'label' must be true or false"
    return _text_or_messages(row, text, ("prompt", "completion"), "the completion")


def _text_or_messages(row: dict, text, keys: tuple[str, ...], answers: str | None) -> str | None:
    """The fields `keys` all text (the first decides), or all non-empty lists of chat messages, those after the
    first (the answers) the assistant's."""
    if isinstance(row.get(keys[0]), str):
        return next((p for p in map(text, keys) if p), None)
    for key in keys:
        messages = row.get(key)
        if not isinstance(messages, list) or not messages:
            if messages is None:
                return f"missing field '{key}' (text, or a list of chat messages)"
            return f"field '{key}' must be text or a non-empty list of messages"
        for i, msg in enumerate(messages):
            parts = key == keys[0] and images.has_images(row) and isinstance(msg, dict) and isinstance(msg.get("content"), list)
            if not isinstance(msg, dict) or msg.get("role") not in CHAT_ROLES or not (isinstance(msg.get("content"), str) or parts):
                return f"{key}[{i}] must be {{role: system|user|assistant|tool, content: string}}"
    if answers and any(m["role"] != "assistant" for key in keys[1:] for m in row[key]):
        return f"{answers} must be assistant messages"
    return None


def _is_call(call: object) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str) and isinstance(function.get("arguments"), (dict, str))


def canonical(row: object, fmt: str, columns: dict[str, str] | None = None) -> tuple[object, str | None]:
    """(the row in its format's own shape, why it cannot be used or None). data.columns renames the
    file's columns to the format's fields; a chat row may also come as ShareGPT (`conversations` of
    {from, value}) and its messages' content as OpenAI's list of text parts."""
    if not isinstance(row, dict):
        return row, "expected a JSON object"
    if columns:
        row = dict(row)
        for field, column in columns.items():
            if column in row:
                row[field] = row.pop(column)
    if fmt == "chat":
        row, problem = _chat_shape(row)
        if problem:
            return row, problem
    if fmt == "prompt" and "prompt" not in row and isinstance(row.get("messages"), list):
        row = {**{k: v for k, v in row.items() if k != "messages"}, "prompt": row["messages"]}
    if fmt in ("preference", "unpaired", "prompt"):
        if fmt != "prompt":
            row = _pair_shape(row, ("chosen", "rejected") if fmt == "preference" else ("completion",))
        prompt = row.get("prompt")
        if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt) and (
                row.get("images") or any(isinstance(m.get("content"), list) for m in prompt)):
            # TRL's vision pairs and GRPO prompts: the prompt shows them
            shown, problem = images.gather({"messages": prompt, **({"images": row["images"]} if "images" in row else {})})
            if problem:
                return row, problem.replace("messages", "prompt", 1)
            row = {**row, "prompt": shown["messages"], **({"images": shown["images"]} if "images" in shown else {})}
    return row, _row_problem(row, fmt)


def _pair_shape(row: dict, answers: tuple[str, ...]) -> dict:
    """A chat pair as TRL's conversational rows: the shared history under `prompt` (also accepted as
    `messages`), each answer a list of messages (one given as a string or a single message is wrapped)."""
    if "prompt" not in row and isinstance(row.get("messages"), list):
        row = {**{k: v for k, v in row.items() if k != "messages"}, "prompt": row["messages"]}
    if isinstance(row.get("prompt"), list):
        for key in answers:
            answer = row.get(key)
            if isinstance(answer, str):
                row = {**row, key: [{"role": "assistant", "content": answer}]}
            elif isinstance(answer, dict):
                row = {**row, key: [answer]}
    return row


def _chat_shape(row: dict) -> tuple[dict, str | None]:
    if "messages" not in row and isinstance(row.get("conversations"), list):
        messages = []
        for i, turn in enumerate(row["conversations"]):
            speaker = turn.get("from") if isinstance(turn, dict) else None
            if speaker not in SHAREGPT_ROLES or not isinstance(turn.get("value"), str):
                return row, f"conversations[{i}] must be {{from: human|gpt|system|tool, value: string}}"
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn["value"]})
        row = {**{k: v for k, v in row.items() if k != "conversations"}, "messages": messages}
    messages = row.get("messages")
    if isinstance(messages, list) and any(isinstance(m, dict) and m.get("content") is None and m.get("tool_calls") for m in messages):
        messages = [{**m, "content": ""} if isinstance(m, dict) and m.get("content") is None and m.get("tool_calls") else m
                    for m in messages]  # OpenAI's null content beside tool calls
        row = {**row, "messages": messages}
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages) and (
            row.get("images") or any(isinstance(m.get("content"), list) for m in messages)):
        return images.gather(row)
    return row, None


@dataclass
class _Invalid:
    problem: str


def located(source: str, split: str = "train") -> Iterator[tuple[int, object]]:
    """(line or row number, row) of one source, streamed; a line that is not JSON comes as _Invalid."""
    path = Path(source).expanduser()
    if not path.exists():
        yield from _hub_rows(source, split)
    elif path.is_dir() and _saved(path):
        yield from _saved_rows(path, split)
    elif path.is_dir():
        for index, file in enumerate(folder_files(path, split)):
            for number, row in _file_rows(file):
                yield index << LINE_BITS | number, row
    else:
        yield from _file_rows(path)


def _saved(folder: Path) -> bool:
    """Written by datasets' save_to_disk (a Dataset or a DatasetDict)?"""
    return (folder / "state.json").exists() or (folder / "dataset_dict.json").exists()


def data_kind(path: Path) -> str:
    """The data format a file's name says: '.jsonl' for both x.jsonl and x.jsonl.gz."""
    return Path(path.stem).suffix if path.suffix == ".gz" else path.suffix


def folder_files(folder: Path, split: str) -> list[Path]:
    """The data files of `split` in a folder, found by datasets' own rules, all of one kind."""
    from datasets.data_files import EmptyDatasetError, get_data_patterns, resolve_pattern

    try:
        patterns = get_data_patterns(str(folder))
    except EmptyDatasetError:
        patterns = {}
    if patterns and split not in patterns:
        raise UserError(f"{folder}: no files of split '{split}' in this folder (it has {', '.join(map(str, patterns))}); "
                        f"set the source's split (data.split for all)")
    found = sorted({Path(f) for pattern in patterns.get(split, []) for f in resolve_pattern(pattern, str(folder))})
    files = [f for f in found if readable(f)]
    kinds = sorted({data_kind(f) for f in files})
    if not files:
        raise UserError(f"{folder}: no data files ({', '.join(SUFFIXES)}, or those gzipped) in this folder")
    if len(kinds) > 1:
        raise UserError(f"{folder}: holds data files of {len(kinds)} kinds ({', '.join(kinds)}); keep one kind in it, or name the files")
    return files


def _file_rows(path: Path) -> Iterator[tuple[int, object]]:
    try:
        yield from _read_file(path)
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise UserError(f"{path}: not a readable gzip file ({err})") from None


def _read_file(path: Path) -> Iterator[tuple[int, object]]:
    kind = data_kind(path)
    if not readable(path):
        raise UserError(f"{path}: unsupported data file type '{''.join(path.suffixes[-2:]) if path.suffix == '.gz' else path.suffix or path.name}' "
                        f"(expected {', '.join(SUFFIXES)}, or one of those but .parquet gzipped)")
    if kind in (".csv", ".txt"):
        yield from _text_rows(path)
    elif kind == ".jsonl":
        with _open(path) as fh:
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
    elif kind == ".json":
        try:
            with _open(path) as fh:
                rows = json.loads(fh.read().decode("utf-8"))
        except UnicodeDecodeError:
            raise UserError(f"{path}: not UTF-8 text") from None
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
        if isinstance(rows, dict) and isinstance(rows.get("data"), list):
            rows = rows["data"]
        if not isinstance(rows, list):
            raise UserError(f"{path}: expected a JSON list of rows (or JSONL)")
        yield from enumerate(rows, 1)
    else:
        yield from _parquet_rows(path)


def readable(path: Path) -> bool:
    """A data file finetune reads: one of SUFFIXES, or one of those gzipped (Parquet compresses inside)."""
    return data_kind(path) in SUFFIXES and not (path.suffix == ".gz" and data_kind(path) == ".parquet")


def _open(path: Path, text: bool = False):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="") if text else gzip.open(path, "rb")
    return path.open(encoding="utf-8", newline="") if text else path.open("rb")


def _text_rows(path: Path) -> Iterator[tuple[int, object]]:
    """CSV rows as {column: text} (the header names the columns), numbered by the line they end on;
    a .txt file's non-empty lines as {"text": line}, as datasets' text loader reads them."""
    import csv

    try:
        with _open(path, text=True) as fh:
            if data_kind(path) == ".txt":
                for number, line in enumerate(fh, 1):
                    if line.strip():
                        yield number, {"text": line.rstrip("\r\n")}
                return
            reader = csv.DictReader(fh)
            for row in reader:
                yield reader.line_num, row if None not in row else _Invalid(f"{len(row[None])} more fields than the header names")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    except csv.Error as err:
        raise UserError(f"{path}: not readable as CSV ({err})") from None


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
    yield from enumerate(_pictures_as_bytes(ds), 1)


def _saved_rows(path: Path, split: str) -> Iterator[tuple[int, object]]:
    """The rows of a folder that `datasets`' save_to_disk wrote (a Dataset, or a DatasetDict's split)."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001 - any failure here means "can't read this folder"
        raise UserError(f"{path}: cannot load this save_to_disk folder: {str(err).splitlines()[0]}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(f"{path}: no split '{split}' in this dataset (it has {', '.join(ds)}); set the source's split (data.split for all)")
        ds = ds[split]
    yield from enumerate(_pictures_as_bytes(ds), 1)


def _pictures_as_bytes(ds):
    """A dataset whose Image columns (one picture, or a list of them) give their stored bytes, not PIL
    images: the pictures are cached as their files' bytes (finetune/data/images.py), never decoded twice."""
    import datasets

    for name, feature in ds.features.items():
        if isinstance(feature, datasets.Image):
            ds = ds.cast_column(name, datasets.Image(decode=False))
        elif isinstance(feature, (datasets.List, datasets.LargeList, datasets.Sequence)) and isinstance(feature.feature, datasets.Image):
            ds = ds.cast_column(name, type(feature)(datasets.Image(decode=False)))
    return ds


def where(source: str, number: int, split: str = "train") -> str:
    """How an error names a row: file:line where a file has lines (in a folder too), the row number elsewhere."""
    path = Path(source).expanduser()
    if path.is_dir() and not _saved(path):
        source, number = str(folder_files(path, split)[number >> LINE_BITS]), number & ((1 << LINE_BITS) - 1)
    lines = data_kind(Path(source)) in (".jsonl", ".csv", ".txt")
    return f"{source}:{number}" if lines else f"{source}: row {number}"


class Skipped:
    """Bad rows skipped so far (data.bad_rows: skip): how many, and where the first was."""

    def __init__(self):
        self.count, self.first = 0, None

    def add(self, source: str, number: int, split: str, problem: str) -> None:
        self.count += 1
        if self.first is None:  # only the first is named: where() lists a folder's files to find the row's
            self.first = f"{where(source, number, split)}: {problem}"


def checked_rows(source: str, fmt: str, bad_rows: str, skipped: Skipped, split: str = "train",
                 columns: dict[str, str] | None = None) -> Iterator[tuple[int, dict]]:
    """The usable rows of one source with their numbers, in their format's own shape; a bad row fails
    with its location, or is skipped and counted."""
    for number, raw in located(source, split):
        row, problem = (raw, raw.problem) if isinstance(raw, _Invalid) else canonical(raw, fmt, columns)
        if problem is None and images.has_images(row):
            row, problem = images.located(row, _file_of(source, number, split))
        if problem is None:
            yield number, row
        elif bad_rows == "fail":
            other = [f for f in FORMATS if f != fmt and not isinstance(raw, _Invalid) and canonical(raw, f, columns)[1] is None]
            hint = f"this row looks like format '{other[0]}': set data.format: {other[0]}" if other else "set data.bad_rows: skip to skip bad rows"
            raise UserError(f"{where(source, number, split)}: {problem} (format '{fmt}'; {hint})")
        else:
            skipped.add(source, number, split, problem)


def _file_of(source: str, number: int, split: str) -> Path:
    """The file a row was read from (a folder's rows are numbered with their file's index)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path / "dataset_info.json" if _saved(path) else folder_files(path, split)[number >> LINE_BITS]
    return path


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
        return assistant_masks(tokenizer, [r["messages"] if fmt == "chat" else _alpaca_messages(r) for r in rows],
                               [r.get("tools") if fmt == "chat" else None for r in rows])
    # alpaca without a chat template: the classic Alpaca prompt
    prompts = tokenizer([_alpaca_prompt(r) for r in rows], add_special_tokens=True)["input_ids"]
    answers = tokenizer([r["output"] for r in rows], add_special_tokens=False)["input_ids"]
    return [(p + a + [tokenizer.eos_token_id], [False] * len(p) + [True] * (len(a) + 1)) for p, a in zip(prompts, answers)]


def tokenize_pairs(rows: list[dict], tokenizer, max_seq_len: int, processor=None,
                   pictures: list | None = None) -> list[tuple[list[int], list[bool], int, int] | str]:
    """Preference rows -> (chosen ids + rejected ids, which are trained, the chosen sequence's length,
    where the answer starts) each, or the reason a template refused the row. Each sequence is the prompt
    and one answer; as TRL tokenizes them, the answer is what follows the longest common start of the
    tokenized prompt and prompt + answer (text pairs get the EOS token after each answer; chat pairs are
    rendered by the chat template). Each is cut to max_seq_len (its start kept); a pair that keeps no
    answer token on one side comes back empty. A pair that shows pictures (pictures: images.row_pictures',
    per row) is tokenized by the processor, both sides with the prompt's pictures, and never cut."""
    out = []
    for row, shown in zip(rows, pictures or [[] for _ in rows]):
        if isinstance(shown, str):
            out.append(shown)
            continue
        try:
            sides = [_pair_side(row, key, tokenizer, images.encoder(processor, shown) if shown else None) for key in ("chosen", "rejected")]
        except UserError as err:
            out.append(str(err))
            continue
        longest = max(len(ids) for _, ids in sides)
        if shown and longest > max_seq_len:
            out.append(f"data: the pair's longer side is {longest} tokens with its pictures, over data.max_seq_len={max_seq_len}; a "
                       "picture's tokens cannot be cut (raise data.max_seq_len)")
            continue
        start = min(_common_start(prompt, ids) for prompt, ids in sides)
        cut = [ids[:max_seq_len] for _, ids in sides]
        if start >= max_seq_len:
            out.append(([], [], 0, start))
            continue
        trained = [[i >= start for i in range(len(ids))] for ids in cut]
        out.append((cut[0] + cut[1], trained[0] + trained[1], len(cut[0]), start))
    return out


def tokenize_unpaired(rows: list[dict], tokenizer, max_seq_len: int) -> list[tuple[list[int], list[bool], int, int] | str]:
    """Unpaired rows (KTO) -> (prompt + completion ids cut to max_seq_len, which are trained, 1 for a desirable
    completion and 0 for an undesirable one, where the completion starts) each, tokenized as a pair's side is."""
    out = []
    for row in rows:
        try:
            prompt, ids = _pair_side(row, "completion", tokenizer)
        except UserError as err:
            out.append(str(err))
            continue
        start = _common_start(prompt, ids)
        if start >= max_seq_len:
            out.append(([], [], int(row["label"]), start))
            continue
        ids = ids[:max_seq_len]
        out.append((ids, [i >= start for i in range(len(ids))], int(row["label"]), start))
    return out


def tokenize_prompts(rows: list[dict], tokenizer, processor=None, pictures: list | None = None) -> list[tuple[list[int], list[bool]] | str]:
    """Prompt rows -> (the prompt's ids, nothing trained) each: text as generation reads it (special tokens
    where the tokenizer has no chat template), chat messages rendered with the generation prompt. A prompt that
    shows pictures (pictures: images.row_pictures', per row) is tokenized by the processor with them."""
    out = []
    for row, shown in zip(rows, pictures or [[] for _ in rows]):
        if isinstance(shown, str):
            out.append(shown)
            continue
        try:
            ids = images.encoder(processor, shown)(prompt_text(row, tokenizer)) if shown else prompt_ids(row, tokenizer)
        except UserError as err:
            out.append(str(err))
            continue
        out.append((ids, [False] * len(ids)))
    return out


def prompt_text(row: dict, tokenizer) -> str:
    """A prompt row as the text the model completes."""
    if isinstance(row["prompt"], str):
        return row["prompt"]
    return render(tokenizer, row["prompt"], add_generation_prompt=True, tools=row.get("tools"))


def prompt_ids(row: dict, tokenizer) -> list[int]:
    add = isinstance(row["prompt"], str) and not tokenizer.chat_template  # as evaluate.generate tokenizes a prompt
    return tokenizer(prompt_text(row, tokenizer), add_special_tokens=add)["input_ids"]


def _pair_side(row: dict, key: str, tokenizer, encode=None) -> tuple[list[int], list[int]]:
    """(the prompt's ids, the prompt and one answer's ids); encode: a chat pair's text -> ids (a processor's, with the pictures)."""
    if isinstance(row["prompt"], str):
        eos = tokenizer.eos_token or ""
        answer = row[key] if row[key].endswith(eos) else row[key] + eos
        return tokenizer(row["prompt"])["input_ids"], tokenizer(row["prompt"] + answer)["input_ids"]
    tools = row.get("tools")
    prompt = render(tokenizer, row["prompt"], add_generation_prompt=True, tools=tools)
    full = render(tokenizer, row["prompt"] + row[key], tools=tools)
    encode = encode or (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    return encode(prompt), encode(full)


def _common_start(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def prompt_and_answer(row: dict, tokenizer, fmt: str) -> tuple[str, str]:
    """The prompt text a model should complete, and the reference answer (alpaca and chat rows)."""
    if fmt == "chat":
        last = max(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant")
        msgs = row["messages"]
        return render(tokenizer, msgs[:last], add_generation_prompt=True, tools=row.get("tools")), msgs[last]["content"]
    if fmt == "alpaca":
        if tokenizer.chat_template:
            return render(tokenizer, _alpaca_messages(row)[:1], add_generation_prompt=True), row["output"]
        return _alpaca_prompt(row), row["output"]
    if fmt == "prompt":
        return prompt_text(row, tokenizer), str(row.get("answer", ""))
    if fmt in ("preference", "unpaired"):  # the chosen answer; the completion (the data step keeps the desirable ones as examples)
        key = "chosen" if fmt == "preference" else "completion"
        if isinstance(row["prompt"], str):
            return row["prompt"], row[key]
        return render(tokenizer, row["prompt"], add_generation_prompt=True, tools=row.get("tools")), row[key][-1]["content"]
    raise ValueError("completion rows have no prompt/answer split")


