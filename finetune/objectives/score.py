"""Reward models after training: `finetune score` (each row's score), and a reward model as a GRPO reward
function (`grpo.rewards: [reward_model:PATH]`).

A reward model is what `train.objective: reward` saves: a sequence-classification model with one label
(full fine-tuning), or a PEFT adapter of task SEQ_CLS with its score head (LoRA), over its base. A row is
scored as training scored a sequence: prompt and completion tokenized together (text with the EOS token
after the completion, chat rendered by the template), the score head's output at the last token.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from finetune.config.errors import UserError
from finetune.data.encoding import _pair_side
from finetune.data.readers import located, where
from finetune.data.rows import canonical


def load_reward_model(path: str, device: str | torch.device = "cpu"):
    """(model, tokenizer) of a reward model folder or adapter, in eval mode, loaded as training loaded it."""
    from peft import PeftModel

    from finetune.config.files import read_json_object, read_model_config
    from finetune.config.schema import ModelConfig
    from finetune.model.loading import load_model, load_tokenizer

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"reward model: folder not found: {path}")
    adapter = folder / "adapter_config.json"
    if adapter.exists():
        settings = read_json_object(adapter, "reward model")
        if settings.get("task_type") != "SEQ_CLS":
            raise UserError(f"reward model: {path} is a {settings.get('task_type')} adapter, not a reward model's (train.objective: reward)")
        base = settings["base_model_name_or_path"]
        model = PeftModel.from_pretrained(load_model(ModelConfig(name_or_path=base), head="score"), folder)
    else:
        config = read_model_config(folder, "reward model")
        architectures = config.get("architectures") or ["?"]
        labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        if not any(a.endswith("ForSequenceClassification") for a in architectures) or labels != 1:
            raise UserError(f"reward model: {path} is a {', '.join(architectures)} with {labels} labels, not a sequence-classification "
                            "model with one (train.objective: reward saves one)")
        base = str(folder)
        model = load_model(ModelConfig(name_or_path=base), head="score")
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(folder) if (folder / "tokenizer_config.json").exists() else base))
    return model.to(device).eval(), tokenizer


@torch.no_grad()
def scores(model, tokenizer, rows: list[dict]) -> list[float]:
    """Each {prompt, completion} row's score (text, or chat messages with the completion an assistant message or string)."""
    from finetune.objectives.objective import sequence_scores

    device = next(model.parameters()).device
    out = []
    for row in rows:
        _, ids = _pair_side(row, "completion", tokenizer)
        batch = {"input_ids": torch.tensor([ids], device=device), "position_ids": torch.arange(len(ids), device=device)[None]}
        out.append(float(sequence_scores(model, batch, torch.tensor([len(ids) - 1], device=device))[0]))
    return out


def score_file(model_path: str, data: str, out: str) -> int:
    """`finetune score`: every row of `data` with its score, as JSONL at `out`. Returns the rows scored."""
    target = Path(out)
    if target.exists():
        raise UserError(f"--out: {out} exists; name a new file")
    model, tokenizer = load_reward_model(model_path)
    rows = []
    for number, raw in located(data):
        row, problem = (raw, raw.problem) if hasattr(raw, "problem") else canonical({**raw, "label": True} if isinstance(raw, dict) else raw, "unpaired")
        if problem:
            raise UserError(f"{where(data, number)}: {problem.replace(' (true: a desirable completion, false: an undesirable one)', '')} "
                            "(rows to score: {prompt, completion}, text or chat messages)")
        rows.append((raw, row))
    from tqdm.auto import tqdm

    tmp = target.with_name(f".{target.name}.tmp")
    with tmp.open("w") as fh:
        for start in tqdm(range(0, len(rows), 64), desc="scoring", unit=" batches", delay=2):
            chunk = rows[start : start + 64]
            for (raw, _), value in zip(chunk, scores(model, tokenizer, [row for _, row in chunk])):
                fh.write(json.dumps({**raw, "score": value}, ensure_ascii=False) + "\n")
    tmp.replace(target)
    return len(rows)


class RewardModelReward:
    """A trained reward model as a GRPO reward function: the score of each prompt + completion. The folder is
    checked when the run starts (and by `finetune validate`); the model loads at the first call."""

    def __init__(self, path: str):
        folder = Path(path).expanduser()
        if not ((folder / "adapter_config.json").exists() or (folder / "config.json").exists()):
            raise UserError(f"grpo.rewards: reward_model:{path}: no reward model there (a folder with adapter_config.json or config.json)")
        self.path, self.model, self.tokenizer = path, None, None

    def __call__(self, prompts: list, completions: list, **_) -> list[float]:
        if self.model is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            self.model, self.tokenizer = load_reward_model(self.path, device)
        return scores(self.model, self.tokenizer, [{"prompt": p, "completion": c} for p, c in zip(prompts, completions)])
