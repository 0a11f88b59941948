"""Distillation (`train.objective: distill`): the student learns a frozen teacher's next-token
distribution at each trained token of the data's answers (off-policy distillation), by the divergence
TRL's GKDTrainer.generalized_jsd_loss computes (forward KL, reverse KL or the generalised JSD, both
models' logits divided by the temperature), optionally mixed with the cross-entropy on the answers.

The teacher runs the same rows under no_grad, and both models' outputs are taken at the trained
positions only. Where both heads are plain linear layers (loss.forward_kept's fused path), the logits
are made from the decoders' hidden states a chunk of tokens at a time, and the divergence and its
gradient are taken per chunk in the forward, as linear_cross_entropy does: neither model's (tokens x
vocabulary) logits exist in full. Otherwise both models' logits at the trained positions are compared.

On-policy distillation (distill.lmbda, GKD's lambda): on a share of the steps, chosen by a function of the
seed and the data step, the student samples each sample's answer itself (`rollout`): the prompt is the
sample's tokens before its first trained one, and the answer replaces the rest. Its noise comes from a
seed of (train.seed, data step, the sample's index in the table), as GRPO's completions do: the same in
any batch, process or start of the run.

Sequence-level distillation (distill.sequence_level): the teacher's greedy answers replace the data's before
training (`teacher_answers`, cached by the data step); the loss above is then taken on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from finetune.config.schema import DistillConfig, ModelConfig
from finetune.data.packing import Row, collate
from finetune.data.rows import IGNORE
from finetune.data.tokenized import Answers
from finetune.model.teacher import teacher_key, whole_teacher
from finetune.objectives.cross_tokenizer import teacher_batch, uld
from finetune.objectives.loss import Losses, chunk_rows, chunked_head, forward_kept, fusable_parts, next_token_targets, to_device, trained_tokens
from finetune.objectives.objective import Objective
from finetune.objectives.sampling import GumbelSampler, generate


@dataclass
class Distill(Objective):
    cfg: DistillConfig
    seed: int = 0
    synced: bool = False  # the weights are sharded over the processes (fsdp, zero3): every rank decodes as many tokens as the longest
    teacher: torch.nn.Module | None = None  # frozen, held as the strategy holds weights (engines.reference)
    tokenizers: tuple | None = None  # distill.cross_tokenizer: (the student's tokenizer, the teacher's)

    # Means over trained tokens: the divergence to the teacher, the cross-entropy on the trained tokens, the share of tokens
    # where the student's most likely next token is the teacher's, and the share the student sampled (on-policy steps).
    metrics = ("divergence", "ce", "agreement", "on_policy")
    mean_over = (0, 0, 0, 0)

    def counts(self, batch: dict[str, torch.Tensor]) -> list[int]:
        return [trained_tokens(batch)]

    def eval_line(self, result: dict) -> str:
        return (f"eval loss {result['eval_loss']:.4f} ({self.cfg.divergence} {result['eval_divergence']:.4f}, cross-entropy "
                f"{result['eval_ce']:.4f}, top-1 agreement with the teacher {result['eval_agreement']:.1%})")

    def losses(self, model, batch: dict[str, torch.Tensor], totals: list[float], router: bool = False) -> Losses:
        if self.tokenizers is not None:
            return self._across_tokenizers(model, batch, router)
        fuse = fusable_parts(model) is not None and fusable_parts(self.teacher) is not None
        student = forward_kept(model, batch, router, fuse)
        with torch.no_grad():
            teacher = forward_kept(self.teacher, batch, fuse=fuse)
        # An on-policy step's tokens are the student's own: no cross-entropy there (the data's answers are not in it), as GKD
        cfg = self.cfg.model_copy(update={"ce_weight": 0.0}) if "sampled" in batch else self.cfg
        if fuse:
            total, metrics = linear_divergence(student.hidden, student.weight, teacher.hidden, teacher.weight, student.targets, cfg)
        else:
            total, metrics = logits_divergence(student.logits, teacher.logits, student.targets, cfg)
        sampled = len(student.targets) if "sampled" in batch else 0
        return Losses(total, student.aux, torch.cat([metrics, metrics.new_tensor([sampled])]))

    def _across_tokenizers(self, model, batch: dict[str, torch.Tensor], router: bool) -> Losses:
        """distill.cross_tokenizer: ULD's distance at each aligned span's first token (cross_tokenizer.py), a span weighing
        as many as its trained tokens, and the cross-entropy on the student's trained tokens."""
        mine, theirs = self.tokenizers
        student = forward_kept(model, batch, router, fuse=False)
        keep, _ = next_token_targets(batch)
        pad = theirs.pad_token_id if theirs.pad_token_id is not None else (theirs.eos_token_id or 0)
        teacher_rows, pairs = teacher_batch(mine, theirs, {k: v.cpu() for k, v in batch.items() if k in ("input_ids", "labels", "position_ids")}, pad)
        at, where, weight = (torch.tensor([p[i] for p in pairs], dtype=torch.long) for i in range(3))
        keep_teacher = torch.zeros(teacher_rows["input_ids"].numel(), dtype=torch.bool)
        keep_teacher[where] = True
        teacher_rows = {**teacher_rows, "keep": keep_teacher.view_as(teacher_rows["input_ids"]), "targets": torch.zeros(len(pairs), dtype=torch.long)}
        with torch.no_grad():
            teacher = forward_kept(self.teacher, to_device(teacher_rows, student.logits.device), fuse=False)
        rows = (keep.flatten().cumsum(0) - 1)[at.to(keep.device)]  # each span's row among the student's kept logits
        chosen = student.logits[rows]
        weight = weight.to(chosen.device, torch.float32)
        divergence = (uld(chosen, teacher.logits, self.cfg.temperature) * weight).sum()
        ce = F.cross_entropy(student.logits.float(), student.targets, reduction="sum")
        total = (1 - self.cfg.ce_weight) * divergence + self.cfg.ce_weight * ce
        same = [mine.decode([a]) == theirs.decode([b]) for a, b in zip(chosen.argmax(-1).tolist(), teacher.logits.argmax(-1).tolist())]
        agree = (torch.tensor(same, dtype=torch.float32, device=weight.device) * weight).sum()
        sampled = len(student.targets) if "sampled" in batch else 0
        return Losses(total, student.aux, torch.stack([divergence.detach(), ce.detach(), agree, agree.new_tensor(float(sampled))]))

    # -- on-policy steps ---------------------------------------------------------------------------

    @property
    def rollouts(self) -> bool:
        return self.cfg.lmbda > 0

    def on_policy(self, position: int) -> bool:
        """Whether data step `position`'s answers are the student's own (a share lmbda of the steps)."""
        return self.cfg.lmbda >= 1 or np.random.default_rng([self.seed, position]).random() < self.cfg.lmbda

    @torch.no_grad()
    def rollout(self, model, tokenizer, batches: list[dict], position: int, device) -> tuple[list[dict], int] | None:
        """On an on-policy step, the micro-batches with each sample's answer sampled by the student (and their real
        tokens); else None: the data's answers."""
        if not self.on_policy(position):
            return None
        was_training = model.training
        model.eval()
        try:
            rows = [self._sampled(model, tokenizer, batch, position, device) for batch in batches]
        finally:
            model.train(was_training)
        batches = [{**collate(r, tokenizer.pad_token_id), "sampled": torch.ones(1)} for r in rows]
        return batches, sum(len(row.input_ids) for r in rows for row in r)

    def _sampled(self, model, tokenizer, batch: dict, position: int, device) -> list[Row]:
        """One micro-batch's rows, each of its samples with a trained token as its prompt + the student's answer."""
        prompts, seeds, owners = [], [], []
        for r, (ids, labels, positions) in enumerate(zip(batch["input_ids"], batch["labels"], batch["position_ids"])):
            starts = [*(positions == 0).nonzero()[:, 0].tolist(), len(ids)]
            for k, (a, b) in enumerate(zip(starts, starts[1:])):
                trained = (labels[a:b] != IGNORE).nonzero()
                sample = int(batch["samples"][r, k]) if k < batch["samples"].shape[1] else -1
                if sample < 0 or not len(trained):  # padding, or a sample with nothing to train
                    continue
                prompts.append(ids[a : a + int(trained[0])].numpy())
                seeds.append(np.random.SeedSequence([self.seed, position, sample]).generate_state(1, np.uint64)[0])
                owners.append(r)
        from transformers.generation.logits_process import TemperatureLogitsWarper

        warpers = [TemperatureLogitsWarper(self.cfg.temperature)]
        sampler = GumbelSampler(torch.as_tensor(np.array(seeds, dtype=np.uint64).view(np.int64), device=device), warpers)
        if prompts or self.synced:  # sharded weights: every rank decodes, one with nothing to answer on a stand-in (not kept)
            answers = generate(model, tokenizer, prompts or [batch["input_ids"][0, :1].numpy()], self.cfg.max_new_tokens, device,
                               sampler if prompts else None, synced=self.synced)
        parts: list[list[tuple[np.ndarray, list[int]]]] = [[] for _ in batch["input_ids"]]
        for r, prompt, answer in zip(owners, prompts, answers if prompts else []):
            parts[r].append((prompt, answer))
        return [_row(p, tokenizer.pad_token_id) for p in parts]


def _row(samples: list[tuple[np.ndarray, list[int]]], pad_id: int) -> Row:
    """Samples (prompt, answer) packed in one row, the answers trained, positions restarting at each; a row left
    without any: one untrained pad token."""
    if not samples:
        return Row(np.array([pad_id]), np.array([IGNORE]), np.array([0]))
    ids = np.concatenate([np.concatenate([p, np.array(a, dtype=p.dtype)]) for p, a in samples])
    labels = np.concatenate([np.concatenate([np.full(len(p), IGNORE), np.array(a, dtype=np.int64)]) for p, a in samples])
    positions = np.concatenate([np.arange(len(p) + len(a)) for p, a in samples])
    return Row(ids, labels, positions)


def token_losses(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, cfg: DistillConfig) -> torch.Tensor:
    """Per token (rows of fp32 logits): the loss, the divergence, the cross-entropy on the target and whether the
    two models' most likely tokens agree, stacked (4, tokens). The divergences as TRL's generalized_jsd_loss
    computes them (F.kl_div on log-probabilities), summed over the vocabulary."""
    s = torch.log_softmax(student / cfg.temperature, dim=-1)
    if cfg.top_k:  # the teacher's top k tokens, its probabilities renormalised over them
        values, index = teacher.topk(min(cfg.top_k, teacher.shape[-1]), dim=-1)
        t = torch.log_softmax(values / cfg.temperature, dim=-1)
        divergence = F.kl_div(s.gather(-1, index), t, reduction="none", log_target=True).sum(-1)
    else:
        t = torch.log_softmax(teacher / cfg.temperature, dim=-1)
        if cfg.divergence == "forward_kl":
            divergence = F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
        elif cfg.divergence == "reverse_kl":
            divergence = F.kl_div(t, s, reduction="none", log_target=True).sum(-1)
        else:
            mixture = torch.logsumexp(torch.stack([s + math.log1p(-cfg.beta), t + math.log(cfg.beta)]), dim=0)
            divergence = (cfg.beta * F.kl_div(mixture, t, reduction="none", log_target=True)
                          + (1 - cfg.beta) * F.kl_div(mixture, s, reduction="none", log_target=True)).sum(-1)
    plain = s if cfg.temperature == 1.0 else torch.log_softmax(student, dim=-1)
    ce = -plain.gather(-1, targets[:, None])[:, 0]
    agree = (student.argmax(-1) == teacher.argmax(-1)).to(divergence.dtype)
    return torch.stack([(1 - cfg.ce_weight) * divergence + cfg.ce_weight * ce, divergence, ce, agree.detach()])


def logits_divergence(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, cfg: DistillConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss summed over tokens, [divergence, cross-entropy, agreement] sums) from both models' logits."""
    sums = torch.zeros(4, dtype=torch.float32, device=student.device)
    chunk = chunk_rows(student, student.shape[-1])
    for start in range(0, len(student), chunk):
        rows = slice(start, start + chunk)
        sums = sums + token_losses(student[rows].float(), teacher[rows].float(), targets[rows], cfg).sum(1)
    return sums[0], sums[1:].detach()


def linear_divergence(hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor,
                      targets: torch.Tensor, cfg: DistillConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """token_losses summed, from the two decoders' hidden states and head weights, a chunk of tokens at a time (loss.chunked_head:
    the gradient through autograd over one chunk's logits; none under no_grad)."""

    def divergence(logits: torch.Tensor, rows: slice, with_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        teacher = (teacher_hidden[rows] @ teacher_weight.t()).to(logits.dtype)
        if not with_grad:
            return token_losses(logits, teacher, targets[rows], cfg).sum(1), None
        with torch.enable_grad():
            logits = logits.detach().requires_grad_(True)
            per_token = token_losses(logits, teacher, targets[rows], cfg).sum(1)
            (grad,) = torch.autograd.grad(per_token[0], logits)
        return per_token.detach(), grad

    return chunked_head(hidden, weight, divergence)


def teacher_answers(teacher: ModelConfig, adapter: str | None, cfg: DistillConfig, tokenizer, device, say=print) -> Answers:
    """Sequence-level distillation's answers: the teacher's greedy ones (up to max_new_tokens, cut after its EOS). The
    teacher loads whole on this process at the first prompts (a cache miss), whatever the strategy; its cache key
    covers its files and how it loads."""
    held: list[torch.nn.Module] = []

    def answer(prompts: list[np.ndarray]) -> list[list[int]]:
        if not held:
            say(f"distill.sequence_level: the teacher ({adapter or teacher.name_or_path}) answers the training prompts")
            held.append(whole_teacher(teacher, adapter, device))
        return generate(held[0], tokenizer, prompts, cfg.max_new_tokens, device)

    return Answers(teacher_key(teacher, adapter, "greedy", cfg.max_new_tokens), answer)
