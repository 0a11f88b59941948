"""What a step minimises: cross-entropy on the answers (sft), or a preference loss over pairs (dpo, orpo, cpo, simpo).

The loop asks an objective two things per micro-batch: `counts` (what the step's loss is a mean over:
trained tokens, or pairs; ORPO also counts the tokens of the chosen sequences), which the loop sums over the
step's micro-batches and ranks; and `losses`, the micro-batch's loss as a sum that the first of those
totals turns into its share of the step's mean, with the objective's metrics as sums over its pairs.

A preference pair is two sequences of a batch, one after the other: prompt + chosen answer, then prompt
+ rejected answer, each with position_ids from 0 (packing.Split lays them out). Only the answers'
tokens are labelled, so a batch's answers are its sequences that have a trained token, chosen and
rejected alternating. Losses are TRL's (DPOTrainer, ORPOTrainer, CPOTrainer), tested against them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from finetune.config import PreferenceConfig
from finetune.loss import Losses, losses, trained_mask, trained_tokens


class SFT:
    """Summed cross-entropy over the trained tokens, a mean over the step's tokens."""

    metrics: tuple[str, ...] = ()
    start_loss = 0.0  # what the guard's min_rise defaults to: any rise of a cross-entropy may be divergence
    levels = True  # the loss has a level the guard's drift and start tests can judge
    metric_total = 0  # the metrics are means over counts' first entry

    def counts(self, batch: dict[str, torch.Tensor]) -> list[int]:
        return [trained_tokens(batch)]

    def losses(self, model, batch: dict[str, torch.Tensor], totals: list[float], router: bool = False) -> Losses:
        return losses(model, batch, router=router)


@dataclass
class Preference:
    """DPO (the reference is the base with the adapter off, or a frozen copy), or ORPO, CPO and SimPO (no
    reference), a mean over pairs."""

    kind: str  # dpo, orpo, cpo or simpo
    cfg: PreferenceConfig
    reference: torch.nn.Module | None = None  # DPO with full fine-tuning: a frozen copy (engines.reference); else the adapter-off model

    # Means over pairs. reward_accuracy: chosen's reward above rejected's (TRL's rewards/accuracies; 0 while the policy is the
    # reference); choice_accuracy: the policy gives the chosen answer the higher log-probability (what the model would pick).
    metrics = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "logps_chosen", "logps_rejected", "choice_accuracy")
    levels = True
    metric_total = 0  # over pairs

    @property
    def start_loss(self) -> float:
        """DPO's loss while the policy is the reference (ln 2 for sigmoid); the reference-free losses start anywhere: judged as a
        cross-entropy (0)."""
        if self.kind != "dpo":
            return 0.0
        zero = torch.zeros(1)
        return float(dpo_loss(zero, zero, zero + 1, zero + 1, self.cfg)[0])

    @property
    def nll_weight(self) -> float:
        """The weight of the chosen answers' mean cross-entropy in the loss: ORPO's 1, CPO's and SimPO's cpo_alpha."""
        if self.kind in ("cpo", "simpo"):
            return self.cfg.cpo_alpha if self.cfg.cpo_alpha is not None else float(self.kind == "cpo")
        return float(self.kind == "orpo")

    def counts(self, batch: dict[str, torch.Tensor]) -> list[int]:
        keep, answer, n = answers(batch)
        return [n // 2, int(self._nll_positions(batch, keep, answer).sum()) if self.nll_weight else 0]

    def _nll_positions(self, batch, keep: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
        """Where the cross-entropy is taken: ORPO's covers the chosen sequences whole, prompt included (TRL's ORPOTrainer; the
        ORPO authors' code), CPO's the chosen answers (TRL's CPOTrainer)."""
        if not self.nll_weight:
            return torch.zeros_like(keep)
        if self.kind == "orpo":
            return chosen_sequences(batch, keep, answer)
        chosen = torch.zeros_like(keep)
        chosen[keep] = answer % 2 == 0
        return chosen

    def losses(self, model, batch: dict[str, torch.Tensor], totals: list[float], router: bool = False) -> Losses:
        keep, answer, n = answers(batch)
        nll = self._nll_positions(batch, keep, answer)
        token, aux = token_logps(model, batch, keep | nll, router)
        logps, length = answer_sums(token[keep[keep | nll]], answer, n)
        chosen, rejected = logps[0::2], logps[1::2]
        if self.kind == "dpo":
            with torch.no_grad(), adapters_off(model) if self.reference is None else contextlib.nullcontext():
                reference, _ = answer_sums(token_logps(model if self.reference is None else self.reference, batch, keep)[0], answer, n)
            loss, rewards = dpo_loss(chosen - reference[0::2], rejected - reference[1::2], length[0::2], length[1::2], self.cfg)
        elif self.kind == "orpo":
            loss, rewards = orpo_loss(chosen, rejected, length[0::2], length[1::2], self.cfg.orpo_lambda)
        else:
            loss, rewards = cpo_loss(chosen, rejected, length[0::2], length[1::2], self.kind == "simpo", self.cfg)
        if self.nll_weight:  # the mean cross-entropy over those tokens: as a sum to divide by the pairs, weighted pairs / tokens
            loss = loss - self.nll_weight * token[nll[keep | nll]].sum() * (totals[0] / max(totals[1], 1))
        good, bad = rewards
        metrics = torch.stack([good.sum(), bad.sum(), (good - bad).sum(), (good > bad).sum().to(good.dtype), chosen.detach().sum(),
                               rejected.detach().sum(), (chosen > rejected).sum().to(good.dtype)])
        return Losses(loss, aux, metrics)


def objective_for(train, preference: PreferenceConfig) -> SFT | Preference:
    return SFT() if train.objective == "sft" else Preference(train.objective, preference)


def answers(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(which positions predict a trained token, the answer each of those belongs to (0, 1, 2, ...), how many answers)."""
    keep = trained_mask(batch["labels"])
    sequence = sequence_index(batch["position_ids"])[keep]  # a sequence's first label is never trained
    _, answer = torch.unique_consecutive(sequence, return_inverse=True)
    count = int(answer[-1]) + 1 if len(answer) else 0
    if count % 2:
        raise ValueError(f"a preference batch holds {count} answers; pairs come as two")
    return keep, answer, count


def chosen_sequences(batch: dict[str, torch.Tensor], keep: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """The positions that predict a token of a chosen answer's sequence (its prompt too, not its first token)."""
    sequence = sequence_index(batch["position_ids"])
    inside = torch.zeros_like(keep)
    inside[:, :-1] = sequence[:, 1:] == sequence[:, :-1]
    chosen = torch.zeros(int(sequence.max()) + 1, dtype=torch.bool, device=keep.device)
    chosen[sequence[keep][answer % 2 == 0]] = True
    return inside & chosen[sequence]


def sequence_index(positions: torch.Tensor) -> torch.Tensor:
    """Each position's sequence of the batch, numbered 0, 1, ... in row order (positions restart at each)."""
    return ((positions == 0).flatten().cumsum(0) - 1).view_as(positions)


def token_logps(model, batch: dict[str, torch.Tensor], where: torch.Tensor, router: bool = False,
                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(next token) at each position of `where`, in order, and with `router` the MoE router's
    load-balancing loss of this forward (added as TRL's preference trainers add it). Logits only there
    (transformers' logits_to_keep mask), divided by the sampling temperature (GRPO, as TRL), log-softmax in fp32."""
    extra = {"output_router_logits": True} if router else {}
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, logits_to_keep=where, **extra)
    targets = batch["input_ids"][:, 1:][where[:, :-1]]
    logits = out.logits.float() if temperature == 1.0 else out.logits.float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0], out.aux_loss if router else None


def answer_sums(token: torch.Tensor, answer: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each answer's summed log-probability and its token count."""
    total = torch.zeros(count, dtype=token.dtype, device=token.device).index_add(0, answer, token)
    return total, torch.bincount(answer, minlength=count).to(token.dtype)


@contextlib.contextmanager
def adapters_off(model):
    """The reference model: the same weights with the adapter disabled (peft), under DDP or DeepSpeed's wrapper too."""
    inner = getattr(model, "module", model)
    with inner.disable_adapter():
        yield


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, chosen_len: torch.Tensor, rejected_len: torch.Tensor,
             cfg: PreferenceConfig) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Summed DPO loss of the pairs from the log-probability ratios (policy - reference) of each answer,
    and the rewards (beta x ratio). ipo compares per-token averages, as TRL does."""
    beta, delta = cfg.beta, chosen - rejected
    if cfg.dpo_loss == "sigmoid":
        eps = cfg.label_smoothing
        per_pair = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    elif cfg.dpo_loss == "hinge":
        per_pair = torch.relu(1 - beta * delta)
    else:
        per_pair = (chosen / chosen_len.clamp(min=1) - rejected / rejected_len.clamp(min=1) - 1 / (2 * beta)) ** 2
    return per_pair.sum(), (beta * chosen.detach(), beta * rejected.detach())


def orpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, chosen_len: torch.Tensor, rejected_len: torch.Tensor,
              weight: float) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """ORPO's odds-ratio term summed over the pairs, from per-token average log-probabilities, and its
    rewards (weight x average log-probability), as TRL's ORPOTrainer computes them."""
    good, bad = chosen / chosen_len, rejected / rejected_len
    log_odds = (good - bad) - (_log1mexp(good) - _log1mexp(bad))
    return -weight * F.logsigmoid(log_odds).sum(), (weight * good.detach(), weight * bad.detach())


def cpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, chosen_len: torch.Tensor, rejected_len: torch.Tensor, simpo: bool,
             cfg: PreferenceConfig) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """CPO's (summed log-probabilities) or SimPO's (per-token averages, less a margin of gamma / beta)
    sigmoid loss summed over the pairs, and the rewards (beta x those log-probabilities), as TRL's
    CPOTrainer computes them; no reference model."""
    if simpo:
        chosen, rejected = chosen / chosen_len.clamp(min=1), rejected / rejected_len.clamp(min=1)
    logits = chosen - rejected - (cfg.simpo_gamma / cfg.beta if simpo else 0.0)
    eps = cfg.label_smoothing
    per_pair = -(1 - eps) * F.logsigmoid(cfg.beta * logits) - eps * F.logsigmoid(-cfg.beta * logits)
    return per_pair.sum(), (cfg.beta * chosen.detach(), cfg.beta * rejected.detach())


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))
