"""`finetune generate`: try a trained result on a prompt, with the tokens streamed to the terminal,
or answer a JSONL file of prompts in batches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from finetune.config.errors import UserError
from finetune.config.schema import ModelConfig
from finetune.data import images
from finetune.data.chat import render as render_chat
from finetune.model import vision
from finetune.model.adapters import as_trained, find_adapter, tokenizer_source
from finetune.model.loading import end_tokens, load_model, load_tokenizer
from finetune.objectives.evaluate import generate as continuation
from finetune.objectives.evaluate import sampling


def load(model_dir: str | None, adapter_dir: str | None, base: str | None = None):
    """(model, tokenizer): a model folder (merged or full fine-tune) as saved, or base + adapter as trained."""
    if model_dir:
        if not Path(model_dir).expanduser().is_dir():
            raise UserError(f"--model: folder not found: {model_dir}")
        cfg = ModelConfig(name_or_path=model_dir, dtype="auto")
        return load_model(cfg).eval(), load_tokenizer(cfg)
    adapter = find_adapter(adapter_dir, base)
    model = as_trained(adapter)
    return model, load_tokenizer(ModelConfig(name_or_path=tokenizer_source(adapter)))


def processor_of(model_dir: str | None, adapter_dir: str | None, base: str | None = None):
    """A vision-language model's processor (saved beside the model or the adapter), None for a text model."""
    if model_dir:
        return vision.processor_for(ModelConfig(name_or_path=model_dir))
    adapter = find_adapter(adapter_dir, base)
    return vision.processor_for(ModelConfig(name_or_path=tokenizer_source(adapter)), adapter.base)


def answer_picture(model, processor, prompt: str, image: str, max_new_tokens: int = 128, temperature: float = 0.0, stream: bool = True) -> str:
    """The answer to a question about a picture: a user turn showing it, through the model's chat template."""
    from transformers import TextStreamer

    if processor is None:
        raise UserError("--image: this model takes no pictures (a vision-language model's config.json has a vision_config)")
    data, problem = images.read([str(Path(image).expanduser())])
    if problem:
        raise UserError(f"--image: {problem}")
    tokenizer = processor.tokenizer
    text = render_chat(tokenizer, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}], add_generation_prompt=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    answer = continuation(model, tokenizer, text, max_new_tokens, add_special_tokens=False, temperature=temperature, streamer=streamer,
                          pictures=data, processor=processor)
    if stream:
        sys.stdout.flush()
    return answer


def read_prompts(path: str) -> list[dict]:
    """The rows of a --prompts file: JSON objects with a "prompt" string each; one line names a bad one."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"--prompts: file not found: {path}")
    rows = []
    for number, line in enumerate(file.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not isinstance(row.get("image", ""), str):
            raise UserError(f'{path}:{number}: expected a JSON object with a "prompt" string (and an "image" path, for a picture), '
                            'e.g. {"prompt": "Name a colour."}')
        if row.get("image"):  # relative to the prompts file, as data rows' pictures are to theirs
            row["image"] = str((file.parent / Path(row["image"]).expanduser()).resolve())
        rows.append(row)
    if not rows:
        raise UserError(f"--prompts: {path} holds no prompts")
    return rows


def answer_file(model, tokenizer, rows: list[dict], out: str | None, batch_size: int, chat: bool = False, max_new_tokens: int = 128,
                temperature: float = 0.0, processor=None) -> None:
    """Each row with its "completion", written as JSONL to `out` (or standard output) batch by batch (a
    row with an "image", on its own)."""
    from tqdm import tqdm

    texts = [render(tokenizer, row["prompt"], chat) for row in rows]
    sink = open(out, "x", encoding="utf-8") if out else sys.stdout  # noqa: SIM115 - stdout is not ours to close
    try:
        with tqdm(total=len(rows), desc="generating", unit="prompt", file=sys.stderr, disable=not out) as bar:
            for start in range(0, len(rows), batch_size):
                answers = [answer_picture(model, processor, row["prompt"], row["image"], max_new_tokens, temperature, stream=False)
                           if row.get("image") else None for row in rows[start:start + batch_size]]
                texts_only = [t for t, a in zip(texts[start:start + batch_size], answers) if a is None]
                plain = iter(generate_batch(model, tokenizer, texts_only, not chat, max_new_tokens, temperature) if texts_only else [])
                answers = [a if a is not None else next(plain) for a in answers]
                for row, answer in zip(rows[start:start + batch_size], answers):
                    sink.write(json.dumps({**row, "completion": answer}, ensure_ascii=False) + "\n")
                sink.flush()
                bar.update(len(answers))
    finally:
        if out:
            sink.close()


@torch.no_grad()
def generate_batch(model, tokenizer, texts: list[str], add_special_tokens: bool, max_new_tokens: int, temperature: float) -> list[str]:
    """Continuations of several prompts in one generate call: padded on the left, so that every
    prompt's last token sits at the end of its row."""
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        batch = tokenizer(texts, add_special_tokens=add_special_tokens, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    device = next(model.parameters()).device
    out = model.generate(**batch.to(device), max_new_tokens=max_new_tokens, use_cache=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=end_tokens(model, tokenizer), **sampling(temperature))
    return tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)


def render(tokenizer, prompt: str, chat: bool) -> str:
    """The prompt as sent: as is, or as a user turn through the tokenizer's chat template."""
    if not chat:
        return prompt
    if not tokenizer.chat_template:
        raise UserError("--chat: this tokenizer has no chat template; leave out --chat to send the prompt as plain text")
    return render_chat(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)


def generate(model, tokenizer, prompt: str, chat: bool = False, max_new_tokens: int = 128, temperature: float = 0.0,
             stream: bool = True) -> str:
    """The continuation of `prompt` (greedy unless temperature > 0), printed token by token if `stream`."""
    from transformers import TextStreamer

    prompt = render(tokenizer, prompt, chat)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    # A rendered chat template already carries the special tokens it needs.
    text = continuation(model, tokenizer, prompt, max_new_tokens, add_special_tokens=not chat, temperature=temperature, streamer=streamer)
    if stream:
        sys.stdout.flush()
    return text
