"""Reward models (train.objective reward): the Bradley-Terry loss and gradients equal TRL's RewardTrainer; a run
learns to score the demo's chosen answers above the rejected ones; `finetune score` and a reward model as a GRPO
reward function read what it saved."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DEMO_DATA, base_config, finetune_in_process, read_jsonl, write_config

from finetune.config.errors import UserError
from finetune.config.schema import PreferenceConfig, validate_config
from finetune.objectives.loss import to_device
from finetune.objectives.objective import RewardModel

PAIRS = [
    {"prompt": "What kind of word is this?\n\nrabbit\n", "chosen": "noun", "rejected": "verb"},
    {"prompt": "What kind of word is this?\n\nsmall\n", "chosen": "adjective", "rejected": "name"},
    {"prompt": "What kind of word is this?\n\nfinds\n", "chosen": "verb", "rejected": "the kind of word that names a thing"},
    {"prompt": "Which kind is Anna?\n", "chosen": "a name, as it is written with a capital", "rejected": "noun"},
]


def _reward_config(model_dir, out, **sections):
    cfg = base_config(model_dir, out, **sections)
    cfg["data"] = {"train": str(DEMO_DATA / "pairs-train.jsonl"), "eval": str(DEMO_DATA / "pairs-eval.jsonl"), "format": "preference",
                   "max_seq_len": 64, **sections.get("data", {})}
    cfg["train"] = {**cfg["train"], "objective": "reward", "max_steps": 30, "micro_batch_size": 8, "lr": 5e-3, **sections.get("train", {})}
    return cfg


def _reward_lora(model_dir):
    from finetune.config.schema import AdapterConfig, ModelConfig
    from finetune.model.loading import apply_adapter, load_model

    torch.manual_seed(0)
    model = apply_adapter(load_model(ModelConfig(name_or_path=str(model_dir)), head="score"), AdapterConfig(r=8, alpha=16, dropout=0.0),
                          gradient_checkpointing=False, say=lambda _: None)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)  # an adapter that moves the scores, so that its gradients are compared too
    return model


def test_the_plan_holds_the_score_head_where_the_lm_head_was(tmp_path, tiny_model_dir):
    """A reward model holds a one-output score head, trained whole beside the adapter, where the language model holds its
    lm_head: the plan once counted the lm_head's weights for it (at Llama-3-8B's widths, 1 GiB the run never holds)."""
    from finetune.model.loading import apply_adapter, load_model
    from finetune.outputs.plan import make_plan

    cfg = validate_config(_reward_config(tiny_model_dir, tmp_path / "out"), "test")
    lm = validate_config(base_config(tiny_model_dir, tmp_path / "out"), "test")
    model = apply_adapter(load_model(cfg.model, say=lambda _: None, head="score"), cfg.adapter, gradient_checkpointing=False, say=lambda _: None)
    held = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(b.numel() * b.element_size() for b in model.buffers())
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    plan = make_plan(cfg)
    assert held == pytest.approx(plan.rows["weights"], abs=2 * hidden * 4)  # the score head, and peft's trained copy of it
    assert make_plan(lm).rows["weights"] - plan.rows["weights"] == vocab * hidden * 4  # the lm_head, fp32


@pytest.mark.parametrize("center", [None, 0.01])
def test_loss_and_gradients_equal_trls(tmp_path, tiny_model_dir, center):
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    from finetune.config.schema import DataConfig
    from finetune.data.datasets import load_data

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = _reward_lora(tiny_model_dir).train()
    assert sorted(model.peft_config["default"].modules_to_save) == ["classifier", "score"]  # the new head trains whole
    args = RewardConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, report_to=[], use_cpu=True, bf16=False,
                        center_rewards_coefficient=center)
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(PAIRS), processing_class=tokenizer)
    theirs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PAIRS))])
    expected = trainer.compute_loss(model, theirs)
    expected.backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    expected_grads = [p.grad.clone() for p in trained]
    model.zero_grad()

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    data = load_data(DataConfig(train=str(path), format="preference", max_seq_len=128, cache_dir=str(tmp_path / "cache")), tokenizer, seed=0)
    batch = data.train.batch(range(len(data.train)), tokenizer.pad_token_id)  # the four pairs packed into rows
    assert len(data.train) < len(PAIRS)
    objective = RewardModel(PreferenceConfig(center_rewards_coefficient=center))
    counts = objective.counts(batch)
    loss = objective.losses(model, to_device(batch, "cpu"), counts).tokens / counts[0]
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5) and abs(expected.item() - 0.6931) > 1e-3
    worst = max((p.grad - g).abs().max().item() for p, g in zip(trained, expected_grads))
    assert worst < 1e-4 * max(g.abs().max().item() for g in expected_grads), worst


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory, demo_model_dir):
    """LoRA on the demo base (it learned the words in pretraining; the held-out pairs ask about words the run never sees)."""
    out = tmp_path_factory.mktemp("reward") / "rm"
    cfg = _reward_config(demo_model_dir, out, adapter={"r": 16, "alpha": 32}, train={"max_steps": 100, "lr": 2e-3}, eval={"every": 50})
    cfg["logging"]["progress_bar"] = True  # as `finetune train --config reward` shows it: its accuracy in the bar
    result = finetune_in_process("train", "--config", str(write_config(out.parent / "rm.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def test_a_reward_model_learns_to_score_the_chosen_answers_higher(reward_run, tmp_path):
    evals = [r for r in read_jsonl(reward_run / "metrics.jsonl") if "eval_loss" in r]
    first, last = evals[0], evals[-1]
    assert last["eval_loss"] < first["eval_loss"] - 0.2 and last["eval_accuracy"] > 0.8 > 0.6 > first["eval_accuracy"], (first, last)
    assert json.loads((reward_run / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    # finetune score: the held-out pairs' answers, each scored alone, as the eval scored them
    rows = [json.loads(line) for line in (DEMO_DATA / "pairs-eval.jsonl").read_text().splitlines()[:20]]
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["messages"], "completion": r[k]}) + "\n" for r in rows for k in ("chosen", "rejected")))
    result = finetune_in_process("score", "--model", str(reward_run), "--data", str(data), "--out", str(tmp_path / "scores.jsonl"))
    assert result.returncode == 0 and "scored 40 rows" in result.stdout, result.stderr[-2000:]
    scores = [r["score"] for r in read_jsonl(tmp_path / "scores.jsonl")]
    assert sum(c > r for c, r in zip(scores[0::2], scores[1::2])) >= 15  # 75% of the held-out pairs ranked right (the eval: 85%)
    again = finetune_in_process("score", "--model", str(reward_run), "--data", str(data), "--out", str(tmp_path / "scores.jsonl"))
    assert again.returncode == 2 and "exists" in again.stderr


def test_a_reward_model_is_a_grpo_reward_function(reward_run, tmp_path, tiny_model_dir):
    cfg = base_config(tiny_model_dir, tmp_path / "grpo", data={"train": str(DEMO_DATA / "prompts-train.jsonl"), "eval": None, "format": "prompt",
                                                               "max_seq_len": 64},
                      train={"objective": "grpo", "max_steps": 2, "micro_batch_size": 2},
                      grpo={"rewards": [f"reward_model:{reward_run}"], "num_generations": 2, "max_completion_length": 3})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "grpo.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-2000:]
    steps = [r for r in read_jsonl(tmp_path / "grpo" / "metrics.jsonl") if "loss" in r]
    assert all(isinstance(s["reward_model"], float) and s["reward_model"] == s["reward"] for s in steps)
    # Each prompt's 2 completions, sampled at temperature 1 from the demo vocabulary, differ, and so do the model's scores of
    # them: a spread in every step (a reward function that returned a constant would give 0).
    assert all(s["reward_std"] > 0 for s in steps), [s["reward_std"] for s in steps]


def test_reward_model_settings_are_refused_in_one_line(tmp_path, tiny_model_dir):
    for sections, why in (({"distributed": {"strategy": "fsdp"}}, "score head is not in the base's files"),
                          ({"eval": {"generate_samples": 4}}, "does not generate"),
                          ({"model": {"quantization": {"bits": 4}}}, "quantized reward models")):
        with pytest.raises(UserError, match=why):
            validate_config(_reward_config(tiny_model_dir, tmp_path / "out", **sections), "test")
    result = finetune_in_process("score", "--model", str(tiny_model_dir), "--data", str(DEMO_DATA / "pairs-eval.jsonl"), "--out",
                                 str(tmp_path / "s.jsonl"))
    assert result.returncode == 2 and "not a sequence-classification model with one" in result.stderr, result.stderr[-1500:]


def test_merge_and_generate_refuse_a_reward_model(reward_run, tmp_path):
    for command in (("merge", "--adapter", str(reward_run), "--out", str(tmp_path / "merged")),
                    ("generate", "--adapter", str(reward_run), "--prompt", "Hi")):
        result = finetune_in_process(*command)
        assert result.returncode == 2 and "is a reward model" in result.stderr, result.stderr[-1500:]
    assert not (tmp_path / "merged").exists()
