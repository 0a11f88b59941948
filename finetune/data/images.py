"""Images in chat rows: where a row's pictures are, their bytes, and the tokens a processor gives them.

A row with pictures, whatever shape it came in, is kept as TRL keeps one: `images` (each a path made
absolute against the data file, or the picture's bytes as base64) and messages whose content is a list
of parts, `{"type": "image"}` standing where each picture goes, in order. Accepted shapes:
- OpenAI/TRL content parts: `{"type": "image", "path"|"image"|"url": ...}` (a local path, or the bytes
  of a Parquet column or a `datasets` Image feature, `{"bytes": ..., "path": ...}`), or OpenAI's
  `{"type": "image_url", "image_url": {"url": ...}}` (a local path or a base64 data URI);
- LLaVA / ShareGPT: `"images": [...]` beside messages or conversations whose text says `<image>` where
  each picture goes.

The processor (the model's own, AutoProcessor) decides how many tokens a picture takes: the conversation
is tokenized with the loss mask as text rows are (finetune/data/chat.py), then once more by the processor
with the pictures, and the two are aligned: the processor's added tokens (a picture's placeholders,
LLaVA's 576 `<image>`s, Qwen-VL's grid of `<|image_pad|>`s) are never trained, every other token keeps
its mask. The cache keeps each picture's file bytes, not its pixel tensors: a 224 x 224 PNG is a few
KiB, its pixels as a processor gives them 0.6-1.2 MiB (docs/vision.md); the pictures are decoded and
processed again when a step's batch is made.
"""

from __future__ import annotations

import base64
import io
from difflib import SequenceMatcher
from pathlib import Path

import numpy as np

IMAGE_MARKER = "<image>"  # LLaVA / ShareGPT rows: where each of the row's `images` goes in the text
SOURCE_KEYS = ("path", "image", "url", "image_url")  # an image part names its picture under one of these
# What a batch with pictures gives the model's forward besides its tokens (LLaVA: pixel values; Qwen-VL:
# also each picture's patch grid and which tokens are a picture's, for its 3-D positions; LLaVA-NeXT: sizes;
# Gemma 3: which tokens are a picture's, which attend to each other both ways; Gemma 4: each patch's place in its picture).
MODEL_INPUTS = ("pixel_values", "pixel_attention_mask", "image_grid_thw", "image_sizes", "token_type_ids", "mm_token_type_ids",
                "aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask", "image_position_ids")


def has_images(row: dict) -> bool:
    return bool(row.get("images"))


def gather(row: dict) -> tuple[dict, str | None]:
    """A chat row (messages already in place) with its pictures moved to `images` and each message that
    shows one given as parts; (row, why it cannot be used)."""
    images = list(row.get("images") or [])
    if row.get("videos"):  # LLaMA-Factory's and TRL's field: silently dropped, its <video> marker would train as text
        return row, "field 'videos': finetune trains vision-language models on pictures, not videos; drop the row's videos"
    if not isinstance(row.get("images", []), list):
        return row, "field 'images' must be a list of paths or image bytes"
    messages, parted = [], False
    for i, m in enumerate(row["messages"]):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in ("image", "image_url"):
                    source = next((part[k] for k in SOURCE_KEYS if part.get(k) is not None), None)
                    source = source.get("url") if kind == "image_url" and isinstance(source, dict) else source  # OpenAI's {"url": ...}
                    if source is not None:
                        images.append(source)
                        parted = True
                    parts.append({"type": "image"})
                else:
                    return row, f"messages[{i}].content: only text and image parts can be trained on (got {kind or type(part).__name__})"
            m = {**m, "content": parts}
        elif isinstance(content, str) and IMAGE_MARKER in content and row.get("images"):
            pieces = content.split(IMAGE_MARKER)
            parts = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
            for piece in pieces[1:]:
                parts += [{"type": "image"}] + ([{"type": "text", "text": piece}] if piece else [])
            m = {**m, "content": parts}
        messages.append(m)
    slots = sum(1 for m in messages if isinstance(m.get("content"), list) for p in m["content"] if p["type"] == "image")
    if slots != len(images):
        given = f"{len(images)} image(s)" + (" in 'images'" if not parted else "")
        return row, f"{slots} image place(s) in the messages ({IMAGE_MARKER} or image parts) but {given}"
    if not images:  # text parts only: one string, as text rows are
        messages = [{**m, "content": "".join(p["text"] for p in m["content"])} if isinstance(m.get("content"), list) else m for m in messages]
        return {**row, "messages": messages}, None
    for i, m in enumerate(messages):
        if m.get("role") == "assistant" and isinstance(m.get("content"), list):
            if any(p["type"] == "image" for p in m["content"]):
                return row, f"messages[{i}]: an assistant message cannot show an image (the model writes text)"
            messages[i] = {**m, "content": "".join(p["text"] for p in m["content"])}
    return {**row, "messages": messages, "images": images}, None


def located(row: dict, data_file: Path) -> tuple[dict, str | None]:
    """The row's pictures as JSON can hold them: paths absolute (relative ones are against the data
    file's folder), bytes as base64; (row, why not)."""
    out = []
    for i, image in enumerate(row["images"]):
        if isinstance(image, dict):
            image = image.get("bytes") if image.get("bytes") is not None else image.get("path")
        if isinstance(image, (bytes, bytearray)):
            out.append({"base64": base64.b64encode(image).decode("ascii")})
        elif isinstance(image, str) and image.startswith("data:") and ";base64," in image:  # a data URI (OpenAI's image_url)
            out.append({"base64": image.split(";base64,", 1)[1]})
        elif isinstance(image, str) and image:
            if image.startswith(("http://", "https://")):
                return row, f"images[{i}]: {image} is a URL; finetune reads local files only (download the pictures first)"
            path = Path(image).expanduser()
            out.append(str(path if path.is_absolute() else (data_file.parent / path).resolve()))
        else:
            return row, f"images[{i}] must be a path or image bytes"
    return {**row, "images": out}, None


def read(images: list) -> tuple[list[bytes], str | None]:
    """The pictures' bytes, each checked to decode; (bytes, why one cannot be used)."""
    from PIL import Image

    out = []
    for i, image in enumerate(images):
        name = image if isinstance(image, str) else f"images[{i}] (bytes)"
        try:
            data = base64.b64decode(image["base64"]) if isinstance(image, dict) else Path(image).read_bytes()
            with Image.open(io.BytesIO(data)) as picture:
                picture.load()  # decodes it whole: a truncated file fails here, not at its training step
        except Image.UnidentifiedImageError:
            return [], f"image {name}: not a picture (no image format recognises it)"
        except (ValueError, Image.DecompressionBombError) as err:
            return [], f"image {name}: not a picture ({str(err).splitlines()[0]})"
        except OSError as err:  # missing or unreadable, or cut short ("image file is truncated")
            return [], f"image {name}: cannot be read ({err.strerror or str(err).splitlines()[0]})"
        out.append(data)
    return out, None


def row_pictures(rows: list[dict], processor) -> list[list[bytes] | str]:
    """Each row's pictures (bytes; none for a text row), or why they cannot be used: a model that takes
    none, a picture that does not read."""
    out: list[list[bytes] | str] = []
    for row in rows:
        if not has_images(row):
            out.append([])
        elif processor is None:
            out.append("data: the row has pictures, but the model takes none: it trains on text only (the families that take pictures: docs/vision.md)")
        else:
            data, problem = read(row["images"])
            out.append(f"data: {problem}" if problem else data)
    return out


def expand_rows(rows: list[dict], results: list, tokenizer, processor, pictures: list, max_seq_len: int) -> list:
    """tokenize_rows' results with each picture row's tokens as the processor makes them (pictures:
    row_pictures'), or the reason a row cannot be used."""
    from finetune.data.chat import render

    out = list(results)
    for i, row in enumerate(rows):
        if isinstance(results[i], str) or not pictures[i]:
            continue
        if isinstance(pictures[i], str):
            out[i] = pictures[i]
            continue
        out[i] = with_image_tokens(processor, render(tokenizer, row["messages"], tools=row.get("tools")), *results[i], pictures[i], max_seq_len)
    return out


def encoder(processor, pictures: list[bytes]):
    """text -> its ids as the processor tokenizes it with these pictures (a preference pair's side); a
    processor's refusal as UserError."""
    from finetune.config.errors import UserError

    shown = decoded(pictures)

    def encode(text: str) -> list[int]:
        try:
            return list(np.asarray(processor(text=[text], images=shown, add_special_tokens=False)["input_ids"][0]).tolist())
        except (ValueError, OSError) as err:  # the processor refuses this row (a count mismatch, a picture too small): its words
            raise UserError(f"data: the model's processor refuses the row: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None

    return encode


def image_inputs(processor, pictures: list[bytes], input_ids) -> dict:
    """A batch's image inputs (pixel values, and what the family adds: Qwen-VL's grid sizes), as the
    processor's image processor makes them from the pictures in the batch's order; the tokens' modality
    types where the processor gives them (Gemma 3)."""
    import torch

    if "cross_attention_mask" in processor.model_input_names:
        return _cross_attended(processor, pictures, input_ids)
    out = dict(processor.image_processor(images=decoded(pictures), return_tensors="pt")) if pictures else {}
    for name in ("token_type_ids", "mm_token_type_ids"):  # Gemma 3's name for them, and Qwen-VL's (its 3-D positions need them)
        if name in processor.model_input_names:
            out[name] = processor.create_mm_token_type_ids(input_ids.tolist())
    return {key: torch.as_tensor(value) for key, value in out.items() if key in MODEL_INPUTS}


def _cross_attended(processor, pictures: list[bytes], input_ids) -> dict:
    """Mllama's image inputs: each row's pictures its own (its text attends to them through cross-attention layers, not
    through tokens in the row), the tiles of each, and which tokens see which picture (from each `<|image|>` on)."""
    import torch
    from transformers.models.mllama.processing_mllama import convert_sparse_cross_attention_mask_to_dense, get_cross_attention_token_mask

    counts = (input_ids == processor.image_token_id).sum(1).tolist()
    shown, at = [], 0
    for count in counts:
        shown.append(decoded(pictures[at : at + count]))
        at += count
    out = dict(processor.image_processor(images=shown, return_tensors="pt"))
    masks = [get_cross_attention_token_mask(row, processor.image_token_id) for row in input_ids.tolist()]
    out["cross_attention_mask"] = convert_sparse_cross_attention_mask_to_dense(
        masks, out.pop("num_tiles"), max_num_tiles=processor.image_processor.max_image_tiles, length=input_ids.shape[1])
    return {key: torch.as_tensor(value) for key, value in out.items() if key in MODEL_INPUTS}


def placeholders(processor) -> list[int]:
    """The token ids that stand for a picture's features (LLaVA's <image>, Gemma 3's soft token, Qwen-VL's pads): a
    sampled completion must never hold one, or the forward would look for a picture it does not have."""
    return sorted({i for i in (getattr(processor, name, None) for name in ("image_token_id", "video_token_id")) if isinstance(i, int)})


def decoded(data: list[bytes]) -> list:
    from PIL import Image

    return [Image.open(io.BytesIO(b)).convert("RGB") for b in data]


def with_image_tokens(processor, text: str, ids: list[int], trained: list[bool], pictures: list[bytes], max_seq_len: int):
    """(ids, trained) of the conversation as the processor tokenizes it with its pictures, or why not:
    the processor's tokens aligned to the text's, those it adds never trained."""
    from finetune.config.errors import UserError

    try:
        theirs = encoder(processor, pictures)(text)
    except UserError as err:
        return str(err)
    if len(theirs) > max_seq_len:
        return (f"data: the row is {len(theirs)} tokens with its pictures, over data.max_seq_len={max_seq_len}; a picture's tokens "
                "cannot be cut (raise data.max_seq_len, or the processor's max_pixels)")
    mask = _inserted_only(ids, trained, theirs)
    if mask is not None:
        return theirs, mask
    mask = [False] * len(theirs)
    for tag, a, b, c, d in SequenceMatcher(None, ids, theirs, autojunk=False).get_opcodes():
        if tag == "equal":
            mask[c:d] = trained[a:b]
        elif any(trained[a:b]):
            return "data: the processor changes trained tokens of this row (its chat template and processor disagree)"
    return theirs, mask


def _inserted_only(ids: list[int], trained: list[bool], theirs: list[int]) -> list[bool] | None:
    """The mask on the processor's tokens where they are ours with tokens inserted (a picture's run widened:
    LLaVA, Qwen-VL), in one pass; None where they are not (Gemma 3's blank lines may merge with the text's),
    for difflib's alignment, which takes time quadratic in a row of thousands of picture tokens."""
    mask, i = [False] * len(theirs), 0
    for j, token in enumerate(theirs):
        if i < len(ids) and token == ids[i]:
            mask[j] = trained[i]
            i += 1
    return mask if i == len(ids) else None
