"""Data: loss masks, packing exactness, padding-free batches, bad rows, the tokenization cache,
mixing sources, one tokenization per node."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import DEMO_DATA, REPO, base_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.config.errors import UserError
from finetune.config.schema import DataConfig
from finetune.data.datasets import load_data
from finetune.data.encoding import tokenize_row
from finetune.data.packing import Row, collate, epoch_batches, pack
from finetune.data.readers import Skipped, checked_rows
from finetune.data.rows import IGNORE


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


def read_rows(sources: list[str], fmt: str, bad_rows: str) -> list[dict]:
    """Every usable row of the sources, as the data step reads them."""
    skipped = Skipped()
    return [row for source in sources for _, row in checked_rows(source, fmt, bad_rows, skipped)]


def _alpaca(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _samples_of(split) -> list[tuple[tuple, tuple]]:
    """Every sample of every row of a split, as (ids, labels), cut at the position restarts."""
    out = []
    for row in split.rows(range(len(split))):
        starts = list(np.flatnonzero(np.asarray(row.position_ids) == 0)) + [len(row.input_ids)]
        out += [(tuple(row.input_ids[s:e]), tuple(row.labels[s:e])) for s, e in zip(starts, starts[1:])]
    return out


def test_first_token_masked_truncation_and_samples_without_targets(tmp_path, tok):
    """Every sample's first label is masked; a long answer is cut to max_seq_len; a prompt longer than
    max_seq_len leaves nothing to train and the sample is dropped."""
    rows = [{"instruction": "Name it.", "output": "fine"}, {"instruction": "Say it.", "output": "word " * 60},
            {"instruction": "word " * 60, "output": "late"}]
    cfg = DataConfig(train=_alpaca(tmp_path / "d.jsonl", rows), max_seq_len=32, packing=False, cache_dir=str(tmp_path / "cache"))
    data = load_data(cfg, tok, seed=0)
    assert data.stats["train"] | {"sources": None} == {"samples": 2, "truncated": 2, "dropped_no_target": 1, "first_dropped": f"{cfg.train}:3",
                                                      "chunked": 0, "windows": 0, "rows": 2,
                                                      "tokens": len(tokenize_row(rows[0], tok, "alpaca", False)["input_ids"]) + 32,
                                                      "sources": None}
    for ids, labels in _samples_of(data.train):
        assert labels[0] == IGNORE and len(ids) <= 32
        assert all(l in (IGNORE, i) for i, l in zip(ids, labels))


def test_pipeline_batches_equal_the_rows_tokenized_one_by_one(tmp_path, tok):
    """Unpacked, the memory-mapped pipeline yields token for token what tokenize_row gives each demo
    row (first label masked); packed, its rows hold exactly those samples, each whole, once."""
    cfg = DataConfig(train=str(DEMO_DATA / "train.jsonl"), max_seq_len=128, packing=False, cache_dir=str(tmp_path / "cache"))
    data = load_data(cfg, tok, seed=0)
    expected = []
    for line in (DEMO_DATA / "train.jsonl").read_text().splitlines():
        t = tokenize_row(json.loads(line), tok, "alpaca", False)
        expected.append((tuple(t["input_ids"][:128]), tuple([IGNORE] + t["labels"][1:128])))
    assert _samples_of(data.train) == expected
    batch = data.train.batch([3, 0], tok.pad_token_id)
    assert batch["input_ids"][0, : len(expected[3][0])].tolist() == list(expected[3][0])
    packed = load_data(cfg.model_copy(update={"packing": True}), tok, seed=0)
    assert sorted(_samples_of(packed.train)) == sorted(expected)
    assert len(packed.train) < len(expected) / 2.5 and packed.stats["train"]["fill"] > 0.8
    assert max(packed.train.row_lengths) <= 128


def test_packing_fills_rows_and_keeps_every_sample():
    lengths = np.array([5, 3, 7, 2, 6, 1, 4])
    order, offsets = pack(lengths, max_seq_len=8)
    rows = [order[a:b] for a, b in zip(offsets, offsets[1:])]
    assert len(rows) == 4  # 28 tokens in rows of 8: best fit needs exactly 4
    assert sorted(order.tolist()) == list(range(7)) and all(lengths[r].sum() <= 8 for r in rows)
    assert np.array_equal(pack(lengths, 8)[0], order)  # deterministic
    big = np.random.default_rng(0).integers(1, 500, 200_000)
    order, offsets = pack(big, 512)
    assert sorted(order.tolist()) == list(range(len(big))) and np.add.reduceat(big[order], offsets[:-1]).max() <= 512
    assert big.sum() / (512 * (len(offsets) - 1)) > 0.99  # best fit leaves almost no room


def test_padding_free_batches_pad_only_to_their_longest_row():
    rows = [Row([1, 2, 3], [IGNORE, 2, 3], [0, 1, 2]), Row([4, 5], [IGNORE, 5], [0, 1])]
    batch = collate(rows, pad_id=0)
    assert batch["input_ids"].shape == (2, 3)  # not max_seq_len
    assert batch["labels"][1].tolist() == [IGNORE, 5, IGNORE]
    assert batch["position_ids"][1].tolist() == [0, 1, 0]  # the pad is its own segment


def test_packed_logits_equal_each_sample_alone(tiny_model_dir, tok):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()
    rows = [{"instruction": "What kind of word is this?", "input": w, "output": k}
            for w, k in [("apple", "noun"), ("red", "adjective"), ("finds", "verb"), ("Anna", "name"), ("tiger", "noun")]]
    samples = [tokenize_row(r, tok, "alpaca", False) for r in rows]
    packed = [Row(sum((s["input_ids"] for s in samples), []), sum((s["labels"] for s in samples), []),
                  sum((list(range(len(s["input_ids"]))) for s in samples), []))]
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


def test_bad_rows_skipped_and_counted(tmp_path, tok):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\nnot json\n{"text": "x"}\n{"messages": []}\n{"instruction": "c", "output": "d"}\n')
    assert [r["output"] for r in read_rows([str(path)], "alpaca", "skip")] == ["b", "d"]
    said = []
    data = load_data(DataConfig(train=str(path), bad_rows="skip", cache_dir=str(tmp_path / "cache")), tok, seed=0, say=said.append)
    assert data.stats["train"]["samples"] == 2
    assert said == [f"data: skipped 3 bad row(s) of {path}; first: {path}:2: invalid JSON (Expecting value)"]


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
    assert _samples_of(first.train) == _samples_of(second.train)
    assert len(list((tmp_path / "cache" / "tokenized").glob("pack-*.npz"))) == 2  # train and eval layouts, reused
    # A change in settings is a different cache entry.
    third = load_data(cfg.model_copy(update={"train_on_prompt": True}), tok, seed=0)
    assert not third.stats["cache_hit"]


def test_a_cached_data_set_is_memory_mapped_not_held(tmp_path, tok):
    """20,000 rows from the cache: Arrow allocates nothing for the tokens (they stay in the mapped
    files); what the process holds is per sample (lengths, layout), not per token."""
    import pyarrow as pa

    words = (DEMO_DATA / "corpus.jsonl").read_text().split()[:5000]
    rows = [{"instruction": "Repeat.", "output": " ".join(words[i % 4000 : i % 4000 + 40])} for i in range(20_000)]
    cfg = DataConfig(train=_alpaca(tmp_path / "big.jsonl", rows), max_seq_len=256, cache_dir=str(tmp_path / "cache"), num_proc=1)
    load_data(cfg, tok, seed=0)
    before = pa.total_allocated_bytes()
    data = load_data(cfg, tok, seed=0)
    assert data.stats["cache_hit"] and data.stats["train"]["tokens"] > 1_000_000
    assert pa.total_allocated_bytes() - before < 2**20
    assert isinstance(data.train.order, np.ndarray) and isinstance(data.train.samples, np.ndarray)
    assert data.train.batch([0, 1], tok.pad_token_id)["input_ids"].shape[1] <= 256


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


def test_folders_and_gzipped_files_read_as_datasets_finds_them(tmp_path, tok):
    """A hub snapshot's folder (data/train-*-of-*.parquet, data/test-*, a README): each split's shards
    in order, as datasets.load_dataset reads them; a folder of .jsonl.gz files (all train), its bad
    line named by file and line; a save_to_disk DatasetDict; the cache sees a shard added."""
    import gzip

    import datasets

    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(9)]
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    (hub / "README.md").write_text("# a dataset card\n")
    for name, part in (("train-00000-of-00002", rows[:4]), ("train-00001-of-00002", rows[4:7]), ("test-00000-of-00001", rows[7:])):
        datasets.Dataset.from_list(part).to_parquet(str(hub / "data" / f"{name}.parquet"))
    assert read_rows([str(hub)], "alpaca", "fail") == rows[:7] == list(datasets.load_dataset(str(hub), split="train"))
    assert [row for _, row in checked_rows(str(hub), "alpaca", "fail", Skipped(), "test")] == rows[7:]
    with pytest.raises(UserError, match=r"hub: no files of split 'validation' in this folder \(it has train, test\)"):
        list(checked_rows(str(hub), "alpaca", "fail", Skipped(), "validation"))

    shards = tmp_path / "shards"
    (shards / "more").mkdir(parents=True)
    for name, part in (("a.jsonl.gz", rows[:5]), ("more/b.jsonl.gz", rows[5:])):
        with gzip.open(shards / name, "wt") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in part))
    assert read_rows([str(shards)], "alpaca", "fail") == rows
    cfg = DataConfig(train=str(shards), eval=[{"path": str(hub), "split": "test"}], format="alpaca", max_seq_len=64, packing=False,
                     cache_dir=str(tmp_path / "cache"))
    data = load_data(cfg, tok, seed=0)
    assert len(data.train) == 9 and len(data.eval) == 2
    with gzip.open(shards / "more" / "c.jsonl.gz", "wt") as fh:
        fh.write(json.dumps(rows[0]) + "\n" + '{"instruction": "q"}\n')
    with pytest.raises(UserError, match=rf"{shards / 'more' / 'c.jsonl.gz'}:2: missing field 'output'"):
        load_data(cfg, tok, seed=0)  # a new shard: tokenized anew, not the cached entry
    (shards / "more" / "c.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(UserError, match=r"c.jsonl.gz: not a readable gzip file"):
        read_rows([str(shards)], "alpaca", "fail")
    (shards / "more" / "c.jsonl.gz").unlink()
    (shards / "notes.txt").write_text("a line\n")
    with pytest.raises(UserError, match=r"shards: holds data files of 2 kinds \(.jsonl, .txt\)"):
        read_rows([str(shards)], "alpaca", "fail")

    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:6]), "test": datasets.Dataset.from_list(rows[6:])}).save_to_disk(
        str(tmp_path / "saved"))
    assert read_rows([str(tmp_path / "saved")], "alpaca", "fail") == rows[:6]
    with pytest.raises(UserError, match=r"saved: no split 'dev' in this dataset \(it has train, test\)"):
        list(checked_rows(str(tmp_path / "saved"), "alpaca", "fail", Skipped(), "dev"))


def test_eval_fraction_holds_out_a_seeded_share(tmp_path, tok):
    total = 60
    path = _alpaca(tmp_path / "rows.jsonl", [{"instruction": f"word {i}", "output": f"answer {i}"} for i in range(total)])
    cfg = DataConfig(train=path, eval_fraction=0.1, format="alpaca", max_seq_len=128, packing=False, cache_dir=str(tmp_path / "cache"))
    data = load_data(cfg, tok, seed=3, eval_examples=100)
    assert len(data.eval) == int(total * 0.1) and len(data.train) == total - len(data.eval)
    assert len(data.eval_examples) == len(data.eval)
    held = _samples_of(data.eval)
    assert not set(held) & set(_samples_of(data.train))  # nothing held out is trained on
    assert {r["output"] for r in data.eval_examples} == {tok.decode([t for t, l in zip(*s) if l != -100]).removesuffix("</s>") for s in held}
    assert _samples_of(load_data(cfg, tok, seed=3).eval) == held and _samples_of(load_data(cfg, tok, seed=4).eval) != held


def test_mixing_sources_by_weight_and_naming_a_bad_one(tmp_path, tok):
    """data.train as sources with their own format and weight: 2 repeats every sample, 0.5 takes a
    seeded half; the summary counts each; a bad row names its own source and line."""
    a = _alpaca(tmp_path / "a.jsonl", [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(10)])
    b = _alpaca(tmp_path / "b.jsonl", [{"text": f"plain text number {i}"} for i in range(40)])
    cfg = DataConfig(train=[{"path": a, "weight": 2}, {"path": b, "format": "completion", "weight": 0.5}], max_seq_len=64, packing=False,
                     cache_dir=str(tmp_path / "cache"))
    data = load_data(cfg, tok, seed=0)
    assert [s["samples"] for s in data.stats["train"]["sources"]] == [20, 20] and len(data.train) == 40
    again = load_data(cfg, tok, seed=0)
    assert _samples_of(again.train) == _samples_of(data.train)  # the half is seeded
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    with pytest.raises(UserError, match=rf"{tmp_path / 'b.jsonl'}:2: missing field 'text'"):
        load_data(cfg, tok, seed=0)
    skip = DataConfig(**{**cfg.model_dump(), "train": [{"path": a, "weight": 2}, {"path": b, "format": "completion", "bad_rows": "skip"}]})
    assert load_data(skip, tok, seed=0).stats["train"]["sources"][1]["samples"] == 1


def test_unreadable_inputs_fail_with_one_line(tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(UserError, match="dir.jsonl: no data files"):
        read_rows([str(tmp_path / "dir.jsonl")], "alpaca", "fail")
    (tmp_path / "bytes.jsonl").write_bytes(b'{"instruction": "a", "output": "b"}\n\xff\xfe{"x": 1}\n')
    with pytest.raises(UserError, match=r"bytes.jsonl:2: not UTF-8 text"):
        read_rows([str(tmp_path / "bytes.jsonl")], "alpaca", "fail")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(UserError, match="junk.parquet: not a readable Parquet file"):
        read_rows([str(tmp_path / "junk.parquet")], "alpaca", "fail")


TOKENIZE = """
import sys, time
from transformers import AutoTokenizer
from finetune.config.schema import DataConfig
from finetune.data.datasets import load_data
tok = AutoTokenizer.from_pretrained(sys.argv[1])
data = load_data(DataConfig(train=sys.argv[2], cache_dir=sys.argv[3], max_seq_len=128), tok, seed=0)
print("HIT" if data.stats["cache_hit"] else "WROTE", data.stats["train"]["tokens"])
"""


def test_two_processes_on_a_node_tokenize_once(tmp_path, demo_tokenizer_dir):
    """Started together, one process tokenizes; the other says it waits, then maps the same files."""
    rows = [{"instruction": f"question {i}", "output": " ".join(["answer"] * (i % 50 + 1))} for i in range(30_000)]
    path = _alpaca(tmp_path / "d.jsonl", rows)
    procs = [subprocess.Popen([sys.executable, "-c", TOKENIZE, str(demo_tokenizer_dir), path, str(tmp_path / "cache")], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    results = sorted(out.strip().splitlines()[-1].split()[0] for out in outs)
    assert results == ["HIT", "WROTE"], outs
    assert len({out.strip().splitlines()[-1].split()[1] for out in outs}) == 1
    assert sum("another process is tokenizing" in out for out in outs) == 1
    assert sum("tokenizing " in out and "examples" in out for out in outs) == 1  # one progress bar: one tokenization


def test_data_command_tokenizes_as_train_does_and_marks_the_trained_tokens(tmp_path, tiny_model_dir, capsys):
    """`finetune data`: train's counts, the first sequences with exactly the trained tokens «marked»,
    and the cache filled, so that the run's data step is a cache hit."""
    from conftest import write_config

    from finetune.cli import main
    from finetune.config.schema import validate_config
    from finetune.model.loading import load_tokenizer

    rows = [{"instruction": "Name the kind of word.", "input": w, "output": k} for w, k in (("rabbit", "noun"), ("small", "adjective"))] * 3
    cfg = base_config(tiny_model_dir, tmp_path / "out", data={"train": _alpaca(tmp_path / "rows.jsonl", rows), "eval": None,
                                                              "cache_dir": str(tmp_path / "cache")})
    path = write_config(tmp_path / "c.yaml", cfg)
    assert main(["data", "--config", str(path), "--show", "2"]) == 0
    out = capsys.readouterr().out
    assert "data: 6 samples -> 2 rows, 192 tokens" in out and "cache written" in out
    shown = out.split("--- sequence ")[1:]
    assert len(shown) == 2 and shown[0].startswith("1 of row 1")
    tok = load_tokenizer(validate_config(cfg, "test").model)
    for text in shown:
        body = text.split("---\n", 1)[1]
        row = next(r for r in rows if f"\n{r['input']}\n" in body.split("«")[0])  # packed in a shuffled order
        sample = tokenize_row(row, tok, "alpaca", train_on_prompt=False)
        trained = [i for i, label in zip(sample["input_ids"], sample["labels"]) if label != IGNORE]
        assert body.count("«") == 1 and body.split("«")[1].split("»")[0] == tok.decode(trained) == f"{row['output']}</s>"
    assert main(["data", "--config", str(path), "--show", "0"]) == 0
    assert "cache hit" in capsys.readouterr().out
