"""Small models built from a config, for the demo, the tests and the benchmarks: the demo's near-character BPE
tokenizer and a Llama of a given shape, a byte-level BPE tokenizer of any vocabulary as released models have,
random weights of a model of any size written shard by shard, and random-weight vision-language models of
each family we claim (LLaVA with CLIP or SigLIP, Gemma 3, Idefics3/SmolVLM, Mllama, Qwen2-VL, Qwen2.5-VL)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

VOCAB_SIZE = 1024


SPECIAL = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]


# Newlines are written as {{ '\n' }}: transformers renders templates with trim_blocks, which eats a
# literal newline after a block tag.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ '\n' }}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ '\n' }}{% endif %}"
)


MODEL_SHAPE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def build_tokenizer(texts: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Spaces, newlines and punctuation are tokens of their own, so a word is the same token wherever
    # it stands (after a space, a newline or a role marker): copying a word is then an identity map,
    # which a model this small learns quickly.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\s|[^\w\s]"), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.Sequence(
        [processors.ByteLevel(trim_offsets=False), processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL[3:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )


def build_model(tokenizer, shape: dict | None = None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **(shape or MODEL_SHAPE),
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def student_shape(hidden_size: int, layers: int) -> dict:
    """A narrower demo model's shape (make demo-distill's student): the demo's proportions, 4 heads."""
    return dict(hidden_size=hidden_size, intermediate_size=hidden_size * 11 // 4, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2)


def byte_level_bpe(texts: list[str], vocab: int, fill: bool = True):
    """A byte-level BPE tokenizer as real models have (GPT-2's pre-tokenization: words merged into
    tokens, unlike the demo's near-character one) trained on `texts` for up to `vocab` entries. `fill`:
    where the texts have fewer merges to learn, the vocabulary is filled up to exactly `vocab` with
    reserved tokens no merge produces (as Llama 3 reserves some; as added tokens instead, 120k of them
    took transformers a minute to load). Adds <s> in front, as the demo tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    words = trained.get_vocab()
    words.update({f"<|reserved_{i}|>": i for i in range(len(words), vocab if fill else 0)})
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in json.loads(trained.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=words, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", words["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", additional_special_tokens=SPECIAL[3:],
                                   chat_template=CHAT_TEMPLATE, model_max_length=8192)


def write_random_model(out: Path, config, tokenizer, shard_bytes: int, say=print) -> Path:
    """A model of any size with random bf16 weights (std 0.02, norms 1), written tensor after tensor
    into safetensors shards of about `shard_bytes` with an index, then its config and tokenizer: never
    more than one shard in memory (an 8B model's 16 GB would not fit beside anything else). Written to
    a sibling folder and renamed into place when complete."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    config.dtype = "bfloat16"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is model.get_input_embeddings().weight
    # a tied head is left out: written apart with other values, transformers would load it untied
    names = [(name, tuple(p.shape)) for name, p in model.state_dict().items() if not (tied and name == "lm_head.weight")]
    shards, size = [[]], 0
    for name, shape in names:
        nbytes = 2 * torch.Size(shape).numel()
        if size and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    generator, weight_map, total = torch.Generator().manual_seed(0), {}, 0
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: torch.ones(shape, dtype=torch.bfloat16) if name.endswith("norm.weight")
                   else torch.randn(shape, generator=generator, dtype=torch.bfloat16).mul_(0.02) for name, shape in shard}
        save_file(tensors, partial / file, metadata={"format": "pt"})
        written = sum(t.numel() * 2 for t in tensors.values())
        total += written
        weight_map.update(dict.fromkeys(tensors, file))
        say(f"wrote {file} ({written / 1e9:.2f} GB)")
        del tensors
    (partial / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(partial)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    return out


# A vision-language test model: the demo tokenizer with LLaVA's `<image>` token, a template that writes
# it where a message shows a picture (generation markers around the answers), and a tiny LLaVA: a CLIP
# or SigLIP tower over `side` x `side` pictures (56: 16 patches, 16 `<image>` tokens each), a projector, a Llama.
IMAGE_TOKEN = "<image>"


VISION_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ '\n' }}"
    "{% if m['content'] is string %}{% set text = m['content'] %}{% else %}{% set text = namespace(s='') %}"
    "{% for p in m['content'] %}{% set text.s = text.s + ('<image>' if p['type'] == 'image' else p['text']) %}{% endfor %}"
    "{% set text = text.s %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ text }}{{ eos_token }}{% endgeneration %}{% else %}{{ text }}{% endif %}"
    "{{ '\n' }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{{ '\n' }}{% endif %}"
)


def build_vision_model(out: Path, tokenizer, tower: str = "clip", language: dict | None = None, seed: int = 0, side: int = 56) -> Path:
    """A random-weight LLaVA (tower "clip" or "siglip"), Gemma 3 ("gemma3"), Idefics3 ("idefics3"), SmolVLM2 ("smolvlm"), Mllama ("mllama"), Qwen2-VL
    ("qwen2_vl") or Qwen2.5-VL ("qwen2_5_vl") with `tokenizer` (given the
    family's picture tokens here) and its processor, saved to `out`."""
    import torch
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, SiglipImageProcessor

    if tower == "gemma3":
        return _gemma3(out, tokenizer, language, seed)
    if tower in ("idefics3", "smolvlm"):
        return _idefics3(out, tokenizer, language, seed, tower)
    if tower == "mllama":
        return _mllama(out, tokenizer, language, seed)
    if tower == "gemma4":
        return _gemma4(out, tokenizer, language, seed)
    if tower == "llava_onevision":
        return _llava_onevision(out, tokenizer, language, seed)
    if tower == "internvl":
        return _internvl(out, tokenizer, language, seed)
    if tower == "mistral3":
        return _mistral3(out, tokenizer, language, seed)
    if tower in QWEN_VISION:
        return _qwen_vl(out, tokenizer, tower, language, seed)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = VISION_TEMPLATE
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=side, patch_size=14)
    if tower == "clip":  # CLIP's class token is one more position, which LLaVA's "default" strategy drops
        vision, images = {**vision, "model_type": "clip_vision_model", "projection_dim": 32}, CLIPImageProcessor(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    else:
        vision, images = {**vision, "model_type": "siglip_vision_model"}, SiglipImageProcessor(size={"height": side, "width": side})
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = LlavaConfig(text_config={**text, **(language or {})}, vision_config=vision, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_select_strategy="default" if tower == "clip" else "full", vision_feature_layer=-1,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14, image_token=IMAGE_TOKEN, chat_template=VISION_TEMPLATE,
                               vision_feature_select_strategy=config.vision_feature_select_strategy, num_additional_image_tokens=int(tower == "clip"))
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def _with_named_tokens(tokenizer, named: dict[str, str]):
    """`tokenizer` given special tokens under the names a family's processor reads them by (tokenizer.image_token, ...):
    transformers takes such names only as it loads a tokenizer."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return AutoTokenizer.from_pretrained(tmp, extra_special_tokens=named)


def _gemma3(out: Path, tokenizer, language: dict | None, seed: int) -> Path:
    """Gemma 3's way: `<start_of_image>` in the text, which its processor widens to the picture's 4 soft
    tokens (2 x 2 pooled from 4 x 4 patches) between a begin and an end token."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor

    tokenizer = _with_named_tokens(tokenizer, {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    template = VISION_TEMPLATE.replace(IMAGE_TOKEN, "<start_of_image>")
    tokenizer.chat_template = template
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, query_pre_attn_scalar=16, sliding_window=32, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = Gemma3Config(text_config={**text, **(language or {})}, mm_tokens_per_image=4,
                          vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                                             patch_size=14),
                          boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id, image_token_index=tokenizer.image_token_id)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    # transformers starts the projection at zeros: every picture would reach the language model as nothing
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=config.vision_config.hidden_size ** -0.5)
    model.save_pretrained(out)
    Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": 56, "width": 56}), tokenizer=tokenizer, chat_template=template,
                    image_seq_length=4).save_pretrained(out)
    return out


def _idefics3(out: Path, tokenizer, language: dict | None, seed: int, family: str = "idefics3") -> Path:
    """Idefics3's (SmolVLM's) way: each `<image>` widened by its processor to the picture's crops, here a 2 x 2 grid
    of 56-pixel crops of the picture enlarged to 112 and the whole picture at 56, each crop 4 tokens (16 patches
    shuffled 2 x 2 into one) between its row/column tag and `<fake_token_around_image>`. SmolVLM2 ("smolvlm") is the
    same model with its own classes; its processor also takes videos (without torchvision, vision.load_processor
    builds it for pictures only, and so does this)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, Idefics3ImageProcessorPil, Idefics3Processor, SmolVLMProcessor
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    from finetune.model import vision

    tags = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"]
    tokenizer.add_special_tokens({"additional_special_tokens": tags + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]})
    tokenizer.chat_template = VISION_TEMPLATE
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = AutoConfig.for_model(family, text_config={**text, **(language or {})}, scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                                  vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                                                     patch_size=14))
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    sizes = dict(size={"longest_edge": 112}, max_image_size={"longest_edge": 56}, do_image_splitting=True)
    processor = Idefics3Processor if family == "idefics3" else (vision.pictures_only_class(family) or SmolVLMProcessor)
    images = (Idefics3ImageProcessorPil if family == "idefics3" else SmolVLMImageProcessorPil)(**sizes)
    processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4, chat_template=VISION_TEMPLATE).save_pretrained(out)
    return out


def _mllama(out: Path, tokenizer, language: dict | None, seed: int) -> Path:
    """Mllama's (Llama 3.2 Vision's) way: one `<|image|>` token a picture; the text attends to the picture's tiles (up to
    2 of 56 x 56 pixels here) through a cross-attention layer between its self-attention layers."""
    import torch
    from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaProcessor
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    tokenizer.add_special_tokens({"additional_special_tokens": ["<|image|>", "<|python_tag|>"]})
    template = VISION_TEMPLATE.replace(IMAGE_TOKEN, "<|image|>")
    tokenizer.chat_template = template
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                cross_attention_layers=[1], max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_global_layers=1, attention_heads=2, intermediate_size=64, vision_output_dim=64,
                  image_size=56, patch_size=14, max_num_tiles=2, intermediate_layers_indices=[0], supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    config = MllamaConfig(vision_config=vision, text_config={**text, **(language or {})}, image_token_index=tokenizer.convert_tokens_to_ids("<|image|>"))
    torch.manual_seed(seed)
    MllamaForConditionalGeneration(config).save_pretrained(out)
    images = MllamaImageProcessorPil(size={"height": 56, "width": 56}, max_image_tiles=2)
    MllamaProcessor(image_processor=images, tokenizer=tokenizer, chat_template=template).save_pretrained(out)
    return out


def _llava_onevision(out: Path, tokenizer, language: dict | None, seed: int) -> Path:
    """LLaVA-OneVision's way: `<image>` widened by its processor to the picture's features at the tower's size and at the best
    of its grid's resolutions (anyres), each row of the latter ended by a newline feature: a 56-pixel picture, 16 + 16 + 4
    tokens. A Qwen2 language model; its processor also takes videos (without torchvision, built for pictures only)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, LlavaOnevisionProcessor
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

    from finetune.model import vision

    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, "<video>"]})
    tokenizer.chat_template = VISION_TEMPLATE
    grid = [[56, 56], [56, 112], [112, 56], [112, 112]]
    text = dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = AutoConfig.for_model("llava_onevision", text_config={**text, **(language or {})}, image_grid_pinpoints=grid,
                                  vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                     num_attention_heads=2, image_size=56, patch_size=14),
                                  image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
                                  vision_feature_select_strategy="full", vision_feature_layer=-1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    images = LlavaOnevisionImageProcessorPil(size={"height": 56, "width": 56}, image_grid_pinpoints=grid)
    processor = vision.pictures_only_class("llava_onevision") or LlavaOnevisionProcessor
    processor(image_processor=images, tokenizer=tokenizer, num_image_tokens=16, vision_feature_select_strategy="full",
              chat_template=VISION_TEMPLATE).save_pretrained(out)
    return out


def _internvl(out: Path, tokenizer, language: dict | None, seed: int) -> Path:
    """InternVL's way: `<IMG_CONTEXT>` in the text, which its processor widens to each tile's tokens between `<img>` and
    `</img>` (a 56-pixel picture: one tile of 4 x 4 patches, shuffled 2 x 2 into 4 tokens). A Qwen2 language model; its
    processor also takes videos (without torchvision, built for pictures only)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, InternVLProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from finetune.model import vision

    marks = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
    tokenizer = _with_named_tokens(tokenizer, marks)
    template = VISION_TEMPLATE.replace(IMAGE_TOKEN, "<IMG_CONTEXT>")
    tokenizer.chat_template = template
    text = dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = AutoConfig.for_model("internvl", text_config={**text, **(language or {})}, image_token_id=tokenizer.context_image_token_id,
                                  image_seq_length=4, downsample_ratio=0.5, tie_word_embeddings=False,
                                  vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                                     image_size=[56, 56], patch_size=[14, 14]))
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    processor = vision.pictures_only_class("internvl") or InternVLProcessor
    processor(image_processor=GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}), tokenizer=tokenizer, image_seq_length=4,
              chat_template=template).save_pretrained(out)
    return out


def _mistral3(out: Path, tokenizer, language: dict | None, seed: int) -> Path:
    """Mistral 3's way (Pixtral's): `[IMG]` in the text, which its processor widens to the picture's rows of patches, 2 x 2 of
    14 pixels merged into one token, each row ended by `[IMG_BREAK]` and the last by `[IMG_END]` (a 56-pixel picture: 2 rows
    of 2; pictures up to 112 pixels, 16 tokens, at least the 8 llama.cpp's pixtral graph takes). A Mistral language model;
    its processor is built without torchvision as vision.load_processor builds it."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from finetune.model import vision

    tokenizer.add_special_tokens({"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]})
    template = VISION_TEMPLATE.replace(IMAGE_TOKEN, "[IMG]")
    tokenizer.chat_template = template
    text = dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = AutoConfig.for_model("mistral3", text_config={**text, **(language or {})}, spatial_merge_size=2, vision_feature_layer=-1,
                                  image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), tie_word_embeddings=False,
                                  vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                                                     image_size=112, patch_size=14, hidden_act="silu"))
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    processor = vision.pixtral_processor()
    processor(image_processor=PixtralImageProcessorPil(size={"longest_edge": 112}, patch_size=14), tokenizer=tokenizer, patch_size=14,
              spatial_merge_size=2, chat_template=template).save_pretrained(out)
    return out


def _gemma4(out: Path, tokenizer, language: dict | None, seed: int) -> Path:
    """Gemma 4's way: `<|image|>` in the text, which its processor widens to the picture's soft tokens between a begin and an
    end token: the picture resized to at most 70 x 9 patches of 16 pixels, pooled 3 x 3 (its smallest setting: 64 tokens for a
    square picture). Its language model with per-layer inputs, causal over pictures (use_bidirectional_attention unset); its
    processor also takes audio and videos (without torchvision, built for pictures only, as vision.load_processor does)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    from finetune.model import vision

    marks = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>", "boa_token": "<|audio>", "eoa_token": "<audio|>",
             "audio_token": "<|audio|>"}
    tokenizer = _with_named_tokens(tokenizer, marks)
    template = VISION_TEMPLATE.replace(IMAGE_TOKEN, "<|image|>")
    tokenizer.chat_template = template
    ids = {name: tokenizer.convert_tokens_to_ids(mark) for name, mark in marks.items()}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, sliding_window=32, layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=len(tokenizer), max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = AutoConfig.for_model("gemma4", text_config={**text, **(language or {})}, audio_config=None,
                                  vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                                     num_key_value_heads=2, head_dim=16, patch_size=16, pooling_kernel_size=3),
                                  boi_token_id=ids["boi_token"], eoi_token_id=ids["eoi_token"], image_token_id=ids["image_token"],
                                  boa_token_id=ids["boa_token"], eoa_token_index=ids["eoa_token"], audio_token_id=ids["audio_token"])
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    processor = vision.pictures_only_class("gemma4") or Gemma4Processor
    processor(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=Gemma4ImageProcessorPil(max_soft_tokens=70), tokenizer=tokenizer,
              chat_template=template, image_seq_length=70).save_pretrained(out)
    return out


# Qwen-VL's vision towers, tiny: 14-pixel patches (Qwen3-VL's 16), 2 x 2 of them merged into one token (a 56-pixel picture: 4
# tokens; Qwen3-VL's resized to 64 pixels). Qwen3-VL's tower hands its first layer's features on to the language model's first
# layer too (DeepStack), its learned position embeddings a 4 x 4 grid.
QWEN_VISION = {"qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14),
               "qwen2_5_vl": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, window_size=56,
                                  fullatt_block_indexes=[1], patch_size=14),
               "qwen3_vl": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, num_position_embeddings=16,
                                deepstack_visual_indexes=[0], patch_size=16)}
QWEN_VISION["qwen3_vl_moe"] = QWEN_VISION["qwen3_vl"]
QWEN_VISION["qwen3_5"] = QWEN_VISION["qwen3_5_moe"] = {**QWEN_VISION["qwen3_vl"], "deepstack_visual_indexes": []}  # Qwen3.5's tower: no DeepStack
# The language models beyond Qwen3-VL's, tiny: the MoEs' 4 experts, 2 a token; Qwen3.5's Gated DeltaNet layer before its attention layer
QWEN3_LANGUAGE = {"qwen3_vl_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
                  "qwen3_5": dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4, linear_num_key_heads=2,
                                  linear_key_head_dim=16, linear_value_head_dim=16)}
QWEN3_LANGUAGE["qwen3_5_moe"] = {**QWEN3_LANGUAGE["qwen3_5"], **QWEN3_LANGUAGE["qwen3_vl_moe"], "shared_expert_intermediate_size": 32}


QWEN_PICTURE = "<|vision_start|><|image_pad|><|vision_end|>"


def _qwen_vl(out: Path, tokenizer, family: str, language: dict | None, seed: int) -> Path:
    """Qwen2-VL's / Qwen2.5-VL's way: `<|image_pad|>` between `<|vision_start|>` and `<|vision_end|>`, widened by its processor to the
    picture's grid of merged patches; 3-D rotary positions (time, height, width) for the language model. The folder is as the
    releases ship it, the image processor's settings in preprocessor_config.json."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]})
    tokenizer.chat_template = VISION_TEMPLATE.replace(IMAGE_TOKEN, QWEN_PICTURE)
    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>") for name in ("vision_start", "vision_end", "image_pad", "video_pad")}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if family.startswith("qwen3"):  # Qwen3-VL, Qwen3.5: rope_parameters, their 3-D sections interleaved by the model
        text = {**text, "head_dim": 16, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                                                                  "mrope_interleaved": True}}
        text.update(QWEN3_LANGUAGE.get(family, {}))
    config = AutoConfig.for_model(family, vision_config={**QWEN_VISION[family], "spatial_merge_size": 2, "temporal_patch_size": 2},
                                  text_config={**text, **(language or {})}, image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
                                  vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"])
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_qwen_vl_processor(out, family)
    return out


QWEN_PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor", "qwen3_vl_moe": "Qwen3VLProcessor",
                   "qwen3_5": "Qwen3VLProcessor", "qwen3_5_moe": "Qwen3VLProcessor"}


def write_qwen_vl_processor(out: Path, family: str) -> None:
    """Qwen-VL's image processor settings as its releases ship them (preprocessor_config.json): pixels between 56 x 56 and 3584 x 3584
    (Qwen3-VL: its 16-pixel patches, mean and deviation 0.5, and a smallest picture of 64 x 64 here: its releases' is 256 x 256)."""
    images = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": QWEN_PROCESSORS[family],
              "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True, "rescale_factor": 1 / 255, "resample": 3,
              "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
              "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    if family.startswith("qwen3"):
        images.update(image_mean=[0.5] * 3, image_std=[0.5] * 3, patch_size=16, size={"shortest_edge": 4096, "longest_edge": 16777216})
        del images["min_pixels"], images["max_pixels"]
    (out / "preprocessor_config.json").write_text(json.dumps(images, indent=2) + "\n")
