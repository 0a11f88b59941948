"""Data: read rows, check them, tokenize with a loss mask, cache, pack, batch.

Rows come from local JSON/JSONL (parsed here, so a bad row is reported with its file and line),
Parquet or a hub dataset (through `datasets`). Each row becomes a sample of `input_ids` and `labels`
(-100 where no loss is taken). Samples are packed into rows of at most `max_seq_len` tokens whose
`position_ids` restart at every sample: transformers turns that into a block-diagonal causal mask
(when no attention_mask is passed), so tokens never attend across samples on eager/sdpa/flash alike.
Padding, where a batch needs it, is one more such segment, with labels -100.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.chat import assistant_mask, render
from finetune.config import DataConfig, data_files
from finetune.errors import UserError

IGNORE = -100

ALPACA_PROMPT = (
    "Below is an instruction that describes a task{with_input}. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
)
CHAT_ROLES = {"system", "user", "assistant", "tool"}


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


def _read_local(path: Path) -> list[tuple[str, object]]:
    """(location, row) pairs; location is 'file:line' for JSONL, 'file: row N' otherwise."""
    if path.suffix == ".jsonl":
        out = []
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    out.append((where, json.loads(line)))
                except json.JSONDecodeError as err:
                    out.append((where, _Invalid(f"invalid JSON ({err.msg})")))
        return out
    if path.suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
        if isinstance(rows, dict) and isinstance(rows.get("data"), list):
            rows = rows["data"]
        if not isinstance(rows, list):
            raise UserError(f"{path}: expected a JSON list of rows (or JSONL)")
        return [(f"{path}: row {i + 1}", row) for i, row in enumerate(rows)]
    if path.suffix == ".parquet":
        import datasets

        ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
        return [(f"{path}: row {i + 1}", row) for i, row in enumerate(ds)]
    raise UserError(f"{path}: unsupported data file type '{path.suffix}' (expected .jsonl, .json or .parquet)")


@dataclass
class _Invalid:
    problem: str


def read_rows(sources: list[str], fmt: str, bad_rows: str, split: str = "train") -> list[dict]:
    """All valid rows of the given files (or hub datasets). Bad rows fail or are skipped and counted."""
    rows, skipped, first_skip = [], 0, None
    for source in sources:
        path = Path(source).expanduser()
        if path.exists():
            located = _read_local(path)
        else:  # a hub dataset name: only reachable where a hub is
            import datasets

            try:
                ds = datasets.load_dataset(source, split=split)
            except Exception as err:  # noqa: BLE001 - any failure here means "can't get this dataset"
                raise UserError(f"data: cannot load dataset '{source}': {str(err).splitlines()[0]}") from None
            located = [(f"{source}: row {i + 1}", row) for i, row in enumerate(ds)]
        for where, row in located:
            problem = row.problem if isinstance(row, _Invalid) else _row_problem(row, fmt)
            if problem is None:
                rows.append(row)
            elif bad_rows == "fail":
                raise UserError(f"{where}: {problem} (format '{fmt}'; set data.bad_rows: skip to skip bad rows)")
            else:
                skipped += 1
                first_skip = first_skip or f"{where}: {problem}"
    if skipped:
        print(f"data: skipped {skipped} bad row(s); first: {first_skip}")
    if not rows:
        raise UserError(f"data: no usable rows in {', '.join(sources)}")
    return rows


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
    if fmt == "completion":
        ids = tokenizer(row["text"], add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
            ids = ids + [tokenizer.eos_token_id]
        trained = [True] * len(ids)
    elif fmt == "chat" or tokenizer.chat_template:
        ids, trained = assistant_mask(tokenizer, row["messages"] if fmt == "chat" else _alpaca_messages(row))
    else:  # alpaca without a chat template: the classic Alpaca prompt
        prompt = tokenizer(_alpaca_prompt(row), add_special_tokens=True)["input_ids"]
        answer = tokenizer(row["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, trained = prompt + answer, [False] * len(prompt) + [True] * len(answer)
    labels = [t if (train_on_prompt or keep) else IGNORE for t, keep in zip(ids, trained)]
    return {"input_ids": ids, "labels": labels}


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


# ----------------------------------------------------------------------------------------------
# Cache


def _fingerprint(cfg: DataConfig, tokenizer, sources: list[str], role: str) -> str:
    h = hashlib.sha256()
    for source in sources:
        path = Path(source).expanduser()
        stat = path.stat() if path.exists() else None
        h.update(f"{path.resolve() if stat else source}|{stat.st_size if stat else ''}|{stat.st_mtime_ns if stat else ''}".encode())
    h.update(tokenizer.backend_tokenizer.to_str().encode())
    h.update(str(tokenizer.chat_template).encode())
    h.update(json.dumps([role, cfg.format, cfg.train_on_prompt, cfg.bad_rows, cfg.split, tokenizer.eos_token_id]).encode())
    return h.hexdigest()[:24]


def cache_root(cfg: DataConfig) -> Path:
    root = cfg.cache_dir or os.environ.get("FINETUNE_CACHE") or "~/.cache/finetune"
    return Path(root).expanduser() / "tokenized"


def tokenized_samples(cfg: DataConfig, tokenizer, sources: list[str], role: str) -> tuple[list, list, bool]:
    """Tokenized (input_ids, labels) lists of the given sources, from the cache when present.

    Returns (input_ids, labels, from_cache).
    """
    import datasets

    path = cache_root(cfg) / _fingerprint(cfg, tokenizer, sources, role)
    if (path / "dataset_info.json").exists():
        ds = datasets.load_from_disk(str(path))
        return ds["input_ids"], ds["labels"], True
    rows = read_rows(sources, cfg.format, cfg.bad_rows, cfg.split)
    ds = datasets.Dataset.from_list([{"row": json.dumps(r)} for r in rows])
    ds = ds.map(
        lambda ex: tokenize_row(json.loads(ex["row"]), tokenizer, cfg.format, cfg.train_on_prompt),
        remove_columns=["row"],
        num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
        desc=f"tokenizing {role}",
    )
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    datasets.disable_progress_bars()
    ds.save_to_disk(str(tmp))
    datasets.enable_progress_bars()
    if path.exists():  # another process filled the same entry meanwhile: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, path)
    return ds["input_ids"], ds["labels"], False


# ----------------------------------------------------------------------------------------------
# Truncation, packing, batching


@dataclass
class Row:
    """One training row: one sample, or several packed, each with positions starting at 0."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]


def prepare_samples(input_ids: list, labels: list, max_seq_len: int) -> tuple[list[tuple[list, list]], dict]:
    """Truncate to max_seq_len; drop samples with no trained token. Returns samples and counts."""
    samples, truncated, dropped = [], 0, 0
    for ids, lab in zip(input_ids, labels):
        if len(ids) > max_seq_len:
            ids, lab, truncated = ids[:max_seq_len], lab[:max_seq_len], truncated + 1
        # The first token of a sample is never predicted (nothing precedes it in its own sequence):
        # masking it also keeps a packed neighbour's last token from being trained to predict it.
        lab = [IGNORE] + list(lab[1:])
        if all(t == IGNORE for t in lab):
            dropped += 1
            continue
        samples.append((list(ids), lab))
    return samples, {"samples": len(samples), "truncated": truncated, "dropped_no_target": dropped}


def pack(samples: list[tuple[list, list]], max_seq_len: int) -> list[Row]:
    """Best-fit-decreasing bin packing: few rows, little padding, deterministic."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i][0]))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, bin index), sorted
    for i in order:
        n = len(samples[i][0])
        pos = bisect.bisect_left(free, (n, -1))
        if pos < len(free):
            space, b = free.pop(pos)
        else:
            space, b = max_seq_len, len(bins)
            bins.append([])
        bins[b].append(i)
        if space - n > 0:
            bisect.insort(free, (space - n, b))
    return [_join([samples[i] for i in members]) for members in bins]


def _join(parts: list[tuple[list, list]]) -> Row:
    ids, labels, positions = [], [], []
    for sample_ids, sample_labels in parts:
        ids += sample_ids
        labels += sample_labels
        positions += range(len(sample_ids))
    return Row(ids, labels, positions)


def build_rows(samples: list[tuple[list, list]], max_seq_len: int, packing: bool) -> list[Row]:
    return pack(samples, max_seq_len) if packing else [_join([s]) for s in samples]


def collate(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Stack rows padded to the longest row of this batch. The pad is its own position segment, so no
    attention_mask is needed and real tokens never see it."""
    width = max(len(r.input_ids) for r in rows)
    ids, labels, positions = [], [], []
    for r in rows:
        pad = width - len(r.input_ids)
        ids.append(r.input_ids + [pad_id] * pad)
        labels.append(r.labels + [IGNORE] * pad)
        positions.append(r.position_ids + list(range(pad)))
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "labels": torch.tensor(labels, dtype=torch.long),
        "position_ids": torch.tensor(positions, dtype=torch.long),
    }


def epoch_batches(num_rows: int, micro_batch_size: int, seed: int, epoch: int, rank: int, world: int) -> list[list[int]]:
    """This rank's micro-batches (row indices) for one epoch.

    The order is a function of (seed, epoch) only, so a resumed run sees the same batches. Every rank
    gets the same number of batches: uneven counts make ranks wait on collectives that never come.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(num_rows, generator=gen).tolist()
    batches = [perm[i : i + micro_batch_size] for i in range(0, num_rows, micro_batch_size)]
    usable = len(batches) - len(batches) % world
    return batches[rank:usable:world]


# ----------------------------------------------------------------------------------------------
# The whole data step


@dataclass
class Datasets:
    train: list[Row]
    eval: list[Row]
    eval_examples: list[dict]  # raw eval rows, for generation checks
    stats: dict


def load_data(cfg: DataConfig, tokenizer, seed: int, keep_eval_examples: bool = False) -> Datasets:
    """Train and eval rows, ready to batch. Eval comes from data.eval or a seeded share of train.

    With keep_eval_examples, the raw eval rows are kept too (for generation checks)."""
    keep_eval_examples = keep_eval_examples and cfg.format != "completion"
    stats: dict = {}
    train_ids, train_labels, cached = tokenized_samples(cfg, tokenizer, data_files(cfg.train), "train")
    stats["cache_hit"] = cached
    eval_ids, eval_labels, eval_rows = [], [], []
    if cfg.eval:
        eval_ids, eval_labels, _ = tokenized_samples(cfg, tokenizer, data_files(cfg.eval), "eval")
        if keep_eval_examples:
            eval_rows = read_rows(data_files(cfg.eval), cfg.format, "skip")
    elif cfg.eval_fraction > 0:
        n = len(train_ids)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        n_eval = max(1, int(n * cfg.eval_fraction))
        held, kept = order[:n_eval], order[n_eval:]
        eval_ids, eval_labels = [train_ids[i] for i in held], [train_labels[i] for i in held]
        train_ids, train_labels = [train_ids[i] for i in kept], [train_labels[i] for i in kept]
        if keep_eval_examples:
            all_rows = read_rows(data_files(cfg.train), cfg.format, "skip")
            eval_rows = [all_rows[i] for i in held] if len(all_rows) == n else []
    train_samples, stats["train"] = prepare_samples(train_ids, train_labels, cfg.max_seq_len)
    eval_samples, stats["eval"] = prepare_samples(eval_ids, eval_labels, cfg.max_seq_len)
    train_rows = build_rows(train_samples, cfg.max_seq_len, cfg.packing)
    eval_rows_packed = build_rows(eval_samples, cfg.max_seq_len, cfg.packing)
    real = sum(len(s[0]) for s in train_samples)
    stats["train"]["rows"] = len(train_rows)
    stats["train"]["tokens"] = real
    if cfg.packing and train_rows:
        stats["train"]["fill"] = real / (len(train_rows) * cfg.max_seq_len)
    return Datasets(train_rows, eval_rows_packed, eval_rows, stats)
