"""Model cards: the README.md of a run folder and of a merged folder, in the Hugging Face model-card
format (a YAML header that the Hub and `huggingface_hub.ModelCard` read, then Markdown), written with
huggingface_hub's own `ModelCard` / `ModelCardData`.

The header names the base model, the library that loads the folder (peft for an adapter, transformers
for a full or merged model), tags and the training data; the license is left for the user to fill in.
The body holds what the run measured (losses, the eval table, exact match before and after), the
guard's events, the loss curve, the training config and the command that reproduces the run.
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune.config.schema import CONFIG_FILE, RunConfig, looks_local
from finetune.run.metrics import EVENTS_FILE

CARD = "README.md"


def run_card(cfg: RunConfig, summary: dict, out: Path) -> str:
    """The card of a finished run's folder (an adapter, or a fully fine-tuned model)."""
    from huggingface_hub import ModelCard, ModelCardData

    adapter = cfg.adapter.method != "full"
    method = {"lora": "LoRA", "dora": "DoRA", "full": "full fine-tuning"}[cfg.adapter.method]
    if cfg.model.quantization is not None and adapter:
        method = f"Q{method} ({cfg.model.quantization.bits}-bit base)"
    tags = ["finetune", cfg.train.objective, *(["lora"] if cfg.adapter.method == "lora" else ["dora"] if adapter else [])]
    base = summary.get("base_model") or cfg.model.name_or_path
    parts = summary.get("vision")
    data = ModelCardData(base_model=hub_id(base), library_name="peft" if adapter else "transformers",
                         pipeline_tag="image-text-to-text" if parts else "text-generation", tags=tags, datasets=_datasets(cfg), license=None)
    lines = [f"# {Path(out).name}", "",
             f"{method} of `{base}` with finetune ({cfg.train.objective}, "
             f"{summary.get('steps')} optimizer steps, {summary.get('tokens', 0):,} tokens trained).", ""]
    if parts:
        lines += [f"A vision-language model: {method} on its language model; its vision tower {_trained(parts['tower'])}, its projector "
                  f"{_trained(parts['projector'])}.", ""]
    lines += [
             "## Results", "", "| measure | value |", "| --- | --- |"]
    lines += [f"| {label} | {_number(summary[key])} |" for key, label in RESULTS if summary.get(key) is not None]
    vllm = summary.get("vllm")
    if vllm:
        lines += ["", f"Serving: vLLM loads this adapter with `--enable-lora --max-lora-rank {vllm['max_lora_rank']}`." if vllm["loads"] else
                  f"Serving: vLLM would not load this adapter ({'; '.join(vllm['problems'])}): merge it first (`finetune merge`)."]
    events = _events(Path(out))
    lines += ["", "## Training", "",
              f"Guard events (divergence skips, rollbacks, stops): {len(events) or 'none'}."]
    lines += [f"- step {e.get('step')}: {e.get('event')}: {e.get('message', '')}" for e in events[:20]]
    if (Path(out) / "loss_curve.png").is_file():
        lines += ["", "![loss curve](loss_curve.png)"]
    lines += ["", "Reproduce (the resolved config is beside this card):", "", "```bash", f"finetune train --config {CONFIG_FILE}", "```",
              "", "<details><summary>Training config</summary>", "", "```yaml", (Path(out) / CONFIG_FILE).read_text().rstrip()
              if (Path(out) / CONFIG_FILE).is_file() else "", "```", "", "</details>", "",
              "## License", "", "Not set: fill in the `license` field above (the base model's license applies to this work too)."]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"))


def _trained(choice: str) -> str:
    return {"frozen": "frozen", "lora": "adapted by LoRA", "full": "trained whole"}[choice]


def merged_card(report: dict) -> str:
    """The card of a merged folder: base + adapter as one transformers model, with merge's check."""
    from huggingface_hub import ModelCard, ModelCardData

    pictures = report.get("check_pictures")  # a vision-language model's merge checks on pictures
    data = ModelCardData(base_model=hub_id(report["base"]), library_name="transformers",
                         pipeline_tag="image-text-to-text" if pictures else "text-generation",
                         tags=["finetune", "merged"], license=None)
    check, effect = report["merged_vs_tuned"], report["adapter_effect"]
    lines = [f"# {Path(report['out']).name}", "", f"`{report['base']}` with the adapter `{report['adapter']}` merged into its weights "
             f"({report['dtype']}" + (f", QLoRA: the {report['qlora_base']} base" if "qlora_base" in report else "") + "); loads with "
             "transformers alone.", "", "## Merge check", "",
             f"On {report['check_texts']} texts the merged model's logits are within max {check['max']:.3g} (mean {check['mean']:.3g}) of base + "
             f"adapter (tolerance {report['tolerance_max']:g}); the adapter itself moves the base's logits by max {effect['max']:.3g} "
             f"(mean {effect['mean']:.3g}). Figures in `merge_report.json`.", "", "## License", "",
             "Not set: fill in the `license` field above (the base model's license applies to this work too)."]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"))


def hub_id(base: str) -> str | None:
    """The header's base_model: a hub id as given; a local folder is left out (the Hub rejects a path there), and the
    card's text names it."""
    return None if looks_local(base) or Path(base).expanduser().exists() else base


RESULTS = [("train_loss", "final train loss"), ("train_reward", "final step's mean reward"), ("train_kl", "final step's KL"),
           ("eval_loss", "eval loss"), ("eval_ppl", "eval perplexity"), ("eval_reward_accuracy", "eval reward accuracy"),
           ("best_loss_level", "best loss level (the guard's)"), ("exact_match_before", "exact match before training"),
           ("exact_match_after", "exact match after training")]


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _datasets(cfg: RunConfig) -> list[str]:
    sources = cfg.data.train if isinstance(cfg.data.train, list) else [cfg.data.train]
    names = [getattr(s, "path", s) for s in sources]
    return [Path(n).name if looks_local(n) else n for n in names]


def _events(out: Path) -> list[dict]:
    path = out / EVENTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
