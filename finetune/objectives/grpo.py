"""GRPO (`train.objective: grpo`): completions sampled by the policy, scored by reward functions, and the
clipped policy-ratio loss on their group-normalised rewards, as TRL's GRPOTrainer computes it.

Each data step's prompts are turned into training micro-batches by `rollout` before the step's
forward passes: every prompt gets `grpo.num_generations` completions from `generate` (the KV cache,
the model in eval mode), a micro-batch's prompts left-padded in one call. Each completion is sampled
by the Gumbel-max trick with noise computed from a seed of (train.seed, data step, the prompt's sample
index, the completion's index) and the token's step, not drawn from a shared generator: a prompt's
completions are the same whichever process, batch or start of the run samples them, so a resumed run
and two processes sample what one uninterrupted process does, with no generator state to checkpoint. A prompt's
completions are packed into one row (positions restarting at each), trained on their tokens.

One policy update per generation (TRL's default num_iterations=1): the ratio to the sampling policy
is 1 in value, so the clipping bounds nothing and only its gradient, the advantage times the token's
log-probability gradient, moves the weights. With grpo.num_iterations = mu > 1, a data step's rollouts
are held for mu optimizer steps (`held`, saved per rank in every checkpoint, so a run resumed between
them trains on the same completions), with the log-probabilities the policy gave their tokens when it
sampled them (`old_logps`): from the second update on, the ratio moves and the clipping bounds it.

With grpo.async_rollouts k, the next k data steps' rollouts are sampled in a background thread while a step
trains (`sample_ahead`), each by a copy of the policy as the step that started it began, with their
log-probabilities under that copy: a step trains up to k updates off the sampling policy, its ratio clipped
as above (the importance-sampling correction). A copy shares the frozen weights (LoRA: only the adapter is
copied); one is kept for each sampling not yet finished. Pending rollouts are saved in the checkpoint beside
the held ones, so a resumed run trains on what the uninterrupted one sampled.
"""

from __future__ import annotations

import contextlib
import copy
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from finetune.config.schema import GRPOConfig
from finetune.data.encoding import prompt_text
from finetune.data.packing import Prompt, Row, Split, collate
from finetune.data.rows import IGNORE
from finetune.model import mixers, routing
from finetune.model.attention import PACKED_SDPA, accelerator_path, attention_of, base_model
from finetune.objectives.evaluate import batches_per_rank
from finetune.objectives.loss import Losses, to_device
from finetune.objectives.objective import Objective, adapters_off, answers, token_logps
from finetune.objectives.rewards import Reward, score
from finetune.objectives.sampling import GumbelSampler, generate


@dataclass
class GRPO(Objective):
    cfg: GRPOConfig
    rewards: list[Reward]
    seed: int
    reference: torch.nn.Module | None = None  # full fine-tuning with beta > 0: a frozen copy (engines.reference); else the adapter-off model
    locate: object = None  # sample index -> "file:line" (data.Split.locate), for reward errors
    synced: bool = False  # the weights are sharded over the processes (fsdp, zero3): every rank decodes as many tokens as the longest
    vision: object = None  # a vision-language model's (pictures, input_ids) -> image inputs (data.Split.vision): prompts with pictures
    placeholders: tuple[int, ...] = ()  # ...and its picture placeholder tokens, never sampled (images.placeholders)
    held: tuple[int, list[dict], int] | None = None  # num_iterations > 1: (data step, its training micro-batches, their tokens)
    ahead: list[tuple[int, tuple[int, list[dict], int] | Future]] = field(default_factory=list)  # async_rollouts: the coming data
    # steps' (position, rollouts as `held`, or a Future while sampled), in order
    policy_copies: list[list] = field(default_factory=list, repr=False)  # async_rollouts: [copy of the policy, the Future sampling with it]
    worker: ThreadPoolExecutor | None = field(default=None, repr=False)
    metrics: tuple[str, ...] = field(init=False)
    mean_over: tuple[int, ...] = field(init=False)

    extra_metrics: tuple[str, ...] = ()  # per-completion numbers a subclass's rows carry (their "extra" column), averaged like the rest
    keeps_sampler_logps = True  # its rollouts carry the sampler's log-probabilities of their tokens (the agent's episodes do not yet)
    levels = False  # the loss is centred on 0 by the advantages: no start level, no stuck-at-0 check
    rollouts = True
    watched_name = "negative mean reward"
    final = ("reward", "kl")  # a GRPO loss is centred on 0 by the advantages: it says nothing of the run

    def watched(self, loss: float, metrics: dict[str, float]) -> float:
        """What the guard judges: the negative mean reward. Its spikes and drift are a reward collapse, rolled back as a
        loss's are (the level may be negative: the noise test, not the ratio, decides)."""
        return -metrics["reward"]

    def reading_position(self, position: int) -> int:
        """grpo.num_iterations updates train on each data step's rollouts."""
        return position // self.cfg.num_iterations

    def samples_ahead(self) -> int:
        return int(self.cfg.async_rollouts)

    def sampling(self, position: int) -> bool:
        """Whether data step `position`'s rollouts are sampled ahead (begun or done)."""
        return any(p == position for p, _ in self.ahead)

    def __post_init__(self):
        gap = ("mismatch_kl", "mismatch_max", *(("is_capped",) if self.cfg.importance_sampling else ())) if self.keeps_sampler_logps else ()
        self.metrics = ("reward", "reward_std", "zero_std_groups", "completion_length", "kl", "clip_ratio", *(r.metric for r in self.rewards),
                        *self.extra_metrics, *gap, *(("routing_mismatch",) if self.cfg.router_replay else ()))
        self.mean_over = (1,) * len(self.metrics)  # means over the step's completions (counts' second entry)

    def eval_line(self, result: dict) -> str:
        return (f"eval reward {result['eval_reward']:.4f} (greedy completions of {result['eval_prompts']} prompts; "
                + ", ".join(f"{r.metric} {result['eval_' + r.metric]:.4f}" for r in self.rewards) + ")")

    # -- the loss ------------------------------------------------------------------------------

    def counts(self, batch: dict[str, torch.Tensor]) -> list[int]:
        """(what the loss is a mean over, completions): completions (grpo), completion tokens (dapo), or
        completions x max_completion_length (dr_grpo)."""
        n = len(batch["advantages"])
        if self.cfg.loss_type in ("dapo", "cispo"):
            return [int((batch["labels"][:, 1:] != IGNORE).sum()), n]
        return [n * (self.cfg.max_completion_length if self.cfg.loss_type == "dr_grpo" else 1), n]

    def losses(self, model, batch: dict[str, torch.Tensor], totals: list[float], router: bool = False) -> Losses:
        keep, completion, _ = answers(batch, pairs=False)
        replayed = self._replay(model, batch)
        logps, aux = token_logps(model, batch, keep, router, self.cfg.temperature)
        routes_differ = routing.differing(model).to(logps.dtype).reshape(1) if replayed else None  # before the reference's forward
        advantage = batch["advantages"].to(logps.dtype)[completion]
        old = batch["old_logps"][keep].to(logps.dtype) if "old_logps" in batch else logps.detach()
        n = len(batch["advantages"])
        lengths = torch.bincount(completion, minlength=n).to(logps.dtype)
        ratio = torch.exp(self._log_ratio(logps - old, completion, lengths))  # one update per generation: 1, with the gradient of log p
        per_token = self._policy_term(ratio, advantage, logps)
        gap = None
        if "sampler_logps" in batch:  # the trainer's log-probabilities at the sampling weights less the sampler's
            gap = old - batch["sampler_logps"].to(logps.dtype)
            weight, capped = self._importance_weights(gap, completion, n)
            per_token = per_token * weight  # the policy's term alone, as TRL weighs it (not the KL's)
        kl = torch.zeros_like(logps)
        if self.cfg.beta:
            with torch.no_grad(), adapters_off(model) if self.reference is None else contextlib.nullcontext():
                ref, _ = token_logps(model if self.reference is None else self.reference, batch, keep, temperature=self.cfg.temperature)
            kl = torch.exp(ref - logps) - (ref - logps) - 1
            # Times the ratio (1 in value): the unbiased reverse-KL gradient (DeepSeek-V3.2; TRL's use_bias_correction_kl default)
            per_token = per_token + self.cfg.beta * kl * ratio
        if self.cfg.loss_type in ("grpo", "sapo"):  # each completion's mean over its tokens
            loss = (per_token / lengths[completion]).sum()
        else:
            loss = per_token.sum()
        clip = (((ratio < 1 - self.cfg.epsilon) & (advantage < 0)) | ((ratio > 1 + (self.cfg.epsilon_high or self.cfg.epsilon)) & (advantage > 0)))
        per_completion = torch.zeros(2, n, dtype=logps.dtype, device=logps.device)
        per_completion[0].index_add_(0, completion, kl.detach())
        per_completion[1].index_add_(0, completion, clip.to(logps.dtype))
        per_completion = per_completion / lengths.clamp(min=1)
        rewards = batch["rewards"].to(logps.dtype)
        metrics = torch.cat([torch.stack([batch["reward"].sum(), batch["reward_std"].sum(), batch["zero_std"].sum(), lengths.sum(),
                                          per_completion[0].sum(), per_completion[1].sum()]).to(logps.dtype), rewards.sum(0),
                             *([batch["extra"].to(logps.dtype).sum(0)] if "extra" in batch else []),
                             *([self._gap_metrics(gap, capped, completion, lengths)] if gap is not None else []),
                             *([routes_differ * n] if replayed else [])])
        return Losses(loss, aux, metrics)

    def _replay(self, model, batch: dict[str, torch.Tensor]) -> bool:
        """grpo.router_replay: the batch's forwards (and their recomputation in the backward) route each token as the sampler did."""
        if "routing" not in batch:
            if self.cfg.router_replay:  # rows the sampler did not record (held from before): the routers' own choices
                routing.replay(model, None)
            return False
        rows, width = batch["input_ids"].shape
        recorded = batch["routing"]
        real = torch.arange(width, device=recorded.device)[None] < batch["routing_rows"].to(recorded.device)[:, None]  # right-padded rows
        choices = torch.full((rows, width, *recorded.shape[1:]), routing.FREE, dtype=recorded.dtype, device=recorded.device)
        choices[real] = recorded
        routing.replay(model, choices.flatten(0, 1))
        return True

    def _importance_weights(self, gap: torch.Tensor, completion: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """grpo.importance_sampling: each token's weight exp(gap), or its completion's exp(sum of gaps) (level sequence),
        capped or zeroed above cap, and which tokens were (as TRL's vllm_importance_sampling_correction); 1 where it is off."""
        s = self.cfg.importance_sampling
        if s is None:
            return torch.ones_like(gap), None
        log_weight = gap if s.level == "token" else torch.zeros(n, dtype=gap.dtype, device=gap.device).index_add(0, completion, gap)[completion]
        weight = torch.exp(log_weight)
        capped = weight > s.cap
        weight = weight.clamp(max=s.cap) if s.mode == "truncate" else weight.masked_fill(capped, 0.0)
        return weight.detach(), capped

    def _gap_metrics(self, gap: torch.Tensor, capped: torch.Tensor | None, completion: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Per completion, summed over them: the mean over its tokens of KL(sampler || trainer) (k3: exp(gap) - gap - 1, from the
        sampler's own draws), its largest |gap|, and the share of its tokens capped or masked (importance_sampling only)."""
        n = len(lengths)
        gap = gap.detach()
        rows = [torch.zeros(n, dtype=gap.dtype, device=gap.device).index_add(0, completion, torch.exp(gap) - gap - 1) / lengths.clamp(min=1),
                torch.zeros(n, dtype=gap.dtype, device=gap.device).index_reduce(0, completion, gap.abs(), "amax", include_self=False)]
        if capped is not None:
            rows.append(torch.zeros(n, dtype=gap.dtype, device=gap.device).index_add(0, completion, capped.to(gap.dtype)) / lengths.clamp(min=1))
        return torch.stack([r.sum() for r in rows])

    def _log_ratio(self, log_ratio: torch.Tensor, completion: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Each token's log policy ratio, or (grpo.ratio sequence: GSPO) its completion's mean of them, at every token."""
        if self.cfg.ratio == "token":
            return log_ratio
        means = torch.zeros_like(lengths).index_add(0, completion, log_ratio) / lengths.clamp(min=1)
        return means[completion]

    def _policy_term(self, ratio: torch.Tensor, advantage: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
        """Each token's policy loss from its ratio to the sampling policy (1 in value on the sampling policy)."""
        high = self.cfg.epsilon_high or self.cfg.epsilon
        if self.cfg.loss_type == "cispo":  # the ratio, capped, weighs the policy gradient; none flows through it
            return -torch.clamp(ratio, max=high).detach() * advantage * logps
        if self.cfg.loss_type == "sapo":
            positive, other = self.cfg.sapo_temperatures
            tau = torch.where(advantage > 0, positive, other)
            return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantage
        return -torch.min(ratio * advantage, torch.clamp(ratio, 1 - self.cfg.epsilon, 1 + high) * advantage)

    # -- sampling and scoring --------------------------------------------------------------------

    @torch.no_grad()
    def rollout(self, model, tokenizer, prompts: list[list[Prompt]], position: int, device) -> tuple[list[dict], int]:
        """Data step `position`'s micro-batches of prompts as training micro-batches (on the host): each prompt's
        completions sampled, scored and given their advantages. Also the real tokens they hold. With
        num_iterations > 1, the rollouts held from the first of the step's updates; with async_rollouts, those
        sampled during the step before (in line where there are none for this data step: the first step, after a
        rollback that skipped a window)."""
        if self.held is not None and self.held[0] == position:
            return self.held[1], self.held[2]
        ahead = next((self._joined(entry) for p, entry in self.ahead if p == position), None)
        self.ahead = [(p, entry) for p, entry in self.ahead if p > position]  # what a rollback left behind goes
        if ahead is not None:
            _, batches, tokens = ahead
        else:
            batches, tokens = self._sampled(model, tokenizer, prompts, position, device, old_logps=self.cfg.num_iterations > 1)
        if self.cfg.num_iterations > 1:
            self.held = (position, batches, tokens)
        return batches, tokens

    def _sampled(self, model, tokenizer, prompts: list[list[Prompt]], position: int, device, old_logps: bool) -> tuple[list[dict], int]:
        """The rollouts `model` samples, with its log-probabilities of their tokens where `old_logps` (on the host)."""
        was_training = model.training
        model.eval()
        batches, tokens = [], 0
        try:
            for micro in prompts:
                rows, columns = [], {}
                for row, parts in self.groups(model, tokenizer, micro, position, device):
                    rows.append(row)
                    tokens += len(row.input_ids)
                    for key, value in parts.items():
                        columns.setdefault(key, []).append(value)
                batch = collate(rows, tokenizer.pad_token_id)
                shown = self._picture_inputs([p.pictures for p in micro for _ in range(self.cfg.num_generations)])
                if shown is not None:  # each completion in its group's row shows its prompt's pictures
                    batch.update(shown(batch["input_ids"]))
                batches.append({**batch, **{key: torch.cat(value) for key, value in columns.items()}})
        finally:
            model.train(was_training)
        if self.cfg.advantage == "reinforce_pp":
            whitened_over_the_step(batches, device)
        if old_logps:
            for batch in batches:
                batch["old_logps"] = self._logps(model, batch, device)
        return batches, tokens

    def sample_ahead(self, model, tokenizer, prompts: list[list[Prompt]], position: int, device, autocast) -> None:
        """grpo.async_rollouts: start sampling data step `position`'s rollouts in the background (after those begun
        before), by a copy of the policy as it is now, with their log-probabilities under it; `rollout` takes them at
        that step. autocast: the training forward's (a thread's autocast state is its own)."""
        slot = self._free_copy(model)
        policy = slot[0]
        stream = torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None
        if stream is not None:  # the copy's weights are written on the current stream: the side stream starts after them
            stream.wait_stream(torch.cuda.current_stream(device))

        @torch.no_grad()
        def work() -> tuple[int, list[dict], int]:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(), autocast():
                batches, tokens = self._sampled(policy, tokenizer, prompts, position, device, old_logps=True)  # on the host: no stream to wait for
            return position, batches, tokens

        self.worker = self.worker or ThreadPoolExecutor(1, thread_name_prefix="rollouts")
        slot[1] = self.worker.submit(work)
        self.ahead.append((position, slot[1]))

    def joined_ahead(self) -> list[tuple[int, list[dict], int]]:
        """The rollouts sampled ahead, in order, waiting for their thread (its error raised here)."""
        self.ahead = [(p, self._joined(entry)) for p, entry in self.ahead]
        return [entry for _, entry in self.ahead]

    @staticmethod
    def _joined(entry: tuple[int, list[dict], int] | Future) -> tuple[int, list[dict], int]:
        return entry.result() if isinstance(entry, Future) else entry

    @torch.no_grad()
    def _free_copy(self, model) -> list:
        """A copy of the policy no sampling is using, its trained weights set to the model's: the frozen ones are shared
        (read only, by both threads), the rest copied once per copy and refreshed in place. [copy, None]."""
        slot = next((s for s in self.policy_copies if s[1] is None or s[1].done()), None)
        if slot is None:
            slot = [copy.deepcopy(model, memo={id(p): p for p in model.parameters() if not p.requires_grad}), None]
            for p in slot[0].parameters():
                p.grad = None
            self.policy_copies.append(slot)
        for mine, theirs in zip(slot[0].parameters(), model.parameters(), strict=True):
            if theirs.requires_grad:
                mine.copy_(theirs)
        slot[1] = None
        return slot

    def _logps(self, model, batch: dict[str, torch.Tensor], device) -> torch.Tensor:
        """The policy's log-probability of each trained token as it samples them, where the batch's labels are
        (0 elsewhere): the later updates' ratio is to these. In the training forward's mode, as TRL computes them."""
        moved = to_device(batch, device)
        keep, _, _ = answers(moved, pairs=False)  # as `losses` picks them
        self._replay(model, batch)
        logps, _ = token_logps(model, moved, keep, temperature=self.cfg.temperature)
        old = torch.zeros(keep.shape, dtype=torch.float32, device=keep.device)
        old[keep] = logps.float()
        return old.cpu()

    def held_state(self) -> dict[str, torch.Tensor]:
        """The held rollouts and those sampled ahead, as flat tensors (a checkpoint's per-rank file); {} when none are."""
        ahead = self.joined_ahead()
        return {**_flat(self.held, ""), **{k: v for j, entry in enumerate(ahead) for k, v in _flat(entry, _ahead_prefix(j)).items()}}

    def load_held(self, state: dict[str, torch.Tensor]) -> None:
        """Hold the rollouts a checkpoint saved (none if it saved none: the next step samples). A thread still
        sampling from the weights before a rollback is waited for, and its rollouts dropped."""
        self.joined_ahead()
        self.held = _unflat(state, "")
        self.ahead = []
        while (entry := _unflat(state, _ahead_prefix(len(self.ahead)))) is not None:
            self.ahead.append((entry[0], entry))

    def groups(self, model, tokenizer, prompts: list[Prompt], position: int, device) -> list[tuple[Row, dict[str, torch.Tensor]]]:
        """Each prompt's group of completions as a scored training row, with what the sampler saw of their tokens."""
        completions, seen = self.sample(model, tokenizer, prompts, position, device)
        shared = self.reads_shared_prompts(model)
        return [self._scored(tokenizer, p, c, s, shared) for p, c, s in zip(prompts, completions, seen)]

    def reads_shared_prompts(self, model) -> bool:
        """Whether a group's row holds its prompt once (grpo.shared_prompts): where the model's attention is finetune's packed
        attention without sinks, no layer carries a state along the row, no expert routes or pictures are kept per copy,
        and the model is on the CPU. On an accelerator such rows would take the block mask (attention over the whole row),
        not the varlen kernel: tests/test_gpu.py's check of how that kernel aligns them waits for a GPU."""
        return (self.cfg.shared_prompts and not self.cfg.router_replay and self.vision is None and attention_of(model) == PACKED_SDPA
                and not mixers.mixers(base_model(model)) and not accelerator_path(next(model.parameters())))

    def sample(self, model, tokenizer, prompts: list[Prompt], position: int, device) -> tuple[list[list[list[int]]], list[list[dict]]]:
        """num_generations completions of each prompt (each cut after its EOS token), all in one `generate` call, and what
        the sampler saw of each: its tokens' log-probabilities as drawn (at grpo.temperature, before top-k/top-p;
        "sampler_logps") and, with grpo.router_replay, the experts each token of prompt and completion was routed to
        ("routing"). Completion j of a prompt draws its noise from a seed of (train.seed, data step, the prompt's sample
        index, j), so it is the same in any batch, process or start of the run."""
        cfg = self.cfg
        seeds = np.concatenate([np.random.SeedSequence([self.seed, position, p.sample]).generate_state(cfg.num_generations, np.uint64)
                                for p in prompts]).view(np.int64)
        repeated = [p.ids for p in prompts for _ in range(cfg.num_generations)]
        sampler = self.sampler(torch.as_tensor(seeds, device=device), keep_logps=True)
        shown = [p.pictures for p in prompts for _ in range(cfg.num_generations)]
        with routing.recording(model, len(repeated)) if cfg.router_replay else contextlib.nullcontext() as taken:
            completions = generate(model, tokenizer, repeated, cfg.max_completion_length, device, sampler, synced=self.synced, cache=cfg.kv_cache,
                                   picture_inputs=self._picture_inputs(shown), never=self.placeholders, share=not cfg.router_replay)  # replay: routes a row
            routes = routing.per_sequence(taken(), [len(p) for p in repeated], [len(c) for c in completions]) if taken else None
        table = sampler.drawn_logps()
        seen = [{"sampler_logps": table[i, : len(c)], **({"routing": routes[i]} if routes else {})} for i, c in enumerate(completions)]
        g = cfg.num_generations
        return [completions[i : i + g] for i in range(0, len(completions), g)], [seen[i : i + g] for i in range(0, len(seen), g)]

    def _picture_inputs(self, shown: list[list[bytes]]):
        """generate's image inputs for prompts showing these pictures (each prompt's, in order): None for text prompts."""
        if self.vision is None or not any(shown):
            return None
        return lambda ids: self.vision([b for pictures in shown for b in pictures], ids)

    def sampler(self, seeds: torch.Tensor, keep_logps: bool = False) -> GumbelSampler:
        """A sampler of grpo.temperature, top_k and top_p, a row a seed (keep_logps: it keeps the drawn tokens' log-probabilities)."""
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        cfg = self.cfg
        warpers = [TemperatureLogitsWarper(cfg.temperature), *([TopKLogitsWarper(cfg.top_k)] if cfg.top_k else []),
                   *([TopPLogitsWarper(cfg.top_p)] if cfg.top_p < 1 else [])]
        return GumbelSampler(seeds, warpers, cfg.top_k, keep_logps)

    def _rewards(self, tokenizer, prompt: Prompt, completions: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(each function's reward of each completion, their weighted sums)."""
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        chat = not isinstance(prompt.row["prompt"], str)
        shown = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
        locate = self.locate or (lambda sample: f"sample {sample}")
        table = score(self.rewards, [prompt.row["prompt"]] * len(texts), shown, completions, [prompt.row] * len(texts),
                      lambda _: f"{locate(prompt.sample)} (prompt {prompt_text(prompt.row, tokenizer)[:60]!r})")
        per_function = torch.tensor(table, dtype=torch.float32)
        return per_function, (per_function * torch.tensor([r.weight for r in self.rewards], dtype=torch.float32)).sum(1)

    def _scored(self, tokenizer, prompt: Prompt, completions: list[list[int]], seen: list[dict],
                shared: bool = False) -> tuple[Row, dict[str, torch.Tensor]]:
        """One prompt's completions as a packed row (trained on the completions), with their rewards and advantages, and what
        the sampler saw (`sample`), in the row's order: its log-probabilities of the trained tokens, the experts of every token
        (and the row's length, "routing_rows", to place them in the padded batch)."""
        per_function, reward = self._rewards(tokenizer, prompt, completions)
        ids = prompt.ids.tolist()
        if shared and len(ids) > 1:  # the prompt but its last token once; each completion after that token
            sequences = [(ids[:-1], [False] * (len(ids) - 1))] + [([ids[-1], *c], [False] + [True] * len(c)) for c in completions]
            firsts = [0] + [len(ids) - 1] * len(completions)
        else:
            sequences, firsts = [([*ids, *c], [False] * len(ids) + [True] * len(c)) for c in completions], None
        row, columns = group_row(sequences, per_function, reward, self.cfg, firsts=firsts)
        columns.update({key: torch.cat([s[key] for s in seen]) for key in seen[0]})
        if "routing" in columns:
            columns["routing_rows"] = torch.tensor([len(row.input_ids)])
        return row, columns

    # -- evaluation ------------------------------------------------------------------------------

    def greedy_scores(self, model, tokenizer, prompts: list[Prompt], device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each prompt's greedy completion's (rewards by function, weighted sum)."""
        completions = generate(model, tokenizer, [p.ids for p in prompts], self.cfg.max_completion_length, device, synced=self.synced,
                               cache=self.cfg.kv_cache, picture_inputs=self._picture_inputs([p.pictures for p in prompts]), never=self.placeholders)
        return [self._rewards(tokenizer, p, [c]) for p, c in zip(prompts, completions)]

    @torch.no_grad()
    def evaluate(self, model, tokenizer, rows: Split, batch_size: int, accelerator, max_batches: int | None) -> dict:
        """The mean reward of greedy completions of this rank's share of the eval prompts, reduced over ranks."""
        was_training = model.training
        model.eval()
        if self.cfg.router_replay:
            routing.replay(model, None)  # greedy completions route as the model does
        world, rank = accelerator.num_processes, accelerator.process_index
        mine = list(range(rank, len(rows), world))
        if max_batches:
            mine = mine[: max_batches * batch_size]
        total = torch.zeros(2 + len(self.rewards), dtype=torch.float64)
        prompts = rows.prompts(mine)
        # Sharded weights: every rank makes as many `generate` calls (each forward gathers the weights), a short
        # rank's last ones on a stand-in prompt whose completion is not scored.
        count = batches_per_rank(len(rows), world, batch_size, max_batches)
        stand_in = prompts[:1] or rows.prompts([0])
        for start in range(0, count * batch_size if self.synced else len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            with accelerator.autocast():  # as the training forward: bf16 weights with fp32 adapters need it (peft's input casts are off)
                scores = self.greedy_scores(model, tokenizer, batch or stand_in, accelerator.device)
            for per_function, reward in scores[: len(batch)]:
                total += torch.cat([reward, torch.ones(1), per_function[0]]).double()
        total = accelerator.reduce(total.to(accelerator.device), "sum").cpu()
        model.train(was_training)
        n = max(float(total[1]), 1.0)
        reward = float(total[0]) / n
        return {"eval_loss": -reward, "eval_reward": reward, "eval_prompts": int(total[1]),
                **{f"eval_{r.metric}": float(v) / n for r, v in zip(self.rewards, total[2:])}}


def _ahead_prefix(j: int) -> str:
    return "ahead." if j == 0 else f"ahead{j}."  # the first as a one-step-ahead run saved it


def _flat(held: tuple[int, list[dict], int] | None, prefix: str) -> dict[str, torch.Tensor]:
    if held is None:
        return {}
    position, batches, tokens = held
    flat = {f"{prefix}{i}.{key}": value.contiguous() for i, batch in enumerate(batches) for key, value in batch.items()}
    return {**flat, f"{prefix}position": torch.tensor(position), f"{prefix}tokens": torch.tensor(tokens), f"{prefix}batches": torch.tensor(len(batches))}


def _unflat(state: dict[str, torch.Tensor], prefix: str) -> tuple[int, list[dict], int] | None:
    if f"{prefix}batches" not in state:
        return None
    starts = [f"{prefix}{i}." for i in range(int(state[f"{prefix}batches"]))]
    batches = [{key[len(start) :]: value for key, value in state.items() if key.startswith(start)} for start in starts]
    return int(state[f"{prefix}position"]), batches, int(state[f"{prefix}tokens"])


def whitened_over_the_step(batches: list[dict[str, torch.Tensor]], device) -> None:
    """REINFORCE++-baseline: the step's group-centred advantages less their mean over every completion token of the step
    (every process's), over their standard deviation there (unbiased), as verl's masked whitening of token advantages."""
    tokens = [torch.bincount(answers(batch, pairs=False)[1], minlength=len(batch["advantages"])).double() for batch in batches]
    values = torch.cat([batch["advantages"].double() for batch in batches])
    weights = torch.cat(tokens)
    stats = torch.stack([(weights * values).sum(), (weights * values**2).sum(), weights.sum()])
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        stats = stats.to(device)
        torch.distributed.all_reduce(stats)
    total, squares, n = stats.cpu().tolist()
    mean = total / n
    std = max((squares - n * mean**2) / max(n - 1, 1), 0.0) ** 0.5
    for batch in batches:
        batch["advantages"] = ((batch["advantages"].double() - mean) / (std + 1e-8)).to(batch["advantages"].dtype)


def group_row(sequences: list[tuple[list[int], list[bool]]], per_function: torch.Tensor, reward: torch.Tensor,
              cfg: GRPOConfig, extra: torch.Tensor | None = None, firsts: list[int] | None = None) -> tuple[Row, dict[str, torch.Tensor]]:
    """A group's sequences (token ids, whether each is the policy's own and trained) packed into one row, positions
    restarting at each (at `firsts`' where given: a sequence restarting at p > 0 reads the first p tokens of the one before
    that began at 0, attention.sample_prefixes), with their rewards and the advantages: each reward less the group's mean,
    or the mean of the others (grpo.advantage rloo), over the group's standard deviation where grpo.scale_rewards is
    group. extra: more per-sequence metrics, summed into the step's."""
    std = reward.std().expand_as(reward)  # unbiased, as TRL's nanstd
    advantages = reward - reward.mean()
    if cfg.advantage == "rloo":  # r - (sum - r) / (n - 1) = n / (n - 1) x (r - mean)
        advantages = advantages * len(reward) / (len(reward) - 1)
    if cfg.scale_rewards == "group" and cfg.advantage != "reinforce_pp":  # reinforce_pp: whitened over the step instead
        advantages = advantages / (std + 1e-4)
    ids, labels, positions = [], [], []
    for (sequence, trained), first in zip(sequences, firsts or [0] * len(sequences)):
        ids += sequence
        labels += [token if keep else IGNORE for token, keep in zip(sequence, trained)]
        positions += range(first, first + len(sequence))
    zero = torch.isclose(std, torch.zeros_like(std)).float()
    columns = {"advantages": advantages, "rewards": per_function, "reward": reward, "reward_std": std, "zero_std": zero}
    if extra is not None:
        columns["extra"] = extra
    return Row(np.array(ids), np.array(labels), np.array(positions)), columns
