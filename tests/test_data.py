"""Data: loss masks, packing exactness, padding-free batches, bad rows, the tokenization cache."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import base_config
from finetune.config import DataConfig
from finetune.data import IGNORE, build_rows, collate, epoch_batches, load_data, pack, prepare_samples, read_rows, tokenize_row
from finetune.errors import UserError


@pytest.fixture(scope="module")
def tok(demo_tokenizer_dir):
    return AutoTokenizer.from_pretrained(demo_tokenizer_dir)


def _spans(tok, sample):
    """(prompt text, response text) as decoded from the label mask."""
    ids, labels = sample["input_ids"], sample["labels"]
    prompt = tok.decode([i for i, l in zip(ids, labels) if l == IGNORE])
    response = tok.decode([i for i, l in zip(ids, labels) if l != IGNORE])
    return prompt, response


def test_alpaca_mask_trains_only_the_response(tok):
    row = {"instruction": "What kind of word is this?", "input": "apple", "output": "noun"}
    sample = tokenize_row(row, tok, "alpaca", train_on_prompt=False)
    prompt, response = _spans(tok, sample)
    assert "What kind of word is this?" in prompt and "apple" in prompt and "<|assistant|>" in prompt
    assert response == "noun</s>"  # the newline between turns is not the answer
    labels = sample["labels"]
    first = next(i for i, l in enumerate(labels) if l != IGNORE)
    last = max(i for i, l in enumerate(labels) if l != IGNORE)
    assert all(l == IGNORE for l in labels[:first] + labels[last + 1 :]) and IGNORE not in labels[first:last]  # one contiguous response
    # Response labels are the token ids themselves.
    trained = [(i, l) for i, l in zip(sample["input_ids"], sample["labels"]) if l != IGNORE]
    assert trained and all(i == l for i, l in trained)


def test_train_on_prompt_switch(tok):
    row = {"instruction": "Name it.", "output": "fine"}
    sample = tokenize_row(row, tok, "alpaca", train_on_prompt=True)
    assert IGNORE not in sample["labels"]


def test_chat_mask_covers_every_assistant_turn(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "answer one"},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": "answer two"},
    ]
    sample = tokenize_row({"messages": messages}, tok, "chat", train_on_prompt=False)
    prompt, response = _spans(tok, sample)
    assert "answer one" in response and "answer two" in response
    assert "question" not in response and "Be brief" not in response
    assert "first question" in prompt and "second question" in prompt


def test_completion_trains_every_token_and_ends_with_eos(tok):
    sample = tokenize_row({"text": "The red apple."}, tok, "completion", train_on_prompt=False)
    assert sample["input_ids"][0] == tok.bos_token_id and sample["input_ids"][-1] == tok.eos_token_id
    assert IGNORE not in sample["labels"]


def test_first_token_of_each_sample_is_never_trained():
    samples, stats = prepare_samples([[5, 6, 7], [8, 9]], [[5, 6, 7], [8, 9]], max_seq_len=8)
    assert [s[1] for s in samples] == [[IGNORE, 6, 7], [IGNORE, 9]]
    assert stats["truncated"] == 0


def test_truncation_and_dropping_samples_without_targets():
    samples, stats = prepare_samples([[1, 2, 3, 4, 5], [1, 2, 3]], [[1, 2, 3, 4, 5], [IGNORE, IGNORE, IGNORE]], max_seq_len=3)
    assert samples == [([1, 2, 3], [IGNORE, 2, 3])]
    assert stats == {"samples": 1, "truncated": 1, "dropped_no_target": 1}


def test_packing_fills_rows_and_keeps_every_token():
    samples = [([i] * n, [i] * n) for i, n in enumerate([5, 3, 7, 2, 6, 1, 4], start=1)]
    rows = pack(samples, max_seq_len=8)
    assert all(len(r.input_ids) <= 8 for r in rows)
    assert len(rows) == 4  # 28 tokens in rows of 8: best fit needs exactly 4
    assert sorted(t for r in rows for t in r.input_ids) == sorted(t for s in samples for t in s[0])
    for r in rows:  # positions restart at every sample
        starts = [i for i, p in enumerate(r.position_ids) if p == 0]
        assert len(starts) == len({t for t in r.input_ids})


def test_padding_free_batches_pad_only_to_their_longest_row():
    rows = build_rows([([1, 2, 3], [IGNORE, 2, 3]), ([4, 5], [IGNORE, 5]), ([6] * 9, [IGNORE] + [6] * 8)], 64, packing=False)
    batch = collate(rows[:2], pad_id=0)
    assert batch["input_ids"].shape == (2, 3)  # not max_seq_len
    assert batch["labels"][1].tolist() == [IGNORE, 5, IGNORE]
    assert batch["position_ids"][1].tolist() == [0, 1, 0]  # the pad is its own segment


def test_packed_logits_equal_each_sample_alone(tiny_model_dir, tok):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()
    rows = [{"instruction": "What kind of word is this?", "input": w, "output": k}
            for w, k in [("apple", "noun"), ("red", "adjective"), ("finds", "verb"), ("Anna", "name"), ("tiger", "noun")]]
    samples = [tokenize_row(r, tok, "alpaca", False) for r in rows]
    packed = pack([(s["input_ids"], s["labels"]) for s in samples], max_seq_len=256)
    assert len(packed) == 1 and len(packed[0].input_ids) == sum(len(s["input_ids"]) for s in samples)
    for impl in ("sdpa", "eager"):
        model.config._attn_implementation = impl
        batch = collate(packed, tok.pad_token_id)
        with torch.no_grad():
            together = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
            starts = [i for i, p in enumerate(batch["position_ids"][0].tolist()) if p == 0] + [batch["input_ids"].shape[1]]
            for s, e in zip(starts, starts[1:]):
                alone = model(input_ids=batch["input_ids"][:, s:e], use_cache=False).logits[0]
                assert torch.allclose(together[s:e], alone, atol=1e-4), (impl, (together[s:e] - alone).abs().max())


def test_bad_rows_fail_with_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": "b"\n{"instruction": "a"}\n{"instruction": "a", "output": " "}\n')
    with pytest.raises(UserError, match=rf"{path}:2: invalid JSON"):
        read_rows([str(path)], "alpaca", "fail")
    path.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a"}\n')
    with pytest.raises(UserError, match=rf"{path}:2: missing field 'output'"):
        read_rows([str(path)], "alpaca", "fail")


def test_bad_rows_skipped_and_counted(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\nnot json\n{"text": "x"}\n{"messages": []}\n{"instruction": "c", "output": "d"}\n')
    rows = read_rows([str(path)], "alpaca", "skip")
    assert [r["output"] for r in rows] == ["b", "d"]
    assert "skipped 3 bad row(s)" in capsys.readouterr().out


def test_chat_rows_checked(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"messages": [{"role": "user", "content": "hi"}]}]))
    with pytest.raises(UserError, match="row 1: no non-empty assistant message"):
        read_rows([str(path)], "chat", "fail")


def test_tokenized_data_is_cached(tmp_path, tok):
    cfg = DataConfig(**{**base_config("m", "o")["data"], "cache_dir": str(tmp_path / "cache")})
    first = load_data(cfg, tok, seed=0)
    second = load_data(cfg, tok, seed=0)
    assert not first.stats["cache_hit"] and second.stats["cache_hit"]
    assert [r.input_ids for r in first.train] == [r.input_ids for r in second.train]
    # A change in settings is a different cache entry.
    third = load_data(cfg.model_copy(update={"train_on_prompt": True}), tok, seed=0)
    assert not third.stats["cache_hit"]


def test_every_rank_gets_the_same_number_of_batches():
    for world in (1, 2, 3):
        counts = {len(epoch_batches(101, 4, seed=1, epoch=0, rank=r, world=world)) for r in range(world)}
        assert len(counts) == 1
    a = epoch_batches(50, 4, seed=1, epoch=0, rank=0, world=1)
    assert a == epoch_batches(50, 4, seed=1, epoch=0, rank=0, world=1)  # order is a function of (seed, epoch)
    assert a != epoch_batches(50, 4, seed=1, epoch=1, rank=0, world=1)


def test_parquet_and_json_read_like_jsonl(tmp_path):
    import datasets

    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(5)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    assert read_rows([str(tmp_path / "d.parquet")], "alpaca", "fail") == rows
    assert read_rows([str(tmp_path / "d.json")], "alpaca", "fail") == rows


def test_eval_fraction_holds_out_a_seeded_share(tmp_path, tok):
    total = 60
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"word {i}", "output": f"answer {i}"}) + "\n" for i in range(total)))
    cfg = DataConfig(train=str(path), eval_fraction=0.1, format="alpaca", max_seq_len=128, packing=False, cache_dir=str(tmp_path / "cache"))
    data = load_data(cfg, tok, seed=3, keep_eval_examples=True)
    assert len(data.eval) == int(total * 0.1) and len(data.train) == total - len(data.eval)
    assert len(data.eval_examples) == len(data.eval)
    eval_ids = {tuple(r.input_ids) for r in data.eval}
    assert not eval_ids & {tuple(r.input_ids) for r in data.train}  # nothing held out is trained on
    assert {r["output"] for r in data.eval_examples} == {tok.decode([t for t, l in zip(r.input_ids, r.labels) if l != -100]).removesuffix("</s>") for r in data.eval}
