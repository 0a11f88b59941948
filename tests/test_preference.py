"""Preference tuning (train.objective dpo / orpo): pairs read and laid out as TRL does, losses and
gradients equal to TRL's trainers, and the SFT loop's guarantees (resume, two processes) on pairs."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DEMO_DATA, adapted_lora, base_config, killed_and_resumed, read_jsonl, train_strategy, write_config

from finetune.cli import main
from finetune.config.errors import UserError
from finetune.config.schema import DataConfig, PreferenceConfig, validate_config
from finetune.train import run

PAIRS = [
    {"prompt": "What kind of word is this?\n\nrabbit\n", "chosen": "noun", "rejected": "verb"},
    {"prompt": "What kind of word is this?\n\nsmall\n", "chosen": "adjective", "rejected": "name"},
    {"prompt": "What kind of word is this?\n\nfinds\n", "chosen": "verb", "rejected": "the kind of word that names a thing"},
    {"prompt": "Which kind is Anna?\n", "chosen": "a name, as it is written with a capital", "rejected": "noun"},
]


def _pairs_config(model_dir, out, objective="dpo", **sections):
    cfg = base_config(model_dir, out, **sections)
    cfg["data"] = {"train": str(DEMO_DATA / "pairs-train.jsonl"), "eval": str(DEMO_DATA / "pairs-eval.jsonl"), "format": "preference",
                   "max_seq_len": 64, **sections.get("data", {})}
    cfg["train"] = {**cfg["train"], "objective": objective, "max_steps": 6, "micro_batch_size": 4, "lr": 5e-3, **sections.get("train", {})}
    return cfg


def _trl_loss(kind, variant, adapted, tokenizer, tmp_path):
    """TRL's loss on the four pairs as one batch, with the adapter's weights (its gradients land in the
    returned trainer's model). TRL gets the base and a LoRA config, so that its reference is the base
    with the adapter off, as ours (given a PeftModel, it would take the adapter's starting state)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(adapted.name_or_path)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")

    if kind == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.1, loss_type=[variant], per_device_train_batch_size=4, report_to=[],
                         use_cpu=True, max_length=None, bf16=False)
        trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(PAIRS), processing_class=tokenizer, peft_config=lora)
    elif kind in ("cpo", "simpo"):
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(output_dir=str(tmp_path / "trl"), beta=0.1, loss_type="sigmoid" if kind == "cpo" else "simpo", cpo_alpha=variant,
                         simpo_gamma=0.5, per_device_train_batch_size=4, report_to=[], use_cpu=True, bf16=False, max_length=256)
        trainer = CPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(PAIRS), processing_class=tokenizer, peft_config=lora)
    else:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        args = ORPOConfig(output_dir=str(tmp_path / "trl"), beta=0.1, per_device_train_batch_size=4, report_to=[], use_cpu=True, bf16=False,
                          max_length=256)
        trainer = ORPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(PAIRS), processing_class=tokenizer, peft_config=lora)
    model = trainer.model
    mine = dict(adapted.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(mine[name])
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PAIRS))])
    model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    return loss.item(), trainer


@pytest.mark.parametrize("kind,variant", [("dpo", "sigmoid"), ("dpo", "ipo"), ("dpo", "hinge"), ("orpo", None), ("cpo", 1.0), ("simpo", 0.0),
                                          ("simpo", 0.5)])
def test_loss_and_gradients_equal_trls(tmp_path, tiny_model_dir, kind, variant):
    pytest.importorskip("trl")
    from transformers import AutoTokenizer

    from finetune.data.datasets import load_data
    from finetune.objectives.objective import Preference

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected, trainer = _trl_loss(kind, variant, adapted_lora(tiny_model_dir), tokenizer, tmp_path)

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    data = load_data(DataConfig(train=str(path), format="preference", max_seq_len=128, cache_dir=str(tmp_path / "cache")), tokenizer, seed=0)
    batch = data.train.batch(range(len(data.train)), tokenizer.pad_token_id)  # the four pairs, packed into rows
    ours = adapted_lora(tiny_model_dir).train()
    settings = {"cpo_alpha": variant} if kind in ("cpo", "simpo") else {"dpo_loss": variant or "sigmoid"}
    objective = Preference(kind, PreferenceConfig(beta=0.1, orpo_lambda=0.1, simpo_gamma=0.5, **settings))
    counts = objective.counts(batch)
    assert counts[0] == 4 and len(data.train) < 4  # pairs share rows
    loss = objective.losses(ours, batch, counts).tokens / counts[0]
    loss.backward()
    assert loss.item() == pytest.approx(expected, abs=1e-5)
    grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    for name, p in ours.named_parameters():
        if p.grad is not None:
            assert torch.allclose(p.grad, grads[name], atol=1e-6, rtol=1e-4), name


def test_pairs_are_tokenized_as_trl_does_and_laid_out_as_two_sequences(tmp_path, tiny_model_dir):
    pytest.importorskip("trl")
    from transformers import AutoTokenizer

    from finetune.data.datasets import load_data
    from finetune.objectives.objective import answers

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    _, trainer = _trl_loss("dpo", "sigmoid", adapted_lora(tiny_model_dir), tokenizer, tmp_path)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    data = load_data(DataConfig(train=str(path), format="preference", max_seq_len=128, packing=False, cache_dir=str(tmp_path / "c")), tokenizer, seed=0)
    for i, row in enumerate(data.train.rows(range(len(PAIRS)))):
        expected = trainer.train_dataset[i]
        prompt = expected["prompt_ids"]
        chosen, rejected = prompt + expected["chosen_ids"], prompt + expected["rejected_ids"]
        assert list(row.input_ids) == chosen + rejected
        assert list(row.position_ids) == list(range(len(chosen))) + list(range(len(rejected)))
        trained = [j for j, label in enumerate(row.labels) if label != -100]
        assert trained == [*range(len(prompt), len(chosen)), *range(len(chosen) + len(prompt), len(chosen) + len(rejected))]
    batch = data.train.batch(range(len(PAIRS)), tokenizer.pad_token_id)
    assert answers(batch)[2] == 2 * len(PAIRS)


def test_chat_pairs_are_rendered_and_tokenized_as_trls_conversational_rows(tmp_path, tiny_model_dir):
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from finetune.data.datasets import load_data

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [json.loads(line) for line in (DEMO_DATA / "pairs-eval.jsonl").read_text().splitlines()[:3]]
    theirs = [{"prompt": r["messages"], "chosen": [{"role": "assistant", "content": r["chosen"]}],
               "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows]
    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, max_length=None)
    trainer = DPOTrainer(model=adapted_lora(tiny_model_dir), args=args, train_dataset=Dataset.from_list(theirs), processing_class=tokenizer)
    data = load_data(DataConfig(train=str(DEMO_DATA / "pairs-eval.jsonl"), format="preference", max_seq_len=128, packing=False,
                                cache_dir=str(tmp_path / "c")), tokenizer, seed=0)
    for i, row in enumerate(data.train.rows(range(3))):
        expected = trainer.train_dataset[i]
        prompt = expected["prompt_ids"]
        assert list(row.input_ids) == prompt + expected["chosen_ids"] + prompt + expected["rejected_ids"]
        assert sum(label != -100 for label in row.labels) == len(expected["chosen_ids"]) + len(expected["rejected_ids"])


@pytest.mark.parametrize("adapter,model", [({"method": "dora"}, {}), ({"method": "lora"}, {"quantization": {"bits": 4}})], ids=["dora", "qlora"])
def test_dpo_with_dora_and_a_4bit_base_starts_at_the_reference_and_learns(tmp_path, tiny_model_dir, adapter, model):
    cfg = _pairs_config(tiny_model_dir, tmp_path / "out", adapter=adapter, data={"eval": None}, train={"max_steps": None, "overfit_batch": 8})
    cfg["model"].update(model)
    run(validate_config(cfg, "test"))
    steps = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert steps[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # the adapter off is the reference: the policy at the start
    assert steps[-1]["loss"] < 0.6 and all(b["loss"] < a["loss"] for a, b in zip(steps, steps[1:])), steps  # the same pairs each step: learned


def test_dpo_run_learns_the_preference_and_logs_its_metrics(tmp_path, tiny_model_dir):
    cfg = _pairs_config(tiny_model_dir, tmp_path / "dpo", eval={"on_start": True, "every": 3}, logging={"plot": True})
    run(validate_config(cfg, "test"))
    rows = read_jsonl(tmp_path / "dpo" / "metrics.jsonl")
    steps = [r for r in rows if "loss" in r]
    assert steps[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # policy = reference at the start: -log sigmoid(0)
    later = steps[2:]
    assert sum(r["loss"] for r in later) / len(later) < 0.65 and min(r["reward_margin"] for r in later) > 0.05
    assert sum(r["reward_accuracy"] for r in later) / len(later) > 0.7 and {"rewards_chosen", "logps_rejected", "choice_accuracy"} <= set(steps[-1])
    evals = [r for r in rows if "eval_loss" in r]
    assert evals[0]["eval_reward_accuracy"] == 0 and evals[0]["eval_loss"] == pytest.approx(0.6931, abs=1e-4) and evals[-1]["eval_pairs"] == 108
    from finetune.run.metrics import curve_data

    assert [a for _, a in curve_data(tmp_path / "dpo")["accuracy"]] == [r["eval_reward_accuracy"] for r in evals]  # on loss_curve.png
    assert (tmp_path / "dpo" / "loss_curve.png").stat().st_size > 10_000
    # The adapter merges and is checked as an SFT one is (its check texts: prompts with their chosen answers).
    assert main(["merge", "--adapter", str(tmp_path / "dpo"), "--out", str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    report = json.loads((tmp_path / "merged" / "merge_report.json").read_text())
    assert report["passed"] and report["check_texts"] == 4 and report["merged_vs_tuned"]["max"] < 1e-3 and report["adapter_effect"]["max"] > 1e-3


# Each objective's rows: DPO's and the reward model's pairs, KTO's unpaired examples.
DATA = {"dpo": ("pairs-train.jsonl", "preference"), "reward": ("pairs-train.jsonl", "preference"), "kto": ("unpaired-train.jsonl", "unpaired")}


@pytest.mark.parametrize("objective", ["dpo", "kto", "reward"])
def test_kill_9_mid_run_then_resume_gives_the_same_losses(tmp_path, tiny_model_dir, objective):
    """DPO, KTO (its reference point computed again from the mismatched pairs) and a reward model (its score
    head saved whole in the checkpoint): SIGKILL after the step-3 checkpoint, resumed, the same losses bitwise."""
    train, kind = DATA[objective]
    cfg = _pairs_config(tiny_model_dir, tmp_path / "reference", objective=objective, data={"train": str(DEMO_DATA / train), "format": kind, "eval": None})
    run(validate_config(cfg, "test"))
    expected = [r["loss"] for r in read_jsonl(tmp_path / "reference" / "metrics.jsonl") if "loss" in r]
    assert len(set(expected)) == 6  # every step trained something else
    _, steps = killed_and_resumed(tmp_path, cfg, save_every=3, kill_at=4)
    assert [r["loss"] for r in steps] == expected  # bitwise


def test_orpo_trains_full_fine_tuning_without_a_reference(tmp_path, tiny_model_dir):
    cfg = _pairs_config(tiny_model_dir, tmp_path / "orpo", objective="orpo", adapter={"method": "full"}, train={"lr": 1e-3})
    run(validate_config(cfg, "test"))
    evals = [r for r in read_jsonl(tmp_path / "orpo" / "metrics.jsonl") if "eval_loss" in r]
    first, last = evals[0], evals[-1]
    # On the held-out pairs the loss falls, and the chosen answers gain on the rejected ones, which a run that only learned
    # the chosen answers' text would not show. ORPO's reward is beta (0.1) x an answer's mean log-probability per token:
    # its margin went 0.0005 -> 0.0044 in these 6 steps, the share of pairs ranked right 54% -> 61% (measured 2026-11-27).
    assert first["step"] == 0 and last["eval_loss"] < first["eval_loss"], (first, last)
    assert last["eval_reward_margin"] > first["eval_reward_margin"] + 0.003 and last["eval_reward_accuracy"] > first["eval_reward_accuracy"] + 0.05


@pytest.mark.parametrize("objective", ["cpo", "simpo"])
def test_reference_free_cpo_and_simpo_learn_the_preference(tmp_path, tiny_model_dir, objective):
    """LoRA on the demo pairs, 12 steps: on the held-out pairs the eval loss falls and the rewards' margin
    (beta x the chosen minus the rejected answers' log-probabilities: summed for CPO, per token for
    SimPO) grows."""
    out = tmp_path / objective
    cfg = _pairs_config(tiny_model_dir, out, objective=objective, train={"max_steps": 12, "lr": 1e-2})
    run(validate_config(cfg, "test"))
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if "eval_loss" in r]
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and last["step"] == 12
    assert last["eval_loss"] < first["eval_loss"] and last["eval_reward_margin"] > first["eval_reward_margin"] + 0.01, (first, last)

def test_preference_settings_are_checked_in_one_line(tmp_path, tiny_model_dir):
    for sections, why in (({"train": {"objective": "sft"}}, "set train.objective: dpo, orpo, cpo or simpo for data.format: preference"),):
        with pytest.raises(UserError, match=why):
            validate_config(_pairs_config(tiny_model_dir, tmp_path / "out", **sections), "test")
    with pytest.raises(UserError, match="set data.format: preference"):
        validate_config(base_config(tiny_model_dir, tmp_path / "out", train={"objective": "dpo"}), "test")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps({"prompt": "Hi", "chosen": "Hello"}) + "\n")
    cfg = _pairs_config(tiny_model_dir, tmp_path / "out", data={"train": str(bad), "eval": None})
    with pytest.raises(UserError, match=r"bad.jsonl:2: missing field 'rejected'"):
        run(validate_config(cfg, "test"))


def _sections(objective: str) -> dict:
    train, kind = DATA[objective]
    return {"data": {"train": str(DEMO_DATA / train), "format": kind, "max_seq_len": 64}, "train": {"objective": objective}}


@pytest.mark.parametrize("strategy,method,objective", [(s, m, "dpo") for s in ("ddp", "fsdp", "zero3") for m in ("lora", "full")]
                         + [("zero2", "lora", "dpo"), ("ddp", "lora", "reward"), ("ddp", "lora", "kto")])
def test_two_processes_match_one_on_pairs(tmp_path, tiny_model_dir, trained, strategy, method, objective):
    """2 processes x 2 rows = 1 process x 4 rows: DPO, its reference the adapter-off base (lora), or a frozen copy
    held as the policy is (full: whole, FSDP-sharded, ZeRO-3-partitioned); a reward model (score head and LoRA under
    DDP). KTO's reference point is the KL on each process's mismatched pairs, averaged over the processes: equal
    at the first step (the policy is the reference), within 1e-3 after it (2e-4 seen)."""
    _, one, _ = trained(tiny_model_dir, method, **_sections(objective))  # one process: trained once for every strategy
    out, two, summary = train_strategy(tmp_path, "two", tiny_model_dir, method, 2, strategy, **_sections(objective))
    assert summary["world_size"] == 2 and len(two) == 4
    if objective == "kto":
        assert two[0] == pytest.approx(one[0], rel=1e-5) and two == pytest.approx(one, rel=1e-3)
        assert summary["replicas_identical"] is True
        return
    assert objective != "dpo" or one[0] == pytest.approx(0.6931, abs=1e-4)  # the policy starts as its reference: log 2
    assert two == pytest.approx(one, rel=1e-4, abs=1e-5) and two[-1] < one[0] - 0.01


def test_plan_counts_the_frozen_reference_the_trainer_builds(tmp_path, tiny_model_dir):
    """DPO, KTO and GRPO with a KL term hold a frozen base beside a fully fine-tuned policy (cfg.needs_reference, the
    trainer's rule too); ORPO, GRPO without beta and any adapter hold none."""
    from finetune.outputs.plan import make_plan

    data = {"dpo": "pairs", "orpo": "pairs", "kto": "unpaired", "grpo": "prompts"}
    formats = {"pairs": "preference", "unpaired": "unpaired", "prompts": "prompt"}

    def plan(objective, method, beta=0.04, **sections):
        cfg = _pairs_config(tiny_model_dir, tmp_path / "out", objective=objective, adapter={"method": method}, **sections)
        cfg["data"].update(train=str(DEMO_DATA / f"{data[objective]}-train.jsonl"), eval=str(DEMO_DATA / f"{data[objective]}-eval.jsonl"),
                           format=formats[data[objective]])
        cfg["grpo"] = {"beta": beta} if objective == "grpo" else {}
        cfg = validate_config(cfg, "test")
        rows = make_plan(cfg, devices=2 if sections else 1).rows
        assert cfg.needs_reference == ("reference model" in rows)
        return rows

    for objective in ("dpo", "kto", "grpo"):
        rows = plan(objective, "full")
        assert rows["reference model"] == rows["weights"] > 0, objective  # a second copy of the base, as the policy holds it
        assert "reference model" not in plan(objective, "lora"), objective  # the base with the adapter off
    assert "reference model" not in plan("orpo", "full") and "reference model" not in plan("grpo", "full", beta=0.0)
    sharded = plan("dpo", "full", distributed={"strategy": "fsdp"})
    assert sharded["reference model"] == plan("dpo", "full")["reference model"] / 2


def test_the_guard_skips_a_poisoned_dpo_step_and_judges_the_preference_loss(tmp_path, tiny_model_dir, monkeypatch):
    from finetune.config import faults
    from finetune.run.guard import Guard

    monkeypatch.setattr(faults, "FAULT", faults.parse("nan@12"))  # a poisoned batch (FINETUNE_FAULT, in-process), after the first-steps check
    seen = {}
    real = Guard.__init__

    def spy(self, cfg, state=None, min_rise=0.0, **rest):
        seen["min_rise"] = min_rise
        real(self, cfg, state, min_rise, **rest)

    monkeypatch.setattr(Guard, "__init__", spy)
    run(validate_config(_pairs_config(tiny_model_dir, tmp_path / "out", data={"eval": None}, train={"max_steps": 14}), "test"))
    events = [(e["step"], e["event"]) for e in read_jsonl(tmp_path / "out" / "events.jsonl")]
    assert (12, "skip") in events and seen["min_rise"] == pytest.approx(0.6931, abs=1e-4)  # dpo's default: the loss it starts at


def test_train_on_prompt_is_refused_for_pairs(tmp_path, tiny_model_dir):
    with pytest.raises(UserError, match="data.train_on_prompt: dpo takes its loss on the answers only"):
        validate_config(_pairs_config(tiny_model_dir, tmp_path / "out", data={"train_on_prompt": True}), "test")


def test_label_smoothing_is_conservative_dpo():
    """TRL 1.16's sigmoid loss has no label smoothing any more; cDPO's formula, by hand: a share eps of
    pairs taken as flipped, -(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d)."""
    import math

    from finetune.objectives.objective import dpo_loss

    chosen, rejected, ones = torch.tensor([1.5, -0.5, 0.2]), torch.tensor([0.5, 0.5, 0.2]), torch.ones(3)
    log_sigmoid = lambda x: -math.log1p(math.exp(-x))  # noqa: E731
    for eps in (0.0, 0.1, 0.3):
        loss, (good, bad) = dpo_loss(chosen, rejected, ones, ones, PreferenceConfig(beta=0.5, label_smoothing=eps))
        expected = sum(-(1 - eps) * log_sigmoid(0.5 * d) - eps * log_sigmoid(-0.5 * d) for d in (1.0, -1.0, 0.0))
        assert loss.item() == pytest.approx(expected, abs=1e-6)
        assert good.tolist() == pytest.approx([0.75, -0.25, 0.1]) and bad.tolist() == pytest.approx([0.25, 0.25, 0.1])


def test_moe_preference_runs_train_the_routers_load_balancing_loss(tmp_path, family_dirs):
    """Mixtral: a DPO forward hands back the router's load-balancing loss as the model computes it
    (TRL adds it to its preference losses alike), the preference loss itself unchanged; a run trains
    it with the config's coefficient and logs it, and a coefficient of 0 leaves it out."""
    from transformers import AutoTokenizer

    from finetune.config.schema import AdapterConfig, ModelConfig
    from finetune.data.datasets import load_data
    from finetune.model.loading import apply_adapter, load_model
    from finetune.objectives.objective import Preference

    model_dir = family_dirs("mixtral")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    data = load_data(DataConfig(train=str(path), format="preference", max_seq_len=128, cache_dir=str(tmp_path / "cache")), tokenizer, seed=0)
    batch = data.train.batch(range(len(data.train)), tokenizer.pad_token_id)
    model = apply_adapter(load_model(ModelConfig(name_or_path=str(model_dir)), say=lambda _: None), AdapterConfig(r=4, dropout=0.0),
                          gradient_checkpointing=False).train()
    objective = Preference("dpo", PreferenceConfig())
    counts = objective.counts(batch)
    with torch.no_grad():
        parts, plain = objective.losses(model, batch, counts, router=True), objective.losses(model, batch, counts)
        own = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, output_router_logits=True).aux_loss
    assert plain.router is None and parts.tokens.item() == pytest.approx(plain.tokens.item(), abs=1e-6)
    assert parts.router.item() == pytest.approx(own.item(), abs=1e-6) and parts.router.item() > 1.0  # ~num_experts_per_tok when balanced

    for name, coef in (("routed", None), ("off", 0.0)):
        run(validate_config(_pairs_config(model_dir, tmp_path / name, data={"eval": None}, train={"max_steps": 3, "router_aux_loss_coef": coef}),
                            "test"))
        steps = [r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "loss" in r]
        assert steps[0]["loss"] == pytest.approx(0.6931, abs=1e-3)
        assert all(("router_aux_loss" in r) == (coef is None) for r in steps), steps


def test_data_command_shows_each_pair_as_its_chosen_and_rejected_sequences(tmp_path, tiny_model_dir, capsys):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    cfg = _pairs_config(tiny_model_dir, tmp_path / "out", data={"train": str(path), "eval": None, "cache_dir": str(tmp_path / "cache")})
    assert main(["data", "--config", str(write_config(tmp_path / "c.yaml", cfg)), "--show", "8"]) == 0
    shown = capsys.readouterr().out.split("--- sequence ")[1:]
    assert len(shown) == 8
    for chosen, rejected in zip(shown[0::2], shown[1::2]):
        assert "(chosen)" in chosen.split("\n")[0] and "(rejected)" in rejected.split("\n")[0]
        pair = next(p for p in PAIRS if p["prompt"] in chosen)
        marked = [text.split("«")[1].split("»")[0] for text in (chosen, rejected)]
        assert marked == [pair["chosen"] + "</s>", pair["rejected"] + "</s>"] and pair["prompt"] in rejected.split("«")[0]
