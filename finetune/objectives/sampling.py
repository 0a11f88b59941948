"""Sampling from the policy: `generate` (one completion per prompt from one transformers `generate` call, the
prompts left-padded; greedy, or drawn by a `GumbelSampler`), shared by GRPO's rollouts, the agent's episodes
and on-policy distillation. A sampled token is the argmax of the logits plus Gumbel noise made from the row's
own seed and the token's step (`uniforms`): the same completion whichever process, batch or start samples it."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from finetune.model.attention import base_model
from finetune.model.loading import end_tokens


def generate(model, tokenizer, prompts: list[np.ndarray], max_new_tokens: int, device, sampler=None, synced: bool = False,
             cache: str = "dynamic", picture_inputs=None, never: tuple[int, ...] = (), share: bool = True) -> list[list[int]]:
    """One completion of each prompt (cut after its first end token: loading.end_tokens) from one `generate` call, the prompts
    left-padded: greedy, or sampled by `sampler` (a GumbelSampler). `synced`: the weights are sharded, and
    every rank runs as many forwards as the rank with the longest completion (transformers' synced_gpus).
    cache: grpo.kv_cache (static: transformers' static KV cache, its decoding step compiled on CUDA).
    picture_inputs: the padded ids -> the prompts' image inputs (a vision-language model's), or None; `never`: tokens not sampled.
    share: a prompt given several times (GRPO's group) is read once (shared_prefill), where the cache is dynamic (and the
    model's generation_config names no cache of its own) and the prompts are text."""
    from transformers import GenerationConfig, LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    ends = end_tokens(model, tokenizer)
    settings = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=ends, use_cache=True, cache_implementation="static" if cache == "static" else None,
                                suppress_tokens=list(never) or None)
    shown = {k: v.to(device) for k, v in picture_inputs(ids).items()} if picture_inputs is not None else {}
    with root_gathered(model):
        own = getattr(model.generation_config, "cache_implementation", None)  # a released generation_config.json's (Gemma's "hybrid")
        read = shared_prefill(model, ids, mask, device) if share and cache == "dynamic" and own is None and not shown else None
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **shown, generation_config=settings, past_key_values=read,
                             logits_processor=LogitsProcessorList([] if sampler is None else [sampler]), synced_gpus=synced)
    completions = []
    for seq in out[:, width:].tolist():
        end = next((i for i, token in enumerate(seq) if token in ends), None)
        completions.append(seq if end is None else seq[: end + 1])
    return completions


@torch.no_grad()
def shared_prefill(model, ids: torch.Tensor, mask: torch.Tensor, device):
    """The KV cache of every left-padded prompt but its last token, computed once for each distinct prompt and copied to
    each row that repeats it (transformers' Cache.reorder_cache), for `generate` to go on from: GRPO's num_generations
    copies of a prompt read it once, as a serving engine's prefix cache would. None where no prompt repeats, or where
    the prompts are one token long. Positions as generate derives them from the mask (_prepare_position_ids_for_generation)."""
    if ids.shape[1] < 2:
        return None
    distinct, rows = np.unique(torch.cat([ids, mask], 1).numpy(), axis=0, return_inverse=True)
    if len(distinct) == len(ids):
        return None
    head, head_mask = (torch.as_tensor(part[:, :-1]) for part in np.split(distinct, 2, axis=1))
    positions = (head_mask.cumsum(-1) - 1).masked_fill_(head_mask == 0, 0)
    out = base_model(model)(  # what generate calls: under FSDP2 not the PEFT root, whose forward would reshard it
        input_ids=head.to(device), attention_mask=head_mask.to(device), position_ids=positions.to(device), use_cache=True, logits_to_keep=1)
    out.past_key_values.reorder_cache(torch.as_tensor(rows.reshape(-1), device=device))
    return out.past_key_values


@contextlib.contextmanager
def root_gathered(model):
    """FSDP2: the root's own weights (embeddings, final norm, head) gathered for the whole `generate` call. Its
    gather runs in the root's forward, and a PEFT root's generate calls the inner model's forward, not the root's;
    the decoder layers, sharded apart, still gather themselves in each forward."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


class GumbelSampler:
    """Sampling as greedy decoding: the argmax of logits/temperature (top-k/top-p filtered) plus Gumbel
    noise is a draw from their softmax (the Gumbel-max trick). The noise of each row is a function of its
    own seed and the token's step (`uniforms`), never of a shared generator, so one `generate` call
    samples each row as a call of its own would, whatever rows share its batch or its process. With a
    top k, the noise is made for the k candidates alone (the same numbers the whole row would get)."""

    def __init__(self, seeds: torch.Tensor, warpers: list, top_k: int = 0, keep_logps: bool = False):
        self.seeds, self.warpers, self.top_k, self.step = seeds, warpers, top_k, 0  # one sampler per `generate` call: called once a token
        # keep_logps: each step's log-probability of the token drawn, under the first warper's (the temperature's) distribution
        self.logps: list[torch.Tensor] | None = [] if keep_logps else None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = tempered = scores.float()
        for i, warp in enumerate(self.warpers):
            scores = warp(input_ids, scores)
            tempered = scores if i == 0 else tempered
        width, step = scores.shape[1], self.step
        self.step += 1
        if not self.top_k or self.top_k >= width:
            drawn = scores + gumbel(uniforms(self.seeds, step, width))
        else:
            values, index = scores.topk(self.top_k, dim=1)
            drawn = torch.full_like(scores, -float("inf")).scatter_(1, index, values + gumbel(uniforms(self.seeds, step, width, index)))
        if self.logps is not None:  # generate's greedy step takes this argmax (the sampler is its last logits processor)
            self.logps.append(torch.log_softmax(tempered, dim=-1).gather(1, drawn.argmax(1, keepdim=True))[:, 0])
        return drawn

    def drawn_logps(self) -> torch.Tensor:
        """keep_logps: (rows, steps), each drawn token's log-probability (fp32, on the host)."""
        return torch.stack(self.logps, dim=1).cpu() if self.logps else torch.zeros(len(self.seeds), 0)


def gumbel(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u))


# splitmix64's constants (0x9e3779b97f4a7c15, 0xbf58476d1ce4e5b9, 0x94d049bb133111eb) as int64: torch has no uint64 arithmetic
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x >> bits as on unsigned 64-bit numbers (torch shifts int64 arithmetically)."""
    return (x >> bits).bitwise_and_((1 << (64 - bits)) - 1)


def uniforms(seeds: torch.Tensor, step: int, width: int, index: torch.Tensor | None = None) -> torch.Tensor:
    """Numbers in (0, 1), float32, one per row and vocabulary entry (or per entry of `index`, (rows, k)):
    splitmix64's output number step * width + entry + 1 from each row's seed, in int64 arithmetic that
    wraps as unsigned arithmetic does, so equal on every device; its top 23 bits make the float (24 would
    round the largest to 1.0 in float32, and its Gumbel noise to infinity)."""
    if index is None:
        index = torch.arange(width, device=seeds.device, dtype=torch.long)[None]
    z = seeds[:, None] + (index + (step * width + 1)) * _GOLDEN
    z.bitwise_xor_(_shift(z, 30)).mul_(_MIX1)
    z.bitwise_xor_(_shift(z, 27)).mul_(_MIX2)
    z.bitwise_xor_(_shift(z, 31))
    return (_shift(z, 41).float() + 0.5) * 2.0**-23
