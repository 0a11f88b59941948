"""Packing and batching over tokenized samples that stay in memory-mapped Arrow files.

Nothing here holds a Python object per token: a split is a few numpy arrays (which samples, in what
order, make each row) over the Arrow tables, and a micro-batch's tensors are cut from Arrow slices when
the step that trains on them needs them.

A packed row holds several samples whose `position_ids` restart at 0: transformers turns that into a
block-diagonal causal mask (when no attention_mask is passed), so tokens never attend across samples
on eager, sdpa or flash attention alike. Padding, where a batch needs it, is one more such segment,
with labels -100.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field

import numpy as np
import torch

from finetune.data.rows import IGNORE


@dataclass
class Row:
    """One training row: one sample, or several packed, each with positions starting at 0."""

    input_ids: np.ndarray | list[int]
    labels: np.ndarray | list[int]
    position_ids: np.ndarray | list[int]


@dataclass
class Prompt:
    """A prompt row (GRPO): its token ids, the row as read, its sample's index in the table, the pictures it shows."""

    ids: np.ndarray
    row: dict
    sample: int
    pictures: list[bytes] = field(default_factory=list)


@dataclass
class Unpaired:
    """KTO's unpaired examples: per sample of a split, whether its completion is desirable, where the
    completion starts, and the longest sequence (the mismatched pairs are cut to it)."""

    desirable: np.ndarray
    answer_starts: np.ndarray
    max_seq_len: int

    def mismatched(self, rows: list[Row], groups: list[np.ndarray], lengths: np.ndarray) -> list[Row]:
        """KTO's reference point pairs, as TRL builds them: each example's prompt with the completion of the
        example before it in the micro-batch (the first takes the last's), in rows parallel to `rows`
        (`groups`: each row's samples)."""
        pieces = []
        for row, group in zip(rows, groups):
            at = 0
            for m in group:
                n = int(lengths[m])
                ids = np.asarray(row.input_ids)[at : at + n]
                answer = min(int(self.answer_starts[m]), n)
                pieces.append((ids[:answer], ids[answer:]))
                at += n
        out, i = [], 0
        for group in groups:
            ids, labels, positions = [], [], []
            for _ in group:
                prompt, completion = pieces[i][0], pieces[i - 1][1]  # i - 1 = -1: the last example's completion
                sequence = np.concatenate([prompt, completion])[: self.max_seq_len]
                ids.append(sequence)
                labels.append(np.where(np.arange(len(sequence)) >= max(len(prompt), 1), sequence, IGNORE))
                positions.append(np.arange(len(sequence)))
                i += 1
            out.append(Row(np.concatenate(ids), np.concatenate(labels), np.concatenate(positions)))
        return out


def collate(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Stack rows padded to the longest row of this batch. The pad is its own position segment, so no
    attention_mask is needed and real tokens never see it.

    >>> batch = collate([Row([5, 6, 7, 8], [-100, 6, -100, 8], [0, 1, 0, 1]), Row([9, 10], [-100, 10], [0, 1])], pad_id=0)
    >>> batch["input_ids"].tolist(), batch["labels"].tolist(), batch["position_ids"].tolist()
    ([[5, 6, 7, 8], [9, 10, 0, 0]], [[-100, 6, -100, 8], [-100, 10, -100, -100]], [[0, 1, 0, 1], [0, 1, 0, 1]])
    """
    width = max(len(r.input_ids) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    labels = np.full((len(rows), width), IGNORE, dtype=np.int64)
    positions = np.tile(np.arange(width, dtype=np.int64), (len(rows), 1))
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n], labels[i, :n], positions[i, :n] = r.input_ids, r.labels, r.position_ids
        positions[i, n:] -= n  # the pad restarts at 0: a segment of its own
    return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels), "position_ids": torch.from_numpy(positions)}


def pack(lengths: np.ndarray, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit-decreasing bin packing of samples of these lengths (each <= max_seq_len) into rows.

    Returns (order, offsets): row r holds samples order[offsets[r]:offsets[r + 1]]. Deterministic.
    Samples are taken longest first, a length at a time: all samples of one length go, as many to a row
    as fit, into the open rows with the least room that holds one; the rest open new rows. The loop runs
    once per (length, room) pair met, not once per sample: 10M samples pack in seconds.

    >>> order, offsets = pack(np.array([5, 3, 4, 2, 6]), max_seq_len=8)
    >>> [order[offsets[r]:offsets[r + 1]].tolist() for r in range(len(offsets) - 1)]  # lengths 6+2, 5+3, 4
    [[4, 3], [0, 1], [2]]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")  # longest first; ties in sample order
    sizes, starts = np.unique(-lengths[order], return_index=True)
    row_of = np.empty(len(order), dtype=np.int64)  # by position in `order`
    rooms: dict[int, list[np.ndarray]] = {}  # room left -> stack of chunks of row ids with that much room
    counts: dict[int, int] = {}
    open_rooms: list[int] = []  # sorted rooms that some row has
    next_row = 0

    def add(room: int, rows: np.ndarray) -> None:
        if room <= 0 or len(rows) == 0:
            return
        if counts.get(room, 0) == 0:
            bisect.insort(open_rooms, room)
            counts[room], rooms[room] = 0, []
        rooms[room].append(rows)
        counts[room] += len(rows)

    def take(room: int, k: int) -> np.ndarray:
        taken = []
        while k > 0:
            chunk = rooms[room].pop()
            if len(chunk) > k:
                chunk, rest = chunk[-k:], chunk[:-k]
                rooms[room].append(rest)
            taken.append(chunk)
            k -= len(chunk)
            counts[room] -= len(chunk)
        if counts[room] == 0:
            open_rooms.remove(room)
        return np.concatenate(taken)

    for neg_size, start, end in zip(sizes, starts, list(starts[1:]) + [len(order)]):
        n, todo, pos = int(-neg_size), int(end - start), int(start)
        while todo:
            at = bisect.bisect_left(open_rooms, n)
            if at < len(open_rooms):
                room = open_rooms[at]
                per_row = room // n
                rows = take(room, min(-(-todo // per_row), counts[room]))
            else:
                room, per_row = max_seq_len, max_seq_len // n
                count = -(-todo // per_row)
                rows, next_row = np.arange(next_row, next_row + count), next_row + count
            placed = min(todo, len(rows) * per_row)
            row_of[pos : pos + placed] = np.repeat(rows, per_row)[:placed]
            full, last = divmod(placed, per_row)
            add(room - per_row * n, rows[:full])
            if last:
                add(room - last * n, rows[full:])
            todo, pos = todo - placed, pos + placed
    by_row = np.argsort(row_of, kind="stable")  # rows in the order they were opened; samples in the order placed
    offsets = np.searchsorted(row_of[by_row], np.arange(next_row + 1))
    index = np.int32 if len(lengths) < 2**31 else np.int64  # per sample: half the memory where it fits
    return order[by_row].astype(index), offsets


def unpacked(count: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, offsets) with one sample a row."""
    return np.arange(count, dtype=np.int64), np.arange(count + 1, dtype=np.int64)


class Split:
    """Rows over tokenized samples: `samples` are indices into the Arrow table (repeats allowed: a
    source weighted above 1, or a long document's windows), each `lengths` tokens from `starts` (0 but
    for a document's later windows); row r holds samples[order[offsets[r]:offsets[r+1]]]. `context`:
    leading tokens of each that are not trained (1: nothing precedes a sample's first token; a later
    window's overlap with the one before). `pairs`: for preference pairs, where each sample's second
    sequence (the rejected answer's) starts."""

    def __init__(self, table, samples: np.ndarray, lengths: np.ndarray, order: np.ndarray, offsets: np.ndarray,
                 starts: np.ndarray | None = None, context: np.ndarray | None = None, pairs: np.ndarray | None = None):
        self.samples, self.lengths, self.pairs = samples, lengths, pairs
        self.starts = np.zeros(len(samples), dtype=np.int64) if starts is None else starts
        self.context = np.ones(len(samples), dtype=np.int64) if context is None else context
        self.order, self.offsets = order, offsets
        self.row_lengths = np.add.reduceat(lengths[order].astype(np.int64), offsets[:-1]) if len(order) else np.zeros(0, dtype=np.int64)
        self.columns = {name: _Column(table.column(name)) for name in ("input_ids", "labels")}
        self.records = table.column("row") if "row" in table.column_names else None  # prompt rows (GRPO): what reward functions read
        self.locate = None  # prompt rows: a sample's file:line (set by the data step)
        self.unpaired: Unpaired | None = None  # KTO's examples: labels and completion starts (set by the data step)
        self.pictures = table.column("images") if "images" in table.column_names else None  # each sample's pictures (bytes)
        self.vision = None  # a vision-language model's: (pictures, input_ids) -> a batch's image inputs (set by the data step)
        self.masked = True  # ...whose unpacked rows carry an attention mask for the model's own forward; packed ones restart positions

    def prompts(self, rows) -> list[Prompt]:
        """Prompt rows (one sample each): their ids, the row as read (its other columns go to the reward
        functions) and the sample's index in the table, which names it whatever the batch or process."""
        out = []
        for r in rows:
            member = self.order[self.offsets[r] : self.offsets[r] + 1]
            sample = int(self.samples[member[0]])
            ids = self.columns["input_ids"].cut(self.samples[member], self.lengths[member], self.starts[member])
            shown = self.pictures[sample].as_py() if self.pictures is not None else []
            out.append(Prompt(ids, json.loads(self.records[sample].as_py()), sample, shown))
        return out

    def sample_ids(self, rows) -> torch.Tensor:
        """(rows, most samples in a row): each row's samples' indices in the table, in row order, then -1: names for
        them whatever the batch or process."""
        members = [self.samples[self.order[self.offsets[r] : self.offsets[r + 1]]] for r in rows]
        out = torch.full((len(members), max(map(len, members))), -1, dtype=torch.long)
        for i, m in enumerate(members):
            out[i, : len(m)] = torch.from_numpy(m.astype(np.int64))
        return out

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def tokens(self, rows) -> int:
        """Real (unpadded) tokens of these rows."""
        return int(self.row_lengths[np.asarray(rows, dtype=np.int64)].sum())

    def rows(self, rows) -> list[Row]:
        """The rows, read from the Arrow table: each sample's tokens cut to its length, its first label
        masked (nothing precedes it in its own sequence, and a packed neighbour's last token must not be
        trained to predict it; a later window's overlap too), its positions from 0."""
        out = []
        for r in rows:
            members = self.order[self.offsets[r] : self.offsets[r + 1]]
            lengths = self.lengths[members]
            ids, labels = (self.columns[name].cut(self.samples[members], lengths, self.starts[members]) for name in ("input_ids", "labels"))
            starts = np.cumsum(lengths) - lengths
            context = np.minimum(self.context[members], lengths)
            labels[np.repeat(starts, context) + np.arange(int(context.sum())) - np.repeat(np.cumsum(context) - context, context)] = IGNORE
            positions = np.arange(len(ids)) - np.repeat(starts, lengths)
            if self.pairs is not None:  # the rejected sequence is a sample of its own: positions from 0, nothing predicts its first token
                second = starts + self.pairs[members]
                positions -= np.repeat(self.pairs[members], lengths) * (positions >= np.repeat(self.pairs[members], lengths))
                labels[second] = IGNORE
            out.append(Row(ids, labels, positions))
        return out

    def batch(self, rows, pad_id: int) -> dict[str, torch.Tensor]:
        built = self.rows(rows)
        batch = collate(built, pad_id)
        if self.unpaired is not None:  # KTO: each example's label, and the mismatched pairs its reference point is taken on
            groups = [self.order[self.offsets[r] : self.offsets[r + 1]] for r in rows]
            kl = collate(self.unpaired.mismatched(built, groups, self.lengths), pad_id)
            batch.update({f"kl_{key}": value for key, value in kl.items()},
                         desirable=torch.from_numpy(self.unpaired.desirable[np.concatenate(groups)]))
        if self.vision is not None:  # the pictures in the rows' order (and their samples'), and unpacked, an attention mask
            if self.masked:
                lengths = torch.from_numpy(self.row_lengths[np.asarray(rows, dtype=np.int64)])
                batch["attention_mask"] = (torch.arange(batch["input_ids"].shape[1]) < lengths[:, None]).long()
            copies = 1 if self.pairs is None else 2  # a preference pair's chosen and rejected sequences each show the prompt's pictures
            shown = [p for r in rows for s in self.samples[self.order[self.offsets[r] : self.offsets[r + 1]]].tolist()
                     for p in self.pictures[s].as_py() * copies]
            batch.update(self.vision(shown, batch["input_ids"]))
        return batch


class _Column:
    """A list<int32> column of memory-mapped Arrow chunks, read a sample at a time. Not pyarrow's
    take(), which concatenates every chunk of a chunked column first: a copy of the whole data set."""

    def __init__(self, column):
        self.starts = np.cumsum([0] + [len(chunk) for chunk in column.chunks])
        # Zero-copy views onto the mapped files; `values` ignores a chunk's slice offset, `offsets` honours it.
        self.chunks = [(chunk.offsets.to_numpy(), chunk.values.to_numpy()) for chunk in column.chunks]

    def cut(self, samples: np.ndarray, lengths: np.ndarray, skip: np.ndarray) -> np.ndarray:
        """lengths[i] values of each sample from its skip[i]-th on, concatenated."""
        out = np.empty(int(lengths.sum()), dtype=np.int64)
        at = 0
        for sample, n, k in zip(samples.tolist(), lengths.tolist(), skip.tolist()):
            c = int(np.searchsorted(self.starts, sample, side="right")) - 1
            offsets, values = self.chunks[c]
            start = int(offsets[sample - self.starts[c]]) + k
            out[at : at + n] = values[start : start + n]
            at += n
        return out


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
