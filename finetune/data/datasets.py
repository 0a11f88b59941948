"""The data step: sources -> tokenized cache entries -> mixing and the eval split -> packed rows.

Every source is tokenized once per node into memory-mapped Arrow files (finetune/data/tokenized.py). What
the run holds in its own memory is per sample, never per token: lengths, the samples each source
contributes (repeated or a seeded subset, by its weight), and the packed layout (finetune/data/packing.py),
which is cached next to the tokens so that a second run starts at once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from finetune.config.errors import UserError
from finetune.config.schema import DataConfig, RunConfig, SourceConfig, data_sources
from finetune.data import images
from finetune.data.packing import Split, Unpaired, epoch_batches, pack, unpacked
from finetune.data.readers import where
from finetune.data.rows import IGNORE
from finetune.data.tokenized import Answers, answered, cache_root, fingerprint, tokenized

PACK_VERSION = 1  # raise it when pack() lays out rows differently


@dataclass
class Datasets:
    train: Split
    eval: Split | None
    eval_examples: list[dict]  # raw eval rows, for generation checks
    stats: dict = field(default_factory=dict)


@dataclass
class _Samples:
    """Tokenized sources side by side: one Arrow table, and per sample its length cut to max_seq_len,
    whether it was cut, and whether it trains anything within that length."""

    table: object  # pyarrow.Table over the entries' memory-mapped files
    keys: list[str]
    ranges: list[tuple[int, int]]  # each source's samples in the table
    sources: list[SourceConfig]
    full: np.ndarray  # tokens of each sample
    lengths: np.ndarray  # cut to max_seq_len
    truncated: np.ndarray
    chunked: np.ndarray  # a completion document longer than max_seq_len, trained as windows (data.long_documents: chunk)
    first: np.ndarray  # the first trained position (-1: none)
    trains: np.ndarray
    cached: bool
    width: int  # tokens a row holds: max_seq_len, or twice that where a sample is a preference pair


def load_data(cfg: DataConfig, tokenizer, seed: int, eval_examples: int = 0, say=print, processor=None, answers: Answers | None = None) -> Datasets:
    """Train and eval rows, ready to batch. Eval comes from data.eval or a seeded share of train; with
    eval_examples, that many raw eval rows are kept too (for generation checks). processor: a
    vision-language model's (AutoProcessor), which tokenizes rows with pictures and makes their pixels.
    answers: replace the training samples' answers (sequence-level distillation: the teacher's; eval keeps the data's)."""
    started = time.perf_counter()
    train_sources = data_sources(cfg.train, cfg)
    source = _tokenized(train_sources, cfg, tokenizer, say, processor)
    train = source if answers is None else _answered(source, answers, cfg, say)
    stats: dict = {"cache_hit": train.cached}
    picked = [np.arange(a, b, dtype=np.int32 if b < 2**31 else np.int64) for a, b in train.ranges]
    held = np.zeros(0, dtype=np.int64)
    if cfg.eval_fraction > 0:
        import torch

        total = int(train.ranges[-1][1])
        order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).numpy()
        held = np.sort(order[: max(1, int(total * cfg.eval_fraction))])
        picked = [np.setdiff1d(p, held, assume_unique=True) for p in picked]
    weighted = [_weighted(p, s.weight, seed, i) for i, (p, s) in enumerate(zip(picked, train_sources))]
    samples = np.concatenate(weighted)
    split, stats["train"] = _split(train, samples, cfg, seed, "train")
    used = np.where(train.chunked, train.full, train.lengths)  # a chunked document trains all its tokens
    stats["train"]["sources"] = [{"path": s.path, "samples": int(train.trains[w].sum()), "tokens": int(used[w][train.trains[w]].sum())}
                                 for s, w in zip(train_sources, weighted)]
    examples: list[dict] = []
    if cfg.eval:
        evals = _tokenized(data_sources(cfg.eval, cfg), cfg, tokenizer, say, processor)
        eval_split, stats["eval"] = _split(evals, np.arange(evals.ranges[-1][1]), cfg, seed, "eval")
        examples = _rows(evals.table, np.arange(min(eval_examples, len(evals.lengths))))
    elif len(held):
        eval_split, stats["eval"] = _split(source, held, cfg, seed, "eval")
        examples = _rows(source.table, held[:eval_examples])
    else:
        eval_split, stats["eval"] = None, {}
    if eval_split is not None and len(eval_split) == 0:
        eval_split = None
    for part in (split, eval_split) if processor is not None else ():
        if part is not None:
            # packed rows, and a pair's two sequences in one row, are kept apart by restarting positions: no attention mask
            part.vision, part.masked = functools.partial(images.image_inputs, processor), not cfg.packing and part.pairs is None
    if cfg.format == "completion":  # no prompt and answer to compare a generation with (preference pairs: the chosen answer)
        examples = []
    if cfg.format == "unpaired":  # an undesirable completion is no answer to match
        examples = [row for row in examples if row["label"]]
    stats["seconds"] = time.perf_counter() - started
    return Datasets(split, eval_split, examples, stats)


def summary_lines(data: Datasets, max_seq_len: int) -> list[str]:
    """What the data step made of the sources, as train prints it: samples, rows, tokens, what was cut or left out."""
    s = data.stats["train"]
    lines = [f"data: {s['samples']} samples -> {s['rows']} rows, {s['tokens']} tokens"
             + (f", {s['fill']:.0%} of packed rows filled" if "fill" in s else "")
             + f", {s['truncated']} truncated" + (f", {s['chunked']} long documents as {s['windows']} windows" if s["chunked"] else "")
             + f"; {len(data.eval) if data.eval else 0} eval rows; cache {'hit' if data.stats['cache_hit'] else 'written'} ({data.stats['seconds']:.1f} s)"]
    if s["dropped_no_target"]:
        lines.append(f"data: {s['dropped_no_target']} sample(s) left out: nothing to train within data.max_seq_len={max_seq_len} "
                     f"(the prompt fills it, or the answer is empty); first: {s['first_dropped']}")
    if len(s["sources"]) > 1:
        lines += [f"  {source['path']}: {source['samples']} samples, {source['tokens']} tokens" for source in s["sources"]]
    return lines


def show(split: Split, tokenizer, count: int, picture_token: str | None = None) -> Iterator[str]:
    """The first `count` sequences of the first rows, decoded as the model reads them, the tokens that
    are trained «marked like this» (a preference pair shows as its two sequences); a picture's run of
    `picture_token`s as [picture: N tokens]."""
    shown = 0
    for r in range(len(split)):
        row = split.rows([r])[0]
        ids, labels, positions = (np.asarray(x) for x in (row.input_ids, row.labels, row.position_ids))
        edges = [*np.flatnonzero(positions == 0), len(ids)]
        for i, (s, e) in enumerate(zip(edges, edges[1:])):
            if shown == count:
                return
            trained = labels[s:e] != IGNORE
            if not trained.any():
                continue  # a row's padding
            cuts = [0, *(np.flatnonzero(np.diff(trained.astype(np.int8))) + 1), e - s]
            text = "".join(("«{}»" if trained[a] else "{}").format(tokenizer.decode(ids[s + a : s + b].tolist())) for a, b in zip(cuts, cuts[1:]))
            if picture_token:
                text = re.sub(f"(?:{re.escape(picture_token)})+", lambda m: f"[picture: {len(m.group(0)) // len(picture_token)} tokens]", text)
            shown += 1
            side = f" ({('chosen', 'rejected')[i % 2]})" if split.pairs is not None else ""  # a pair's two sequences lie side by side
            yield f"--- sequence {shown}{side} of row {r + 1}: {e - s} tokens, {int(trained.sum())} trained ---\n{text}"


def _tokenized(sources: list[SourceConfig], cfg: DataConfig, tokenizer, say, processor=None) -> _Samples:
    import pyarrow as pa

    tables, keys, ranges, cached, start = [], [], [], True, 0
    for source in sources:
        table, hit = tokenized(source, cfg, tokenizer, say, processor)
        tables.append(table)
        keys.append(fingerprint(source, cfg, tokenizer, processor))
        ranges.append((start, start + len(table)))
        start += len(table)
        cached = cached and hit
    return _samples(pa.concat_tables(tables), keys, ranges, sources, cached, cfg)


def _answered(source: _Samples, answers: Answers, cfg: DataConfig, say) -> _Samples:
    table, hit = answered(source.table, source.keys, answers, cfg, say)
    return _samples(table, [*source.keys, answers.key], source.ranges, source.sources, source.cached and hit, cfg)


def _samples(table, keys: list[str], ranges: list[tuple[int, int]], sources: list[SourceConfig], cached: bool, cfg: DataConfig) -> _Samples:
    full = table.column("length").to_numpy()  # int32: per sample, never per token
    first = table.column("first_target").to_numpy()
    width = cfg.max_seq_len * (2 if sources[0].format == "preference" else 1)  # the config keeps pairs apart from other formats
    cut = np.minimum(full, width)
    windows = np.repeat([s.format == "completion" and cfg.long_documents == "chunk" for s in sources], [b - a for a, b in ranges])
    chunked = windows & (full > cfg.max_seq_len)
    return _Samples(table, keys, ranges, sources, full, cut, (full > width) & ~chunked, chunked, first,
                    chunked | ((first >= 1) & (first < cut)), cached, width)


def _weighted(samples: np.ndarray, weight: float, seed: int, index: int) -> np.ndarray:
    """A source's samples repeated int(weight) times, plus a seeded share (the fraction) of them once more."""
    whole, part = divmod(weight, 1.0)
    extra = np.random.default_rng([seed, index]).permutation(len(samples))[: round(part * len(samples))]
    return np.concatenate([np.tile(samples, int(whole)), np.sort(samples[extra])])


def _split(source: _Samples, samples: np.ndarray, cfg: DataConfig, seed: int, role: str) -> tuple[Split, dict]:
    """Rows over the given samples (those that train anything; long documents as windows), packed or
    one a row, with counts."""
    usable = samples[source.trains[samples]]
    if role == "train" and len(usable) == 0:
        raise UserError(_nothing_trained(source, samples, cfg))
    picks, starts, lengths, context = _pieces(source, usable, cfg)
    prompts = source.sources[0].format == "prompt"  # the config keeps prompts apart from other formats; each is sampled from alone
    order, offsets = _layout(source, picks, starts, lengths, cfg, seed, role) if cfg.packing and not prompts else unpacked(len(picks))
    pairs = source.table.column("chosen_length").to_numpy()[picks] if source.width > cfg.max_seq_len else None
    columns = ["input_ids", "labels"] + ["row"] * prompts + ["images"] * ("images" in source.table.column_names)
    split = Split(source.table.select(columns), picks, lengths, order, offsets, starts, context, pairs)
    if prompts:
        split.locate = lambda sample: _where(source, sample)
    if source.sources[0].format == "unpaired":  # KTO: each example's label, and where its completion starts (for the mismatched pairs)
        split.unpaired = Unpaired(source.table.column("chosen_length").to_numpy()[picks].astype(bool), source.first[picks], cfg.max_seq_len)
    dropped = samples[~source.trains[samples]]
    stats = {"samples": len(usable), "truncated": int(source.truncated[samples].sum()), "chunked": int(source.chunked[usable].sum()),
             "windows": len(picks) - len(usable) + int(source.chunked[usable].sum()), "dropped_no_target": len(dropped),
             "first_dropped": _where(source, dropped[0]) if len(dropped) else None, "rows": len(split), "tokens": int(lengths.sum())}
    if cfg.packing and not prompts and len(split):
        stats["fill"] = stats["tokens"] / (len(split) * source.width)
    return split, stats


def _pieces(source: _Samples, samples: np.ndarray, cfg: DataConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(sample, start, length, context tokens) of what the rows are made of: a sample cut to
    max_seq_len, or a long document's windows of max_seq_len tokens, each starting chunk_overlap
    tokens before the previous one ended (those tokens are its context, trained once, before)."""
    width, overlap = source.width, cfg.chunk_overlap
    chunked = source.chunked[samples]
    full = source.full[samples].astype(np.int64)
    count = np.where(chunked, -(-(full - overlap) // (width - overlap)), 1)
    picks = np.repeat(samples, count)
    k = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    starts = k * (width - overlap)
    lengths = np.minimum(np.repeat(np.where(chunked, full, source.lengths[samples]), count) - starts, width)
    return picks, starts, lengths, np.where(k > 0, max(overlap, 1), 1)


def _nothing_trained(source: _Samples, samples: np.ndarray, cfg: DataConfig) -> str:
    """Why no training sample is left: the prompts are longer than max_seq_len, or the rows train nothing."""
    paths = ", ".join(_paths(cfg.train))
    first = source.first[samples]
    cut = first[first >= 1]
    if len(cut):
        return (f"data: no sample of {paths} has a trained token within data.max_seq_len={cfg.max_seq_len}: the prompts of {len(cut)} "
                f"of {len(samples)} samples are that long or longer (e.g. {_where(source, samples[first >= 1][np.argmin(cut)])}, whose answer starts at "
                f"token {int(cut.min())}); raise data.max_seq_len above {int(cut.min())}, or shorten the prompts")
    return f"data: no sample of {paths} has a token to train on (e.g. {_where(source, samples[0])}: an empty answer?)"


def _where(source: _Samples, sample: int) -> str:
    """A sample as its file and line."""
    index = next(i for i, (a, b) in enumerate(source.ranges) if a <= sample < b)
    return where(source.sources[index].path, int(source.table.column("line")[int(sample)].as_py()), source.sources[index].split)


def _layout(source: _Samples, samples: np.ndarray, starts: np.ndarray, lengths: np.ndarray, cfg: DataConfig, seed: int,
            role: str) -> tuple[np.ndarray, np.ndarray]:
    """pack(), cached next to the tokens: keyed by the entries, the pieces taken and max_seq_len."""
    h = hashlib.sha256(json.dumps([PACK_VERSION, source.keys, role, source.width, str(samples.dtype)]).encode())
    h.update(memoryview(np.ascontiguousarray(samples)))
    h.update(memoryview(np.ascontiguousarray(starts)))
    path = cache_root(cfg) / f"pack-{h.hexdigest()[:24]}.npz"
    if path.exists():
        with np.load(path) as saved:
            return saved["order"], saved["offsets"]
    order, offsets = pack(lengths, source.width)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, order=order, offsets=offsets)
    os.replace(tmp, path)  # two processes racing write the same layout
    return order, offsets


def _rows(table, samples: np.ndarray) -> list[dict]:
    return [json.loads(r) for r in table.column("row").take(samples).to_pylist()] if len(samples) else []


def _paths(value) -> list[str]:
    return [s if isinstance(s, str) else s.path for s in ([value] if isinstance(value, (str, SourceConfig)) else value)]


@dataclass
class Schedule:
    steps_per_epoch: int
    total_steps: int


def plan_steps(cfg: RunConfig, num_rows: int, world: int) -> Schedule:
    t = cfg.train
    batches_per_rank = len(epoch_batches(num_rows, t.micro_batch_size, t.seed, 0, 0, world))
    steps_per_epoch = batches_per_rank // t.grad_accum
    if steps_per_epoch == 0:
        raise UserError(
            f"data: {num_rows} rows make {batches_per_rank} micro-batch(es) per process, fewer than "
            f"train.grad_accum={t.grad_accum}: add data or lower train.micro_batch_size / train.grad_accum"
        )
    if t.overfit_batch:
        return Schedule(steps_per_epoch, t.overfit_batch)
    updates = cfg.grpo.num_iterations if t.objective == "grpo" else 1  # optimizer steps per data step
    total = t.max_steps or math.ceil(t.epochs * steps_per_epoch) * updates
    return Schedule(steps_per_epoch, total)


@functools.lru_cache(maxsize=2)
def _epoch_batches(num_rows: int, micro_batch_size: int, seed: int, epoch: int, rank: int, world: int) -> list[list[int]]:
    return epoch_batches(num_rows, micro_batch_size, seed, epoch, rank, world)


def batches_at(data: Datasets, cfg: RunConfig, schedule: Schedule, position: int, rank: int, world: int, pad_id: int):
    """(epoch, micro-batches, real tokens) for the data step `position` on this rank.

    A pure function of the position: a resumed or rolled-back run reads exactly what it should.
    """
    epoch, chunk = _step_rows(data, cfg, schedule, position, rank, world)
    if data.train.records is not None:  # prompts (GRPO): the objective's rollout makes the batches and counts their tokens
        return epoch, [data.train.prompts(idx) for idx in chunk], 0
    real = sum(data.train.tokens(idx) for idx in chunk)  # padding excluded
    batches = [data.train.batch(idx, pad_id) for idx in chunk]
    if cfg.train.objective == "distill" and cfg.distill.lmbda:  # on-policy steps seed each sample's answer by its name
        for batch, idx in zip(batches, chunk):
            batch["samples"] = data.train.sample_ids(idx)
    return epoch, batches, real


def step_samples(data: Datasets, cfg: RunConfig, schedule: Schedule, position: int, rank: int, world: int) -> list[int]:
    """The samples (indices in the table) this rank trains at data step `position`, as batches_at reads them."""
    _, chunk = _step_rows(data, cfg, schedule, position, rank, world)
    return [i for idx in chunk for i in data.train.sample_ids(idx).flatten().tolist() if i >= 0]


def _step_rows(data: Datasets, cfg: RunConfig, schedule: Schedule, position: int, rank: int, world: int) -> tuple[int, list[list[int]]]:
    """(epoch, this rank's micro-batches of rows) of data step `position`: rank r's i-th micro-batch is the (i x world + r)-th
    of the step's block of grad_accum x world in the epoch's one order, so the same global batch at another world size
    (batch_for_world) covers the same rows."""
    t = cfg.train
    epoch, k = (0, 0) if t.overfit_batch else divmod(position, schedule.steps_per_epoch)
    batches = _epoch_batches(len(data.train), t.micro_batch_size, t.seed, epoch, rank, world)
    return epoch, batches[k * t.grad_accum : (k + 1) * t.grad_accum]
