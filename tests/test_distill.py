"""Distillation (train.objective distill): the loss and gradients equal TRL's generalised JSD (GKD) on the same
rows, fused or from the logits; the teacher must share the student's vocabulary; a run moves the student
toward the teacher, resumes bitwise and runs the same on two processes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import DEMO_DATA as REPO_DATA
from conftest import adapted_lora, base_config, finetune_in_process, killed_and_resumed, once, step_rows, write_config

from finetune.config.errors import UserError
from finetune.config.schema import DistillConfig, ModelConfig
from finetune.data.packing import Row, collate
from finetune.data.rows import IGNORE
from finetune.model.teacher import teacher_source
from finetune.objectives import loss as loss_module
from finetune.objectives.distill import Distill
from finetune.objectives.loss import to_device

# Two rows of two packed samples each: (prompt, answer) token ids
SAMPLES = [([5, 9, 17, 23], [40, 41, 42, 2]), ([31, 8], [43, 44, 45, 2]), ([12, 13, 14], [46, 47, 2]), ([50, 51, 52, 53, 54], [55, 2])]


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory, demo_tokenizer_dir):
    """A wider, deeper random Llama than the tiny student, with the same (demo) tokenizer."""

    def build(out):
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
        config = LlamaConfig(vocab_size=len(tok), hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
        torch.manual_seed(1)
        LlamaForCausalLM(config).save_pretrained(out)
        tok.save_pretrained(out)

    return once(tmp_path_factory, "tiny-teacher", build)


@pytest.fixture(scope="session")
def demo_student_dir(tmp_path_factory, demo_model_dir):
    """A random two-layer, 64-wide Llama with the demo model's tokenizer: a student for the demo model."""

    def build(out):
        from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

        config = AutoConfig.from_pretrained(demo_model_dir)
        config.update({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "head_dim": 16})
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(out)
        AutoTokenizer.from_pretrained(demo_model_dir).save_pretrained(out)

    return once(tmp_path_factory, "demo-student", build)


def _ours(model, teacher, cfg: DistillConfig) -> tuple[torch.Tensor, torch.Tensor]:
    rows = []
    for pair in (SAMPLES[:2], SAMPLES[2:]):
        ids = [t for p, a in pair for t in p + a]
        labels = [t for p, a in pair for t in [IGNORE] * len(p) + a]
        positions = [i for p, a in pair for i in range(len(p) + len(a))]
        rows.append(Row(np.array(ids), np.array(labels), np.array(positions)))
    batch = to_device(collate(rows, 0), "cpu")
    objective = Distill(cfg, teacher=teacher)
    count = objective.counts(batch)[0]
    parts = objective.losses(model, batch, [count])
    return parts.tokens / count, parts.metrics / count


def _trls(model, teacher, cfg: DistillConfig) -> torch.Tensor:
    """GKDTrainer.generalized_jsd_loss on the full logits of each sample, padded on the right."""
    from trl.experimental.gkd import GKDTrainer

    width = max(len(p) + len(a) for p, a in SAMPLES)
    ids = torch.tensor([p + a + [0] * (width - len(p) - len(a)) for p, a in SAMPLES])
    mask = torch.tensor([[1] * (len(p) + len(a)) + [0] * (width - len(p) - len(a)) for p, a in SAMPLES])
    labels = torch.tensor([[IGNORE] * len(p) + a + [IGNORE] * (width - len(p) - len(a)) for p, a in SAMPLES])
    student = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids, attention_mask=mask).logits
    beta = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": cfg.beta}[cfg.divergence]
    return GKDTrainer.generalized_jsd_loss(student[:, :-1], teacher_logits[:, :-1], labels[:, 1:], beta=beta, temperature=cfg.temperature)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd", "reverse_kl"])
def test_loss_and_gradients_equal_trls_gkd(tiny_model_dir, teacher_dir, divergence, temperature, fused, monkeypatch):
    """TRL's generalised JSD for beta 0 (forward KL), 0.5 and 1 (reverse KL) at two temperatures: loss to 1e-5, gradients to
    1e-4 of the largest; from the decoders' hidden states a chunk at a time (fused) or from the models' logits."""
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM

    cfg = DistillConfig(teacher=str(teacher_dir), divergence=divergence, temperature=temperature)
    model, teacher = adapted_lora(tiny_model_dir), AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    trained = [p for p in model.parameters() if p.requires_grad]
    expected = _trls(model, teacher, cfg)
    expected.backward()
    expected_grads = [p.grad.clone() for p in trained]
    model.zero_grad()
    if not fused:
        monkeypatch.setattr(loss_module, "fusable_parts", lambda _: None)
        monkeypatch.setattr("finetune.objectives.distill.fusable_parts", lambda _: None)
    ours, metrics = _ours(model, teacher, cfg)
    ours.backward()
    assert abs(ours.item() - expected.item()) < 1e-5 and expected.item() > 1e-3, (ours.item(), expected.item())
    assert metrics[0].item() == pytest.approx(ours.item(), abs=1e-6)  # the divergence itself: ce_weight 0
    worst = max((p.grad - g).abs().max().item() for p, g in zip(trained, expected_grads))
    assert worst < 1e-4 * max(g.abs().max().item() for g in expected_grads), worst


def test_top_k_at_the_vocabulary_is_the_full_loss_and_cross_entropy_mixes_in(tiny_model_dir, teacher_dir):
    """The teacher's top k tokens at k = the vocabulary give the full forward KL; fewer give another loss; ce_weight w gives
    (1 - w) x the divergence + w x the cross-entropy on the answer tokens."""
    from transformers import AutoModelForCausalLM

    model, teacher = adapted_lora(tiny_model_dir), AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    vocab = teacher.config.vocab_size
    with torch.no_grad():
        full, (divergence, ce, _, _) = _ours(model, teacher, DistillConfig(teacher="t"))
        at_vocab, _ = _ours(model, teacher, DistillConfig(teacher="t", top_k=vocab))
        top_8, _ = _ours(model, teacher, DistillConfig(teacher="t", top_k=8))
        mixed, _ = _ours(model, teacher, DistillConfig(teacher="t", ce_weight=0.25))
    assert at_vocab.item() == pytest.approx(full.item(), abs=1e-5) and abs(top_8.item() - full.item()) > 1e-3
    assert mixed.item() == pytest.approx(0.75 * divergence.item() + 0.25 * ce.item(), abs=1e-5) and ce.item() > 1.0


def test_the_chunked_heads_do_no_gradient_work_under_no_grad(tiny_model_dir, teacher_dir, monkeypatch):
    """Eval runs the losses under no_grad with the head still trainable (full fine-tuning): neither the divergence nor the
    cross-entropy takes a chunk's d(hidden) or d(weight) then, and both give the values they give with gradients."""
    from transformers import AutoModelForCausalLM

    model, teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    assert model.get_output_embeddings().weight.requires_grad
    calls = []
    real = loss_module.chunk_grads
    monkeypatch.setattr(loss_module, "chunk_grads", lambda *args: calls.append(1) or real(*args))
    cfg = DistillConfig(teacher="t", ce_weight=0.25)
    with_grads, metrics = _ours(model, teacher, cfg)
    assert calls, "the fused path was not taken"
    calls.clear()
    with torch.no_grad():
        without, metrics_without = _ours(model, teacher, cfg)
        batch = to_device(collate([Row(np.array(p + a), np.array([IGNORE] * len(p) + a), np.arange(len(p) + len(a))) for p, a in SAMPLES], 0), "cpu")
        cross_entropy = loss_module.losses(model, batch).tokens
    assert calls == [] and not without.requires_grad
    assert without.item() == with_grads.item() and torch.equal(metrics, metrics_without)
    assert cross_entropy.item() == pytest.approx(loss_module.losses(model, batch).tokens.item(), rel=1e-6)


def _distill_config(model_dir, teacher, out, **sections) -> dict:
    cfg = base_config(model_dir, out, **sections)
    cfg["train"] = {**cfg["train"], "objective": "distill", "max_steps": 8, "lr": 1e-2, **sections.get("train", {})}
    cfg["distill"] = {"teacher": str(teacher), **sections.get("distill", {})}
    return cfg


def test_a_run_moves_the_student_toward_the_teacher_and_resumes_bitwise(tmp_path, demo_student_dir, demo_model_dir):
    """8 LoRA steps of forward KL to the demo model (pretrained on the demo corpus) lower the random student's divergence
    and raise its top-1 agreement; killed after its step-4 checkpoint and resumed, the run repeats the losses and metrics
    bit for bit."""
    cfg = _distill_config(demo_student_dir, demo_model_dir, tmp_path / "reference", data={"eval": None})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "reference.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "distill: the teacher is" in result.stdout
    keys = ("loss", "grad_norm", "divergence", "ce", "agreement")
    expected = [[r[k] for k in keys] for r in step_rows(tmp_path / "reference")]
    assert expected[-1][2] < 0.92 * expected[0][2] and expected[-1][4] > expected[0][4] + 0.3, expected
    _, steps = killed_and_resumed(tmp_path, cfg, save_every=4, kill_at=5)
    assert [[r[k] for k in keys] for r in steps] == expected


def test_an_adapter_teacher_is_merged_and_bad_teachers_are_one_line(tmp_path, tiny_model_dir, teacher_dir):
    """A finetune run's adapter folder is a teacher (merged into its base as it loads: its first loss equals the merged
    model's); a teacher with another tokenizer or no model stops with exit 2, an adapter under a sharding strategy in one line."""
    sft = base_config(teacher_dir, tmp_path / "sft", data={"eval": None}, train={"max_steps": 2, "lr": 1e-2})
    assert finetune_in_process("train", "--config", str(write_config(tmp_path / "sft.yaml", sft))).returncode == 0
    merged = finetune_in_process("merge", "--adapter", str(tmp_path / "sft"), "--out", str(tmp_path / "merged"))
    assert merged.returncode == 0, merged.stderr[-2000:]
    first = {}
    for name, teacher in (("adapter", tmp_path / "sft"), ("merged", tmp_path / "merged")):
        cfg = _distill_config(tiny_model_dir, teacher, tmp_path / f"from-{name}", data={"eval": None}, train={"max_steps": 1})
        result = finetune_in_process("train", "--config", str(write_config(tmp_path / f"{name}.yaml", cfg)))
        assert result.returncode == 0, result.stderr[-2000:]
        first[name] = step_rows(tmp_path / f"from-{name}")[0]["divergence"]
    assert first["adapter"] == pytest.approx(first["merged"], rel=1e-5)

    def refused(teacher, **sections):
        cfg = _distill_config(tiny_model_dir, teacher, tmp_path / "bad", data={"eval": None}, **sections)
        result = finetune_in_process("train", "--config", str(write_config(tmp_path / "bad.yaml", cfg)))
        assert result.returncode == 2, result.stderr[-2000:]
        return result.stderr.strip().splitlines()[-1]

    other = tmp_path / "other-vocab"
    other.mkdir()
    for f in teacher_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    vocab = json.loads((other / "tokenizer.json").read_text())
    ids = vocab["model"]["vocab"]
    a, b = (next(t for t, i in ids.items() if i == n) for n in (300, 301))
    ids[a], ids[b] = 301, 300  # two tokens swapped: the same merges, another numbering
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    assert f"tokenizer differs from the student's at id 300 ('{b}' there, '{a}' here)" in refused(other)
    assert "is neither a model folder (config.json) nor an adapter folder" in refused(tmp_path / "nothing")
    with pytest.raises(UserError, match="distributed.strategy fsdp loads no rank's weights whole; merge it first"):
        teacher_source(str(tmp_path / "sft"), ModelConfig(name_or_path=str(tiny_model_dir)), None, sharded="fsdp")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_two_processes_distill_as_one(tiny_model_dir, teacher_dir, trained, strategy):
    """The teacher held as the strategy holds weights (whole under ddp, sharded under fsdp and zero3): two processes give
    one process's losses and divergences, on-policy steps (lmbda 0.5: steps 3 and 4 here) sampling the same answers."""
    sections = {"train": {"objective": "distill"}, "distill": {"teacher": str(teacher_dir), "lmbda": 0.5, "max_new_tokens": 6}}
    reference, one, _ = trained(tiny_model_dir, "lora", **sections)
    out, two, summary = trained(tiny_model_dir, "lora", 2, strategy, **sections)
    assert summary["world_size"] == 2 and len(two) == 4
    assert two == pytest.approx(one, rel=1e-4, abs=1e-6)
    assert [r["on_policy"] for r in step_rows(reference)] == [r["on_policy"] for r in step_rows(out)] == [0.0, 0.0, 1.0, 1.0]
    divergences = [r["divergence"] for r in step_rows(reference)]
    assert [r["divergence"] for r in step_rows(out)] == pytest.approx(divergences, rel=1e-4, abs=1e-6)


def test_on_policy_steps_train_on_the_students_answers_and_resume_bitwise(tmp_path, demo_student_dir, demo_model_dir):
    """lmbda 1: every step the student answers the data's prompts itself (at most max_new_tokens, cut at its EOS) and learns
    the teacher's distribution on its own tokens (the divergence alone: ce_weight weighs the data's answers); killed after the
    step-2 checkpoint, the run resamples the same answers."""
    cfg = _distill_config(demo_student_dir, demo_model_dir, tmp_path / "reference", data={"eval": None, "packing": False},
                          train={"max_steps": 4}, distill={"lmbda": 1.0, "max_new_tokens": 8, "ce_weight": 0.5})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "reference.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-2000:]
    keys = ("loss", "grad_norm", "divergence", "agreement", "on_policy", "tokens")
    expected = [[r[k] for k in keys] for r in step_rows(tmp_path / "reference")]
    assert all(r[4] == 1.0 for r in expected) and expected[-1][2] < expected[0][2]
    assert all(r[0] == pytest.approx(r[2], rel=1e-6) for r in expected)  # the student's own tokens: no cross-entropy, ce_weight aside
    _, steps = killed_and_resumed(tmp_path, cfg, save_every=2, kill_at=3)
    assert [[r[k] for k in keys] for r in steps] == expected


def test_a_4_bit_teacher_teaches_a_qlora_student(tmp_path, demo_student_dir, demo_model_dir):
    """distill.teacher_quantization loads the teacher in 4 bits (bitsandbytes' NF4): its divergence from the same student
    moves off the full-precision teacher's by the quantization's error only (under 5%, not 0); a QLoRA student (a 4-bit
    base itself) learns from it: the divergence falls by 8% over 8 steps."""
    q4 = {"bits": 4, "compute_dtype": "float32"}
    first = {}
    for name, distill, model in (("full", {}, {}), ("4-bit", {"teacher_quantization": q4}, {}),
                                 ("qlora", {"teacher_quantization": q4}, {"quantization": q4})):
        cfg = _distill_config(demo_student_dir, demo_model_dir, tmp_path / name, data={"eval": None}, model=model, distill=distill,
                              train={"max_steps": 8 if name == "qlora" else 1})
        result = finetune_in_process("train", "--config", str(write_config(tmp_path / f"{name}.yaml", cfg)))
        assert result.returncode == 0, result.stderr[-2000:]
        rows = step_rows(tmp_path / name)
        first[name] = rows[0]["divergence"]
        if name == "qlora":
            assert "4-bit base" in result.stdout and rows[-1]["divergence"] < 0.92 * rows[0]["divergence"], [r["divergence"] for r in rows]
        assert ("the teacher is" in result.stdout) and ("(in 4 bits, nf4)" in result.stdout) == bool(distill)
    assert 1e-4 < abs(first["4-bit"] / first["full"] - 1) < 0.05, first


def test_sequence_level_answers_are_the_teachers_made_once_and_trained_on(tmp_path, demo_student_dir, demo_model_dir):
    """distill.sequence_level: each training sample's answer is replaced by the teacher's greedy answer to its prompt
    (the same tokens generate gives, cut after EOS); the source's samples are answered once per data and teacher (a second load
    asks nothing); eval keeps the data's answers; a run on them (ce_weight 1: SFT on the teacher's answers) learns them."""
    from transformers import AutoTokenizer

    from finetune.config.schema import validate_config
    from finetune.data.datasets import load_data
    from finetune.data.tokenized import Answers
    from finetune.model.teacher import teacher_source, whole_teacher
    from finetune.objectives.distill import teacher_answers
    from finetune.objectives.sampling import generate

    sections = {"data": {"eval": None, "eval_fraction": 0.05, "cache_dir": str(tmp_path / "cache")}, "distill": {"sequence_level": True, "ce_weight": 1.0,
                "max_new_tokens": 12}, "train": {"max_steps": 6}}
    cfg = validate_config(_distill_config(demo_student_dir, demo_model_dir, tmp_path / "run", **sections), "test")
    tokenizer = AutoTokenizer.from_pretrained(demo_student_dir)
    teacher = teacher_source(str(demo_model_dir), cfg.model, tokenizer)
    asked = []
    answers = teacher_answers(*teacher, cfg.distill, tokenizer, "cpu")
    counted = Answers(answers.key, lambda prompts: asked.append(len(prompts)) or answers.answer(prompts))
    plain = load_data(cfg.data, tokenizer, cfg.train.seed)
    data = load_data(cfg.data, tokenizer, cfg.train.seed, answers=counted)
    assert sum(asked) == len(data.train.samples) + len(data.eval.samples) == 864 and len(data.train.samples) == len(plain.train.samples)
    model = whole_teacher(teacher[0], None, "cpu")
    changed = 0
    for i in range(5):
        (ids, labels), (own_ids, own_labels) = (_sample(d.train, i) for d in (data, plain))
        start = int(np.flatnonzero(labels != IGNORE)[0])
        assert start == int(np.flatnonzero(own_labels != IGNORE)[0]) and (ids[:start] == own_ids[:start]).all()
        assert ids[start:].tolist() == labels[start:].tolist() == generate(model, tokenizer, [ids[:start]], 12, "cpu")[0]
        changed += ids[start:].tolist() != own_ids[start:].tolist()
    assert changed  # the base model does not answer as the data does
    assert len(data.eval.samples) == len(plain.eval.samples) and all((_sample(data.eval, i)[1] == _sample(plain.eval, i)[1]).all() for i in range(5))
    again = load_data(cfg.data, tokenizer, cfg.train.seed, answers=counted)
    assert sum(asked) == 864 and again.stats["cache_hit"]

    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "run.yaml", _distill_config(
        demo_student_dir, demo_model_dir, tmp_path / "run", **sections))))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "answers the training prompts" not in result.stdout  # written above, for this data, teacher and max_new_tokens
    losses = [r["loss"] for r in step_rows(tmp_path / "run")]
    assert losses[-1] < 0.92 * losses[0], losses


def _sample(split, i: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) of a split's i-th sample."""
    picked, length = split.samples[i : i + 1], split.lengths[i : i + 1]
    return tuple(split.columns[name].cut(picked, length, np.zeros(1, dtype=np.int64)) for name in ("input_ids", "labels"))


def test_a_4_bit_teacher_sharded_by_fsdp_teaches_as_in_one_process(tiny_model_dir, teacher_dir, trained):
    """distill.teacher_quantization with torchao's NF4 (the 4-bit tensor FSDP2 shards): two FSDP processes give one
    process's losses and divergences (to 1e-3: 1.4e-4 seen, as FSDP2 over NF4 students, docs/platform-notes.md), and the
    divergence is not the full-precision teacher's."""
    q4 = {"bits": 4, "backend": "torchao", "compute_dtype": "float32"}
    sections = {"train": {"objective": "distill"}, "distill": {"teacher": str(teacher_dir), "teacher_quantization": q4}}
    reference, one, _ = trained(tiny_model_dir, "lora", **sections)
    out, two, summary = trained(tiny_model_dir, "lora", 2, "fsdp", **sections)
    assert summary["world_size"] == 2 and two == pytest.approx(one, rel=1e-3)
    divergences = [r["divergence"] for r in step_rows(reference)]
    assert [r["divergence"] for r in step_rows(out)] == pytest.approx(divergences, rel=1e-3)
    full, _, _ = trained(tiny_model_dir, "lora", train={"objective": "distill"}, distill={"teacher": str(teacher_dir)})
    assert step_rows(full)[0]["divergence"] != divergences[0]


@pytest.mark.parametrize("sections, message", [
    ({"distill": {"teacher_quantization": {"bits": 4}}, "distributed": {"strategy": "zero3"}}, "cannot run with distributed.strategy zero3"),
    ({"distill": {"teacher_quantization": {"bits": 4, "backend": "bitsandbytes"}}, "distributed": {"strategy": "fsdp"}}, "backend bitsandbytes under"),
    ({"distill": {"teacher_quantization": {"bits": 8, "backend": "torchao"}}}, "backend torchao with bits 8 or fp4"),
    ({"distill": {"sequence_level": True}, "data": {"format": "completion"}}, "data.format completion has none"),
    ({"distill": {"cross_tokenizer": True, "top_k": 20}}, "distill.cross_tokenizer: compares the two models' sorted distributions .ULD., "
                                                          "so distill.top_k does not apply"),
])
def test_what_a_distillation_cannot_run_is_one_line(tmp_path, sections, message):
    from finetune.config.schema import validate_config

    cfg = _distill_config(tmp_path, tmp_path, tmp_path / "out", **sections)
    with pytest.raises(UserError, match=message):
        validate_config(cfg, "config.yaml", check_paths=False)


# -- across tokenizers (distill.cross_tokenizer) ------------------------------------------------------------

ACROSS_TEXTS = ["The quick brown fox jumps over the lazy dog.", "  leading spaces, tabs\tand\nnew lines", "3.14159 x 2 = 6.28318; 1000000!",
                "naïve café, 東京 and emoji 🦊🦊", "def f(x):\n    return x ** 2  # square"]


def test_the_spans_of_two_real_tokenizers_cover_the_text():
    """Llama 3's tokens (the student's) against Qwen3's (the teacher's) on hard texts, a chat turn and tokens split otherwise than
    the tokenizer would (as a sampled answer may be): the spans follow each other, cover both token lists whole and spell the
    text; most are one token on each side."""
    from released import tokenizer_dir
    from transformers import AutoTokenizer

    from finetune.objectives.cross_tokenizer import align, student_ends

    llama, qwen = (AutoTokenizer.from_pretrained(tokenizer_dir(f)) for f in ("llama3", "qwen3"))
    turn = llama.apply_chat_template([{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Sure, 42."}], tokenize=False)
    one_to_one = total = 0
    split_otherwise = llama.convert_tokens_to_ids(["The", "Ġqu", "ick", "Ġbr", "own", "Ġf", "ox"])  # a sampled answer's own split
    for ids in [*(llama(text, add_special_tokens=False).input_ids for text in [*ACROSS_TEXTS, turn]), split_otherwise]:
        theirs, spans = align(llama, qwen, ids)
        decoded, _ = student_ends(llama, ids)
        assert theirs == qwen(decoded, add_special_tokens=False).input_ids
        assert [s.student for s in spans] == list(zip([0] + [s.student[1] for s in spans[:-1]], [s.student[1] for s in spans]))
        assert [s.teacher for s in spans] == list(zip([0] + [s.teacher[1] for s in spans[:-1]], [s.teacher[1] for s in spans]))
        assert spans[-1].student[1] == len(ids) and spans[-1].teacher[1] == len(theirs) and "".join(s.text for s in spans) == decoded
        one_to_one += sum(s.student[1] - s.student[0] == 1 == s.teacher[1] - s.teacher[0] for s in spans)
        total += len(spans)
    assert one_to_one > 0.6 * total, (one_to_one, total)


def _renumbered(tmp_path, model_dir, first: int, second: int):
    """The model with two token ids swapped in its tokenizer, its embedding and head rows swapped with them: the same
    distribution over the same text, under other token ids."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "renumbered"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for weight in {id(w): w for w in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)}.values():
            weight[[first, second]] = weight[[second, first]]
    model.save_pretrained(out)
    vocab = json.loads((model_dir / "tokenizer.json").read_text())
    ids = vocab["model"]["vocab"]
    a, b = (next(t for t, i in ids.items() if i == n) for n in (first, second))
    ids[a], ids[b] = second, first
    (out / "tokenizer.json").write_text(json.dumps(vocab))
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer_config", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())
    return out


def test_the_loss_across_tokenizers_is_zero_for_the_same_distribution_over_the_same_text(tmp_path, tiny_model_dir):
    """The student against itself renumbered (two token ids swapped in tokenizer, embedding and head: the same distribution,
    other ids): ULD's distance at every span is 0 to rounding, where the id-by-id forward KL is not; against another model it
    is not 0, and its gradient reaches the student."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = [i for p, a in SAMPLES for i in p + a]
    first, second = sorted(set(ids))[:2]  # tokens the rows hold, so the renumbering shows
    other = _renumbered(tmp_path, tiny_model_dir, first, second)
    student = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    teacher = AutoModelForCausalLM.from_pretrained(other)
    mine, theirs = AutoTokenizer.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(other)
    assert mine.convert_ids_to_tokens(first) == theirs.convert_ids_to_tokens(second)
    batch = to_device(collate([Row(np.array(p + a), np.array([IGNORE] * len(p) + a), np.arange(len(p) + len(a))) for p, a in SAMPLES], 0), "cpu")
    across = Distill(DistillConfig(teacher="t", cross_tokenizer=True), teacher=teacher, tokenizers=(mine, theirs))
    same = across.losses(student, batch, [0])
    trained = sum(len(a) for _, a in SAMPLES)  # every answer token starts a span (one token each side): all weighed, all agreeing
    assert same.tokens.abs().item() < 1e-5 and same.metrics[2].item() == trained
    by_id = Distill(DistillConfig(teacher="t"), teacher=teacher).losses(student, batch, [0])
    assert by_id.metrics[0] > 1e-3  # the plain divergence compares ids: the swapped tokens differ
    another = Distill(DistillConfig(teacher="t", cross_tokenizer=True), teacher=adapted_lora(tiny_model_dir), tokenizers=(mine, mine))
    moved = another.losses(student, batch, [0])
    moved.tokens.backward()
    assert moved.tokens.item() > 1e-3 and student.get_input_embeddings().weight.grad.abs().sum() > 0


def test_a_llama_student_learns_from_another_familys_teacher_across_tokenizers(tmp_path, released, demo_model_dir):
    """Llama 3.2's shape with Llama 3's tokenizer (128,256 rows) distilled from the demo model (pretrained on the demo corpus,
    its own tokenizer of a few hundred tokens): refused id by id with the way out named; with distill.cross_tokenizer, 8 full
    fine-tuning steps, half of them on the student's own answers (lmbda 0.5), lower ULD's distance on the data's answers."""
    student = released("llama-3.2-1b")
    data = {"train": str(REPO_DATA / "train.jsonl"), "eval": None, "format": "alpaca", "max_seq_len": 96}
    cfg = _distill_config(student, demo_model_dir, tmp_path / "out", data=data, distill={"lmbda": 0.5, "max_new_tokens": 8, "ce_weight": 0.5},
                          adapter={"method": "full"}, train={"lr": 1e-2})
    refused = finetune_in_process("train", "--config", str(write_config(tmp_path / "id.yaml", cfg)))
    assert refused.returncode == 2 and "set distill.cross_tokenizer: true" in refused.stderr.strip().splitlines()[-1]
    cfg["distill"]["cross_tokenizer"] = True
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "across.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ULD across tokenizers" in result.stdout
    rows = step_rows(tmp_path / "out")
    assert any(r["on_policy"] > 0 for r in rows) and any(r["on_policy"] == 0 for r in rows)
    divergence = [r["divergence"] for r in rows if r["on_policy"] == 0]
    # From a random init over 128k tokens ULD moves slowly (measured 1.9876 to 1.9621 over these 4 steps: the student's
    # probabilities are all near 1/128k, where softmax's gradient is small); the cross-entropy on the answers speeds it.
    assert divergence[-1] < 0.995 * divergence[0] and divergence == sorted(divergence, reverse=True), divergence
