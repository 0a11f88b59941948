"""`finetune eval`: benchmark tasks through EleutherAI's lm-evaluation-harness (`lm_eval`), run by its
Python API on the model as finetune loads it: a model folder (merged or fully fine-tuned), or base +
adapter as trained (a run folder or a checkpoint mid-run).

Tasks are the harness's own: a registered name (whose data must be reachable: there is no dataset hub
here), or a task YAML file in the harness's format, whose local `data_files` are taken relative to the
file's folder. The demo ships one (demo/eval/word_kind.yaml). Prompts go through the tokenizer's chat
template where it has one, as finetune trains chat and alpaca rows. The results table is printed and
written as JSON to --out, by default harness_eval.json in the current folder (the model's folder may be
shared or read-only: it is not written to).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

from finetune.config.errors import UserError

RESULTS = "harness_eval.json"


def evaluate(model_dir: str | None, adapter_dir: str | None, tasks: list[str], base: str | None = None, limit: int | None = None,
             batch_size: int = 8, out: str | None = None, say=print) -> dict:
    """Run the tasks; returns {task: {metric: value}} and writes it (with the harness's settings) as JSON."""
    if importlib.util.find_spec("lm_eval") is None:
        raise UserError("finetune eval: needs lm-evaluation-harness (pip install 'finetune-kit[eval]')")
    specs = [_task(name) for name in tasks]
    target = Path(out).expanduser() if out else _free_name(Path.cwd() / RESULTS)
    if out and target.exists():
        raise UserError(f"--out: {target} exists; name a new file")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from finetune.outputs.generate import load

    model, tokenizer = load(model_dir, adapter_dir, base)
    if model.config.to_dict().get("vision_config") is not None:
        raise UserError(f"finetune eval: {model.config.model_type} is a vision-language model; its tasks run through lm-evaluation-harness's "
                        "hf-multimodal model, which finetune eval does not drive yet (finetune generate --image tries it on a picture)")
    if hasattr(model, "merge_and_unload") and not getattr(model, "is_loaded_in_4bit", False):
        model = model.merge_and_unload()  # the harness takes a transformers model; merged in memory, as trained
    harness = HFLM(pretrained=model, tokenizer=tokenizer, device=str(next(model.parameters()).device), batch_size=batch_size)
    chat = bool(tokenizer.chat_template)
    found = simple_evaluate(model=harness, tasks=specs, limit=limit, apply_chat_template=chat, log_samples=False)
    table = {task: {key.split(",")[0]: value for key, value in metrics.items() if isinstance(value, (int, float)) and "stderr" not in key}
             for task, metrics in found["results"].items()}
    for task, metrics in table.items():
        say(f"{task}: " + ", ".join(f"{name} {value:.4f}" for name, value in metrics.items() if name != "sample_len")
            + f" on {metrics.get('sample_len', '?')} samples")
    record = {"model": model_dir, "adapter": adapter_dir, "tasks": tasks, "chat_template": chat, "limit": limit, "results": table,
              "lm_eval": importlib.metadata.version("lm_eval")}
    target.write_text(json.dumps(record, indent=2) + "\n")
    say(f"written to {target}")
    return table


def _free_name(path: Path) -> Path:
    """`path`, or the first of path-2, path-3, ... not taken: a results file of an earlier run is not ours to overwrite."""
    n = 1
    while path.exists():
        n += 1
        path = path.with_name(f"{RESULTS.removesuffix('.json')}-{n}.json")
    return path


def _task(name: str):
    """A registered task name, or a task YAML file (as a dict, its local data files made absolute)."""
    path = Path(name).expanduser()
    if not name.endswith((".yaml", ".yml")):
        return name
    if not path.is_file():
        raise UserError(f"--tasks: file not found: {name}")
    import yaml

    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"--tasks: {name} is not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(spec, dict) or "task" not in spec:
        raise UserError(f"--tasks: {name}: expected a task in lm-evaluation-harness's format (a mapping with a 'task' key)")
    files = (spec.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):
        spec["dataset_kwargs"]["data_files"] = resolved = {split: (path.parent / file).resolve() for split, file in files.items()}
        missing = [str(f) for f in resolved.values() if not f.is_file()]
        if missing:
            raise UserError(f"--tasks: {name}: data file not found: {missing[0]} (data_files are taken relative to the task file)")
        spec["dataset_kwargs"]["data_files"] = {split: str(f) for split, f in resolved.items()}
    return spec
