"""GRPO (train.objective grpo): the loss and gradients equal TRL's GRPOTrainer on the same completions and
advantages; sampling is a function of the step and the prompt (resume, two processes); reward functions
are checked; a run on the demo raises the reward."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch
from conftest import DEMO_DATA, REPO, adapted_lora, base_config, finetune_in_process, killed_and_resumed, read_jsonl, step_rows, write_config

from finetune.config.errors import UserError
from finetune.config.schema import GRPOConfig
from finetune.data.packing import Row, collate
from finetune.data.rows import IGNORE
from finetune.objectives.grpo import GRPO
from finetune.objectives.loss import to_device
from finetune.objectives.rewards import Reward, exact_match, load_rewards, score

PROMPTS = [[5, 9, 17, 23], [31, 8, 12]]  # two prompts, two completions each
COMPLETIONS = [[40, 41, 42, 2], [43, 44], [45, 46, 47, 48, 49, 50], [51]]
ADVANTAGES = torch.tensor([0.9, -0.4, 1.3, -0.2])  # not summing to 0: a loss value that says something
MAX_COMPLETION = 6


def _grpo_config(model_dir, out, **sections):
    cfg = base_config(model_dir, out, **sections)
    cfg["data"] = {"train": str(DEMO_DATA / "prompts-train.jsonl"), "eval": str(DEMO_DATA / "prompts-eval.jsonl"), "format": "prompt",
                   "max_seq_len": 64, **sections.get("data", {})}
    cfg["train"] = {**cfg["train"], "objective": "grpo", "max_steps": 4, "micro_batch_size": 2, "lr": 5e-3, **sections.get("train", {})}
    cfg["grpo"] = {"num_generations": 4, "max_completion_length": 4, **sections.get("grpo", {})}
    cfg["eval"] = {"max_batches": 2, **sections.get("eval", {})}
    return cfg


def _ours(model, cfg: GRPOConfig, off_policy: bool = False, sampler_gap: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Our loss on the completions, laid out as the rollout lays them out (a prompt's completions packed in one row). off_policy:
    the completions' old log-probabilities (a later update of num_iterations > 1) are the policy's moved by up to +-0.4, so some
    ratios are clipped; returned as TRL lays them out. sampler_gap: the sampler's log-probabilities are the policy's moved by up to
    +-0.5 (a sampler that rounds otherwise); returned as TRL's importance-sampling weights instead, made by TRL's own rule."""
    rows = []
    for p, prompt in enumerate(PROMPTS):
        ids, labels, positions = [], [], []
        for completion in COMPLETIONS[2 * p : 2 * p + 2]:
            ids += prompt + completion
            labels += [IGNORE] * len(prompt) + completion
            positions += range(len(prompt) + len(completion))
        rows.append(Row(np.array(ids), np.array(labels), np.array(positions)))
    n = len(COMPLETIONS)
    batch = {**collate(rows, 0), "advantages": ADVANTAGES, "rewards": torch.zeros(n, 1), "reward": torch.zeros(n),
             "reward_std": torch.zeros(n), "zero_std": torch.zeros(n)}
    objective = GRPO(cfg, [Reward("r", "reward_r", 1.0, None)], seed=0)
    trl_old = None
    if off_policy:
        with torch.no_grad():
            old = objective._logps(model, batch, "cpu")
        keep = old != 0
        old[keep] += torch.empty(int(keep.sum())).uniform_(-0.4, 0.4, generator=torch.Generator().manual_seed(0))
        batch["old_logps"] = old
        per_completion = old[keep].split([len(c) for c in COMPLETIONS])
        trl_old = torch.stack([torch.nn.functional.pad(c, (0, MAX_COMPLETION - len(c))) for c in per_completion])
    if sampler_gap:
        with torch.no_grad():
            policy = objective._logps(model, batch, "cpu")
        keep = policy != 0
        sampler = policy[keep] + torch.empty(int(keep.sum())).uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(1))
        batch["sampler_logps"] = sampler
        trl_old = _trl_weights(policy[keep] - sampler, cfg)
    totals = objective.counts(batch)
    return objective.losses(model, to_device(batch, "cpu"), totals).tokens / totals[0], trl_old


def _trl_weights(gap: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """TRL 1.16's importance-sampling weights (_generate_and_score_completions, vllm_importance_sampling_correction) from the
    trainer-less-sampler gaps of the completions' tokens, in TRL's (completions, MAX_COMPLETION) layout."""
    s = cfg.importance_sampling
    per_completion = gap.split([len(c) for c in COMPLETIONS])
    diff = torch.stack([torch.nn.functional.pad(c, (0, MAX_COMPLETION - len(c))) for c in per_completion])
    ratio = torch.exp(diff.sum(-1, keepdim=True) if s.level == "sequence" else diff)
    return torch.clamp(ratio, max=s.cap) if s.mode == "truncate" else ratio.masked_fill(ratio > s.cap, 0.0)


def _trls(model, tokenizer, cfg: GRPOConfig, tmp_path, old: torch.Tensor | None = None) -> torch.Tensor:
    """TRL's GRPOTrainer._compute_loss on the same completions: prompts left-padded, completions right-padded, as TRL batches them.
    old: the old log-probabilities, or (grpo.importance_sampling) the importance-sampling weights, which TRL applies where its
    sampler is vLLM."""
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    args = TRLConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=2, max_completion_length=MAX_COMPLETION,
                     beta=cfg.beta, loss_type=cfg.loss_type, temperature=cfg.temperature, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                     importance_sampling_level=cfg.ratio, sapo_temperature_pos=cfg.sapo_temperatures[0],
                     sapo_temperature_neg=cfg.sapo_temperatures[1], report_to=[], use_cpu=True, bf16=False)
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=args,
                          train_dataset=Dataset.from_list([{"prompt": "a"}] * 4), processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    width = max(map(len, PROMPTS))
    prompts = [PROMPTS[i // 2] for i in range(4)]
    prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [0] * (MAX_COMPLETION - len(c)) for c in COMPLETIONS])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (MAX_COMPLETION - len(c)) for c in COMPLETIONS])
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids, "completion_mask": completion_mask,
              "advantages": ADVANTAGES, "num_items_in_batch": completion_mask.sum()}
    if old is not None and cfg.importance_sampling is not None:
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True  # its sampler is vLLM: the weights apply
        inputs["importance_sampling_ratio"] = old
    elif old is not None:
        inputs["old_per_token_logps"] = old
    if cfg.beta:
        with torch.no_grad(), model.disable_adapter():
            inputs["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
                model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), MAX_COMPLETION)
    model.train()
    return trainer._compute_loss(model, inputs)


@pytest.mark.parametrize("loss_type, ratio", [("grpo", "token"), ("dr_grpo", "token"), ("dapo", "token"), ("cispo", "token"), ("sapo", "token"),
                                              ("grpo", "sequence"), ("dapo", "sequence")])
@pytest.mark.parametrize("beta, off_policy", [(0.0, False), (0.2, False), (0.2, True)])
def test_loss_and_gradients_equal_trls(tmp_path, tiny_model_dir, loss_type, ratio, beta, off_policy):
    """On the sampling policy (one update per generation) and off it (num_iterations > 1: the old log-probabilities
    held from the sampling, ratios clipped); the ratio per token, or per completion (GSPO: TRL's importance_sampling_level
    sequence); CISPO's capped weights and SAPO's soft gate as TRL 1.16 has them."""
    pytest.importorskip("trl")
    from transformers import AutoTokenizer

    cfg = GRPOConfig(loss_type=loss_type, ratio=ratio, beta=beta, temperature=0.8, max_completion_length=MAX_COMPLETION,
                     epsilon_high=1.2 if loss_type == "cispo" else 0.28)  # CISPO caps the ratio itself at epsilon_high: some are, off policy
    model = adapted_lora(tiny_model_dir)
    trained = [p for p in model.parameters() if p.requires_grad]
    ours, old = _ours(model, cfg, off_policy)
    ours.backward()
    our_grads = [p.grad.clone() for p in trained]
    model.zero_grad()
    expected = _trls(model, AutoTokenizer.from_pretrained(tiny_model_dir), cfg, tmp_path, old)
    expected.backward()
    expected_grads = [p.grad.clone() for p in trained]
    for p, g in zip(trained, our_grads):
        p.grad = g
    assert abs(ours.item() - expected.item()) < 1e-5, (ours.item(), expected.item())
    assert abs(expected.item()) > 1e-3  # a loss that says something: the advantages do not cancel
    worst = max((p.grad - g).abs().max().item() for p, g in zip(trained, expected_grads))
    assert worst < 1e-4 * max(g.abs().max().item() for g in expected_grads), worst


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_the_sampler_gap_correction_equals_trls(tmp_path, tiny_model_dir, level, mode, loss_type):
    """grpo.importance_sampling: the policy's term weighted by exp(trainer - sampler) per token or per completion, capped (truncate)
    or zeroed (mask) above cap, the KL's term not, equals TRL's vllm_importance_sampling_correction (its weights made by its own
    rule from the same gaps), loss and LoRA gradients; some weights are over the cap of 1.1."""
    pytest.importorskip("trl")
    from transformers import AutoTokenizer

    cfg = GRPOConfig(loss_type=loss_type, beta=0.2, temperature=0.8, max_completion_length=MAX_COMPLETION, epsilon_high=0.28,
                     importance_sampling={"level": level, "mode": mode, "cap": 1.1})
    model = adapted_lora(tiny_model_dir)
    trained = [p for p in model.parameters() if p.requires_grad]
    ours, weights = _ours(model, cfg, sampler_gap=True)
    assert ((weights > 0) & (weights < 1)).any() and ((weights == 1.1) | (weights == 0)).any(), weights  # some weigh less, some capped
    ours.backward()
    our_grads = [p.grad.clone() for p in trained]
    model.zero_grad()
    expected = _trls(model, AutoTokenizer.from_pretrained(tiny_model_dir), cfg, tmp_path, weights)
    expected.backward()
    assert abs(ours.item() - expected.item()) < 1e-5, (ours.item(), expected.item())
    worst = max((g - p.grad).abs().max().item() for p, g in zip(trained, our_grads))
    assert worst < 1e-4 * max(p.grad.abs().max().item() for p in trained), worst


def test_the_sampler_keeps_its_tokens_log_probabilities_and_the_gap_is_logged(tiny_model_dir):
    """A rollout keeps each completion token's log-probability as the sampler drew it (generate with its KV cache, eval mode, at
    the temperature): in fp32 here within 1e-4 of the trainer's forward over the packed row; mismatch_kl and mismatch_max log the
    gap (0 where the two agree), and a gap made larger is logged larger."""
    from finetune.config.schema import ModelConfig
    from finetune.data.packing import Prompt
    from finetune.model.loading import load_tokenizer

    cfg = GRPOConfig(num_generations=3, max_completion_length=5, temperature=0.7, top_k=20)
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    model = adapted_lora(tiny_model_dir)
    objective = GRPO(cfg, [Reward("r", "reward_r", 1.0, lambda **kw: [0.0] * len(kw["completions"]))], seed=3)
    prompts = [Prompt(np.array(p), {"prompt": "x"}, i) for i, p in enumerate(PROMPTS)]
    batches, _ = objective._sampled(model, tokenizer, [prompts], position=0, device="cpu", old_logps=True)
    batch = batches[0]
    keep = batch["old_logps"] != 0
    assert batch["sampler_logps"].shape == (int(keep.sum()),) and (batch["sampler_logps"] < 0).all()
    gap = batch["old_logps"][keep] - batch["sampler_logps"]
    assert gap.abs().max() < 1e-4, gap
    metrics = dict(zip(objective.metrics, objective.losses(model, to_device(batch, "cpu"), objective.counts(batch)).metrics.tolist()))
    n = len(batch["advantages"])
    assert metrics["mismatch_max"] / n < 1e-4 and metrics["mismatch_kl"] / n < 1e-8
    batch["sampler_logps"] = batch["sampler_logps"] - 0.3  # a sampler that puts less on what it drew
    moved = dict(zip(objective.metrics, objective.losses(model, to_device(batch, "cpu"), objective.counts(batch)).metrics.tolist()))
    assert abs(moved["mismatch_max"] / n - 0.3) < 1e-3 and abs(moved["mismatch_kl"] / n - (np.exp(0.3) - 1.3)) < 1e-3, moved


@pytest.fixture(scope="module")
def parity_reward(tmp_path_factory) -> str:
    """A reward random completions of a random model score unevenly on: the parity of their tokens (id sum)."""
    path = tmp_path_factory.mktemp("rewards") / "parity.py"
    path.write_text("def even(completion_ids, **_):\n    return [float(sum(ids) % 2 == 0) + 0.1 * len(ids) for ids in completion_ids]\n")
    return f"{path}:even"


def test_kill_9_mid_grpo_run_then_resume_samples_and_trains_the_same(tmp_path, tiny_model_dir, parity_reward):
    """A prompt's completions come from a seed of (train.seed, step, prompt): the resumed steps sample the
    same completions (lengths, rewards) and give the same losses, bitwise, with no sampler state saved."""
    cfg = _grpo_config(tiny_model_dir, tmp_path / "reference", data={"eval": None}, grpo={"rewards": [parity_reward], "beta": 0.1})
    assert finetune_in_process("train", "--config", str(write_config(tmp_path / "reference.yaml", cfg))).returncode == 0
    keys = ("loss", "grad_norm", "reward", "completion_length", "kl")
    expected = [[r[k] for k in keys] for r in step_rows(tmp_path / "reference")]
    assert len({tuple(e[1:]) for e in expected}) == 4  # every step sampled something else
    resumed, steps = killed_and_resumed(tmp_path, cfg, save_every=2, kill_at=3)
    assert [[r[k] for k in keys] for r in steps] == expected  # bitwise
    # A GRPO run ends with what it was for: the final step's mean reward and KL, not its loss (centred on 0 by the advantages).
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["train_reward"], summary["train_kl"]) == (expected[-1][2], expected[-1][4]) and "train_loss" not in summary
    assert f"final step's mean reward {expected[-1][2]:.4f}, KL {expected[-1][4]:.4g}" in resumed.stdout and "final train loss" not in resumed.stdout


def test_num_iterations_holds_each_generation_and_a_run_resumed_between_its_updates_trains_the_same(tmp_path, tiny_model_dir, parity_reward):
    """grpo.num_iterations 2: each sample of completions trains two optimizer steps (the same rewards and lengths, the second
    update's ratio to the old log-probabilities moved); a checkpoint between them holds the rollouts (this rank's file), so
    the run killed after it resumes on the same completions and losses, bitwise."""
    cfg = _grpo_config(tiny_model_dir, tmp_path / "reference", data={"eval": None}, train={"max_steps": 6},
                       grpo={"rewards": [parity_reward], "beta": 0.1, "num_iterations": 2})
    assert finetune_in_process("train", "--config", str(write_config(tmp_path / "reference.yaml", cfg))).returncode == 0
    keys = ("loss", "grad_norm", "reward", "completion_length", "kl", "clip_ratio")
    expected = [[r[k] for k in keys] for r in step_rows(tmp_path / "reference")]
    sampled = [tuple(e[2:4]) for e in expected]
    assert sampled[0::2] == sampled[1::2] and len(set(sampled)) == 3, sampled  # one generation per two updates
    assert expected[1][0] != expected[0][0] and expected[1][4] > expected[0][4]  # the second update trains on a moved ratio
    _, steps = killed_and_resumed(tmp_path, cfg, save_every=3, kill_at=3)
    assert (tmp_path / "out" / "checkpoints" / "step-000003" / "state-rank0.safetensors").is_file()
    assert [[r[k] for k in keys] for r in steps] == expected  # bitwise


def test_rollouts_sampled_ahead_are_the_policys_as_it_was_when_they_began(tiny_model_dir, parity_reward):
    """grpo.async_rollouts: a thread samples the next data step's completions while the step trains; what it samples, and
    the log-probabilities it gives them, are those of the weights when it began, however the model moves meanwhile."""
    from transformers import AutoTokenizer

    from finetune.data.packing import Prompt

    model, tokenizer = adapted_lora(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = GRPOConfig(rewards=[parity_reward], num_generations=4, max_completion_length=6, async_rollouts=True)
    prompts = [[Prompt(np.array(p), {"prompt": "a"}, i) for i, p in enumerate(PROMPTS)]]
    expected, tokens = GRPO(cfg, load_rewards(cfg), seed=3).rollout(model, tokenizer, prompts, 5, "cpu")
    expected_old = GRPO(cfg, [], seed=3)._logps(model, expected[0], "cpu")
    objective = GRPO(cfg, load_rewards(cfg), seed=3)
    objective.sample_ahead(model, tokenizer, prompts, 5, "cpu", contextlib.nullcontext)
    with torch.no_grad():  # the step trains meanwhile
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.3)
    ahead, ahead_tokens = objective.rollout(model, tokenizer, prompts, 5, "cpu")
    assert ahead_tokens == tokens and objective.ahead == []
    for key in ("input_ids", "labels", "position_ids", "rewards", "advantages"):
        assert torch.equal(ahead[0][key], expected[0][key]), key
    assert torch.equal(ahead[0]["old_logps"], expected_old) and (expected_old != 0).sum() > 10
    assert (GRPO(cfg, [], seed=3)._logps(model, expected[0], "cpu") - expected_old).abs().max() > 0.1  # the moved model's are not
    objective.sample_ahead(model, tokenizer, prompts, 5, "cpu", contextlib.nullcontext)  # begun after the move: its copy is refreshed
    again = objective.joined_ahead()[0][1][0]
    assert torch.equal(again["old_logps"], GRPO(cfg, [], seed=3)._logps(model, again, "cpu"))
    in_line, _ = objective.rollout(model, tokenizer, prompts, 6, "cpu")  # another data step: sampled in line, what was ahead dropped
    assert "old_logps" not in in_line[0] and objective.ahead == []


@pytest.mark.parametrize("depth", [1, 2])
def test_async_rollouts_run_resumed_after_kill_9_trains_the_same(tmp_path, tiny_model_dir, parity_reward, depth):
    """The first step samples in line (as a synchronous run's), the later ones train on completions sampled up to `depth` steps
    before (their ratio moved off 1); a checkpoint holds every rollout sampled ahead, so a run killed after it resumes bitwise.
    Two steps ahead, step 2's completions come from the policy of step 0, not step 1's as one step ahead: its ratio, and loss, differ."""
    sections = {"data": {"eval": None}, "grpo": {"rewards": [parity_reward], "beta": 0.1}}
    runs = {name: _grpo_config(tiny_model_dir, tmp_path / name, **{**sections, "grpo": {**sections["grpo"], "async_rollouts": k}})
            for name, k in (("reference", depth), ("one-ahead", 1), ("synchronous", 0)) if name != "one-ahead" or depth > 1}
    for config in runs.values():
        assert finetune_in_process("train", "--config", str(write_config(tmp_path / "run.yaml", config))).returncode == 0
    keys = ("loss", "grad_norm", "reward", "completion_length", "kl", "clip_ratio")
    expected, in_line = ([[r[k] for k in keys] for r in step_rows(tmp_path / name)] for name in ("reference", "synchronous"))
    assert expected[0] == in_line[0] and all(e[0] != s[0] for e, s in zip(expected[1:], in_line[1:]))
    if depth > 1:
        one_ahead = [[r[k] for k in keys] for r in step_rows(tmp_path / "one-ahead")]
        assert expected[:2] == one_ahead[:2] and expected[2][0] != one_ahead[2][0]
    _, steps = killed_and_resumed(tmp_path, runs["reference"], save_every=2, kill_at=3)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "out" / "checkpoints" / "step-000002" / "state-rank0.safetensors")
    # steps 3 (and 4)'s rollouts, sampled during the steps before; none held
    assert [int(saved[f"{p}position"]) for p in ("ahead.", "ahead1.") if f"{p}position" in saved] == [2, 3][:depth] and "batches" not in saved
    assert [[r[k] for k in keys] for r in steps] == expected  # bitwise


def test_plan_counts_the_policy_copy_that_samples_ahead(tmp_path, tiny_model_dir):
    from finetune.config.schema import validate_config
    from finetune.outputs.plan import make_plan

    rows = {(method, ahead): make_plan(validate_config(_grpo_config(tiny_model_dir, tmp_path, adapter={"method": method},
                                                                    grpo={"async_rollouts": ahead}), "test")).rows
            for method in ("lora", "full") for ahead in (False, True)}
    copied, weights = rows["full", True]["async rollouts' policy copy"], rows["full", True]["weights"]
    assert weights - 1024 < copied <= weights  # all trained: a second copy (the weights' row adds the rotary buffers)
    assert 0 < rows["lora", True]["async rollouts' policy copy"] == rows["lora", True]["gradients"]  # the fp32 adapter's size
    assert "async rollouts' policy copy" not in rows["lora", False] and "async rollouts' policy copy" not in rows["full", False]


@pytest.fixture(scope="module")
def two_sections(tmp_path_factory, tiny_model_dir, parity_reward) -> dict:
    """4 steps of 4 prompts, two updates on each sample (num_iterations 2: the held rollouts' old log-probabilities computed
    by the sharded model too), and an eval of 5 prompts every 2 steps: 3 on rank 0 and 2 on rank 1 at 2 processes."""
    tmp = tmp_path_factory.mktemp("grpo-eval")
    sections = _grpo_config(tiny_model_dir, tmp, grpo={"rewards": [parity_reward, "length"], "num_iterations": 2})
    rows = (DEMO_DATA / "prompts-eval.jsonl").read_text().splitlines()[:5]
    (tmp / "eval.jsonl").write_text("\n".join(rows) + "\n")
    sections["data"]["eval"] = str(tmp / "eval.jsonl")
    return {k: sections[k] for k in ("data", "grpo")} | {"train": {"objective": "grpo"}, "eval": {"every": 2}}


@pytest.mark.parametrize("strategy, sampled_ahead", [("ddp", False), ("fsdp", False), ("zero3", False), ("ddp", True), ("zero2", True)])
def test_two_processes_sample_and_train_as_one(tiny_model_dir, trained, two_sections, strategy, sampled_ahead):
    """The same completions (rewards, lengths), losses and greedy eval whether one process or two sample them, the
    weights whole (ddp) or sharded (fsdp, zero3: every rank decodes as long as the longest; rank 1 evaluates one
    prompt fewer and runs a stand-in batch); with grpo.async_rollouts too (each data step's two updates on rollouts
    sampled during the update before)."""
    if sampled_ahead:
        two_sections = {**two_sections, "grpo": {**two_sections["grpo"], "async_rollouts": True}}
    reference, one, _ = trained(tiny_model_dir, "lora", **two_sections)
    out, two, summary = trained(tiny_model_dir, "lora", 2, strategy, **two_sections)
    assert summary["world_size"] == 2 and summary["strategy"] == strategy and len(two) == 4
    assert two == pytest.approx(one, rel=1e-4, abs=1e-6)
    keys = ("reward", "completion_length", "eval_reward")
    sampled = [r.get(k) for r in read_jsonl(out / "metrics.jsonl") for k in keys]
    expected = [r.get(k) for r in read_jsonl(reference / "metrics.jsonl") for k in keys]
    assert sampled == pytest.approx(expected, abs=1e-6) and sum(v is not None for v in expected) == 4 + 4 + 3  # evals at 0, 2 and 4


def test_gumbel_noise_samples_the_softmax_and_is_splitmix64():
    """The sampler's uniforms are splitmix64's numbers (its 64-bit arithmetic done in int64), never 0 or 1;
    argmax of the warped logits plus their Gumbel noise draws each token as often as softmax(logits / T)
    over the top k; the noise made for the top k alone is the whole row's at those entries."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

    from finetune.objectives.sampling import GumbelSampler, uniforms

    def splitmix64(seed: int, k: int) -> float:
        z = (seed + k * 0x9E3779B97F4A7C15) % 2**64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return (((z ^ (z >> 31)) >> 41) + 0.5) * 2.0**-23

    seeds = [7, 2**63 + 5, 2**64 - 1]
    drawn = uniforms(torch.tensor([s - 2**64 if s >= 2**63 else s for s in seeds]), 3, 6)
    assert torch.equal(drawn, torch.tensor([[splitmix64(s, 3 * 6 + i + 1) for i in range(6)] for s in seeds]))
    many = uniforms(torch.arange(64) * 7, 0, 100_000)
    assert 0 < many.min() and many.max() < 1 and abs(many.mean().item() - 0.5) < 1e-3
    rows, logits = 40_000, torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    warpers = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(3)]
    sampler = GumbelSampler(torch.arange(rows) * 1_000_003, warpers)
    picks = sampler(torch.zeros(rows, 1, dtype=torch.long), logits.expand(rows, -1)).argmax(-1)
    share = torch.bincount(picks, minlength=5).double() / rows
    expected = torch.cat([torch.softmax(logits[:3].double() / 0.7, 0), torch.zeros(2, dtype=torch.float64)])
    assert (share - expected).abs().max() < 0.01, (share, expected)  # 4 standard errors at 40,000 draws
    assert sampler.step == 1 and not torch.equal(sampler(torch.zeros(rows, 2, dtype=torch.long), logits.expand(rows, -1)).argmax(-1), picks)
    wide = torch.randn(64, 5000)
    whole, only_k = GumbelSampler(torch.arange(64), warpers), GumbelSampler(torch.arange(64), warpers, top_k=3)
    assert torch.equal(whole(None, wide), only_k(None, wide))


def test_a_prompts_completions_are_the_same_in_any_batch(tiny_model_dir):
    """One `generate` call samples a micro-batch's prompts left-padded; a prompt's completions are the ones it gets
    sampled alone (and greedy decoding likewise), so they hang on (seed, step, prompt) and nothing else."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.data.packing import Prompt
    from finetune.objectives.sampling import generate

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    objective = GRPO(GRPOConfig(num_generations=4, max_completion_length=8, temperature=1.0), [], seed=3)
    short, long = Prompt(np.array(PROMPTS[1]), {}, 5), Prompt(np.array(PROMPTS[0] * 3), {}, 9)
    alone = objective.sample(model, tokenizer, [short], 2, "cpu")[0][0]
    beside = objective.sample(model, tokenizer, [long, short], 2, "cpu")[0]
    assert beside[1] == alone and beside[0] != alone
    assert len({tuple(c) for c in alone}) == 4  # four different completions of one prompt
    assert objective.sample(model, tokenizer, [short], 3, "cpu")[0][0] != alone  # another step, other draws
    assert generate(model, tokenizer, [long.ids, short.ids], 8, "cpu")[1] == generate(model, tokenizer, [short.ids], 8, "cpu")[0]
    static = GRPO(GRPOConfig(num_generations=4, max_completion_length=8, temperature=1.0, kv_cache="static"), [], seed=3)
    assert static.sample(model, tokenizer, [long, short], 2, "cpu")[0] == beside  # fp32 on CPU: the static KV cache samples the same


SHARED_PREFILL_FAMILIES = ["llama3", "mistral", "gemma2", "gemma3", "qwen3-moe", "gpt-oss", "deepseek-v3", "gemma4", "qwen3.5", "lfm2", "jamba"]


@pytest.mark.parametrize("family", SHARED_PREFILL_FAMILIES)
def test_a_prompt_read_once_for_its_group_samples_what_reading_it_each_time_does(family_dirs, family):
    """generate reads a prompt given several times (a GRPO group) once, and copies its KV cache (and a hybrid model's
    recurrent and convolution states) to each of its rows (sampling.shared_prefill). Two prompts of unequal lengths
    (left-padded, the long one past the sliding window), 3 completions each, sampled at temperature 1: the same tokens and
    the same sampler log-probabilities (1e-5) as the prompts read row by row, in every family whose cache it copies."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.objectives.sampling import generate, shared_prefill

    folder = family_dirs(family)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    objective = GRPO(GRPOConfig(num_generations=3, max_completion_length=6, temperature=1.0), [], seed=3)
    prompts = [np.array(PROMPTS[0] * 3)] * 3 + [np.array(PROMPTS[1])] * 3
    results = []
    for share in (True, False):
        sampler = objective.sampler(torch.arange(6) * 7919, keep_logps=True)
        results.append((generate(model, tokenizer, prompts, 6, "cpu", sampler, share=share), sampler.drawn_logps()))
    (shared, shared_logps), (each, each_logps) = results
    assert shared == each and len({tuple(c) for c in each}) > 2, (shared, each)
    torch.testing.assert_close(shared_logps, each_logps, rtol=0, atol=1e-5)
    ids = torch.as_tensor(np.stack([prompts[0], prompts[3][:1].repeat(len(prompts[0]))]))
    assert shared_prefill(model, ids, torch.ones_like(ids), "cpu") is None  # no prompt repeats: generate reads them all itself
    if family == "llama3":  # a generation_config.json naming a cache of its own (Gemma's releases: "hybrid"): generate makes it, reading each copy
        model.generation_config.cache_implementation = "static"
        assert generate(model, tokenizer, prompts, 6, "cpu", objective.sampler(torch.arange(6) * 7919)) == each


SHARED_PROMPT_FAMILIES = ["llama3", "mistral", "gemma3", "qwen3-moe", "deepseek-v3", "glm4-moe", "gemma4"]


@pytest.mark.parametrize("kernel", ["finetune", "sdpa", "gpu-block-mask"])
@pytest.mark.parametrize("family", SHARED_PROMPT_FAMILIES)
def test_a_groups_prompt_written_once_trains_as_a_copy_for_each_completion(monkeypatch, family_dirs, family, kernel):
    """grpo.shared_prompts: a group's row holds its prompt once, each completion after a copy of its last token, reading the
    prompt's keys and values (attention.sample_prefixes). Two prompts (one past the sliding window) of 3 completions of
    unequal lengths, the length reward, beta 0.2, LoRA with B drawn: the loss and every LoRA gradient equal the row of a
    copy a completion (1e-6 / 1e-5), through finetune's CPU kernel, torch's sdpa a sample at a time, and the GPU's
    block mask (its Python on CPU tensors); and the row is shorter."""
    from transformers import AutoTokenizer

    from finetune.config.schema import AdapterConfig, ModelConfig
    from finetune.data.packing import Prompt
    from finetune.model import attention
    from finetune.model.loading import apply_adapter, load_model

    if kernel == "sdpa":
        monkeypatch.setattr(attention, "short_sample", lambda *a: 0)
    elif kernel == "gpu-block-mask":
        monkeypatch.setattr(attention, "accelerator_path", lambda tensor: True)
    folder = family_dirs(family)
    torch.manual_seed(0)
    model = apply_adapter(load_model(ModelConfig(name_or_path=str(folder)), say=lambda _: None), AdapterConfig(r=4, alpha=8, dropout=0.0),
                          gradient_checkpointing=False, say=lambda _: None).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    cfg = GRPOConfig(num_generations=3, max_completion_length=6, beta=0.2, loss_type="grpo", rewards=["length"])
    objective = GRPO(cfg, load_rewards(cfg), seed=0)
    assert objective.reads_shared_prompts(model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [Prompt(np.array(PROMPTS[0] * 3), {"prompt": "a"}, 0), Prompt(np.array(PROMPTS[1]), {"prompt": "b"}, 1)]
    completions = [[[40, 41, 42, 2], [43, 44], [45, 46, 47, 48, 49, 50]], [[51], [52, 53, 54], [55, 56]]]
    trained = [p for p in model.parameters() if p.requires_grad]
    results = []
    for shared in (True, False):
        rows, columns = zip(*(objective._scored(tokenizer, p, c, [{}] * 3, shared) for p, c in zip(prompts, completions)))
        batch = {**collate(list(rows), 0), **{k: torch.cat([c[k] for c in columns]) for k in columns[0]}}
        model.zero_grad()
        totals = objective.counts(batch)
        loss = objective.losses(model, to_device(batch, "cpu"), totals).tokens / totals[0]
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in trained], batch["input_ids"].shape[1]))
    (loss, grads, width), (copied_loss, copied_grads, copied_width) = results
    largest = max(c.abs().max().item() for c in copied_grads)
    assert width < copied_width and largest > 1e-4
    torch.testing.assert_close(loss, copied_loss, rtol=0, atol=1e-6)
    worst = max((g - c).abs().max().item() for g, c in zip(grads, copied_grads))
    # Gemma 4's gradients carry more of fp32's rounding between the two layouts of the same sums than the other families'
    # (2e-7 to 4e-7 of the largest): 3e-6 to 9e-6 before its experts' routing weight scaled their inputs, to 1.5e-5 since
    assert worst <= (3e-5 if family == "gemma4" else 1e-5) * largest, (worst, largest)


def test_a_copy_of_the_prompt_a_completion_where_a_shared_one_cannot_be_read(monkeypatch, family_dirs):
    """grpo.shared_prompts holds where finetune's packed attention reads the rows; attention with sinks (gpt-oss), layers that
    carry a state along the row (Qwen3.5's linear attention), eager attention (Gemma 2), router replay, the setting off, and
    a model on an accelerator (until the varlen kernel's alignment is checked there) keep a copy a completion."""
    from finetune.config.schema import ModelConfig
    from finetune.model.loading import load_model
    from finetune.objectives import grpo

    def reads(family: str, **settings) -> bool:
        model = load_model(ModelConfig(name_or_path=str(family_dirs(family))), say=lambda _: None)
        return GRPO(GRPOConfig(**settings), [], seed=0).reads_shared_prompts(model)

    assert reads("llama3") and not reads("llama3", shared_prompts=False) and not reads("llama3", router_replay=True)
    assert not any(reads(family) for family in ("gpt-oss", "qwen3.5", "gemma2"))
    monkeypatch.setattr(grpo, "accelerator_path", lambda tensor: True)
    assert not reads("llama3")


def test_reward_functions_resolve_and_bad_ones_stop_in_one_line(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def shorter(completions, **kw):\n    return [-float(len(c)) for c in completions]\n"
        "def raises(completions, **kw):\n    raise KeyError('solution')\n"
        "def text(completions, **kw):\n    return ['high'] * len(completions)\n"
        "def short_list(completions, **kw):\n    return [1.0]\n"
        "def nan(completions, **kw):\n    return [float('nan')] * len(completions)\n")
    path = tmp_path / "my_rewards.py"
    rewards = load_rewards(GRPOConfig(rewards=["exact_match", f"{path}:shorter", "format", "length"], format_pattern=r"no\w+",
                                       max_completion_length=4))
    assert [r.metric for r in rewards] == ["reward_exact_match", "reward_shorter", "reward_format", "reward_length"]
    table = score(rewards, ["p", "p"], ["noun", " verb "], [[1, 2], [3]], [{"answer": "noun"}, {"answer": "verb"}], lambda i: f"rows.jsonl:{i}")
    assert table == [[1.0, -4.0, 1.0, -0.5], [1.0, -6.0, 0.0, -0.25]]
    for name, why in ((f"{path}:missing", "has no function missing"), ("no_such_module:f", "importing no_such_module failed: ModuleNotFoundError"),
                      (f"{tmp_path}/nope.py:f", "no file"), ("exactmatch", "is not a built-in")):
        with pytest.raises(UserError, match=why):
            load_rewards(GRPOConfig(rewards=[name]))
    for name, why in (("raises", r"raises raised KeyError: 'solution' \(scoring completions of rows.jsonl:0\)"),
                      ("text", "returned 'high' for a completion of rows.jsonl:0; expected a finite number"),
                      ("short_list", "returned a list of 1; expected a list of 2 numbers"), ("nan", "returned nan")):
        with pytest.raises(UserError, match=why):
            score(load_rewards(GRPOConfig(rewards=[f"{path}:{name}"])), ["p", "p"], ["a", "b"], [[1], [2]], [{}, {}], lambda i: f"rows.jsonl:{i}")
    with pytest.raises(ValueError, match="no 'answer' column"):
        exact_match(["noun"])


@pytest.mark.parametrize("scale", ["none", "group"])
def test_rloo_measures_each_reward_from_the_mean_of_the_others(scale):
    """grpo.advantage rloo (REINFORCE Leave-One-Out): each completion's reward less the mean of its group's other rewards,
    over the group's standard deviation where scale_rewards is group; mean (GRPO): less the group's mean."""
    from finetune.objectives.grpo import group_row

    reward = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0])
    sequences = [([5, 6], [False, True])] * len(reward)
    std = reward.std().item() + 1e-4 if scale == "group" else 1.0
    for advantage, expected in (("rloo", [(r - (reward.sum() - r) / (len(reward) - 1)) / std for r in reward.tolist()]),
                                ("mean", [(r - reward.mean()) / std for r in reward.tolist()])):
        columns = group_row(sequences, reward[:, None], reward, GRPOConfig(advantage=advantage, scale_rewards=scale))[1]
        assert columns["advantages"].tolist() == pytest.approx([float(e) for e in expected], abs=1e-6), advantage


def test_reinforce_pp_whitens_the_group_centred_rewards_over_every_completion_token_of_the_step():
    """grpo.advantage reinforce_pp (REINFORCE++-baseline, as verl): each reward less its group's mean, then less the mean and
    over the (unbiased) standard deviation of those advantages taken over every completion token of the step, written out
    here; the group's own deviation (scale_rewards) does not apply."""
    from finetune.objectives.grpo import group_row, whitened_over_the_step

    cfg = GRPOConfig(advantage="reinforce_pp", num_generations=3)
    groups = [([1.0, 0.0, 0.0], [2, 5, 1]), ([1.0, 1.0, 0.5], [3, 1, 4])]  # rewards, completion lengths
    batches = []
    for rewards, lengths in groups:
        reward = torch.tensor(rewards)
        row, columns = group_row([([7, 8] + [9] * n, [False, False] + [True] * n) for n in lengths], reward[:, None], reward, cfg)
        batches.append({**collate([row], 0), **columns})
    whitened_over_the_step(batches, "cpu")
    centred = [r - sum(rewards) / len(rewards) for rewards, _ in groups for r in rewards]
    weights = [n for _, lengths in groups for n in lengths]
    mean = sum(w * a for w, a in zip(weights, centred)) / sum(weights)
    std = (sum(w * (a - mean) ** 2 for w, a in zip(weights, centred)) / (sum(weights) - 1)) ** 0.5
    ours = torch.cat([b["advantages"] for b in batches]).tolist()
    assert ours == pytest.approx([(a - mean) / std for a in centred], abs=1e-5)


@pytest.mark.parametrize("advantage", ["rloo", "reinforce_pp"])
def test_a_run_with_another_estimator_samples_scores_and_trains(tmp_path, tiny_model_dir, parity_reward, advantage):
    """The estimators through a real run (its rollouts, the step's whitening for reinforce_pp): 2 steps train, rewards logged."""
    cfg = _grpo_config(tiny_model_dir, tmp_path / "out", grpo={"advantage": advantage, "scale_rewards": "none", "rewards": [parity_reward]},
                       train={"max_steps": 2}, data={"eval": None})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "c.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = step_rows(tmp_path / "out")
    assert len(rows) == 2 and all("reward" in r and r["grad_norm"] > 0 for r in rows), rows


def test_bad_grpo_input_is_one_line_with_exit_2(tmp_path, tiny_model_dir):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(json.dumps({"prompt": "What kind?", "answer": "noun"}) + "\n" + json.dumps({"prompt": [{"role": "user"}]}) + "\n")
    (tmp_path / "r.py").write_text("def broken(completions, **kw):\n    return [None] * len(completions)\n")
    cases = [({"data": {"train": str(bad), "eval": None}}, r"prompts.jsonl:2: prompt\[0\] must be \{role"),
             ({"grpo": {"rewards": [f"{tmp_path}/r.py:broken"]}, "data": {"eval": None}},
              r"grpo.rewards: .*r.py:broken returned None for a completion of .*prompts-train.jsonl:\d+ \(prompt"),
             ({"grpo": {"rewards": ["exact_match", "length"], "reward_weights": [1.0]}}, "2 reward functions"),
             ({"train": {"objective": "sft"}}, "grpo for data.format: prompt"),
             ({"grpo": {"async_rollouts": True}, "distributed": {"strategy": "fsdp"}},
              "grpo.async_rollouts: sampling in the background would gather distributed.strategy fsdp's sharded weights"),
             ({"grpo": {"advantage": "ppo"}}, r"grpo.advantage: .*'mean', 'rloo' or 'reinforce_pp'"),
             ({"grpo": {"advantage": "reinforce_pp", "async_rollouts": True}}, r"grpo.advantage: reinforce_pp whitens over the whole step"),
             ({"grpo": {"importance_sampling": {"mode": "clip"}}}, r"grpo.importance_sampling.mode: .*'truncate' or 'mask'"),
             ({"grpo": {"importance_sampling": {}, "environment": f"{REPO}/demo/agent/guess.py:GuessNumber"}},
              r"grpo.importance_sampling: an environment's episodes keep no sampler log-probabilities"),
             ({"grpo": {"router_replay": True}}, r"^error: grpo.router_replay: llama is a dense model: no router to replay; set router_replay: false$"),
             ({"grpo": {"router_replay": True, "async_rollouts": True}}, r"grpo.router_replay: the background sampler's copy of the policy")]
    for i, (sections, why) in enumerate(cases):
        config = write_config(tmp_path / f"bad{i}.yaml", _grpo_config(tiny_model_dir, tmp_path / f"out{i}", **sections))
        result = finetune_in_process("train", "--config", str(config))
        assert result.returncode == 2, (why, result.stderr[-1500:])
        line = [x for x in result.stderr.splitlines() if x.startswith("error")]
        assert len(line) == 1 and __import__("re").search(why, line[0]), (why, result.stderr[-1500:])
    # The runs that stopped mid-step stopped their watchdogs too (Watchdog.close joins its thread): a live one would end this
    # process later (exit 4)
    import threading

    assert not [t for t in threading.enumerate() if t.name == "finetune-watchdog"]
    with pytest.raises(UserError, match="set data.format: prompt"):
        from finetune.config.schema import validate_config

        validate_config(base_config(tiny_model_dir, tmp_path / "x", train={"objective": "grpo"}), "test")


def test_a_reward_collapse_is_rolled_back_by_the_guard(tmp_path, tiny_model_dir):
    """The guard judges GRPO by its negative mean reward: a reward that falls from 1 to 0 for good (here after 12
    steps' calls) is a drift, rolled back to the last good checkpoint with a lower LR until the rollbacks run out."""
    (tmp_path / "collapsing.py").write_text("calls = 0\n\ndef reward(completions, **_):\n    global calls\n    calls += 1\n"
                                            "    return [1.0 if calls <= 24 else 0.0] * len(completions)\n")
    cfg = _grpo_config(tiny_model_dir, tmp_path / "out", data={"eval": None}, train={"max_steps": 40},
                       grpo={"rewards": [f"{tmp_path}/collapsing.py:reward"]}, checkpoint={"save_every": 4},
                       guard={"min_history": 4, "max_rollbacks": 1})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "grpo.yaml", cfg)))
    assert result.returncode == 3, result.stderr[-2000:]  # rolled back once, then stopped: the reward stays at 0
    events = read_jsonl(tmp_path / "out" / "events.jsonl")
    rollback = next(e for e in events if e["event"] == "rollback")
    # Steps 1-12 scored 1, then 0: the median of 10 steps reaches -0.5 at step 17; the lowest level was at step 10
    assert "negative mean reward drifted up to -0.5 (median of the last 10 steps) from -1," in rollback["message"], rollback
    assert rollback["step"] == 16 and "rolled back to step-000008, LR x0.5" in rollback["message"], rollback
    assert events[-1]["event"] == "stop"


def test_a_kl_blow_up_past_guard_max_kl_is_rolled_back_then_stops(tmp_path, tiny_model_dir, parity_reward):
    """guard.max_kl judges GRPO's KL to the reference (beta > 0): the step that crosses it is not applied, the run goes back
    to a checkpoint from no later than the last step whose KL was at most half the bound (kept for it), with the LR halved;
    when the KL crosses again and the rollbacks are spent, it stops with exit 3."""
    cfg = _grpo_config(tiny_model_dir, tmp_path / "out", data={"eval": None}, train={"max_steps": 12},
                       grpo={"rewards": [parity_reward], "beta": 0.1}, checkpoint={"save_every": 2}, guard={"max_kl": 0.01, "max_rollbacks": 1})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "grpo.yaml", cfg)))
    assert result.returncode == 3, result.stderr[-2000:]
    rollback, stop = [e for e in read_jsonl(tmp_path / "out" / "events.jsonl") if e["event"] in ("rollback", "stop")]
    assert "the KL to the reference reached" in rollback["message"] and "above guard.max_kl=0.01; rolled back to step-000008" in rollback["message"]
    assert "above guard.max_kl=0.01, after 1 rollback(s); the last good checkpoint is" in stop["message"], stop
    applied = [r["kl"] for r in step_rows(tmp_path / "out")]
    assert max(applied) <= 0.01 < float(rollback["message"].split("reached ")[1].split(",")[0])  # the steps over it were never applied
    with pytest.raises(UserError, match="guard.max_kl: the KL to the reference is measured by GRPO with grpo.beta > 0"):
        from finetune.config.schema import validate_config

        validate_config({**cfg, "grpo": {**cfg["grpo"], "beta": 0.0}}, "test")


def test_bf16_weights_with_bf16_autocast_sample_and_evaluate(tmp_path, tiny_model_dir):
    """Rollouts and the eval's greedy completions run under the training forward's autocast: bf16 weights with fp32
    LoRA (peft's input casts off under bf16, as in training) once raised a dtype mismatch in the first rollout."""
    cfg = _grpo_config(tiny_model_dir, tmp_path / "out", model={"dtype": "bfloat16"}, train={"max_steps": 2, "mixed_precision": "bf16"},
                       eval={"on_start": True, "max_batches": 1})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "c.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert len([r for r in rows if "loss" in r]) == 2 and any("eval_reward" in r for r in rows)


# -- router replay (grpo.router_replay) ------------------------------------------------------------


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe", "qwen3-moe", "qwen3-next", "deepseek-v3", "glm4-moe", "gpt-oss"])
def test_replaying_a_routers_own_choices_changes_nothing_and_other_choices_are_taken(family_dirs, family):
    """Each family's rule for the gate weights (softmax renormalized or not, softmax of the chosen logits, sigmoid scaled):
    replaying the experts a forward chose gives its logits again; replaying others moves them, the choices counted as
    differing, and the router still gets a gradient."""
    from transformers import AutoModelForCausalLM

    from finetune.model import routing
    from finetune.model.experts import named_fused_experts

    model = AutoModelForCausalLM.from_pretrained(family_dirs(family, **({"mlp_only_layers": None} if family == "qwen3-next" else {}))).float()
    assert routing.install(model) == len(named_fused_experts(model)) > 0
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), routing.recording(model, rows=2) as taken:
        own = model(input_ids=ids).logits
        chosen = taken()
    experts = int(chosen.max()) + 1
    routing.replay(model, chosen.flatten(0, 1))
    with torch.no_grad():
        assert (model(input_ids=ids).logits - own).abs().max() < 1e-6
    assert routing.differing(model) == 0
    routing.replay(model, ((chosen + 1) % experts).flatten(0, 1))  # every token to the next experts along
    logits = model(input_ids=ids).logits
    assert (logits - own).abs().max() > 1e-3 and routing.differing(model) > 0.9  # a later layer's own choice may land on the replayed one
    logits.float().square().mean().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routing.routers(model))
    routing.replay(model, None)
    with torch.no_grad():
        assert (model(input_ids=ids).logits - own).abs().max() == 0


def test_router_replay_trains_each_token_on_the_experts_the_sampler_ran_it_through(family_dirs, demo_tokenizer_dir):
    """The rollout records the experts of every token as generate ran it (prompt's forward, then a token a step); a training
    forward over the packed rows routes the same tokens to the same experts (checked with replay off). With routers whose
    experts nearly tie (rows 1e-7 apart), the KV-cached sampler and the training forward choose otherwise for some tokens:
    without replay the log-probabilities of sampled tokens move by over 1e-4; replayed, the gap falls to the dense model's
    (under 2e-6 in fp32), and routing_mismatch logs the share of choices the trainer would have made otherwise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.data.packing import Prompt
    from finetune.model import routing
    from finetune.objectives.objective import answers, token_logps

    model = AutoModelForCausalLM.from_pretrained(family_dirs("qwen3-moe", num_experts=8)).float().eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    routing.install(model)
    objective = GRPO(GRPOConfig(num_generations=4, max_completion_length=12, router_replay=True),
                     [Reward("r", "reward_r", 1.0, lambda **kw: [float(len(c)) for c in kw["completions"]])], seed=3)
    prompts = [Prompt(np.array(p), {"prompt": "x"}, i) for i, p in enumerate([[5, 9, 17, 23, 40, 41, 42], [31, 8, 12]])]

    def sampled() -> dict:
        batch = objective._sampled(model, tokenizer, [prompts], position=0, device="cpu", old_logps=False)[0][0]
        assert batch["routing"].shape == (int(batch["routing_rows"].sum()), 2, 2) and batch["routing"].dtype == torch.int16
        return batch

    def metrics(batch: dict) -> dict:
        values = objective.losses(model, to_device(batch, "cpu"), objective.counts(batch)).metrics.tolist()
        return {k: v / len(batch["advantages"]) for k, v in zip(objective.metrics, values)}

    batch = sampled()
    with torch.no_grad(), routing.recording(model, rows=len(batch["input_ids"])) as taken:
        token_logps(model, batch, answers(batch, pairs=False)[0])
        trained = taken().flatten(0, 1)
    real = (torch.arange(batch["input_ids"].shape[1])[None] < batch["routing_rows"][:, None]).flatten()
    ran = batch["routing"][:, 0, 0] != routing.FREE
    assert ran.sum() == len(ran) - 8  # each completion's last token, drawn and never run
    assert torch.equal(trained[real][ran].sort(-1).values, batch["routing"][ran].long().sort(-1).values)
    assert metrics(batch)["routing_mismatch"] == 0
    with torch.no_grad():
        for router in routing.routers(model):
            router.weight.copy_(router.weight[:1] + 1e-7 * torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(0)))
    batch = sampled()
    replayed = metrics(batch)
    free = metrics({k: v for k, v in batch.items() if not k.startswith("routing")})
    assert replayed["routing_mismatch"] > 0.01 and replayed["mismatch_max"] < 2e-6 < 1e-4 < free["mismatch_max"], (replayed, free)


def test_a_moe_grpo_run_with_router_replay_logs_how_often_the_trainer_would_have_routed_otherwise(tmp_path, family_dirs, parity_reward):
    """Through a real run (num_iterations 2: the held rollouts' old log-probabilities replayed too): router replay said at the
    start, routing_mismatch logged each step (refused on a dense model in one line: test_bad_grpo_input_is_one_line_with_exit_2)."""
    cfg = _grpo_config(family_dirs("qwen3-moe"), tmp_path / "out", data={"eval": None}, train={"max_steps": 2},
                       grpo={"rewards": [parity_reward], "router_replay": True, "num_iterations": 2})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "c.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "router replay: 2 routers send each trained token to the experts it was sampled with" in result.stdout
    rows = step_rows(tmp_path / "out")
    # The first update trains on the weights that sampled (fp32: the same routes); the second, one update later, on moved weights
    # whose router would send a share of the tokens elsewhere: replay keeps them on the experts that made them.
    assert len(rows) == 2 and rows[0]["routing_mismatch"] == 0 < rows[1]["routing_mismatch"], [r.get("routing_mismatch") for r in rows]
