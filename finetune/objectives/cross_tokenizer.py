"""Distillation across tokenizers (`distill.cross_tokenizer`): a teacher whose tokenizer is not the student's.

The two models cannot be compared token by token, so they are compared span by span of the same text, as TRL's GOLD
and universal logit distillation (ULD, Boizard et al. 2024) do. Each packed sample of the student's row is decoded to
text and tokenized by the teacher's tokenizer; wherever both tokenizations end a token at the same character, a span
ends (`align`). The spans cover the text, each a run of student tokens and a run of teacher tokens spelling the same
characters. At a span's first token both models predict what follows the same text; their next-token distributions
there are compared by ULD's distance, the L1 distance between the two probability vectors sorted (the shorter one
padded with zeros), which needs no map between the vocabularies and is 0 where the two distributions are the same up
to the tokens' names. A span weighs as many as its trained student tokens, so the divergence stays a mean per trained
token. Special tokens of the student reach the teacher as their text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from finetune.data.packing import Row, collate
from finetune.data.rows import IGNORE


@dataclass
class Span:
    student: tuple[int, int]  # [start, end) of the student's tokens, in the sample
    teacher: tuple[int, int]  # [start, end) of the teacher's tokens, in its tokenization of the sample's text
    text: str


def student_ends(tokenizer, ids: list[int]) -> tuple[str, list[int | None]]:
    """The sample's text, and where each of its tokens ends in it (None inside a character a token only began: a byte-level
    token with part of a multi-byte character). Where the text tokenizes back to the same ids (rows read from text), from
    the tokenizer's character offsets; else (a sampled answer split otherwise) from decoding each prefix."""
    text = _decode(tokenizer, ids)
    again = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if again["input_ids"] == list(ids):
        return text, token_ends(again["offset_mapping"])
    prefixes = tokenizer.batch_decode([ids[: i + 1] for i in range(len(ids))], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return text, [len(p) if text.startswith(p) and not p.endswith("\ufffd") else None for p in prefixes]


def token_ends(offsets: list[tuple[int, int]]) -> list[int | None]:
    """Each token's end in the text, None where the next token starts before it (a character split between tokens)."""
    return [end if j + 1 == len(offsets) or offsets[j + 1][0] >= end else None for j, (_, end) in enumerate(offsets)]


def align(student_tokenizer, teacher_tokenizer, ids: list[int]) -> tuple[list[int], list[Span]]:
    """The teacher's tokens of the student sample's text, and the spans where the two tokenizations meet."""
    text, mine = student_ends(student_tokenizer, ids)
    encoded = teacher_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    theirs = encoded["input_ids"]
    their_ends = {end: j for j, end in enumerate(token_ends(encoded["offset_mapping"])) if end is not None}
    spans, a, c, start = [], 0, 0, 0
    for i, end in enumerate(mine):
        if end is None or end not in their_ends or end <= start:
            continue
        d = their_ends[end] + 1
        spans.append(Span((a, i + 1), (c, d), text[start:end]))
        a, c, start = i + 1, d, end
    return theirs, spans


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def samples_of(batch: dict[str, torch.Tensor]) -> list[list[tuple[int, int]]]:
    """Each row's packed samples as [start, end) in the row (positions restart at each; padding left out)."""
    out = []
    for positions, labels in zip(batch["position_ids"].tolist(), batch["labels"].tolist()):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        out.append([(a, b) for a, b in zip(starts, starts[1:]) if any(x != IGNORE for x in labels[a:b])])
    return out


def teacher_batch(student_tokenizer, teacher_tokenizer, batch: dict[str, torch.Tensor], pad_id: int) -> tuple[dict, list[tuple[int, int, int]]]:
    """The teacher's rows (each student row's samples, re-tokenized, packed the same way) and, in the rows' order, each used
    span's (student position predicting its first token, teacher position predicting its first token, trained student tokens).
    A span is used where its first student token is trained and both sides have a token before it."""
    rows, pairs = [], []
    for r, samples in enumerate(samples_of(batch)):
        ids, positions, offset = [], [], 0
        for a, b in samples:
            labels = batch["labels"][r, a:b].tolist()
            theirs, spans = align(student_tokenizer, teacher_tokenizer, batch["input_ids"][r, a:b].tolist())
            for span in spans:
                s, c = span.student[0], span.teacher[0]
                if s >= 1 and c >= 1 and labels[s] != IGNORE:
                    trained = sum(x != IGNORE for x in labels[s : span.student[1]])
                    pairs.append((r * batch["labels"].shape[1] + a + s - 1, offset + c - 1, trained, r))
            ids += theirs
            positions += range(len(theirs))
            offset += len(theirs)
        rows.append(Row(np.array(ids or [pad_id]), np.full(max(len(ids), 1), IGNORE), np.array(positions or [0])))
    teacher = collate(rows, pad_id)
    width = teacher["input_ids"].shape[1]
    pairs = [(s, r * width + t, n) for s, t, n, r in pairs]
    return teacher, pairs


def uld(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """ULD's distance per row: the L1 distance between the two models' next-token probabilities sorted, the shorter vocabulary
    padded with zeros (fp32)."""
    s = torch.softmax(student.float() / temperature, dim=-1).sort(dim=-1, descending=True).values
    t = torch.softmax(teacher.float() / temperature, dim=-1).sort(dim=-1, descending=True).values
    width = max(s.shape[-1], t.shape[-1])
    s, t = (torch.nn.functional.pad(x, (0, width - x.shape[-1])) for x in (s, t))
    return (s - t).abs().sum(-1)
