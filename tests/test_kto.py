"""KTO (train.objective kto): unpaired examples read and paired with mismatched completions as TRL does, the
loss and gradients equal TRL's KTOTrainer, and a run on the demo's examples prefers the desirable answers."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DEMO_DATA, adapted_lora, base_config, finetune_in_process, read_jsonl, write_config

from finetune.config.errors import UserError
from finetune.config.schema import PreferenceConfig, validate_config
from finetune.objectives.loss import to_device
from finetune.objectives.objective import KTO

EXAMPLES = [
    {"prompt": "What kind of word is this?\n\nrabbit\n", "completion": "noun", "label": True},
    {"prompt": "What kind of word is this?\n\nsmall\n", "completion": "name", "label": False},
    {"prompt": "What kind of word is this?\n\nfinds\n", "completion": "verb, as it names an action", "label": True},
    {"prompt": "Which kind is Anna?\n", "completion": "adjective", "label": False},
    {"prompt": "What kind of word is this?\n\ngolden\n", "completion": "adjective", "label": True},
]


def _kto_config(model_dir, out, **sections):
    cfg = base_config(model_dir, out, **sections)
    cfg["data"] = {"train": str(DEMO_DATA / "unpaired-train.jsonl"), "eval": str(DEMO_DATA / "unpaired-eval.jsonl"), "format": "unpaired",
                   "max_seq_len": 64, **sections.get("data", {})}
    cfg["train"] = {**cfg["train"], "objective": "kto", "max_steps": 6, "micro_batch_size": 4, "lr": 5e-3, **sections.get("train", {})}
    return cfg


def _our_batch(tmp_path, model_dir, packing: bool = False):
    """Our data step's micro-batch of the examples, in file order."""
    from finetune.config.schema import ModelConfig
    from finetune.data.datasets import load_data
    from finetune.model.loading import load_tokenizer

    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "examples.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    cfg = validate_config(_kto_config(model_dir, tmp_path / "out", data={"train": str(path), "eval": None, "packing": packing,
                                                                              "cache_dir": str(tmp_path / "cache")}), "test")
    data = load_data(cfg.data, load_tokenizer(ModelConfig(name_or_path=str(model_dir))), seed=0)
    return data.train.batch(list(range(len(data.train))), 0)


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 1.33)])
def test_loss_and_gradients_equal_trls(tmp_path, tiny_model_dir, weights):
    """TRL gets the base and a LoRA config (its reference: the adapter off, as ours), then our adapter's weights."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = KTOConfig(output_dir=str(tmp_path / "trl"), beta=1.0, desirable_weight=weights[0], undesirable_weight=weights[1],
                     per_device_train_batch_size=len(EXAMPLES), report_to=[], use_cpu=True, bf16=False)
    trainer = KTOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), args=args, train_dataset=Dataset.from_list(EXAMPLES),
                         processing_class=tokenizer, peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"))
    ours = adapted_lora(tiny_model_dir).train()
    mine = dict(ours.named_parameters())
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_" in name:
                p.copy_(mine[name])
    theirs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(EXAMPLES))])
    trainer.model.train()
    expected = trainer._compute_loss(trainer.model, theirs, return_outputs=False)
    expected.backward()

    batch = _our_batch(tmp_path, tiny_model_dir)
    assert [row[row != 0].tolist() for row in batch["input_ids"]] == [row[m.bool()].tolist() for row, m in zip(theirs["input_ids"],
                                                                                                               theirs["attention_mask"])]
    objective = KTO(PreferenceConfig(beta=1.0, kto_desirable_weight=weights[0], kto_undesirable_weight=weights[1]))
    totals = objective.counts(batch)
    assert totals == [5, 3, 2]
    loss = objective.losses(ours, to_device(batch, "cpu"), totals).tokens / totals[0]
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5) and abs(expected.item() - 0.5) > 1e-3  # the policy is not the reference
    grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    for name, p in ours.named_parameters():
        if p.grad is not None:
            assert torch.allclose(p.grad, grads[name], atol=1e-6, rtol=1e-4), name


def test_kto_run_prefers_the_desirable_answers(tmp_path, tiny_model_dir):
    out = tmp_path / "kto"
    finetune = finetune_in_process("train", "--config", str(write_config(tmp_path / "kto.yaml", _kto_config(tiny_model_dir, out,
                                                                                                          train={"max_steps": 12, "lr": 1e-2}))))
    assert finetune.returncode == 0, finetune.stderr[-2000:]
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if "eval_loss" in r]
    first, last = evals[0], evals[-1]
    assert first["eval_loss"] == pytest.approx(0.5, abs=1e-4) and first["eval_kl"] == 0  # the policy starts as the reference
    assert last["eval_loss"] < first["eval_loss"] - 0.005  # measured: 0.5 -> 0.493 in 12 steps at beta 0.1
    assert last["eval_rewards_desirable"] > last["eval_rewards_undesirable"] + 0.05, last
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert {"kl", "rewards_desirable", "rewards_undesirable"} <= set(steps[-1])


def test_unpaired_rows_are_checked_in_one_line(tmp_path, tiny_model_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(EXAMPLES[0]) + "\n" + json.dumps({"prompt": "Hi", "completion": "Hello", "label": "yes"}) + "\n")
    cfg = _kto_config(tiny_model_dir, tmp_path / "out", data={"train": str(bad), "eval": None})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "bad.yaml", cfg)))
    assert result.returncode == 2 and "bad.jsonl:2: field 'label' must be true or false" in result.stderr, result.stderr[-1500:]
    with pytest.raises(UserError, match="set data.format: unpaired"):
        validate_config(base_config(tiny_model_dir, tmp_path / "x", train={"objective": "kto"}), "test")
