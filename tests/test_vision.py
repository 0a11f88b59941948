"""Vision-language models: rows with pictures tokenized as the model's processor does, the loss and
gradients of the model's own forward, LoRA on the language model only, DDP = one process, kill -9 and
resume, bad picture rows in one line, merge and generate with a picture. Tiny LLaVAs (a CLIP and a SigLIP
tower), a Gemma 3, an Idefics3, a SmolVLM2, an Mllama, a Qwen2-VL and a Qwen2.5-VL with the demo tokenizer given each
family's picture tokens (finetune/model/tiny.py), and a released-shape Qwen2.5-VL with Qwen's own tokenizer (released.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEMO_DATA, REPO, finetune_in_process, killed_and_resumed, once, read_jsonl, step_rows, train_forked, train_strategy, write_config

from finetune.data.rows import IGNORE

QUESTION = "What shape is in the picture?"


def _rows(pictures: list[dict]) -> list[dict]:
    """Half TRL's content parts, half LLaVA/ShareGPT's <image> marker."""
    out = []
    for i, p in enumerate(pictures):
        if i % 2:
            out.append({"messages": [{"role": "user", "content": [{"type": "image", "path": f"img/{p['file']}"}, {"type": "text", "text": QUESTION}]},
                                     {"role": "assistant", "content": p["shape"]}]})
        else:
            out.append({"images": [f"img/{p['file']}"], "conversations": [{"from": "human", "value": f"<image>\n{QUESTION}"},
                                                                         {"from": "gpt", "value": p["shape"]}]})
    return out


@pytest.fixture(scope="session")
def picture_data(tmp_path_factory):
    """A JSONL of 48 picture rows (the pictures beside it, in img/)."""
    from finetune.demo import draw_pictures

    def build(folder):
        rows = _rows(draw_pictures(folder / "img", 48, seed=0))
        (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    return once(tmp_path_factory, "picture-data", build) / "train.jsonl"


@pytest.fixture(scope="session")
def llava(tmp_path_factory):
    """tower ("clip" or "siglip") -> a tiny LLaVA folder, built once."""
    from transformers import AutoTokenizer

    from finetune.model.tiny import build_tokenizer, build_vision_model

    def get(tower: str):
        def build(folder):
            if "-" in tower:  # a released family's tokenizer (npm, tests/released.py): clip-llama2 is LLaVA-1.5's own
                from released import tokenizer_dir

                kind, family = tower.split("-")
                build_vision_model(folder / "model", AutoTokenizer.from_pretrained(tokenizer_dir(family)), kind)
                return
            texts = [json.loads(line)["text"] for line in (DEMO_DATA / "corpus.jsonl").read_text().splitlines()[:400]]
            build_tokenizer(texts).save_pretrained(folder / "tok")
            build_vision_model(folder / "model", AutoTokenizer.from_pretrained(folder / "tok"), tower)

        return once(tmp_path_factory, f"llava-{tower}", build) / "model"

    return get


def _config(model_dir, rows, out, **changes) -> dict:
    cfg = {"model": {"name_or_path": str(model_dir), "dtype": "float32"},
           "adapter": {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.0},
           "data": {"train": str(rows), "format": "chat", "max_seq_len": 96, "packing": False, "eval_fraction": 0.0},
           "train": {"output_dir": str(out), "max_steps": 12, "micro_batch_size": 4, "lr": 1e-2, "warmup_steps": 0, "mixed_precision": "no"},
           "eval": {"on_start": False}, "logging": {"report_to": [], "progress_bar": False, "plot": False}}
    for key, values in changes.items():
        cfg.setdefault(key, {}).update(values)
    return cfg


LENGTHS = {"gemma4": (160, 320)}  # rows' lengths (one sample a row, packed): Gemma 4's smallest picture is 64 tokens


def _split(model_dir, data, tmp_path, packing=False):
    from finetune.config.schema import DataConfig, ModelConfig
    from finetune.data.datasets import load_data
    from finetune.model import vision
    from finetune.model.loading import load_tokenizer

    processor = vision.processor_for(ModelConfig(name_or_path=str(model_dir)))
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(model_dir)), processor)
    length = LENGTHS.get(json.loads((Path(model_dir) / "config.json").read_text())["model_type"], (96, 160))[packing]
    cfg = DataConfig(train=str(data), format="chat", max_seq_len=length, packing=packing, eval_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    return load_data(cfg, tokenizer, seed=0, processor=processor).train, processor, tokenizer


def _batch(model_dir, data, tmp_path, rows=(0, 1, 2)):
    """Our data step's batch of the first rows, and the processor's own tokens and pixels of the same rows."""
    split, processor, tokenizer = _split(model_dir, data, tmp_path)
    samples = [int(split.samples[split.order[r]]) for r in rows]
    return split.batch(list(rows), tokenizer.pad_token_id), processor, tokenizer, samples


# pixel_values rows a 56 x 56 picture takes: Idefics3's and SmolVLM2's 2 x 2 crops and the whole, Qwen-VL's 4 x 4 patches
PIXEL_ROWS = {"idefics3": 5, "smolvlm": 5, "qwen2_vl": 16, "qwen2_5_vl": 16, "qwen3_vl": 16, "qwen3_vl_moe": 16, "qwen3_5": 16, "qwen3_5_moe": 16}


def _pictures_in(batch, tower: str) -> float:
    """How many pictures a batch's pixel_values hold (Idefics3 and SmolVLM2 give them as (rows, crops, ...))."""
    pixels = batch["pixel_values"]
    rows = pixels.shape[:2].numel() if tower in ("idefics3", "smolvlm") else pixels.shape[0]
    return rows / PIXEL_ROWS.get(tower, 1)  # not a whole number where a picture is cut


def _tuned(model_dir):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    return _tuned_model(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32))


def _tuned_model(model):
    """The model with finetune's LoRA, its B not 0 (B = 0 would hide the adapter's gradients in A), its linear-attention layers
    run one packed sample at a time (Qwen3.5), as finetune's loader leaves a model."""
    from finetune.config.schema import AdapterConfig
    from finetune.model import mixers
    from finetune.model.loading import apply_adapter

    mixers.register(model)
    model = apply_adapter(model, AdapterConfig(r=8, dropout=0.0), False)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


# a picture's token, how many (clip-llama2: the CLIP LLaVA with Llama 2's released tokenizer)
TOWERS = {"clip": ("<image>", 16), "clip-llama2": ("<image>", 16), "siglip": ("<image>", 16), "gemma3": ("<image_soft_token>", 4),
          "idefics3": ("<image>", 20), "smolvlm": ("<image>", 20), "mllama": ("<|image|>", 1), "qwen2_vl": ("<|image_pad|>", 4),
          "qwen2_5_vl": ("<|image_pad|>", 4), "qwen3_vl": ("<|image_pad|>", 4), "qwen3_vl_moe": ("<|image_pad|>", 4), "qwen3_5": ("<|image_pad|>", 4),
          "qwen3_5_moe": ("<|image_pad|>", 4), "gemma4": ("<|image|>", 64), "llava_onevision": ("<image>", 36), "internvl": ("<IMG_CONTEXT>", 4),
          "mistral3": ("[IMG]", 4)}


@pytest.mark.parametrize("tower", sorted(TOWERS))
def test_picture_rows_tokenize_as_the_processor_and_train_only_the_answers(llava, picture_data, tmp_path, tower):
    from finetune.data.chat import render
    from finetune.data.images import decoded
    from finetune.data.rows import canonical

    model_dir = llava(tower)
    batch, processor, tokenizer, samples = _batch(model_dir, picture_data, tmp_path)
    lines = picture_data.read_text().splitlines()
    pictures = []
    for r, sample in enumerate(samples):
        row, problem = canonical(json.loads(lines[sample]), "chat")
        assert problem is None
        text = render(tokenizer, row["messages"])
        picture = decoded([(picture_data.parent / row["images"][0]).read_bytes()])
        theirs = processor(text=[text], images=picture, add_special_tokens=False)["input_ids"][0]
        n = len(theirs)
        assert batch["input_ids"][r, :n].tolist() == list(theirs)
        assert batch["attention_mask"][r].sum() == n
        trained = batch["input_ids"][r, :n][batch["labels"][r, :n] != IGNORE]
        text = row["messages"][-1]["content"]
        assert tokenizer.decode(trained.tolist()) == text + tokenizer.eos_token  # the answer and its end, never a picture or user token
        if tower != "clip-llama2":  # (sentencepiece spells a word alone with its leading space: "▁circle", not the answer's "circle")
            assert trained.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        pictures += picture
    shown = [[p] for p in pictures] if tower == "mllama" else pictures  # Mllama: each row's pictures its own
    expected = processor.image_processor(images=shown, return_tensors="pt")["pixel_values"]
    assert torch.equal(batch["pixel_values"], expected)
    token, count = TOWERS[tower]  # 56 x 56 pictures in 14-pixel patches (Gemma 3: pooled 2 x 2)
    assert int((batch["input_ids"] == tokenizer.convert_tokens_to_ids(token)).sum()) == count * len(samples)
    if tower == "gemma3":  # its pictures' tokens see each other both ways: the processor's token types, padding included
        assert torch.equal(batch["token_type_ids"], (batch["input_ids"] == tokenizer.convert_tokens_to_ids(token)).long())


@pytest.mark.parametrize("tower", sorted(TOWERS))
def test_loss_and_gradients_equal_the_models_own_forward(llava, picture_data, tmp_path, tower):
    """Our loss (the fused head on the language model's hidden states, only at trained positions) equals
    the model's own loss with labels (what TRL's SFTTrainer takes), and so do the LoRA gradients."""
    from finetune.model.vision import part_names
    from finetune.objectives.loss import fusable_parts, losses, picture_inputs, to_device

    model_dir = llava(tower)
    batch, *_ = _batch(model_dir, picture_data, tmp_path)
    model = _tuned(model_dir)
    frozen = tuple(f"{name}." for role, name in part_names(model).items() if role != "language")
    assert len(frozen) == 2 and not any(frozen[0] in n or frozen[1] in n for n, p in model.named_parameters() if p.requires_grad)
    assert fusable_parts(model) is not None  # the fused head on the language model's hidden states
    ours = losses(model, to_device(batch, "cpu")).tokens
    count = int((batch["labels"][:, 1:] != IGNORE).sum())
    (ours / count).backward()
    mine = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    theirs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **picture_inputs(batch), labels=batch["labels"]).loss
    theirs.backward()
    assert abs(ours.item() / count - theirs.item()) < 1e-5
    assert mine.keys() == {n for n, p in model.named_parameters() if p.grad is not None} and mine
    for name, grad in mine.items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tower", ["clip", "siglip", "idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                                   "qwen3_5_moe", "gemma4", "llava_onevision", "internvl", "mistral3"])
def test_packed_picture_rows_equal_one_sample_a_row(llava, picture_data, tmp_path, tower):
    """LLaVA packs: its language model keeps the samples of a packed row apart by their restarting positions,
    the pictures' features go to their tokens in order; loss and LoRA gradients equal the unpacked rows'. Qwen-VL's
    3-D positions restart with each sample too."""
    from finetune.objectives.loss import losses, to_device

    model_dir = llava(tower)
    packed, _, tokenizer = _split(model_dir, picture_data, tmp_path, packing=True)
    unpacked, *_ = _split(model_dir, picture_data, tmp_path / "unpacked")
    rows = [0, 1, 2]
    samples = [int(x) for r in rows for x in packed.samples[packed.order[packed.offsets[r] : packed.offsets[r + 1]]]]
    assert len(samples) >= 2 * len(rows)  # rows of several samples, each with its picture
    row_of = {int(x): i for i, x in enumerate(unpacked.samples)}
    model = _tuned(model_dir)
    results = []
    for split, which in ((packed, rows), (unpacked, [row_of[x] for x in samples])):
        batch = split.batch(which, tokenizer.pad_token_id)
        assert ("attention_mask" in batch) == (split is unpacked) and _pictures_in(batch, tower) == len(samples)
        model.zero_grad()
        loss = losses(model, to_device(batch, "cpu")).tokens
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (a, grads_a), (b, grads_b) = results
    assert abs(a - b) < 1e-5 * abs(b), (a, b)
    for name in grads_b:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-4, rtol=1e-4)
    if tower.startswith("qwen"):  # each sample's 3-D positions in the packed row are those the model gives it alone
        from finetune.model.attention import packed_positions

        together = packed_positions(model, packed.batch(rows[:1], tokenizer.pad_token_id))[1:, 0]
        first_row = samples[: int(packed.offsets[1] - packed.offsets[0])]
        starts = (together[0] == 0).nonzero().flatten().tolist()[: len(first_row)]
        for sample, start in zip(first_row, starts, strict=True):
            alone = unpacked.batch([row_of[sample]], tokenizer.pad_token_id)
            mine = model.get_base_model().model.get_rope_index(alone["input_ids"], alone["mm_token_type_ids"], alone["image_grid_thw"],
                                                                 attention_mask=alone["attention_mask"])[0][:, 0, : int(alone["attention_mask"].sum())]
            assert torch.equal(together[:, start : start + mine.shape[1]], mine)
            assert not torch.equal(mine[1], mine[2])  # a picture's tokens: rows and columns of its grid, not a text's one line


def test_mistral3_pictures_of_other_sizes_in_one_batch_give_each_its_own_features(llava):
    """Mistral 3 (Pixtral's tower) takes a batch's pictures padded to the largest, with each one's size: each picture's
    features in a batch of three sizes equal its features alone (its tower crops each to its size, attends within it)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from finetune.config.schema import ModelConfig
    from finetune.model import vision

    processor = vision.processor_for(ModelConfig(name_or_path=str(llava("mistral3"))))
    model = AutoModelForImageTextToText.from_pretrained(llava("mistral3")).eval()
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((56, 56), (30, 50), (50, 28))]

    def features(shown):
        inputs = processor.image_processor(images=shown, return_tensors="pt")
        with torch.no_grad():
            return model.get_image_features(pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"]).pooler_output

    together = features(pictures)
    assert [len(f) for f in together] == [4, 2, 2]
    for picture, mine in zip(pictures, together, strict=True):
        torch.testing.assert_close(features([picture])[0], mine, atol=1e-6, rtol=0)


@pytest.fixture(scope="session")
def vision_run(tmp_path_factory, llava, picture_data):
    """12 LoRA steps on the CLIP LLaVA, one process: (output folder, losses)."""
    def build(folder):
        cfg = _config(llava("clip"), picture_data, folder / "out")
        result = finetune_in_process("train", "--config", str(write_config(folder / "run.yaml", cfg)))
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]

    out = once(tmp_path_factory, "vision-run", build) / "out"
    return out, [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]


def test_lora_trains_the_language_model_and_loads_in_peft(vision_run, llava):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import LlavaForConditionalGeneration

    out, losses = vision_run
    assert losses[-1] < losses[0] - 0.5, losses
    keys = load_file(out / "adapter_model.safetensors").keys()
    assert keys and all(".language_model." in k for k in keys)
    assert (out / "processor_config.json").is_file()
    card = (out / "README.md").read_text()
    assert "pipeline_tag: image-text-to-text" in card and "its vision tower frozen, its projector frozen" in card
    base = LlavaForConditionalGeneration.from_pretrained(llava("clip"))
    tuned = PeftModel.from_pretrained(base, out)
    assert sum("lora_A" in n for n, _ in tuned.named_parameters()) == 2 * 7  # 2 layers x q k v o gate up down


# FSDP2 and ZeRO-3 carry what is vision-specific (the tower's place in the units, a load that draws from the generator); DDP
# over pictures runs below (Qwen2.5-VL packed), and DDP and ZeRO-2 over text in test_distributed.py.
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_two_processes_equal_one(tmp_path, llava, picture_data, vision_run, strategy):
    """FSDP2 (the tower in the root unit) and ZeRO-3 over 2 CPU processes (2 rows each) train as one process on 4 rows,
    12 steps: the guard's start and its step-0 checkpoint included (FSDP's once took a step of Adam's before the first;
    ZeRO-3's load once drew CLIP's class embedding from the generator the adapter's initial weights are drawn from next)."""
    _, one = vision_run
    sections = {k: v for k, v in _config(llava("clip"), picture_data, tmp_path).items() if k in ("model", "adapter", "data", "eval")}
    _, two, _ = train_strategy(tmp_path, strategy, llava("clip"), "lora", 2, strategy,
                               train={"max_steps": 12, "lr": 1e-2, "warmup_steps": 0, "mixed_precision": "no"}, **sections)
    assert len(two) == len(one)
    for a, b in zip(one, two):
        assert abs(a - b) < 1e-4 * max(1.0, abs(a)), (one, two)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_packed_qwen_vl_over_two_processes_equals_one(tmp_path, llava, picture_data, trained, strategy):
    """Qwen2.5-VL's packed rows (each sample's own 3-D positions) under torchrun, its processor built for pictures only in each
    process: 2 processes train as one (the one run both cases share), 8 steps (FSDP2: its tower a unit of its own)."""
    sections = {k: v for k, v in _config(llava("qwen2_5_vl"), picture_data, tmp_path).items() if k in ("model", "adapter", "eval")}
    data = {"train": str(picture_data), "format": "chat", "max_seq_len": 160, "packing": True, "eval_fraction": 0.0}
    train = {"max_steps": 8, "lr": 1e-2, "warmup_steps": 0, "mixed_precision": "no"}
    one = trained(llava("qwen2_5_vl"), "lora", train=train, data=data, **sections)[1]
    two = train_strategy(tmp_path, strategy, llava("qwen2_5_vl"), "lora", 2, strategy, train=train, data=data, **sections)[1]
    assert len(one) == len(two) == 8 and one[-1] < one[0] - 0.3, one
    for a, b in zip(one, two):
        assert abs(a - b) < 1e-4 * max(1.0, abs(a)), (one, two)


def test_kill_and_resume_gives_the_same_losses(tmp_path, llava, picture_data, vision_run):
    _, reference = vision_run
    cfg = write_config(tmp_path / "run.yaml", _config(llava("clip"), picture_data, tmp_path / "out"))
    killed = train_forked("--config", str(cfg), "--save-every", "4", env={"FINETUNE_FAULT": "kill@6"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = finetune_in_process("train", "--config", str(cfg))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r}
    assert [losses[s] for s in sorted(losses)] == reference


def test_merge_loads_in_transformers_and_generates_from_a_picture(tmp_path, vision_run, picture_data, llava):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from finetune.outputs.generate import answer_picture, as_trained, find_adapter

    out, _ = vision_run
    result = finetune_in_process("merge", "--adapter", str(out), "--out", str(tmp_path / "merged"))
    assert result.returncode == 0, result.stderr[-3000:]
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged").eval()
    processor = AutoProcessor.from_pretrained(tmp_path / "merged")
    picture = str(picture_data.parent / "img" / "00001.png")
    tuned = as_trained(find_adapter(str(out), None))
    answers = [answer_picture(m, processor, QUESTION, picture, max_new_tokens=4, stream=False) for m in (merged, tuned)]
    assert answers[0] == answers[1]
    report = json.loads((tmp_path / "merged" / "merge_report.json").read_text())
    assert report["check_pictures"] == 4 and report["passed"]  # the check ran the tower too
    from safetensors import safe_open  # shard by shard, under the base's own names (LLaVA's older ones, which transformers renames)

    names = [set(safe_open(folder / "model.safetensors", "pt").keys()) for folder in (tmp_path / "merged", llava("clip"))]
    assert report["by_shard"] and names[0] == names[1]
    from PIL import Image

    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                                         add_generation_prompt=True)
    batch = processor(text=[text], images=[Image.open(picture).convert("RGB")], add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, tuned(**batch).logits, atol=1e-4, rtol=1e-4)
    rows = tmp_path / "prompts.jsonl"
    rows.write_text(json.dumps({"prompt": QUESTION, "image": picture}) + "\n" + json.dumps({"prompt": "The"}) + "\n")
    answered = finetune_in_process("generate", "--model", str(tmp_path / "merged"), "--prompts", str(rows), "--max-new-tokens", "4")
    assert answered.returncode == 0, answered.stderr[-2000:]
    first = json.loads(answered.stdout.splitlines()[0])
    assert first["completion"] == answers[0]


@pytest.mark.parametrize(("tower", "language", "packing"), [("idefics3", ".text_model.", True), ("smolvlm", ".text_model.", True),
                                                           ("mllama", ".language_model.", False), ("mistral3", ".language_model.", True)])
def test_a_family_trains_merges_and_answers_a_picture(tmp_path, llava, picture_data, tower, language, packing):
    """Idefics3 (SmolVLM's first version) and SmolVLM2 (packed rows of pictures in 2 x 2 crops and the whole; SmolVLM2's
    processor for pictures only here, without torchvision), Mllama (one row a sample, its pictures cross-attended) and
    Mistral 3 (packed; Pixtral's processor imported without torchvision) end to end: LoRA on the language model only, merged into a folder transformers
    loads, which answers a picture as base + adapter does."""
    from transformers import AutoModelForImageTextToText

    from finetune.config.schema import ModelConfig
    from finetune.model import vision
    from finetune.outputs.generate import answer_picture, as_trained, find_adapter

    cfg = _config(llava(tower), picture_data, tmp_path / "out", data={"packing": packing, "max_seq_len": 160})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "run.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.search(r"48 samples -> (\d+) rows", result.stdout)
    assert rows and (int(rows.group(1)) <= 24 if packing else int(rows.group(1)) == 48), result.stdout[-2000:]  # packed: 2+ samples a row
    losses = [r["loss"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses
    from safetensors.torch import load_file

    assert all(language in k for k in load_file(tmp_path / "out" / "adapter_model.safetensors"))
    merged = finetune_in_process("merge", "--adapter", str(tmp_path / "out"), "--out", str(tmp_path / "merged"))
    assert merged.returncode == 0, merged.stderr[-3000:]
    report = json.loads((tmp_path / "merged" / "merge_report.json").read_text())
    assert report["check_pictures"] == 4 and report["passed"] and report["by_shard"]
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged").eval()
    processor = vision.processor_for(ModelConfig(name_or_path=str(tmp_path / "merged")))
    picture = str(picture_data.parent / "img" / "00001.png")
    tuned = as_trained(find_adapter(str(tmp_path / "out"), None))
    answers = [answer_picture(m, processor, QUESTION, picture, max_new_tokens=4, stream=False) for m in (model, tuned)]
    assert answers[0] == answers[1] and answers[0]


@pytest.mark.parametrize("name,processor_class", [("qwen2.5-vl-7b", "Qwen2_5_VLProcessor"), ("qwen3-vl-4b", "Qwen3VLProcessor")])
def test_a_released_qwen_vl_folder_plans_trains_merges_and_answers_a_picture(tmp_path, picture_data, name, processor_class):
    """Qwen2.5-VL and Qwen3-VL as released (their configs scaled down, Qwen's real tokenizer, the release's chat template and
    image processor settings; Qwen3-VL with its DeepStack features and tied head), one config through plan, train, merge and
    generate. Here without torchvision: the processor is built for pictures only, and saves as the family's (docs/vision.md).
    Only the answer and its end-of-turn train."""
    from released import build_vision

    from finetune.config.schema import ModelConfig
    from finetune.data.rows import canonical
    from finetune.model import vision

    model_dir = build_vision(name, tmp_path / "model")
    processor = vision.processor_for(ModelConfig(name_or_path=str(model_dir)))
    assert type(processor).__name__ == processor_class and not hasattr(processor, "video_processor")
    split, _, tokenizer = _split(model_dir, picture_data, tmp_path)
    batch = split.batch([0, 1], tokenizer.pad_token_id)
    lines = picture_data.read_text().splitlines()
    answers = [canonical(json.loads(lines[int(split.samples[split.order[r]])]), "chat")[0]["messages"][-1]["content"] for r in (0, 1)]
    assert [tokenizer.decode(row[labels != IGNORE]) for row, labels in zip(batch["input_ids"], batch["labels"])] == [a + "<|im_end|>" for a in answers]
    # 56 x 56 (Qwen3-VL: resized to 64 x 64): 4 x 4 patches, merged 2 x 2
    assert int((batch["input_ids"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum()) == 2 * 4
    config = write_config(tmp_path / "run.yaml", _config(model_dir, picture_data, tmp_path / "out"))
    planned = finetune_in_process("plan", "--config", str(config))
    assert planned.returncode == 0 and "vision tower + projector" in planned.stdout, planned.stderr[-2000:]
    result = finetune_in_process("train", "--config", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["loss"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses
    merged = finetune_in_process("merge", "--adapter", str(tmp_path / "out"), "--out", str(tmp_path / "merged"))
    assert merged.returncode == 0, merged.stderr[-3000:]
    report = json.loads((tmp_path / "merged" / "merge_report.json").read_text())
    assert report["check_pictures"] == 4 and report["passed"] and report["by_shard"]  # its weights under the release's names, as the base's
    saved = json.loads((tmp_path / "merged" / "processor_config.json").read_text())
    assert saved["processor_class"] == processor_class and (tmp_path / "merged" / "preprocessor_config.json").is_file()
    picture = str(picture_data.parent / "img" / "00001.png")
    answers = [finetune_in_process("generate", *source, "--image", picture, "--prompt", QUESTION, "--max-new-tokens", "4")
               for source in (("--model", str(tmp_path / "merged")), ("--adapter", str(tmp_path / "out")))]
    assert all(a.returncode == 0 for a in answers), answers[0].stderr[-2000:]
    assert answers[0].stdout == answers[1].stdout and answers[0].stdout.strip()


def test_gemma4_packs_trains_merges_and_answers_a_picture(tmp_path, llava, picture_data):
    """Gemma 4 (per-layer inputs; its processor, which also takes audio, built here for pictures only): packed rows of pictures
    train, the plan counts its tower at its most soft tokens (70, each pooled from 3 x 3 patches), the merge is checked on
    pictures, and the merged folder answers a picture as the adapter does."""
    model_dir = llava("gemma4")
    cfg = _config(model_dir, picture_data, tmp_path / "out", data={"packing": True, "max_seq_len": 320}, train={"max_steps": 8})
    config = str(write_config(tmp_path / "run.yaml", cfg))
    planned = finetune_in_process("plan", "--config", config)
    assert planned.returncode == 0 and "vision tower activations" in planned.stdout, planned.stderr[-2000:]
    result = finetune_in_process("train", "--config", config)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "packed rows" in result.stdout
    losses = [r["loss"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses
    merged = finetune_in_process("merge", "--adapter", str(tmp_path / "out"), "--out", str(tmp_path / "merged"))
    assert merged.returncode == 0, merged.stderr[-3000:]
    report = json.loads((tmp_path / "merged" / "merge_report.json").read_text())
    assert report["check_pictures"] == 4 and report["passed"]
    picture = str(picture_data.parent / "img" / "00001.png")
    answers = [finetune_in_process("generate", *source, "--image", picture, "--prompt", QUESTION, "--max-new-tokens", "4")
               for source in (("--model", str(tmp_path / "merged")), ("--adapter", str(tmp_path / "out")))]
    assert all(a.returncode == 0 for a in answers), answers[0].stderr[-2000:]
    assert answers[0].stdout == answers[1].stdout and answers[0].stdout.strip()


BAD = {
    "missing": (lambda row: {**row, "images": ["img/nope.png"]}, "image {}/img/nope.png: cannot be read (No such file or directory)"),
    "corrupt": (lambda row: {**row, "images": ["img/corrupt.png"]}, "image {}/img/corrupt.png: not a picture"),
    "count": (lambda row: {**row, "images": row["images"] * 2}, "1 image place(s) in the messages (<image> or image parts) but 2 image(s) in 'images'"),
    # a video to the picture-only path: as a content part (TRL), or LLaMA-Factory's videos field
    "video-part": (lambda row: {"messages": [{"role": "user", "content": [{"type": "video", "path": "img/clip.mp4"}, {"type": "text", "text": "What?"}]},
                                             {"role": "assistant", "content": "a circle"}]},
                   "messages[0].content: only text and image parts can be trained on (got video)"),
    "videos": (lambda row: {**row, "videos": ["img/clip.mp4"]}, "field 'videos': finetune trains vision-language models on pictures, not videos"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_picture_row_is_one_line_naming_its_line(tmp_path, llava, picture_data, kind):
    shutil.copytree(picture_data.parent / "img", tmp_path / "img")
    (tmp_path / "img" / "corrupt.png").write_bytes((tmp_path / "img" / "00000.png").read_bytes()[:40])
    rows = [json.loads(line) for line in picture_data.read_text().splitlines()[:8]]
    change, message = BAD[kind]
    rows[4] = change(rows[4])
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write_config(tmp_path / "run.yaml", _config(llava("clip"), data, tmp_path / "out", data={"cache_dir": str(tmp_path / "cache")}))
    result = finetune_in_process("train", "--config", str(cfg))
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert f"{data}:5" in line and message.format(tmp_path).split(" (")[0] in line, line
    skipped = finetune_in_process("train", "--config", str(cfg), "--set", "data.bad_rows=skip", "--set", "train.max_steps=1",
                                  "--set", f"train.output_dir={tmp_path / 'skip'}")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert "skipped 1 bad row(s)" in skipped.stdout


def test_what_vision_models_do_not_do_yet_is_refused_in_one_line(tmp_path, llava, picture_data):
    other = tmp_path / "paligemma"  # a family not built (PaliGemma): its config is enough to refuse it
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "paligemma", "vision_config": {}, "text_config": {}}))
    both_ways = shutil.copytree(llava("gemma4"), tmp_path / "gemma4")  # its pictures' tokens see each other both ways: not packed
    config = json.loads((both_ways / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "vision"
    (both_ways / "config.json").write_text(json.dumps(config))
    for change, key in [({"model": {"name_or_path": str(other)}}, "model: paligemma is a vision-language model finetune does not fine-tune yet"),
                        ({"data": {"packing": True}, "model": {"name_or_path": str(llava("gemma3"))}}, "data.packing"),
                        ({"data": {"packing": True}, "model": {"name_or_path": str(both_ways)}}, "data.packing: gemma4's rows with pictures"),
                        ({"train": {"objective": "kto"}, "data": {"format": "unpaired"}}, "train.objective"),
                        ({"train": {"objective": "dpo"}, "data": {"format": "preference"}, "model": {"name_or_path": str(llava("gemma3"))}},
                         "train.objective"),
                        ({"train": {"objective": "grpo"}, "data": {"format": "prompt"}, "model": {"name_or_path": str(llava("gemma3"))}},
                         "train.objective: grpo lays a group's completions in one row"),
                        ({"train": {"objective": "grpo"}, "data": {"format": "prompt"}, "grpo": {"environment": "env.py:Env"}},
                         "grpo.environment: episodes with a vision-language model"),
                        ({"distributed": {"sequence_parallel": 2}}, "distributed.sequence_parallel"),
                        ({"distributed": {"strategy": "zero3"}, "model": {"quantization": {"bits": 4}}}, "model.quantization")]:
        cfg = _config(llava("clip"), picture_data, tmp_path / "out")
        for section, values in change.items():
            cfg.setdefault(section, {}).update(values)
        result = finetune_in_process("validate", "--config", str(write_config(tmp_path / "c.yaml", cfg)))
        assert result.returncode == 2 and f"error: {key}" in result.stderr.strip().splitlines()[-1], result.stderr[-1000:]


def test_a_llava_exports_to_gguf_with_a_projector_file_that_llama_cpp_reads(tmp_path, llava, picture_data):
    """LLaVA with a SigLIP tower and Llama 3's tokenizer (npm), trained 4 steps with LoRA, exported: the language model as GGUF
    read by llama.cpp itself (its tokens, and its logits within q8_0's bound), the tower and projector as llama.cpp's clip file
    (mmproj-NAME), which llama.cpp's multimodal library (mtmd, built by make test) loads and encodes a picture with: its
    embeddings within 1e-3 of the model's own (f32 beside a q8_0 language model), header as llama.cpp's tools read it."""
    model_dir = llava("siglip-llama3")
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "run.yaml", _config(model_dir, picture_data, tmp_path / "out",
                                                                                                   train={"max_steps": 4}))))
    assert result.returncode == 0, result.stderr[-2000:]
    out = tmp_path / "gguf" / "m.gguf"
    out.parent.mkdir()
    result = finetune_in_process("export", "--adapter", str(tmp_path / "out"), "--out", str(out), "--type", "q8_0")
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(p.name for p in out.parent.iterdir()) == ["Modelfile", "m.gguf", "mmproj-m.gguf"]
    said = result.stdout
    text = next(line for line in said.splitlines() if line.startswith("GGUF (q8_0) in llama.cpp itself"))
    assert float(text.split("logits within max ")[1].split()[0]) < 5e-2, text  # q8_0's bound in tests/test_export.py
    line = next(line for line in said.splitlines() if line.startswith("projector file"))
    assert "(f32) in llama.cpp itself (mtmd)" in line and float(line.split("embeddings within ")[1].split()[0]) < 1e-3, line
    from gguf import GGUFReader  # the projector file is small: gguf's own reader

    read = GGUFReader(out.parent / "mmproj-m.gguf")
    fields = {name: field.contents() for name, field in read.fields.items()}
    assert fields["general.architecture"] == "clip" and fields["clip.projector_type"] == "mlp" and fields["clip.has_vision_encoder"]
    assert fields["clip.vision.feature_layer"] == [2] and {"mm.0.weight", "mm.2.weight", "v.blk.1.ffn_down.weight"} <= {t.name for t in read.tensors}


def test_a_gemma3_exports_to_gguf_with_a_projector_file_that_llama_cpp_reads(tmp_path, llava):
    """Gemma 3 with its released tokenizer (npm), exported in f16: the language model read by llama.cpp itself, the tower
    and projector as llama.cpp's gemma3 clip file (the tower's post-layernorm, the patches pooled 2 x 2 where the releases
    pool 4 x 4, the soft-embedding norm's 1 + weight), whose embeddings of a picture in llama.cpp's mtmd are the model's."""
    out = tmp_path / "m.gguf"
    read, fields = _exported(llava("gemma3-gemma3"), out)
    assert fields["clip.projector_type"] == "gemma3" and fields["clip.vision.projector.scale_factor"] == 2
    assert {"mm.input_projection.weight", "mm.soft_emb_norm.weight", "v.post_ln.weight"} <= {t.name for t in read.tensors}
    # The same file with its position embedding in f16 makes llama.cpp abort (a GGML assertion ends its process): the
    # check, which runs llama.cpp in a child process, says so in one line and this process lives on.
    import torch
    from transformers import AutoModelForImageTextToText

    from finetune.config.errors import EXIT_MERGE_CHECK, Stopped
    from finetune.config.schema import ModelConfig
    from finetune.model import vision
    from finetune.outputs import mmproj

    _with_f16_positions(read, tmp_path / "bad.gguf")
    model = AutoModelForImageTextToText.from_pretrained(llava("gemma3-gemma3"), dtype=torch.float32).eval()
    processor = vision.load_processor(ModelConfig(name_or_path=str(llava("gemma3-gemma3"))), "gemma3")
    with pytest.raises(Stopped, match=r"^GGUF check failed: llama.cpp stopped on the projector file bad.gguf \(binary-ops.cpp:\d+: "
                                      r"binary_op: unsupported types") as stopped:
        mmproj.check(model, processor, out, tmp_path / "bad.gguf", mmproj._picture(56))
    assert stopped.value.exit_code == EXIT_MERGE_CHECK


def test_a_gemma4_exports_to_gguf_with_a_projector_file_that_llama_cpp_reads(tmp_path):
    """Gemma 4 with Gemma 3's tokenizer (npm; npm ships none of Gemma 4's), exported in f16. Its language model as
    llama.cpp's gemma4, read by llama.cpp itself within 3e-2: experts beside the dense MLP, per-layer inputs, the last two
    layers reading earlier layers' keys and values, full layers with heads of 32 and one key/value head whose keys are its
    values (attention_k_eq_v, as 31B), soft-capped logits. Its attention does not scale the unit-RMS queries and keys,
    which sharpens the softmax: ggml's own rounding comes out 3-5x Gemma 3's (f32 weights: 1.6e-2 on the longest check
    text; 1.7e-3 with the q/k norms' weights at 0.3), enough to swap a random model's near-tied greedy tokens. Its tower
    and projector as llama.cpp's gemma4v clip file, with the clipped linears' bounds (drawn to 0.05, so that they clip)
    and the standardization's bias and scale (drawn): a 480 x 336 picture's embeddings (10 x 7 tokens: the processor's
    most at its smallest setting, llama.cpp's fewest) in llama.cpp's mtmd within 1e-2 of the model's (without the
    standardization's tensors, 0.40)."""
    import torch
    from gguf import GGUFReader
    from gguf_header import read_header
    from released import tokenizer_dir
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from finetune.model.tiny import build_vision_model

    language = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2, global_head_dim=32,
                    attention_k_eq_v=True, num_global_key_value_heads=1, final_logit_softcapping=30.0, enable_moe_block=True, num_experts=4,
                    top_k_experts=2, moe_intermediate_size=32)
    model_dir = build_vision_model(tmp_path / "model", AutoTokenizer.from_pretrained(tokenizer_dir("gemma3")), "gemma4", language=language)
    config = json.loads((model_dir / "config.json").read_text())
    config["vision_config"].update(use_clipped_linears=True, standardize=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith(("_min", "_max")):
                buffer.fill_(0.05 if name.endswith("_max") else -0.05)
            elif "std_" in name:
                buffer.normal_(0.5, 0.2)
        for name, weight in model.named_parameters():
            if name.endswith("router.proj.weight"):  # routers' margins wide: f16's rounding then picks the experts f32 does
                weight.mul_(20)
    model.save_pretrained(model_dir)
    out = tmp_path / "gguf" / "m.gguf"
    out.parent.mkdir()
    result = finetune_in_process("export", "--model", str(model_dir), "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    text = next(line for line in result.stdout.splitlines() if "in llama.cpp itself" in line)
    assert "the same token ids as transformers on 15 strings" in text and float(text.split("logits within max ")[1].split()[0]) < 3e-2, text
    line = next(line for line in result.stdout.splitlines() if line.startswith("projector file"))
    assert "(f16) in llama.cpp itself (mtmd)" in line and float(line.split("embeddings within ")[1].split()[0]) < 1e-2, line
    fields = read_header(out)[0]  # the text file's header alone: gguf's reader decodes its 262k tokens (14 s)
    assert fields["general.architecture"] == "gemma4" and fields["gemma4.attention.key_length"] == 32
    assert fields["gemma4.attention.key_length_swa"] == 16 and fields["gemma4.attention.head_count_kv"] == [2, 1, 2, 1]
    assert fields["gemma4.attention.shared_kv_layers"] == 2 and fields["gemma4.expert_count"] == 4
    projector = GGUFReader(out.with_name("mmproj-m.gguf"))
    assert projector.fields["clip.projector_type"].contents() == "gemma4v"
    assert {"v.std_bias", "v.std_scale", "v.blk.1.attn_q.input_max", "mm.input_projection.weight"} <= {t.name for t in projector.tensors}


# family -> (llama.cpp's projector type, the projector file's scale factor, tensors it holds)
CROP_EXPORTS = {"idefics3": ("idefics3", 2, {"mm.model.fc.weight", "v.post_ln.weight", "v.blk.1.ffn_down.weight"}),
                "smolvlm": ("idefics3", 2, {"mm.model.fc.weight", "v.post_ln.weight", "v.blk.1.ffn_down.weight"}),
                "internvl": ("internvl", 2, {"v.class_embd", "v.blk.1.ls1.weight", "mm.model.mlp.0.weight", "mm.model.mlp.3.weight"})}


@pytest.mark.parametrize("family", list(CROP_EXPORTS))
def test_a_one_crop_family_exports_to_gguf_with_a_projector_file_that_llama_cpp_reads(tmp_path, llava, family):
    """Idefics3, SmolVLM2 and InternVL with Llama 3's tokenizer (npm) exported in f16: the language model read by llama.cpp
    itself, the tower and projector as llama.cpp's idefics3 clip file (the tower's post-layernorm, the patches shuffled
    scale_factor x scale_factor into one token, one matrix) or internvl (a class token kept in f32, layer scales, a norm
    and two matrices after the shuffle), whose embeddings of a picture the tower's size in llama.cpp's mtmd are the
    model's features of that picture as one crop. An InternVL handing on another layer than its last is refused."""
    read, fields = _exported(llava(f"{family}-llama3"), tmp_path / "m.gguf")
    projector, scale, tensors = CROP_EXPORTS[family]
    assert fields["clip.projector_type"] == projector and fields["clip.vision.projector.scale_factor"] == scale
    assert tensors <= {t.name for t in read.tensors}
    if family == "internvl":  # a tower layer other than the last handed on: refused in one line, nothing written
        import json
        import shutil

        shutil.copytree(llava(f"{family}-llama3"), tmp_path / "other")
        config = json.loads((tmp_path / "other" / "config.json").read_text())
        (tmp_path / "other" / "config.json").write_text(json.dumps({**config, "vision_feature_layer": -2}))
        result = finetune_in_process("export", "--model", str(tmp_path / "other"), "--out", str(tmp_path / "other.gguf"))
        assert result.returncode == 2 and "hands on a layer other than its last" in result.stderr.splitlines()[-1], result.stderr[-500:]
        assert not (tmp_path / "other.gguf").exists()


# family -> (llama.cpp's projector type, its language model's architecture, tensors its projector file holds)
QWEN_EXPORTS = {"qwen2_vl": ("qwen2vl_merger", "qwen2vl", {"v.blk.1.attn_q.weight", "mm.2.weight"}),
                "qwen2_5_vl": ("qwen2.5vl_merger", "qwen2vl", {"v.blk.1.attn_q.weight", "v.blk.1.ffn_gate.weight", "mm.2.weight"}),
                "qwen3_vl": ("qwen3vl_merger", "qwen3vl", {"v.blk.1.attn_qkv.weight", "v.position_embd.weight", "v.deepstack.0.fc1.weight"}),
                "qwen3_vl_moe": ("qwen3vl_merger", "qwen3vlmoe", {"v.blk.1.attn_qkv.weight", "v.deepstack.0.fc2.weight"}),
                "qwen3_5_moe": ("qwen3vl_merger", "qwen35moe", {"v.blk.1.attn_qkv.weight", "v.position_embd.weight", "mm.2.weight"})}


@pytest.mark.parametrize("family", list(QWEN_EXPORTS))
def test_a_qwen_vl_exports_to_gguf_with_a_projector_file_that_llama_cpp_reads(tmp_path, llava, family):
    """Qwen2-VL, Qwen2.5-VL (the releases' 112-pixel windows, every second layer over the whole picture), Qwen3-VL,
    Qwen3-VL-MoE (DeepStack: a tower layer's features handed on beside the picture's; learned positions interpolated) and
    Qwen3.5-MoE (Qwen3-VL's tower without DeepStack; Gated DeltaNet layers and experts in its language model) with
    Llama 3's tokenizer (npm), a q8_0 language model and an f32 projector file: the language model as llama.cpp's qwen2vl,
    qwen3vl, qwen3vlmoe or qwen35moe (its rotary sections: time, height, width) read by llama.cpp itself; the tower as llama.cpp's
    clip file (the 3-D patch embedding as its two frames), whose embeddings of a picture of 8 x 8 patches (4 x 4 tokens)
    in llama.cpp's mtmd, DeepStack's beside them, are the model's within 1e-3. A Qwen2.5-VL tower with other windows is
    refused in one line, nothing written."""
    import json
    import shutil

    from gguf_header import read_header

    model_dir = tmp_path / "model"
    shutil.copytree(llava(f"{family}-llama3"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if family == "qwen2_5_vl":  # the tiny tower's 56-pixel windows (tests/test_vision.py's packing) are not the releases'
        config["vision_config"]["window_size"] = 112
        (model_dir / "config.json").write_text(json.dumps(config))
    read, fields = _exported(model_dir, tmp_path / "gguf" / "m.gguf", "q8_0")
    projector, arch, tensors = QWEN_EXPORTS[family]
    assert fields["clip.projector_type"] == projector and {"v.patch_embd.weight", "v.patch_embd.weight.1"} | tensors <= {t.name for t in read.tensors}
    text = read_header(tmp_path / "gguf" / "m.gguf")[0]  # the header alone: gguf's reader decodes every token
    assert text["general.architecture"] == arch and text[f"{arch}.rope.dimension_sections"] == [2, 3, 3, 0]
    if family in ("qwen3_vl", "qwen3_vl_moe"):
        assert text[f"{arch}.n_deepstack_layers"] == 1 and fields["clip.vision.is_deepstack_layers"] == [True, False]
    if family == "qwen2_5_vl":
        config["vision_config"]["window_size"] = 56
        (model_dir / "config.json").write_text(json.dumps(config))
        result = finetune_in_process("export", "--model", str(model_dir), "--out", str(tmp_path / "other.gguf"))
        assert result.returncode == 2 and "56-pixel windows; llama.cpp's qwen2.5vl graph within the releases' 112" in result.stderr.splitlines()[-1]
        assert not (tmp_path / "other.gguf").exists()


def test_a_mistral3_exports_to_gguf_with_a_projector_file_that_llama_cpp_reads(tmp_path, llava):
    """Mistral 3 (Pixtral's tower) with Llama 3's tokenizer (npm), a q8_0 language model and an f32 projector file: the tower
    and projector as llama.cpp's pixtral clip file (RMS norms, SiLU-gated MLPs, 2-D rotary positions with the queries' and
    keys' rows in llama.cpp's order, the projector's norm and 2 x 2 patch merger, the `[IMG_BREAK]` token's embedding),
    whose embeddings of a 112-pixel picture (4 rows of 4 tokens, a break after each row but the last) in llama.cpp's mtmd are
    the model's within 1e-3. The tower's queries and keys are drawn 40x larger, so that attention is sharp enough for the
    positions to count (the rows in transformers' order came out 1.8e-3). A tower with another rotary base is refused in one line."""

    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(llava("mistral3-llama3"))
    with torch.no_grad():
        for name, weight in model.model.vision_tower.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                weight.mul_(40)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "chat_template.jinja"):
        shutil.copy(llava("mistral3-llama3") / name, model_dir)
    read, fields = _exported(model_dir, tmp_path / "gguf" / "m.gguf", "q8_0")
    assert fields["clip.projector_type"] == "pixtral" and fields["clip.vision.spatial_merge_size"] == 2 and fields["clip.use_silu"]
    assert {"v.token_embd.img_break", "mm.patch_merger.weight", "mm.input_norm.weight", "mm.2.weight", "v.blk.1.attn_q.weight"} <= \
        {t.name for t in read.tensors}
    config = json.loads((model_dir / "config.json").read_text())
    config["vision_config"]["rope_parameters"]["rope_theta"] = 1e6
    (model_dir / "config.json").write_text(json.dumps(config))
    result = finetune_in_process("export", "--model", str(model_dir), "--out", str(tmp_path / "other.gguf"))
    assert result.returncode == 2 and "rotary base is 1e+06; llama.cpp's pixtral graph takes the releases' 10000" in result.stderr.splitlines()[-1]
    assert not (tmp_path / "other.gguf").exists()


def _exported(model_dir, out, kind: str = "f16"):
    """`finetune export` of a vision-language model to `out` (`kind`: its language model's type): the projector file (f16
    beside f16, else f32) checked in llama.cpp's mtmd within 1e-2 (f16) or 1e-3 (f32); its reader (gguf's own: the file is
    small) and header fields."""
    from gguf import GGUFReader

    out.parent.mkdir(exist_ok=True)
    result = finetune_in_process("export", "--model", str(model_dir), "--out", str(out), "--type", kind)
    assert result.returncode == 0, result.stderr[-2000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("projector file"))
    projector = "f16" if kind == "f16" else "f32"
    bound = {"f16": 1e-2, "f32": 1e-3}[projector]
    assert f"({projector}) in llama.cpp itself (mtmd)" in line and float(line.split("embeddings within ")[1].split()[0]) < bound, line
    read = GGUFReader(out.with_name(f"mmproj-{out.name}"))
    return read, {name: field.contents() for name, field in read.fields.items()}


def _with_f16_positions(read, path):
    """A copy of the projector file `read` (gguf's reader) with its position embedding in f16."""
    import numpy as np
    from gguf import GGUFValueType, GGUFWriter

    writer = GGUFWriter(str(path), "clip")
    for name, field in read.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            kind = field.types[0]
            writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    for tensor in read.tensors:
        data = np.array(tensor.data)
        writer.add_tensor(tensor.name, data.astype(np.float16) if ".position_embd." in tensor.name else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_export_refuses_what_it_does_not_write_in_one_line(tmp_path, vision_run, llava):
    """A CLIP tower's LLaVA (llama.cpp hands its class token on in place of the first patch), a LLaVA-OneVision and a Mllama (llama.cpp
    reads no Mllama projector) are not exported: one line each, exit 2, nothing written."""
    out, _ = vision_run
    for args, key in [(("export", "--adapter", str(out), "--out", str(tmp_path / "m.gguf")), "--format gguf: its vision tower is CLIP's"),
                      (("export", "--model", str(llava("llava_onevision")), "--out", str(tmp_path / "m.gguf")),
                       "--format gguf: llama.cpp's converter writes no LLaVA-OneVision projector"),
                      (("export", "--model", str(llava("mllama")), "--out", str(tmp_path / "m.gguf")),
                       "--format gguf: llama.cpp's multimodal library reads no Mllama projector")]:
        result = finetune_in_process(*args)
        assert result.returncode == 2 and key in result.stderr.strip().splitlines()[-1], result.stderr[-1000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_eval_asks_the_harness_about_pictures_and_it_answers_as_generate_does(tmp_path, vision_run, picture_data, tiny_model_dir):
    """finetune eval on the LoRA run, the shipped task file (demo/eval/picture_shape.yaml) over rows that name their pictures as
    training rows do: lm-evaluation-harness's hf-multimodal model with finetune's processor gives, for each picture, the answer
    `finetune generate --image` gives (greedy; with the harness's own encoding, a second BOS before the template's, 2 of 6
    differed). A log-likelihood task, pictures to a text model and a picture that does not read: one line each, exit 2."""
    from finetune.outputs.generate import answer_picture, load, processor_of

    out, _ = vision_run
    (tmp_path / "vision" / "data").mkdir(parents=True)
    (tmp_path / "vision" / "data" / "img").symlink_to(picture_data.parent / "img")
    pictures = sorted(p.name for p in (picture_data.parent / "img").iterdir())[:6]
    rows = [{"images": [f"img/{name}"], "messages": [{"role": "user", "content": f"<image>\n{QUESTION}"}, {"role": "assistant", "content": "circle"}]}
            for name in pictures]
    (tmp_path / "vision" / "data" / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval").mkdir()
    task = tmp_path / "eval" / "picture_shape.yaml"
    task.write_text((REPO / "demo" / "eval" / "picture_shape.yaml").read_text())
    result = finetune_in_process("eval", "--adapter", str(out), "--tasks", str(task), "--batch-size", "4", "--out", str(tmp_path / "r.json"),
                                 "--log-samples")
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "r.json").read_text())
    answers = {s["doc_id"]: s["answer"][0] for s in record["samples"]["finetune_picture_shape"]}
    model, _ = load(None, str(out))
    processor = processor_of(None, str(out))
    ours = {i: answer_picture(model, processor, f"\n{QUESTION}", str(picture_data.parent / "img" / name), max_new_tokens=8, stream=False)
            for i, name in enumerate(pictures)}
    assert answers == {i: a.split("\n")[0] for i, a in ours.items()}
    assert record["results"]["finetune_picture_shape"]["exact_match"] == sum(a == "circle" for a in answers.values()) / 6

    def refused(*args) -> str:
        result = finetune_in_process("eval", *args, "--out", str(tmp_path / "bad.json"))
        assert result.returncode == 2 and not (tmp_path / "bad.json").exists(), result.stderr[-2000:]
        return result.stderr.strip().splitlines()[-1]

    choice = tmp_path / "eval" / "choice.yaml"
    choice.write_text(task.read_text().replace("output_type: generate_until", "output_type: multiple_choice"))
    assert "is output_type multiple_choice; a vision-language model runs through lm-evaluation-harness's hf-multimodal" in refused(
        "--adapter", str(out), "--tasks", str(choice))
    assert "finetune_picture_shape shows pictures (doc_to_image); llama is a text model" in refused("--model", str(tiny_model_dir), "--tasks", str(task))
    (tmp_path / "vision" / "data" / "eval.jsonl").write_text(json.dumps({**rows[0], "images": ["img/gone.png"]}) + "\n")
    assert f"--tasks: {task}: image " in (line := refused("--adapter", str(out), "--tasks", str(task))) and "gone.png: cannot be read" in line


@pytest.mark.parametrize(("name", "published"), [("qwen2.5-vl-7b", 8_292_166_656), ("llava-1.5-7b", 7_063_427_072)])
def test_plan_counts_a_released_vision_models_tower(tmp_path, picture_data, name, published):
    """The plan's parameters equal the released model's published count (the tower and projector counted
    apart from the language model), LoRA's trainable count is the language model's, and the tower's rows
    follow model.processor's picture size."""
    from finetune.config.schema import RunConfig
    from finetune.outputs import plan
    from finetune.outputs import shape as shapes

    config = {"model": {"name_or_path": str(REPO / "docs" / "examples" / name), "dtype": "bfloat16"}, "adapter": {"method": "lora", "r": 16},
              "data": {"train": str(picture_data), "format": "chat", "max_seq_len": 2048, "packing": False},
              "train": {"output_dir": str(tmp_path / "out"), "micro_batch_size": 1, "gradient_checkpointing": True}}
    made = plan.make_plan(RunConfig.model_validate(config))
    assert made.total_params == published
    shape = shapes.read_shape(config["model"]["name_or_path"])
    language = published - shape.vision.params
    assert made.trainable == plan.trainable_params(shape, RunConfig.model_validate(config)) and made.trainable < language * 0.01
    assert made.rows["vision tower + projector"] == shape.vision.params * 2
    if name.startswith("qwen"):  # Qwen-VL resizes pictures up to max_pixels: 4x the pixels, 4x the tower's values
        small = plan.make_plan(RunConfig.model_validate({**config, "model": {**config["model"], "processor": {"max_pixels": 200704}}}))
        large = plan.make_plan(RunConfig.model_validate({**config, "model": {**config["model"], "processor": {"max_pixels": 802816}}}))
        assert large.rows["vision tower activations"] == 4 * small.rows["vision tower activations"]


def test_the_vision_demo_builds_and_its_config_trains_on_it(tmp_path):
    """make-vision-demo (briefly pretrained here) and configs/vision.yaml on it: the shipped path of `make demo-vision`."""
    built = finetune_in_process("make-vision-demo", "--out", str(tmp_path / "vision"), "--steps", "20")
    assert built.returncode == 0, built.stderr[-2000:]
    data = tmp_path / "vision" / "data"
    assert len((data / "captions.jsonl").read_text().splitlines()) == 5800 and len((data / "eval.jsonl").read_text().splitlines()) == 200
    result = finetune_in_process("train", "--config", str(REPO / "configs" / "vision.yaml"), "--set", f"model.name_or_path={tmp_path / 'vision' / 'model'}",
                                 "--set", f"data.train={data / 'train.jsonl'}", "--set", f"data.eval={data / 'eval.jsonl'}",
                                 "--set", "eval.generate_samples=8", "--set", "train.max_steps=6", "--set", f"train.output_dir={tmp_path / 'out'}",
                                 "--set", "logging.progress_bar=false")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "exact match on 8 eval prompts:" in result.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "exact_match_after" in summary and summary["steps"] == 6


def test_openai_image_url_parts_and_parquet_bytes_read_as_paths_do(tmp_path, picture_data):
    """The same picture as a path, an OpenAI data URI and a Parquet binary column: the same bytes reach the cache."""
    import base64

    import pyarrow as pa
    import pyarrow.parquet as pq

    from finetune.data.images import read
    from finetune.data.readers import Skipped, checked_rows

    picture = picture_data.parent / "img" / "00000.png"
    uri = "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode()
    answer = {"role": "assistant", "content": "a shape"}
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "path": str(picture)}, {"type": "text", "text": QUESTION}]}, answer]},
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": QUESTION}]}, answer]}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.table({"images": [[{"bytes": picture.read_bytes(), "path": None}]],
                             "messages": [[{"role": "user", "content": f"<image>{QUESTION}"}, answer]]}), tmp_path / "rows.parquet")
    read_back = [row for name in ("rows.jsonl", "rows.parquet") for _, row in checked_rows(str(tmp_path / name), "chat", "fail", Skipped())]
    assert [read(row["images"])[0] for row in read_back] == [[picture.read_bytes()]] * 3
    assert all(m["content"][0] == {"type": "image"} for m in (row["messages"][0] for row in read_back))


@pytest.mark.parametrize("tower", ["clip", "qwen2_5_vl", "idefics3"])
def test_qlora_quantizes_the_language_model_and_keeps_the_tower(tmp_path, llava, picture_data, tower):
    """bitsandbytes' 4-bit base: the language model's 14 linear layers (2 x 7) quantized, the tower and projector kept in
    model.dtype, bf16 (LLaVA, Qwen2.5-VL, whose merger is inside its tower, and Idefics3); 8 steps train."""
    import bitsandbytes as bnb

    from finetune.config.schema import ModelConfig
    from finetune.model import vision
    from finetune.model.loading import load_model

    model = load_model(ModelConfig(name_or_path=str(llava(tower)), dtype="bfloat16", quantization={"bits": 4}))
    parts = vision.part_names(model)
    quantized = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 14 and all(n.startswith(parts["language"] + ".") for n in quantized)
    kept = [p for role in ("tower", "projector") for p in model.get_submodule(parts[role]).parameters()]
    assert kept and all(p.dtype == torch.bfloat16 for p in kept)
    cfg = _config(llava(tower), picture_data, tmp_path / "out", model={"dtype": "bfloat16", "quantization": {"bits": 4}},
                  train={"mixed_precision": "bf16", "max_steps": 8})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "q.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-2000:]
    losses = [r["loss"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < losses[0] - 0.3, losses


def test_a_saved_dataset_with_image_features_reads_its_pictures_bytes(tmp_path, picture_data):
    """`datasets`' Image feature (a save_to_disk folder, as a hub dataset gives it): its stored bytes reach the row."""
    import datasets

    from finetune.data.images import read
    from finetune.data.readers import Skipped, checked_rows

    picture = picture_data.parent / "img" / "00000.png"
    features = datasets.Features({"images": datasets.List(datasets.Image()),
                                  "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")})})
    rows = {"images": [[str(picture)]], "messages": [[{"role": "user", "content": f"<image>{QUESTION}"}, {"role": "assistant", "content": "a"}]]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "saved"))
    (row,) = [row for _, row in checked_rows(str(tmp_path / "saved"), "chat", "fail", Skipped())]
    assert read(row["images"])[0] == [picture.read_bytes()]


@pytest.fixture(scope="session")
def picture_pairs(tmp_path_factory, picture_data):
    """Preference pairs about the pictures, as TRL's vision DPO rows: the prompt shows the picture, the right shape is chosen."""
    def build(folder):
        from finetune.demo import SHAPES, draw_pictures

        rows = [{"images": [f"img/{p['file']}"], "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                 "chosen": [{"role": "assistant", "content": p["shape"]}],
                 "rejected": [{"role": "assistant", "content": SHAPES[(SHAPES.index(p["shape"]) + 1) % len(SHAPES)]}]}
                for p in draw_pictures(folder / "img", 32, seed=2)]
        (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    return once(tmp_path_factory, "picture-pairs", build) / "pairs.jsonl"


@pytest.mark.parametrize("tower", ["clip", "idefics3", "qwen2_5_vl"])
def test_a_pairs_sequences_each_show_the_prompts_picture(llava, picture_pairs, tmp_path, tower):
    """A preference pair with a picture (LLaVA, Idefics3, Qwen2.5-VL): both sequences in one row, apart by their positions, each with the
    picture; each answer's summed log-probability equals the model's own on that sequence alone, from its processor."""
    from finetune.config.schema import DataConfig, ModelConfig
    from finetune.data.chat import render
    from finetune.data.datasets import load_data
    from finetune.data.images import decoded
    from finetune.data.rows import canonical
    from finetune.model import vision
    from finetune.model.loading import load_tokenizer
    from finetune.objectives.loss import to_device, trained_mask
    from finetune.objectives.objective import token_logps

    model_dir = llava(tower)
    processor = vision.processor_for(ModelConfig(name_or_path=str(model_dir)))
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(model_dir)), processor)
    cfg = DataConfig(train=str(picture_pairs), format="preference", max_seq_len=160, packing=False, eval_fraction=0.0, cache_dir=str(tmp_path))
    split = load_data(cfg, tokenizer, seed=0, processor=processor).train
    batch = split.batch([0, 1], tokenizer.pad_token_id)
    assert "attention_mask" not in batch and _pictures_in(batch, tower) == 4  # two pairs, the picture in each of their four sequences
    model = _tuned(model_dir).eval()
    keep = trained_mask(batch["labels"])
    with torch.no_grad():
        token, _ = token_logps(model, to_device(batch, "cpu"), keep)
    starts = (batch["position_ids"] == 0).long().cumsum(1) - 1  # which sequence of its row each position is in
    ours = torch.zeros(4).index_add(0, (torch.arange(2)[:, None] * 2 + starts)[keep], token)
    lines = picture_pairs.read_text().splitlines()
    theirs = []
    for r in range(2):
        row, _ = canonical(json.loads(lines[int(split.samples[r])]), "preference")
        shown = decoded([(picture_pairs.parent / json.loads(lines[int(split.samples[r])])["images"][0]).read_bytes()])
        prompt = processor(text=[render(tokenizer, row["prompt"], add_generation_prompt=True)], images=shown, add_special_tokens=False)["input_ids"][0]
        for side in ("chosen", "rejected"):
            inputs = processor(text=[render(tokenizer, row["prompt"] + row[side])], images=shown, add_special_tokens=False, return_tensors="pt")
            with torch.no_grad():
                logps = torch.log_softmax(model(**inputs).logits[0].float(), -1)
            ids = inputs["input_ids"][0]
            theirs.append(sum(logps[t - 1, ids[t]].item() for t in range(len(prompt), len(ids))))
    torch.testing.assert_close(ours, torch.tensor(theirs), atol=1e-4, rtol=1e-5)


def test_dpo_on_pictures_prefers_the_chosen_answers(tmp_path, llava, picture_pairs):
    cfg = _config(llava("clip"), picture_pairs, tmp_path / "out", data={"format": "preference"},
                  train={"objective": "dpo", "overfit_batch": 8})  # the same 4 pairs, 8 steps
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "dpo.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-2000:]
    steps = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert steps[0]["loss"] == pytest.approx(0.6931, abs=1e-3) and steps[-1]["loss"] < 0.6  # log 2 at the start, the adapter being B = 0
    assert steps[-1]["reward_margin"] > 0


# -- GRPO on prompts with pictures -------------------------------------------------------------

def _picture_prompts(model_dir, picture_data):
    """Two prompts that each show a picture, as the data step tokenizes them; (prompts, tokenizer, vision)."""
    import functools

    from finetune.data import images
    from finetune.data.chat import render
    from finetune.data.packing import Prompt

    _, processor, tokenizer = _split(model_dir, picture_data, picture_data.parent / "cache-prompts")
    prompts = []
    for i in range(2):
        shown = [(picture_data.parent / "img" / f"{i:05d}.png").read_bytes()]
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        ids = images.encoder(processor, shown)(render(tokenizer, messages, add_generation_prompt=True))
        prompts.append(Prompt(np.array(ids), {"prompt": messages}, i, shown))
    return prompts, tokenizer, functools.partial(images.image_inputs, processor)


@pytest.mark.parametrize("beta", [0.0, 0.2])
def test_grpo_on_pictures_equals_trls_loss(tmp_path, llava, picture_data, beta):
    """Completions of prompts with pictures, laid out as our rollout lays them (a prompt's completions packed in one row, each
    showing the prompt's picture): loss and LoRA gradients equal TRL's GRPOTrainer._compute_loss on the same batch (its
    prompts left-padded, completions right-padded, a picture a sequence)."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    from finetune.config.schema import GRPOConfig
    from finetune.data.packing import collate
    from finetune.objectives.grpo import GRPO, group_row
    from finetune.objectives.loss import to_device
    from finetune.objectives.rewards import Reward

    model_dir = llava("clip")
    prompts, tokenizer, vision = _picture_prompts(model_dir, picture_data)
    completions = [[9, 10, 11, tokenizer.eos_token_id], [12, 13], [14, 15, 16], [17, tokenizer.eos_token_id]]
    advantages = torch.tensor([0.9, -0.9, -0.5, 0.5])
    cfg = GRPOConfig(beta=beta, loss_type="dapo", max_completion_length=4, num_generations=2)
    model = _tuned(model_dir)
    rows = [group_row([([*p.ids.tolist(), *c], [False] * len(p.ids) + [True] * len(c)) for c in completions[2 * i : 2 * i + 2]],
                      torch.zeros(2, 1), torch.zeros(2), cfg)[0] for i, p in enumerate(prompts)]
    batch = collate(rows, tokenizer.pad_token_id)
    batch.update(vision([b for p in prompts for _ in range(2) for b in p.pictures], batch["input_ids"]))
    batch.update(advantages=advantages, rewards=torch.zeros(4, 1), reward=torch.zeros(4), reward_std=torch.zeros(4), zero_std=torch.zeros(4))
    assert batch["pixel_values"].shape[0] == 4  # each completion shows its prompt's picture
    objective = GRPO(cfg, [Reward("r", "reward_r", 1.0, None)], seed=0, vision=vision)
    totals = objective.counts(batch)
    ours = objective.losses(model, to_device(batch, "cpu"), totals).tokens / totals[0]
    ours.backward()
    mine = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    args = TRLConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=2, max_completion_length=4, beta=beta,
                     loss_type="dapo", report_to=[], use_cpu=True, bf16=False)
    processor = vision.args[0]
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=args,
                          train_dataset=Dataset.from_list([{"prompt": "a"}] * 4), processing_class=processor)
    trainer.current_gradient_accumulation_steps = 1
    width = max(len(p.ids) for p in prompts)
    left = [[tokenizer.pad_token_id] * (width - len(p.ids)) + p.ids.tolist() for p in prompts for _ in range(2)]
    prompt_mask = torch.tensor([[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in prompts for _ in range(2)])
    completion_ids = torch.tensor([c + [tokenizer.pad_token_id] * (4 - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (4 - len(c)) for c in completions])
    pixels = vision([b for p in prompts for _ in range(2) for b in p.pictures], torch.tensor(left))["pixel_values"]
    inputs = {"prompt_ids": torch.tensor(left), "prompt_mask": prompt_mask, "completion_ids": completion_ids, "completion_mask": completion_mask,
              "advantages": advantages, "num_items_in_batch": completion_mask.sum(), "pixel_values": pixels, "num_images": [1, 1, 1, 1]}
    if beta:
        with torch.no_grad(), model.disable_adapter():
            inputs["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
                model, torch.cat([inputs["prompt_ids"], completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), 4,
                pixel_values=pixels, num_images=[1, 1, 1, 1])
    model.train()
    theirs = trainer._compute_loss(model, inputs)
    theirs.backward()
    assert abs(ours.item() - theirs.item()) < 1e-5 and abs(theirs.item()) > 1e-3, (ours.item(), theirs.item())
    assert mine.keys() == {n for n, p in model.named_parameters() if p.grad is not None} and mine
    for name, grad in mine.items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tower", ["clip", "qwen2_5_vl"])
def test_grpo_samples_each_prompt_with_its_picture(llava, picture_data, tower):
    """The rollout's `generate` call sees each prompt's picture: greedy completions of two prompts together equal the
    model's own `generate` on each prompt alone from its processor; a rollout's training batch shows each completion its
    prompt's picture (num_generations copies, in order)."""
    from finetune.config.schema import GRPOConfig
    from finetune.data import images
    from finetune.objectives.grpo import GRPO
    from finetune.objectives.rewards import load_rewards
    from finetune.objectives.sampling import generate

    model_dir = llava(tower)
    prompts, tokenizer, vision = _picture_prompts(model_dir, picture_data)
    model = _tuned(model_dir).eval()
    cfg = GRPOConfig(num_generations=3, max_completion_length=6, rewards=["length"])
    objective = GRPO(cfg, load_rewards(cfg), seed=0, vision=vision, placeholders=tuple(images.placeholders(vision.args[0])))
    together = generate(model, tokenizer, [p.ids for p in prompts], 6, "cpu", picture_inputs=objective._picture_inputs([p.pictures for p in prompts]))
    for prompt, completion in zip(prompts, together):
        alone = {"input_ids": torch.tensor([prompt.ids]), **vision(prompt.pictures, torch.tensor([prompt.ids]))}
        with torch.no_grad():
            out = model.generate(**alone, do_sample=False, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id)[0, len(prompt.ids) :].tolist()
        assert completion == out[: len(completion)] and len(completion) > 1
    blind = generate(model, tokenizer, [p.ids for p in prompts], 6, "cpu")  # without the pictures, other completions
    assert blind != together
    batches, _ = objective._sampled(model, tokenizer, [prompts], position=0, device="cpu", old_logps=False)
    shown = [b for p in prompts for _ in range(3) for b in p.pictures]
    torch.testing.assert_close(batches[0]["pixel_values"], vision(shown, batches[0]["input_ids"])["pixel_values"], rtol=0, atol=0)
    per = PIXEL_ROWS.get(tower, 1)
    assert not torch.equal(batches[0]["pixel_values"][:per], batches[0]["pixel_values"][3 * per : 4 * per])  # the second prompt's picture


def test_grpo_on_pictures_resumes_bitwise_after_kill_9(tmp_path, llava, picture_data):
    """A GRPO run on prompts with pictures (the next step's sampled ahead in the background: its pixels in the checkpoint),
    killed with SIGKILL at step 3 and resumed from step 2's checkpoint, repeats every step's loss, reward and lengths."""
    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"images": [str(picture_data.parent / "img" / f"{i:05d}.png")], "answer": "circle",
                                        "prompt": [{"role": "user", "content": f"<image>\n{QUESTION}"}]}) + "\n" for i in range(12)))
    cfg = _config(llava("clip"), rows, tmp_path / "reference", data={"format": "prompt"},
                  train={"objective": "grpo", "max_steps": 4, "micro_batch_size": 2, "lr": 5e-3})
    parity = tmp_path / "parity.py"  # a reward random completions score unevenly on
    parity.write_text("def even(completion_ids, **_):\n    return [float(sum(ids) % 2 == 0) for ids in completion_ids]\n")
    cfg["grpo"] = {"num_generations": 4, "max_completion_length": 4, "rewards": [f"{parity}:even"], "beta": 0.1, "async_rollouts": True}
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "reference.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    keys = ("loss", "grad_norm", "reward", "completion_length", "kl")
    expected = [[r[k] for k in keys] for r in step_rows(tmp_path / "reference")]
    assert len(expected) == 4 and len({tuple(e) for e in expected}) == 4 and all(e[0] != 0 for e in expected)
    _, steps = killed_and_resumed(tmp_path, cfg, save_every=2, kill_at=3)
    assert [[r[k] for k in keys] for r in steps] == expected  # bitwise


def test_prompt_rows_with_pictures_read_in_both_shapes(tmp_path, llava, picture_data):
    """GRPO's prompt rows: image parts (no `images` field) and `<image>` markers with `images` both give the prompt the
    processor's picture tokens and keep the picture's bytes for sampling; a text-only prompt keeps none."""
    from finetune.config.schema import DataConfig, ModelConfig
    from finetune.data.datasets import load_data
    from finetune.model import vision
    from finetune.model.loading import load_tokenizer

    picture = picture_data.parent / "img" / "00002.png"
    rows = tmp_path / "prompts.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": [{"role": "user", "content": [{"type": "image", "path": str(picture)}, {"type": "text", "text": QUESTION}]}], "answer": "a"},
        {"images": [str(picture)], "prompt": [{"role": "user", "content": f"<image>{QUESTION}"}], "answer": "b"},
        {"prompt": [{"role": "user", "content": QUESTION}], "answer": "c"}]) + "\n")
    model_dir = llava("clip")
    processor = vision.processor_for(ModelConfig(name_or_path=str(model_dir)))
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(model_dir)), processor)
    split = load_data(DataConfig(train=str(rows), format="prompt", max_seq_len=96, eval_fraction=0.0, cache_dir=str(tmp_path / "cache")),
                      tokenizer, seed=0, processor=processor).train
    prompts = {p.row["answer"]: p for p in split.prompts(range(len(split)))}
    image = tokenizer.convert_tokens_to_ids("<image>")
    for answer in ("a", "b"):
        assert int((prompts[answer].ids == image).sum()) == 16 and prompts[answer].pictures == [picture.read_bytes()]
    assert prompts["a"].ids.tolist() == prompts["b"].ids.tolist()
    assert int((prompts["c"].ids == image).sum()) == 0 and prompts["c"].pictures == []


def test_dpo_on_pictures_equals_trls_loss(tmp_path, llava, picture_pairs):
    """DPO on 4 pairs that show pictures (LLaVA): loss and LoRA gradients equal TRL's DPOTrainer with the model's processor
    on the same pairs, the reference the adapter off in both. The template here ends an answer at its end-of-turn token:
    TRL also trains the text a template writes after it (the demo template's newline), finetune only what it marks."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from peft import LoraConfig
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import DPOConfig, DPOTrainer

    from finetune.config.schema import DataConfig, ModelConfig, PreferenceConfig
    from finetune.data.datasets import load_data
    from finetune.model import vision
    from finetune.model.loading import load_tokenizer
    from finetune.model.tiny import VISION_TEMPLATE
    from finetune.objectives.loss import to_device
    from finetune.objectives.objective import Preference

    model_dir = tmp_path / "model"
    shutil.copytree(llava("clip"), model_dir)
    processor = AutoProcessor.from_pretrained(model_dir)
    template = VISION_TEMPLATE.replace("{{ '\n' }}{% endfor %}", "{% if m['role'] != 'assistant' %}{{ '\n' }}{% endif %}{% endfor %}")
    assert template != VISION_TEMPLATE
    processor.chat_template = processor.tokenizer.chat_template = template
    processor.save_pretrained(model_dir)
    rows = [json.loads(line) for line in picture_pairs.read_text().splitlines()[:4]]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({**r, "images": [str(picture_pairs.parent / r["images"][0])]}) + "\n" for r in rows))

    processor = vision.processor_for(ModelConfig(name_or_path=str(model_dir)))
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(model_dir)), processor)
    split = load_data(DataConfig(train=str(pairs), format="preference", max_seq_len=160, eval_fraction=0.0, cache_dir=str(tmp_path / "cache")),
                      tokenizer, seed=0, processor=processor).train
    batch = split.batch(range(len(split)), tokenizer.pad_token_id)
    ours = _tuned(model_dir).train()
    objective = Preference("dpo", PreferenceConfig(beta=0.1))
    counts = objective.counts(batch)
    assert counts[0] == 4
    loss = objective.losses(ours, to_device(batch, "cpu"), counts).tokens / counts[0]
    loss.backward()

    shown = [{**r, "images": [Image.open(picture_pairs.parent / r["images"][0]).convert("RGB")]} for r in rows]
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.1, per_device_train_batch_size=4, report_to=[], use_cpu=True, max_length=None, bf16=False)
    lora = LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)")
    trainer = DPOTrainer(model=AutoModelForImageTextToText.from_pretrained(model_dir), args=args, train_dataset=Dataset.from_list(shown),
                         processing_class=AutoProcessor.from_pretrained(model_dir), peft_config=lora)
    theirs_model, mine = trainer.model, dict(ours.named_parameters())
    with torch.no_grad():
        for name, p in theirs_model.named_parameters():
            if "lora_" in name:
                p.copy_(mine[name])
    theirs_model.train()
    theirs = trainer.compute_loss(theirs_model, trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    theirs.backward()
    assert abs(loss.item() - theirs.item()) < 1e-5, (loss.item(), theirs.item())
    grads = {n: p.grad for n, p in theirs_model.named_parameters() if p.grad is not None}
    assert grads.keys() == {n for n, p in ours.named_parameters() if p.grad is not None} and grads
    for name, p in ours.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[name], atol=1e-6, rtol=1e-4)
