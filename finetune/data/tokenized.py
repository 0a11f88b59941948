"""The tokenized-data cache: one entry per data source, Arrow files that every process memory-maps.

An entry is made once per node: the first process to take the entry's lock reads the source (checking
every row, streamed), tokenizes it with `datasets.map` (batched tokenizer calls, `data.num_proc`
processes) and renames the finished entry into place; the others wait for the lock (saying so, for at
most `data.tokenize_wait_minutes`), then map the same files: one copy in the page cache for the node.

Columns: `input_ids`, `labels` (int32 lists), `length`, `first_target` (the first position after the
first whose label is trained, -1 if none), `row` (the row as JSON, for eval prompts), `line` (its
line or row number, for messages), `problem` (why the chat template refused the row, if it did) and
`images` (a picture row's pictures, their files' bytes: finetune/data/images.py).
The key covers the source (each file's path, size and mtime, every file of a folder; its split), the
tokenizer and chat template, the processor's picture settings (a vision-language model), the settings that change the tokens, and TOKENIZE_VERSION.
An answers entry (sequence-level distillation) holds the same columns with each sample's answer replaced by
the teacher's, keyed by the sources' entries, who answered and how (the teacher's files and settings) and max_seq_len.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

from finetune.checkpoint.locks import exclusive
from finetune.config.errors import UserError, make_folder
from finetune.config.schema import DataConfig, SourceConfig
from finetune.data import images
from finetune.data.encoding import tokenize_pairs, tokenize_prompts, tokenize_rows, tokenize_unpaired
from finetune.data.readers import Skipped, checked_rows, where
from finetune.data.rows import IGNORE

# Raise it when the ids or loss mask a row turns into change (2: masks from the chat template; 3: rows
# cached in their canonical shape; 4: preference pairs).
TOKENIZE_VERSION = 6  # 4: preference pairs (prompt and unpaired rows are new formats: no entry of theirs to invalidate); 5: pictures;
# 6: prompts with pictures
LARGE = 10_000  # rows from which tokenization uses every core unless data.num_proc says otherwise


def cache_root(cfg: DataConfig) -> Path:
    root = cfg.cache_dir or os.environ.get("FINETUNE_CACHE") or "~/.cache/finetune"
    return Path(root).expanduser() / "tokenized"


def fingerprint(source: SourceConfig, cfg: DataConfig, tokenizer, processor=None) -> str:
    h = hashlib.sha256()
    path = Path(source.path).expanduser()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.exists() else []
    for file in files:  # a folder: every file in it, so that an added, removed or changed shard makes a new entry
        stat = file.stat()
        h.update(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    h.update(f"{source.path}|{source.split}".encode())
    h.update(tokenizer.backend_tokenizer.to_str().encode())
    h.update(str(tokenizer.chat_template).encode())
    if processor is not None:
        h.update(processor.image_processor.to_json_string().encode())
    cut = cfg.max_seq_len if source.format == "preference" else None  # pairs are cut when tokenized, each side on its own
    h.update(json.dumps([TOKENIZE_VERSION, source.format, source.bad_rows, cfg.train_on_prompt, tokenizer.eos_token_id, source.columns,
                         cut]).encode())
    return h.hexdigest()[:24]


def tokenized(source: SourceConfig, cfg: DataConfig, tokenizer, say=print, processor=None):
    """(the source's tokenized samples as a pyarrow Table over memory-mapped files, whether the cache had them)."""
    root = cache_root(cfg)
    make_folder(root, "data.cache_dir")
    key = fingerprint(source, cfg, tokenizer, processor)
    return cached_entry(root, key, f"tokenizing {source.path}", cfg, say, lambda work: _build(source, cfg, tokenizer, work, say, processor))


def cached_entry(root: Path, name: str, doing: str, cfg: DataConfig, say, build):
    """(the cache entry `name` as a table, whether it was there). `build(work)` writes it into a work folder, once
    per node under the entry's lock, and the folder is renamed into place: an entry is whole or absent."""
    entry = root / name
    if (entry / MANIFEST).exists():
        return _load(entry), True
    lock = root / f"{name}.lock"
    with exclusive(lock, f"data: another process is {doing}; waiting for it", timeout_s=60 * cfg.tokenize_wait_minutes,
                   timeout_hint=f"raise data.tokenize_wait_minutes, or stop the process that holds {lock}", say=say):
        if (entry / MANIFEST).exists():
            return _load(entry), True
        for stale in [*root.glob(f".partial-{name}-*"), entry]:  # a writer killed mid-way: nobody else builds this entry now
            shutil.rmtree(stale, ignore_errors=True)
        work = root / f".partial-{name}-{os.getpid()}"
        try:
            build(work)
            os.replace(work, entry)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return _load(entry), False


MANIFEST = "manifest.json"  # written last: an entry without it is incomplete


def _load(entry: Path):
    import pyarrow as pa

    files = json.loads((entry / MANIFEST).read_text())["files"]
    return pa.concat_tables([pa.ipc.open_stream(pa.memory_map(str(entry / name))).read_all() for name in files])


def _build(source: SourceConfig, cfg: DataConfig, tokenizer, work: Path, say, processor=None) -> None:
    """Read and check the rows into rows.arrow, tokenize them into tokens*.arrow (the entry's files,
    written by datasets.map's processes), then write the manifest. The main process reads no token
    back: its memory stays what it was, however large the source."""
    import datasets
    from datasets.arrow_writer import ArrowWriter
    from tqdm.auto import tqdm

    work.mkdir(parents=True)
    skipped = Skipped()
    rows_file = work / "rows.arrow"
    features = datasets.Features({"row": datasets.Value("string"), "line": datasets.Value("int64")})
    with ArrowWriter(features=features, path=str(rows_file)) as writer, tqdm(desc=f"reading {source.path}", unit=" rows", delay=2) as bar:
        batch = {"row": [], "line": []}
        for number, row in checked_rows(source.path, source.format, source.bad_rows, skipped, source.split, source.columns):
            batch["row"].append(json.dumps(row, ensure_ascii=False))
            batch["line"].append(number)
            if len(batch["row"]) == 1000:
                writer.write_batch(batch)
                bar.update(len(batch["row"]))
                batch = {"row": [], "line": []}
        if batch["row"]:
            writer.write_batch(batch)
            bar.update(len(batch["row"]))
        writer.finalize()
    rows = datasets.Dataset.from_file(str(rows_file))
    if len(rows) == 0:
        raise UserError(f"data: no usable rows in {source.path}" + (f" ({skipped.count} bad; first: {skipped.first})" if skipped.count else ""))
    num_proc = cfg.num_proc or (len(os.sched_getaffinity(0)) if len(rows) >= LARGE else 1)
    # Batches of 4,000 rows are also the record batches of the files: every process that maps them
    # faults in a few pages around each batch's header (the kernel's fault-around), so fewer, larger
    # batches keep that small (500-row batches: ~126 MiB of mapped pages at 1M rows; 4,000: ~16 MiB).
    tokens = rows.with_format("arrow").map(_tokenize_batch, batched=True, batch_size=4000, num_proc=num_proc if num_proc > 1 else None,
                      fn_kwargs={"tokenizer": tokenizer, "fmt": source.format, "train_on_prompt": cfg.train_on_prompt, "max_seq_len": cfg.max_seq_len,
                                 "processor": processor},
                      features=_features(datasets), cache_file_name=str(work / "tokens.arrow"), desc=f"tokenizing {source.path}")
    _refused_rows(tokens.data.table, source, skipped)
    if skipped.count:
        say(f"data: skipped {skipped.count} bad row(s) of {source.path}; first: {skipped.first}")
    files = [Path(f["filename"]).name for f in tokens.cache_files]
    del tokens, rows
    rows_file.unlink()
    (work / MANIFEST).write_text(json.dumps({"files": files, "source": source.path}))


def _refused_rows(table, source: SourceConfig, skipped: Skipped) -> None:
    """Rows the chat template refused to render or mask: fail on the first, or count them as skipped
    (their samples are empty and drop out)."""
    import pyarrow.compute as pc

    bad = pc.indices_nonzero(pc.is_valid(table.column("problem")))
    for line, problem in zip(table.column("line").take(bad).to_pylist(), table.column("problem").take(bad).to_pylist()):
        if source.bad_rows == "fail":
            raise UserError(f"{where(source.path, line, source.split)}: {problem.removeprefix('data: ')} (set data.bad_rows: skip to skip such rows)")
        skipped.add(source.path, line, source.split, problem.removeprefix("data: "))


def _features(datasets):
    ids = datasets.Sequence(datasets.Value("int32"))
    return datasets.Features({"row": datasets.Value("string"), "line": datasets.Value("int64"), "input_ids": ids, "labels": ids,
                              "length": datasets.Value("int32"), "first_target": datasets.Value("int32"), "chosen_length": datasets.Value("int32"),
                              "problem": datasets.Value("string"), "images": datasets.Sequence(datasets.Value("binary"))})


def _unless_refused(tokenize, rows: list[dict], tokenizer, fmt: str, pictures: list) -> list:
    """tokenize(rows, tokenizer, fmt)'s results for the rows whose pictures were not refused (images.row_pictures); the
    others get the reason, unrendered: a text model's chat template may not take a message's picture parts."""
    kept = [i for i, p in enumerate(pictures) if not isinstance(p, str)]
    done = iter(tokenize([rows[i] for i in kept], tokenizer, fmt) if kept else [])
    return [p if isinstance(p, str) else next(done) for p in pictures]


def _tokenize_batch(batch, tokenizer, fmt: str, train_on_prompt: bool, max_seq_len: int, processor=None):
    """datasets.map's function, on Arrow batches: rows -> token columns built from flat numpy arrays
    (no per-token Python lists for Arrow to convert). A preference pair is one sample: the chosen
    sequence, then the rejected one from `chosen_length` on. An unpaired example (KTO) keeps its label there
    (1: desirable, 0: undesirable)."""
    import numpy as np
    import pyarrow as pa

    rows = [json.loads(r) for r in batch.column("row").to_pylist()]
    pictures = images.row_pictures(rows, processor) if fmt in ("chat", "preference", "prompt") else [[] for _ in rows]
    results = (tokenize_pairs(rows, tokenizer, max_seq_len, processor, pictures) if fmt == "preference"
               else tokenize_prompts(rows, tokenizer, processor, pictures) if fmt == "prompt"
               else tokenize_unpaired(rows, tokenizer, max_seq_len) if fmt == "unpaired" else _unless_refused(tokenize_rows, rows, tokenizer, fmt, pictures))
    if fmt == "chat":
        results = images.expand_rows(rows, results, tokenizer, processor, pictures, max_seq_len)
    problems = [r if isinstance(r, str) else None for r in results]
    results = [([], [], 0, -1) if isinstance(r, str) else r for r in results]
    lengths = np.fromiter((len(r[0]) for r in results), dtype=np.int64, count=len(results))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    total = int(offsets[-1])
    ids = np.fromiter(chain.from_iterable(r[0] for r in results), dtype=np.int32, count=total)
    trained = np.ones(total, dtype=bool) if train_on_prompt else np.fromiter(chain.from_iterable(r[1] for r in results), dtype=bool, count=total)
    labels = np.where(trained, ids, np.int32(IGNORE))
    # first_target: a sample's first trained position after its first (that one is never trained).
    position = np.arange(total) - np.repeat(offsets[:-1], lengths)
    hits = np.flatnonzero(trained & (position >= 1))
    first = np.full(len(results), -1, dtype=np.int32)
    rows, at = np.unique(np.searchsorted(offsets, hits, side="right") - 1, return_index=True)
    first[rows] = position[hits[at]]
    if fmt in ("preference", "unpaired"):  # where the answers start, also for a sample cut before it (so the data step can say why it dropped)
        first = np.array([r[3] for r in results], dtype=np.int32)
    if fmt == "prompt":  # the last prompt token predicts the first completion token: a prompt longer than max_seq_len is left out
        first = np.where(lengths > 0, lengths - 1, -1).astype(np.int32)
    arrow_offsets = pa.array(offsets.astype(np.int32))
    return (batch.append_column("input_ids", pa.ListArray.from_arrays(arrow_offsets, pa.array(ids)))
            .append_column("labels", pa.ListArray.from_arrays(arrow_offsets, pa.array(labels)))
            .append_column("length", pa.array(lengths.astype(np.int32)))
            .append_column("first_target", pa.array(first))
            .append_column("chosen_length", pa.array(np.array([r[2] if fmt in ("preference", "unpaired") else 0 for r in results], dtype=np.int32)))
            .append_column("problem", pa.array(problems, type=pa.string()))
            .append_column("images", pa.array([[] if p or isinstance(data, str) else data for p, data in zip(problems, pictures)],
                                              type=pa.list_(pa.binary()))))


@dataclass
class Answers:
    """Answers that replace the data's (sequence-level distillation: the teacher's): `answer` maps prompts (token
    arrays) to answers (token lists, cut after EOS); `key` names who answers and how, for the cache."""

    key: str
    answer: Callable[[list], list[list[int]]]


ANSWER_BATCH = 16  # prompts per answer() call
WRITE_SAMPLES = 4000  # samples per record batch of an answers entry (as a source's entry)


def answered(table, keys: list[str], answers: Answers, cfg: DataConfig, say=print):
    """(`table`'s samples with each one's answer, from its first trained token on, replaced by `answers`' answer to
    the tokens before it, as a table over memory-mapped files; whether the cache had it). Made once per node under
    the entry's lock, as a source's entry is; a sample with nothing trained stays as it is."""
    key = hashlib.sha256(json.dumps([TOKENIZE_VERSION, keys, answers.key, cfg.max_seq_len]).encode()).hexdigest()[:24]

    def build(work: Path) -> None:
        work.mkdir(parents=True)
        _write_answered(table, _answers_of(table, answers, cfg.max_seq_len), work / "answered.arrow")
        (work / MANIFEST).write_text(json.dumps({"files": ["answered.arrow"], "source": keys}))

    return cached_entry(cache_root(cfg), f"answers-{key}", "writing the teacher's answers", cfg, say, build)


def _answers_of(table, answers: Answers, max_seq_len: int) -> dict[int, object]:
    """sample -> its answer (int32 array), for every sample with a trained token within max_seq_len; asked shortest prompt first (less
    padding in each batch of prompts)."""
    import numpy as np
    from tqdm.auto import tqdm

    first = table.column("first_target").to_numpy()
    asked = np.flatnonzero((first >= 1) & (first < max_seq_len))  # a longer prompt leaves its answer untrained
    asked = asked[np.argsort(first[asked], kind="stable")]
    found: dict[int, object] = {}
    ids = table.column("input_ids")
    for start in tqdm(range(0, len(asked), ANSWER_BATCH), desc="teacher's answers", unit=" batches", delay=2):
        picks = asked[start : start + ANSWER_BATCH]
        prompts = [np.asarray(ids[int(i)].values.to_numpy()[: first[i]], dtype=np.int64) for i in picks]
        for i, answer in zip(picks, answers.answer(prompts)):
            found[int(i)] = np.asarray(answer, dtype=np.int32)
    return found


def _write_answered(table, found: dict[int, object], path: Path) -> None:
    """The table with the answers in place, written as a stream of record batches (no token as a Python object)."""
    import numpy as np
    import pyarrow as pa

    first = table.column("first_target").to_numpy()
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for start in range(0, len(table), WRITE_SAMPLES):
            part = table.slice(start, WRITE_SAMPLES)
            ids, labels, cuts = [], [], []
            part_ids, part_labels = part.column("input_ids"), part.column("labels")
            for k in range(len(part)):
                i = start + k
                own_ids = part_ids[k].values.to_numpy()
                if i in found:
                    prompt = own_ids[: first[i]]
                    own_ids = np.concatenate([prompt, found[i]])
                    own_labels = np.concatenate([np.full(len(prompt), IGNORE, dtype=np.int32), found[i]])
                    cuts.append(len(prompt))
                else:
                    own_labels = part_labels[k].values.to_numpy()
                    cuts.append(first[i])
                ids.append(own_ids)
                labels.append(own_labels)
            offsets = pa.array(np.concatenate([[0], np.cumsum([len(x) for x in ids])]).astype(np.int32))
            columns = {"input_ids": pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(ids).astype(np.int32))),
                       "labels": pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(labels).astype(np.int32))),
                       "length": pa.array(np.diff(offsets.to_numpy()).astype(np.int32)), "first_target": pa.array(np.array(cuts, dtype=np.int32))}
            for name, column in columns.items():
                part = part.set_column(part.schema.get_field_index(name), part.schema.field(name), column)
            for batch in part.to_batches():
                writer.write_batch(batch)
