"""`finetune eval`: benchmark tasks through EleutherAI's lm-evaluation-harness (`lm_eval`), run by its
Python API on the model as finetune loads it: a model folder (merged or fully fine-tuned), or base +
adapter as trained (a run folder or a checkpoint mid-run).

Tasks are the harness's own: a registered name (whose data must be reachable: there is no dataset hub
here), or a task YAML file in the harness's format, whose local `data_files` are taken relative to the
file's folder. The demo ships one (demo/eval/word_kind.yaml). Prompts go through the tokenizer's chat
template where it has one, as finetune trains chat and alpaca rows. The results table is printed and
written as JSON to --out, by default harness_eval.json in the current folder (the model's folder may be
shared or read-only: it is not written to).

A vision-language model runs through the harness's own multimodal model (hf-multimodal), which generates
(tasks of output_type generate_until), with the processor finetune trained it with. A task YAML's
`doc_to_image: FIELD` may name its rows' pictures as finetune's training rows do (paths relative to the
data file, or bytes); the vision demo's task: demo/eval/picture_shape.yaml.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

from finetune.config.errors import UserError
from finetune.model.configs import first_line

RESULTS = "harness_eval.json"


def evaluate(model_dir: str | None, adapter_dir: str | None, tasks: list[str], base: str | None = None, limit: int | None = None,
             batch_size: int = 8, out: str | None = None, say=print, samples: bool = False) -> dict:
    """Run the tasks; returns {task: {metric: value}} and writes it (with the harness's settings and, with `samples`, each
    sample's target and answer) as JSON."""
    if importlib.util.find_spec("lm_eval") is None:
        raise UserError("finetune eval: needs lm-evaluation-harness (pip install 'finetune-kit[eval]')")
    specs = [_task(name) for name in tasks]
    target = Path(out).expanduser() if out else _free_name(Path.cwd() / RESULTS)
    if out and target.exists():
        raise UserError(f"--out: {target} exists; name a new file")
    from lm_eval import simple_evaluate

    from finetune.outputs.generate import load, processor_of

    model, tokenizer = load(model_dir, adapter_dir, base)
    processor = processor_of(model_dir, adapter_dir, base)
    _check_tasks(specs, processor, model.config.model_type)
    if hasattr(model, "merge_and_unload") and not getattr(model, "is_loaded_in_4bit", False):
        model = model.merge_and_unload()  # the harness takes a transformers model; merged in memory, as trained
    chat = bool(tokenizer.chat_template)
    harness = _harness(model, tokenizer, processor, batch_size, chat)
    try:
        found = simple_evaluate(model=harness, tasks=specs, limit=limit, apply_chat_template=chat, log_samples=samples)
    except NotImplementedError as err:  # a registered task scored by log-likelihood, which hf-multimodal does not compute
        raise UserError(f"finetune eval: {first_line(err)}") from None
    table = {task: {key.split(",")[0]: value for key, value in metrics.items() if isinstance(value, (int, float)) and "stderr" not in key}
             for task, metrics in found["results"].items()}
    for task, metrics in table.items():
        say(f"{task}: " + ", ".join(f"{name} {value:.4f}" for name, value in metrics.items() if name != "sample_len")
            + f" on {metrics.get('sample_len', '?')} samples")
    record = {"model": model_dir, "adapter": adapter_dir, "tasks": tasks, "chat_template": chat, "limit": limit, "results": table,
              "lm_eval": importlib.metadata.version("lm_eval")}
    if samples:
        record["samples"] = {task: [{"doc_id": s["doc_id"], "target": s["target"], "answer": s["filtered_resps"]} for s in logged]
                             for task, logged in found["samples"].items()}
    target.write_text(json.dumps(record, indent=2, default=str) + "\n")
    say(f"written to {target}")
    return table


def _check_tasks(specs: list, processor, model_type: str) -> None:
    """Task files the model cannot run, refused before any sample: pictures to a text model, a task a vision-language
    model would have to score by log-likelihood."""
    for spec in (s for s in specs if isinstance(s, dict)):
        if processor is None and spec.get("doc_to_image"):
            raise UserError(f"--tasks: {spec['task']} shows pictures (doc_to_image); {model_type} is a text model")
        if processor is not None and spec.get("output_type", "generate_until") != "generate_until":
            raise UserError(f"--tasks: {spec['task']} is output_type {spec['output_type']}; a vision-language model runs through "
                            "lm-evaluation-harness's hf-multimodal model, which scores generate_until tasks only")


def _harness(model, tokenizer, processor, batch_size: int, chat: bool):
    """The harness's model over ours: HFLM, or for a vision-language model its hf-multimodal model with our processor."""
    device = str(next(model.parameters()).device)
    if processor is None:
        from lm_eval.models.huggingface import HFLM

        return HFLM(pretrained=model, tokenizer=tokenizer, device=device, batch_size=batch_size)
    from lm_eval.models.hf_vlms import HFMultimodalLM

    class Multimodal(HFMultimodalLM):
        def _create_tokenizer(self, pretrained, tokenizer, **kwargs) -> None:  # the harness would load one by the model's name
            self.processor, self.tokenizer = processor, processor.tokenizer

    harness = Multimodal(pretrained=model, device=device, batch_size=batch_size)
    if chat:
        harness.processor = _Rendered(processor)
    return harness


class _Rendered:
    """The processor, called on text its chat template rendered: the harness calls it with the tokenizer's defaults, which
    add a BOS before the one the template wrote (tokens the model never trained on)."""

    def __init__(self, processor):
        self._processor = processor

    def __call__(self, *args, **kwargs):
        return self._processor(*args, add_special_tokens=False, **kwargs)

    def __getattr__(self, name):
        return getattr(self._processor, name)


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
        if isinstance(spec.get("doc_to_image"), str):
            split = spec.get("test_split") if spec.get("test_split") in resolved else next(iter(resolved))
            spec["doc_to_image"] = _pictures(name, spec["doc_to_image"], resolved[split])
    return spec


def _pictures(task: str, field: str, data_file: Path):
    """doc_to_image for rows that hold their pictures as finetune's training rows do: paths (relative to the data file)
    or bytes, read and checked as training reads them."""
    from finetune.data import images

    def read(doc: dict) -> list:
        given = doc.get(field)
        given = given if isinstance(given, list) else [given]
        row, problem = images.located({"images": given}, data_file)
        data, problem = images.read(row["images"]) if problem is None else ([], problem)
        if problem:
            raise UserError(f"--tasks: {task}: {problem}")
        return images.decoded(data)

    return read
