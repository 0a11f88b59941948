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

from finetune.config.schema import PreferenceConfig
from finetune.model.attention import packed_positions, restarts
from finetune.objectives.loss import Losses, losses, picture_inputs, trained_mask, trained_tokens


class Objective:
    """What every objective tells the loop besides its counts and losses (the defaults: a loss the guard judges)."""

    metrics: tuple[str, ...] = ()  # the objective's own metrics, as sums per micro-batch
    mean_over: tuple[int, ...] = ()  # per metric, the entry of counts it is a mean over
    unit = "tokens"  # what counts' first entry counts (eval_<unit> in the eval's results)
    start_loss = 0.0  # what the guard's min_rise defaults to: any rise of a cross-entropy may be divergence
    levels = True  # the loss has a level the guard's drift and start tests can judge
    watched_name = "loss"  # what `watched` returns, as the guard's messages name it
    final = ("loss",)  # the last step's figures the run ends with (summary.json's train_<name>)
    rollouts = False  # the policy samples what a step trains on: `rollout` turns the data step's micro-batches into it

    def watched(self, loss: float, metrics: dict[str, float]) -> float:
        """What the guard judges: the loss."""
        return loss

    def reading_position(self, position: int) -> int:
        """The data step whose rows optimizer step `position` trains on (one each, unless updates share a data step)."""
        return position

    def samples_ahead(self) -> int:
        """How many of the coming data steps' rollouts are sampled while a step trains (`sample_ahead` starts them)."""
        return 0

    def sampling(self, position: int) -> bool:
        """Whether data step `position`'s rollouts are being sampled ahead, or were."""
        return False

    def held_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of this objective, per rank, beside the weights ({}: nothing)."""
        return {}

    def load_held(self, state: dict[str, torch.Tensor]) -> None:
        """Take back what `held_state` saved (a resume, a rollback)."""


class SFT(Objective):
    """Summed cross-entropy over the trained tokens, a mean over the step's tokens."""

    def counts(self, batch: dict[str, torch.Tensor]) -> list[int]:
        return [trained_tokens(batch)]

    def eval_line(self, result: dict) -> str:
        return f"eval loss {result['eval_loss']:.4f}, perplexity {result['eval_ppl']:.2f}"

    def losses(self, model, batch: dict[str, torch.Tensor], totals: list[float], router: bool = False) -> Losses:
        return losses(model, batch, router=router)


@dataclass
class Preference(Objective):
    """DPO (the reference is the base with the adapter off, or a frozen copy), or ORPO, CPO and SimPO (no
    reference), a mean over pairs."""

    kind: str  # dpo, orpo, cpo or simpo
    cfg: PreferenceConfig
    reference: torch.nn.Module | None = None  # DPO with full fine-tuning: a frozen copy (engines.reference); else the adapter-off model

    # Means over pairs. reward_accuracy: chosen's reward above rejected's (TRL's rewards/accuracies; 0 while the policy is the
    # reference); choice_accuracy: the policy gives the chosen answer the higher log-probability (what the model would pick).
    metrics = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "logps_chosen", "logps_rejected", "choice_accuracy")
    mean_over = (0,) * 7  # over pairs
    unit = "pairs"

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

    def eval_line(self, result: dict) -> str:
        return (f"eval loss {result['eval_loss']:.4f}, reward accuracy {result['eval_reward_accuracy']:.1%}, margin "
                f"{result['eval_reward_margin']:.3f}; the model's own pick is the chosen answer in {result['eval_choice_accuracy']:.1%} of pairs")

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


@dataclass
class KTO(Objective):
    """KTO on unpaired examples labelled desirable or not, held to the reference as DPO is (the adapter off, or a
    frozen copy), a mean over examples. Each micro-batch's reference point is the policy's KL to the reference
    estimated on mismatched pairs (each prompt with the completion of the example before it: packing.Unpaired),
    averaged over processes and clamped at 0, without gradient: TRL's KTOTrainer, tested against it."""

    cfg: PreferenceConfig
    reference: torch.nn.Module | None = None

    metrics = ("kl", "rewards_desirable", "rewards_undesirable", "logps_desirable", "logps_undesirable")
    mean_over = (0, 1, 2, 1, 2)  # kl over examples; the rest over desirable (counts[1]) or undesirable (counts[2]) ones
    unit = "examples"
    start_loss = 0.5  # 1 - sigmoid(0) while the policy is the reference: a rise smaller than this is no divergence (as DPO's ln 2)

    def eval_line(self, result: dict) -> str:
        return (f"eval loss {result['eval_loss']:.4f}, rewards {result['eval_rewards_desirable']:.3f} on the desirable completions, "
                f"{result['eval_rewards_undesirable']:.3f} on the undesirable ones (reference point kl {result['eval_kl']:.4f})")

    def counts(self, batch: dict[str, torch.Tensor]) -> list[int]:
        _, _, n = answers(batch, pairs=False)
        desirable = int(batch["desirable"][:n].sum())
        return [n, desirable, n - desirable]

    def losses(self, model, batch: dict[str, torch.Tensor], totals: list[float], router: bool = False) -> Losses:
        keep, answer, n = answers(batch, pairs=False)
        token, aux = token_logps(model, batch, keep, router)
        logps = answer_sums(token, answer, n)[0]
        mismatched = {"input_ids": batch["kl_input_ids"], "position_ids": batch["kl_position_ids"], "labels": batch["kl_labels"]}
        kl_keep, kl_answer, kl_n = answers(mismatched, pairs=False)
        reference = model if self.reference is None else self.reference
        with torch.no_grad():
            policy_kl = answer_sums(token_logps(model, mismatched, kl_keep)[0], kl_answer, kl_n)[0]
            with adapters_off(model) if self.reference is None else contextlib.nullcontext():
                ref = answer_sums(token_logps(reference, batch, keep)[0], answer, n)[0]
                ref_kl = answer_sums(token_logps(reference, mismatched, kl_keep)[0], kl_answer, kl_n)[0]
        kl = (policy_kl - ref_kl).mean() if kl_n else logps.new_zeros(())
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:  # every rank runs as many forwards
            torch.distributed.all_reduce(kl)
            kl = kl / torch.distributed.get_world_size()
        kl = kl.clamp(min=0)
        ratio, desirable, beta = logps - ref, batch["desirable"][:n].bool(), self.cfg.beta
        per = torch.where(desirable, self.cfg.kto_desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
                          self.cfg.kto_undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))))
        rewards, held = beta * ratio.detach(), logps.detach()
        metrics = torch.stack([kl * n, rewards[desirable].sum(), rewards[~desirable].sum(), held[desirable].sum(), held[~desirable].sum()])
        return Losses(per.sum(), aux, metrics)


@dataclass
class RewardModel(Objective):
    """A reward model on preference pairs: the score head's output at each sequence's last token is its reward, and
    the loss the Bradley-Terry one, -log sigmoid(chosen - rejected), a mean over pairs (TRL's RewardTrainer, tested
    against it), plus center_rewards_coefficient x the mean squared sum of a pair's rewards where set."""

    cfg: PreferenceConfig

    metrics = ("rewards_chosen", "rewards_rejected", "reward_margin", "accuracy")
    mean_over = (0, 0, 0, 0)  # over pairs
    unit = "pairs"
    start_loss = math.log(2)  # equal rewards: a rise below this is no divergence (as DPO's)

    def eval_line(self, result: dict) -> str:
        return (f"eval loss {result['eval_loss']:.4f}, accuracy {result['eval_accuracy']:.1%} (the chosen answer scored higher), "
                f"margin {result['eval_reward_margin']:.3f}")

    def counts(self, batch: dict[str, torch.Tensor]) -> list[int]:
        return [answers(batch)[2] // 2]

    def losses(self, model, batch: dict[str, torch.Tensor], totals: list[float], router: bool = False) -> Losses:
        keep, answer, n = answers(batch)
        ends = torch.zeros(n, dtype=torch.long, device=keep.device).scatter_reduce(0, answer, keep.flatten().nonzero().squeeze(1), "amax") + 1
        rewards = sequence_scores(model, batch, ends)
        chosen, rejected = rewards[0::2], rewards[1::2]
        loss = -F.logsigmoid(chosen - rejected).sum()
        if self.cfg.center_rewards_coefficient:
            loss = loss + self.cfg.center_rewards_coefficient * ((chosen + rejected) ** 2).sum()
        good, bad = chosen.detach(), rejected.detach()
        return Losses(loss, None, torch.stack([good.sum(), bad.sum(), (good - bad).sum(), (good > bad).sum().to(good.dtype)]))


def sequence_scores(model, batch: dict[str, torch.Tensor], ends: torch.Tensor) -> torch.Tensor:
    """A sequence-classification model's score at the given flat positions of the batch (each sequence's last token).
    The model is called whole (through DDP's or DeepSpeed's wrapper, so that its gradients are reduced); the per-token
    scores come from a hook on its score head, since transformers pools one position a row, not one a packed sequence."""
    inner = getattr(model, "module", model)
    inner = inner.base_model.model if hasattr(inner, "peft_config") else inner
    captured = []
    handle = inner.score.register_forward_hook(lambda module, args, out: captured.append(out))
    try:
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    finally:
        handle.remove()
    return captured[0].float().flatten()[ends]


def answers(batch: dict[str, torch.Tensor], pairs: bool = True) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(which positions predict a trained token, the answer each of those belongs to (0, 1, 2, ...), how many answers)."""
    keep = trained_mask(batch["labels"])
    sequence = sequence_index(batch["position_ids"])[keep]  # a sequence's first label is never trained
    _, answer = torch.unique_consecutive(sequence, return_inverse=True)
    count = int(answer[-1]) + 1 if len(answer) else 0
    if pairs and count % 2:
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
    """Each position's sequence of the batch, numbered 0, 1, ... in row order: positions restart at each (at 0, or, for a
    completion reading its group's prompt written once, at the prompt's last token: grpo.group_row)."""
    return (restarts(positions).flatten().cumsum(0) - 1).view_as(positions)


def token_logps(model, batch: dict[str, torch.Tensor], where: torch.Tensor, router: bool = False,
                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(next token) at each position of `where`, in order, and with `router` the MoE router's
    load-balancing loss of this forward (added as TRL's preference trainers add it). Logits only there
    (transformers' logits_to_keep mask), divided by the sampling temperature (GRPO, as TRL), log-softmax in fp32."""
    extra = {"output_router_logits": True} if router else {}
    out = model(input_ids=batch["input_ids"], position_ids=packed_positions(model, batch), use_cache=False, logits_to_keep=where, **extra,
                **picture_inputs(batch))  # a vision-language model's pair shows its prompt's pictures
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
