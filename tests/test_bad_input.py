"""Bad input of every kind, through every command: exit 2, one line that names the file, key or line
and what was expected, no traceback, and no file changed outside the command's own outputs.

Each case builds its inputs in a fresh folder (a good config, then one thing wrong) and runs the real
CLI in this process (`finetune.cli.main`): a traceback would fail the test as an exception."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import DEMO_DATA, base_config, hub_cached

from finetune.cli import main

GOOD_ROW = {"instruction": "What kind of word is this?", "input": "apple", "output": "noun"}


class Case:
    def __init__(self, tmp: Path, model: Path):
        self.tmp, self.model = tmp, model

    def config(self, text: str | bytes | None = None, **sections) -> str:
        """A good run config with the given sections merged in (None deletes a key), or raw text."""
        path = self.tmp / "run.yaml"
        if text is not None:
            (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
            return str(path)
        cfg = base_config(self.model, self.tmp / "out", train={"max_steps": 2, "micro_batch_size": 2}, data={"eval": None})
        for section, values in sections.items():
            if not isinstance(values, dict):
                cfg[section] = values
                continue
            for key, value in values.items():
                if value is None:
                    cfg.setdefault(section, {}).pop(key, None)
                else:
                    cfg.setdefault(section, {})[key] = value
        path.write_text(yaml.safe_dump(cfg))
        return str(path)

    def train(self, *extra, **sections) -> list[str]:
        return ["train", "--config", self.config(**sections), *extra]

    def file(self, name: str, content: str | bytes) -> str:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
        return str(path)

    def rows(self, name: str, rows: list) -> str:
        return self.file(name, "".join(json.dumps(r) + "\n" for r in rows))

    def model_copy(self, change=None) -> Path:
        """A copy of the tiny model that this case may break."""
        copy = self.tmp / "model"
        shutil.copytree(self.model, copy)
        if change:
            change(copy)
        return copy

    def adapter(self) -> Path:
        """An adapter folder for merge/generate cases, with a good base named in it."""
        folder = self.tmp / "adapter"
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(self.model), "peft_type": "LORA", "r": 2,
                                                                "lora_alpha": 4, "target_modules": ["q_proj"]}))
        (folder / "adapter_model.safetensors").write_bytes(b"")  # what these cases test comes before the weights are read
        return folder


def _weights(model: Path) -> Path:
    return next(model.glob("*.safetensors"))


def _no_template(model: Path) -> None:
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))


def _cases():
    """(id, build(case) -> argv, what the one line must contain)."""
    c = []

    def add(name, build, expect):
        c.append(pytest.param(build, expect, id=name))

    # The config file itself
    add("config-missing", lambda k: ["train", "--config", str(k.tmp / "nope.yaml")], "nope.yaml: config file not found")
    add("config-is-a-folder", lambda k: ["train", "--config", str(k.tmp)], "config file not found")
    add("config-not-utf8", lambda k: ["train", "--config", k.config(b"model:\n  name_or_path: \xff\xfe\n")], "run.yaml: not UTF-8 text")
    add("config-bad-yaml", lambda k: ["train", "--config", k.config("model: [unclosed\n")], "run.yaml:2: not valid YAML")
    add("config-a-list", lambda k: ["train", "--config", k.config("- model\n- data\n")], "run.yaml: expected a mapping")
    add("config-a-scalar", lambda k: ["train", "--config", k.config("hello\n")], "run.yaml: expected a mapping")
    add("config-empty", lambda k: ["train", "--config", k.config("")], "model: required key is missing")
    add("config-yaml-tag", lambda k: ["train", "--config", k.config("model: !!python/object:os.system {}\n")], "run.yaml:1: not valid YAML")
    add("unknown-section", lambda k: k.train(trian={"lr": 1}), "trian: unknown key")
    add("unknown-key", lambda k: k.train(model={"nmae": "x"}), "model.nmae: unknown key")
    add("model-path-missing-key", lambda k: k.train(model={"name_or_path": None}), "model.name_or_path: required key is missing")
    add("data-train-missing-key", lambda k: k.train(data={"train": None}), "data.train: required key is missing")
    add("section-not-a-mapping", lambda k: k.train(train=5), "train: Input should be a valid dictionary")
    # Data
    add("data-train-empty-list", lambda k: k.train(data={"train": []}), "train: the list of training sources is empty")
    add("data-file-missing", lambda k: k.train(data={"train": str(k.tmp / "none.jsonl")}), "train: file not found")
    add("data-folder-named-jsonl", lambda k: k.train(data={"train": (k.tmp.joinpath("d.jsonl").mkdir(), str(k.tmp / "d.jsonl"))[1]}),
        "d.jsonl: no data files")
    add("data-not-utf8", lambda k: k.train(data={"train": k.file("d.jsonl", json.dumps(GOOD_ROW).encode() + b"\n\xff\xfe\n")}),
        "d.jsonl:2: not UTF-8 text")
    add("data-bad-json-line", lambda k: k.train(data={"train": k.file("d.jsonl", json.dumps(GOOD_ROW) + "\n{oops\n")}),
        "d.jsonl:2: invalid JSON")
    add("data-missing-field", lambda k: k.train(data={"train": k.rows("d.jsonl", [GOOD_ROW, {"instruction": "x"}])}),
        "d.jsonl:2: missing field 'output'")
    add("data-empty-field", lambda k: k.train(data={"train": k.rows("d.jsonl", [{**GOOD_ROW, "output": "  "}])}),
        "d.jsonl:1: field 'output' is empty")
    add("data-field-not-text", lambda k: k.train(data={"train": k.rows("d.jsonl", [{**GOOD_ROW, "output": 5}])}),
        "d.jsonl:1: field 'output' must be a string")
    add("data-row-not-object", lambda k: k.train(data={"train": k.rows("d.jsonl", [[1, 2]])}), "d.jsonl:1: expected a JSON object")
    add("data-chat-rows-as-alpaca", lambda k: k.train(data={"train": k.rows("d.jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                                                                        {"role": "assistant", "content": "b"}]}])}),
        "d.jsonl:1: missing field 'instruction' (format 'alpaca'; this row looks like format 'chat': set data.format: chat)")
    add("data-chat-bad-role", lambda k: k.train(data={"format": "chat", "train": k.rows("d.jsonl", [{"messages": [{"role": "bot", "content": "a"}]}])}),
        "d.jsonl:1: messages[0] must be")
    add("data-chat-no-answer", lambda k: k.train(data={"format": "chat", "train": k.rows("d.jsonl", [{"messages": [{"role": "user", "content": "a"}]}])}),
        "d.jsonl:1: no non-empty assistant message")
    picture = {"role": "user", "content": [{"type": "image", "path": "img/a.png"}, {"type": "text", "text": "What is it?"}]}
    add("data-picture-for-a-text-model", lambda k: k.train(data={"format": "chat", "train": k.rows("d.jsonl", [{"messages": [
        picture, {"role": "assistant", "content": "a"}]}])}), "d.jsonl:1: the row has pictures, but the model takes none")
    add("data-picture-url", lambda k: k.train(data={"format": "chat", "train": k.rows("d.jsonl", [{"messages": [
        {**picture, "content": [{"type": "image", "url": "https://x.org/a.png"}]}, {"role": "assistant", "content": "a"}]}])}),
        "d.jsonl:1: images[0]: https://x.org/a.png is a URL; finetune reads local files only")
    add("data-picture-count", lambda k: k.train(data={"format": "chat", "train": k.rows("d.jsonl", [{"images": ["a.png", "b.png"], "messages": [
        {"role": "user", "content": "<image> What?"}, {"role": "assistant", "content": "a"}]}])}),
        "d.jsonl:1: 1 image place(s) in the messages (<image> or image parts) but 2 image(s) in 'images'")
    add("data-completion-missing-text", lambda k: k.train(data={"format": "completion", "train": k.rows("d.jsonl", [{"txt": "a"}])}),
        "d.jsonl:1: missing field 'text'")
    add("data-parquet-garbage", lambda k: k.train(data={"train": k.file("d.parquet", b"PAR1 garbage")}), "d.parquet: not a readable Parquet file")
    add("data-json-not-a-list", lambda k: k.train(data={"train": k.file("d.json", '{"a": 1}')}), "d.json: expected a JSON list of rows")
    add("data-json-invalid", lambda k: k.train(data={"train": k.file("d.json", '[{"a": 1},')}), "d.json:1: invalid JSON")
    add("data-tsv", lambda k: k.train(data={"train": k.file("d.tsv", "a\tb\n")}), "d.tsv: unsupported data file type '.tsv'")
    add("data-dotted-name", lambda k: k.train(data={"train": k.file("d.v2.tsv", "a\tb\n")}), "d.v2.tsv: unsupported data file type '.tsv'")
    add("data-csv-extra-field", lambda k: k.train(data={"train": k.file("d.csv", "instruction,output\nhi,there,again\n")}),
        "d.csv:2: 1 more fields than the header names")
    add("data-csv-missing-column", lambda k: k.train(data={"train": k.file("e.csv", "question,output\nhi,there\n")}),
        "e.csv:2: missing field 'instruction' (format 'alpaca'; set data.bad_rows: skip to skip bad rows)")
    add("data-columns-unknown-field", lambda k: k.train(data={"columns": {"question": "q"}}), "data.columns.question")
    add("data-only-blank-lines", lambda k: k.train(data={"train": k.file("d.jsonl", "\n\n")}), "data: no usable rows in")
    add("data-eval-missing", lambda k: k.train(data={"eval": str(k.tmp / "none.jsonl")}), "eval: file not found")
    add("data-eval-and-fraction", lambda k: k.train(data={"eval": str(DEMO_DATA / "eval.jsonl"), "eval_fraction": 0.1}),
        "set either data.eval or data.eval_fraction")
    add("data-format-bogus", lambda k: k.train(data={"format": "sharegpt"}),
        "data.format: Input should be 'completion', 'alpaca', 'chat', 'preference', 'prompt' or 'unpaired'")
    add("data-max-seq-len-one", lambda k: k.train(data={"max_seq_len": 1}), "data.max_seq_len: Input should be greater than or equal to 2")
    add("data-max-seq-len-over-model", lambda k: k.train(data={"max_seq_len": 100000}), "data.max_seq_len: 100000 is larger than the model's")
    add("data-bad-rows-bogus", lambda k: k.train(data={"bad_rows": "ignore"}), "data.bad_rows: Input should be 'fail' or 'skip'")
    add("data-chat-template-unknown", lambda k: k.train(data={"chat_template": "vicuna"}), "data.chat_template: expected chatml, llama3, alpaca")
    add("data-num-proc-zero", lambda k: k.train(data={"num_proc": 0}), "data.num_proc: Input should be greater than 0")
    add("data-eval-fraction-one", lambda k: k.train(data={"eval_fraction": 1.0}), "data.eval_fraction: Input should be less than 1")
    add("data-source-unknown-key", lambda k: k.train(data={"train": [{"path": str(DEMO_DATA / "train.jsonl"), "wieght": 2}]}), "wieght")
    add("data-source-weight-zero", lambda k: k.train(data={"train": [{"path": str(DEMO_DATA / "train.jsonl"), "weight": 0}]}),
        "weight: Input should be greater than 0")
    add("data-source-missing-file", lambda k: k.train(data={"train": [{"path": str(k.tmp / "gone.jsonl")}]}), "train: file not found")
    add("data-all-prompts-too-long", lambda k: k.train(data={"max_seq_len": 4, "train": k.rows("d.jsonl", [GOOD_ROW] * 8)}),
        "has a trained token within data.max_seq_len=4")
    add("data-too-few-rows", lambda k: k.train(data={"train": k.rows("d.jsonl", [GOOD_ROW] * 2), "packing": False}, train={"grad_accum": 8}),
        "fewer than train.grad_accum=8")
    add("chat-without-template", lambda k: k.train(model={"name_or_path": str(k.model_copy(_no_template))},
                                                   data={"format": "chat", "train": k.rows("d.jsonl", [{"messages": [
                                                       {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}])}),
        "data.chat_template: the model's tokenizer has no chat template")
    add("chat-template-file-missing", lambda k: k.train(data={"chat_template": str(k.tmp / "t.jinja")}), "data.chat_template: expected chatml")
    add("chat-template-not-utf8", lambda k: k.train(data={"chat_template": k.file("t.jinja", b"\xff\xfe{{ x }}")}), "t.jinja: cannot read it")
    add("chat-template-tokens-missing", lambda k: k.train(data={"chat_template": "chatml"}), "chatml is written in tokens this tokenizer does not have")
    # The model folder
    add("model-folder-missing", lambda k: k.train(model={"name_or_path": str(k.tmp / "gone")}), "model.name_or_path: folder not found")
    add("model-no-config", lambda k: k.train(model={"name_or_path": str(k.model_copy(lambda m: (m / "config.json").unlink()))}),
        "has no config.json")
    add("model-config-garbage", lambda k: k.train(model={"name_or_path": str(k.model_copy(lambda m: (m / "config.json").write_text("{{{")))}),
        "config.json is not valid JSON")
    add("model-config-a-list", lambda k: k.train(model={"name_or_path": str(k.model_copy(lambda m: (m / "config.json").write_text("[1]")))}),
        "config.json: expected a JSON object")
    add("model-config-not-utf8", lambda k: k.train(model={"name_or_path": str(k.model_copy(lambda m: (m / "config.json").write_bytes(b"\xff")))}),
        "config.json is not valid JSON")
    add("model-config-fields-disagree", lambda k: k.train(model={"name_or_path": str(k.model_copy(lambda m: (m / "config.json").write_text(
        json.dumps({**json.loads((m / "config.json").read_text()), "layer_types": ["full_attention"] * 7}))))}),
        "must be equal to the number of `layer_types` (7)")
    add("model-weights-truncated", lambda k: k.train(model={"name_or_path": str(k.model_copy(
        lambda m: _weights(m).write_bytes(_weights(m).read_bytes()[:500])))}), "model.name_or_path: cannot load")
    add("model-weights-garbage", lambda k: k.train(model={"name_or_path": str(k.model_copy(lambda m: _weights(m).write_bytes(b"x" * 4096)))}),
        "model.name_or_path: cannot load")
    add("model-weights-wrong-shapes", lambda k: k.train(model={"name_or_path": str(k.model_copy(lambda m: (m / "config.json").write_text(
        json.dumps({**json.loads((m / "config.json").read_text()), "hidden_size": 32}))))}), "model.name_or_path: cannot load")
    add("model-weights-missing", lambda k: k.train(model={"name_or_path": str(k.model_copy(lambda m: _weights(m).unlink()))}),
        "model.name_or_path: cannot load")
    add("model-tokenizer-garbage", lambda k: k.train(model={"name_or_path": str(k.model_copy(lambda m: (m / "tokenizer.json").write_text("{oops")))}),
        "model.name_or_path: cannot load a tokenizer")
    add("model-dtype-bogus", lambda k: k.train(model={"dtype": "int4"}), "model.dtype: Input should be")
    add("model-attn-bogus", lambda k: k.train(model={"attn_implementation": "fast"}), "model.attn_implementation: Input should be")
    add("model-flash-on-cpu", lambda k: k.train(model={"attn_implementation": "flash_attention_2"}), "needs a CUDA GPU")
    add("model-trust-remote-code-text", lambda k: k.train(model={"trust_remote_code": "maybe"}), "model.trust_remote_code: Input should be a valid boolean")
    add("model-ramdisk-reserve-negative", lambda k: k.train(model={"ramdisk_reserve_gib": -1}), "model.ramdisk_reserve_gib: Input should be")
    add("quant-bits-3", lambda k: k.train(model={"quantization": {"bits": 3}}), "model.quantization.bits: Input should be 4 or 8")
    add("quant-full", lambda k: k.train(model={"quantization": {"bits": 4}}, adapter={"method": "full"}), "quantized weights cannot be fully fine-tuned")
    add("quant-8bit-dora-cpu", lambda k: k.train(model={"quantization": {"bits": 8}}, adapter={"method": "dora"}), "8-bit + DoRA fails")
    add("quant-fsdp-bitsandbytes", lambda k: k.train(model={"quantization": {"bits": 4, "backend": "bitsandbytes"}}, distributed={"strategy": "fsdp"}),
        "FSDP2 drops bitsandbytes' quantization state")
    add("quant-torchao-8bit", lambda k: k.train(model={"quantization": {"bits": 8, "backend": "torchao"}}), "it needs bits: 4")
    add("fsdp-8bit-optimizer", lambda k: k.train(train={"optimizer": "paged_adamw_8bit"}, distributed={"strategy": "fsdp"}),
        "steps plain tensors, not FSDP2's sharded ones")
    add("quant-fp16-cpu", lambda k: k.train(model={"quantization": {"bits": 4, "compute_dtype": "float16"}}), "float16 compute with a quantized base")
    add("quant-4bit-odd-width-cpu", lambda k: k.train(model={"name_or_path": str(k.model_copy(lambda m: (m / "config.json").write_text(
        json.dumps({**json.loads((m / "config.json").read_text()), "intermediate_size": 100})))), "quantization": {"bits": 4}}),
        "4-bit on CPU needs layer widths divisible by 32; intermediate_size=100")
    # Adapter
    add("adapter-method-bogus", lambda k: k.train(adapter={"method": "qlora"}), "adapter.method: Input should be 'lora', 'dora' or 'full'")
    add("adapter-r-zero", lambda k: k.train(adapter={"r": 0}), "adapter.r: Input should be greater than 0")
    add("adapter-alpha-negative", lambda k: k.train(adapter={"alpha": -1}), "adapter.alpha: Input should be greater than 0")
    add("adapter-dropout-one", lambda k: k.train(adapter={"dropout": 1.0}), "adapter.dropout: Input should be less than 1")
    add("adapter-targets-nothing", lambda k: k.train(adapter={"target_modules": ["qq_proj"]}), "adapter.target_modules: qq_proj matches no layer")
    add("adapter-targets-empty", lambda k: k.train(adapter={"target_modules": []}), "adapter.target_modules: name at least one module")
    add("adapter-modules-to-save-nothing", lambda k: k.train(adapter={"modules_to_save": ["lm_headd"]}),
        "adapter.modules_to_save: lm_headd matches no module")
    # Train
    add("train-lr-zero", lambda k: k.train(train={"lr": 0}), "train.lr: Input should be greater than 0")
    add("train-lr-text", lambda k: k.train(train={"lr": "fast"}), "train.lr: Input should be a valid number")
    add("train-epochs-zero", lambda k: k.train(train={"epochs": 0}), "train.epochs: Input should be greater than 0")
    add("train-max-steps-zero", lambda k: k.train(train={"max_steps": 0}), "train.max_steps: Input should be greater than 0")
    add("train-micro-batch-zero", lambda k: k.train(train={"micro_batch_size": 0}), "train.micro_batch_size: Input should be greater than 0")
    add("train-grad-accum-zero", lambda k: k.train(train={"grad_accum": 0}), "train.grad_accum: Input should be greater than 0")
    add("train-optimizer-bogus", lambda k: k.train(train={"optimizer": "adam"}), "train.optimizer: Input should be")
    add("train-scheduler-bogus", lambda k: k.train(train={"scheduler": "step"}), "train.scheduler: Input should be")
    add("train-fp16-cpu", lambda k: k.train(train={"mixed_precision": "fp16"}), "train.mixed_precision: fp16 needs a GPU")
    add("train-fp8-cpu", lambda k: k.train(train={"mixed_precision": "fp8"}), "train.mixed_precision: fp8 needs an NVIDIA GPU")
    add("train-precision-bogus", lambda k: k.train(train={"mixed_precision": "tf32"}), "train.mixed_precision: Input should be")
    add("train-betas-one", lambda k: k.train(train={"betas": [0.9]}), "train.betas")
    add("train-skip-data-malformed", lambda k: k.train(train={"skip_data": [[1]]}), "train.skip_data")
    add("train-warmup-negative", lambda k: k.train(train={"warmup_steps": -1}), "train.warmup_steps: Input should be greater than or equal to 0")
    add("train-clip-zero", lambda k: k.train(train={"max_grad_norm": 0}), "train.max_grad_norm: Input should be greater than 0")
    add("train-checkpointing-text", lambda k: k.train(train={"gradient_checkpointing": "please"}), "train.gradient_checkpointing: Input should be")
    add("train-weight-decay-negative", lambda k: k.train(train={"weight_decay": -0.1}), "train.weight_decay: Input should be greater than or equal to 0")
    add("train-optimizer-offload-cpu", lambda k: k.train(train={"optimizer_offload": True}), "train.optimizer_offload")
    add("train-output-dir-a-file", lambda k: k.train(train={"output_dir": k.file("out.txt", "mine")}), "out.txt is a file")
    add("train-output-dir-under-a-file", lambda k: k.train(train={"output_dir": str(Path(k.file("f.txt", "mine")) / "out")}),
        "train.output_dir: cannot create")
    add("train-output-dir-unwritable", lambda k: k.train(train={"output_dir": "/proc/finetune-out"}), "train.output_dir: cannot create /proc/finetune-out")
    add("train-output-dir-foreign", lambda k: (k.file("out/notes.txt", "mine"), k.train())[1], "holds files that are not a finetune run's (notes.txt)")
    # Eval, logging, checkpoints, guard, watchdog, distributed
    add("eval-every-negative", lambda k: k.train(eval={"every": -1}), "eval.every: Input should be greater than or equal to 0")
    add("eval-generate-fsdp", lambda k: k.train(eval={"generate_samples": 2}, distributed={"strategy": "fsdp"}), "eval.generate_samples: not available")
    add("logging-tracker-bogus", lambda k: k.train(logging={"report_to": ["comet"]}), "logging.report_to.0: Input should be")
    add("logging-tracker-unknown", lambda k: k.train(logging={"report_to": ["comet"]}),
        "logging.report_to.0: Input should be 'tensorboard', 'wandb' or 'mlflow'")
    add("logging-every-zero", lambda k: k.train(logging={"log_every": 0}), "logging.log_every: Input should be greater than 0")
    add("resume-path-missing", lambda k: k.train(checkpoint={"resume": str(k.tmp / "gone")}), "checkpoint.resume: expected auto, never or a checkpoint")
    add("resume-not-a-checkpoint", lambda k: k.train(checkpoint={"resume": str((k.tmp / "ck").mkdir() or k.tmp / "ck")}), "checkpoint.resume:")
    add("resume-manifest-null", lambda k: k.train(checkpoint={"resume": str(Path(k.file("ck/manifest.json", "null")).parent)}), "checkpoint.resume:")
    add("resume-manifest-list", lambda k: k.train(checkpoint={"resume": str(Path(k.file("ck/manifest.json", "[1, 2]")).parent)}), "checkpoint.resume:")
    add("keep-last-zero", lambda k: k.train(checkpoint={"keep_last": 0}), "checkpoint.keep_last: Input should be greater than or equal to 1")
    add("guard-window-one", lambda k: k.train(guard={"window": 1}), "guard.window: Input should be greater than 1")
    add("guard-backoff-two", lambda k: k.train(guard={"lr_backoff": 2}), "guard.lr_backoff: Input should be less than or equal to 1")
    add("watchdog-factor-one", lambda k: k.train(watchdog={"factor": 1}), "watchdog.factor: Input should be greater than 1")
    add("strategy-bogus", lambda k: k.train(distributed={"strategy": "zero4"}), "distributed.strategy: Input should be")
    add("expert-parallel-zero3", lambda k: k.train(distributed={"strategy": "zero3", "expert_parallel": 2}),
        "distributed.expert_parallel: 2 runs with distributed.strategy ddp or fsdp")
    add("expert-parallel-fsdp-4bit", lambda k: k.train(model={"quantization": {"bits": 4}}, distributed={"strategy": "fsdp", "expert_parallel": 2}),
        "distributed.expert_parallel: 2 runs with a 16-bit base under distributed.strategy fsdp")
    add("expert-parallel-full", lambda k: k.train(adapter={"method": "full"}, distributed={"expert_parallel": 2}),
        "distributed.expert_parallel: 2 runs with adapter.method lora")
    add("expert-parallel-one-process", lambda k: k.train(distributed={"expert_parallel": 2}), "distributed.expert_parallel: 2 does not divide the 1 processes")
    add("fsdp-shard-size-zero", lambda k: k.train(distributed={"fsdp_shard_size": 0}), "distributed.fsdp_shard_size: Input should be greater than 0")
    add("fsdp-cpu-offload-cpu", lambda k: k.train(distributed={"strategy": "fsdp", "fsdp_cpu_offload": True}), "fsdp_cpu_offload")
    # Flags and --set
    add("set-no-equals", lambda k: k.train("--set", "train.lr"), "--set train.lr: expected KEY=VALUE")
    add("set-empty-key", lambda k: k.train("--set", "=3"), "--set =3: the key is empty")
    add("set-empty-part", lambda k: k.train("--set", "train..lr=1"), "--set train..lr=1: the key is empty")
    add("set-yaml-tag", lambda k: k.train("--set", "train.lr=!!python/object:os.system x"),
        "--set train.lr=!!python/object:os.system x: not a plain YAML value")
    add("set-unparsable", lambda k: k.train("--set", "train.lr=[1,"), "--set train.lr=[1,: not a plain YAML value")
    add("set-into-a-value", lambda k: k.train("--set", "train.lr.x=1"), "lr is not a section")
    add("set-unknown-key", lambda k: k.train("--set", "train.lrr=1"), "train.lrr: unknown key")
    add("flag-max-steps-text", lambda k: k.train("--max-steps", "ten"), "argument --max-steps: invalid int value: 'ten'")
    add("flag-max-steps-zero", lambda k: k.train("--max-steps", "0"), "train.max_steps: Input should be greater than 0")
    add("flag-unknown", lambda k: k.train("--lr", "1"), "unrecognized arguments: --lr 1")
    add("command-unknown", lambda k: ["trian"], "invalid choice: 'trian'")
    add("train-without-config", lambda k: ["train"], "the following arguments are required: --config")
    add("validate-bad-key", lambda k: ["validate", "--config", k.config(train={"lrr": 1})], "train.lrr: unknown key")
    # plan
    add("plan-gpus-zero", lambda k: ["plan", "--config", k.config(), "--gpus", "0"], "--gpus: expected at least 1")
    add("plan-gpus-negative", lambda k: ["plan", "--config", k.config(), "--gpus", "-2"], "--gpus: expected at least 1")
    add("plan-gpu-mem-bogus", lambda k: ["plan", "--config", k.config(), "--gpu-mem", "lots"], "--gpu-mem lots: expected a size like 80GiB")
    add("plan-gpu-mem-zero", lambda k: ["plan", "--config", k.config(), "--gpu-mem", "0GiB"], "--gpu-mem 0GiB: expected a size like 80GiB")
    add("plan-hub-id", lambda k: ["plan", "--config", k.config(model={"name_or_path": "someone/model"})], "the planner reads a local model folder")
    add("plan-config-garbage",
        lambda k: ["plan", "--config", k.config(model={"name_or_path": str(k.model_copy(lambda m: (m / "config.json").write_text("{{")))})],
        "config.json is not valid JSON")
    add("plan-config-lacks-keys",
        lambda k: ["plan", "--config", k.config(model={"name_or_path": str(k.model_copy(lambda m: (m / "config.json").write_text('{"a": 1}')))})],
        "lacks")
    # merge
    add("merge-adapter-missing", lambda k: ["merge", "--adapter", str(k.tmp / "gone"), "--out", str(k.tmp / "m")], "--adapter: no such folder")
    add("merge-adapter-empty-folder", lambda k: ["merge", "--adapter", str((k.tmp / "a").mkdir() or k.tmp / "a"), "--out", str(k.tmp / "m")],
        "is neither a PEFT adapter")
    add("merge-adapter-config-garbage", lambda k: ["merge", "--adapter", str(Path(k.file("a/adapter_config.json", "{oops")).parent), "--out", str(k.tmp / "m")],
        "adapter_config.json is not valid JSON")
    add("merge-adapter-config-list", lambda k: ["merge", "--adapter", str(Path(k.file("a/adapter_config.json", "[]")).parent), "--out", str(k.tmp / "m")],
        "adapter_config.json: expected a JSON object")
    add("merge-adapter-weights-missing", lambda k: ["merge", "--adapter", str((k.adapter() / "adapter_model.safetensors").unlink() or k.tmp / "adapter"),
                                                    "--out", str(k.tmp / "m")],
        "has adapter_config.json but no adapter_model.safetensors")
    add("merge-out-a-file", lambda k: ["merge", "--adapter", str(k.adapter()), "--out", k.file("m.txt", "mine")], "--out:")
    add("merge-out-not-empty", lambda k: ["merge", "--adapter", str(k.adapter()), "--out", str(Path(k.file("m/x.txt", "mine")).parent)],
        "already exists and is not empty")
    add("merge-shard-size-bogus", lambda k: ["merge", "--adapter", str(k.adapter()), "--out", str(k.tmp / "m"), "--max-shard-size", "huge"],
        "argument --max-shard-size: huge: expected a size like 5GB")
    add("merge-prompts-missing", lambda k: ["merge", "--adapter", str(k.adapter()), "--out", str(k.tmp / "m"), "--check-prompts", str(k.tmp / "p.txt")],
        "--check-prompts: no such file")
    add("merge-tolerance-negative", lambda k: ["merge", "--adapter", str(k.adapter()), "--out", str(k.tmp / "m"), "--tolerance", "-1"],
        "--tolerance: expected a number above 0")
    add("merge-dtype-bogus", lambda k: ["merge", "--adapter", str(k.adapter()), "--out", str(k.tmp / "m"), "--dtype", "int8"],
        "argument --dtype: invalid choice")
    # generate
    add("generate-max-new-tokens-negative", lambda k: ["generate", "--model", str(k.model), "--prompt", "hi", "--max-new-tokens", "-1"],
        "--max-new-tokens: expected at least 1")
    add("generate-max-new-tokens-zero", lambda k: ["generate", "--model", str(k.model), "--prompt", "hi", "--max-new-tokens", "0"],
        "--max-new-tokens: expected at least 1")
    add("generate-temperature-negative", lambda k: ["generate", "--model", str(k.model), "--prompt", "hi", "--temperature", "-1"],
        "--temperature: expected 0 (greedy) or more")
    add("generate-model-missing", lambda k: ["generate", "--model", str(k.tmp / "gone"), "--prompt", "hi"], "folder not found")
    add("generate-adapter-missing", lambda k: ["generate", "--adapter", str(k.tmp / "gone"), "--prompt", "hi"], "--adapter: no such folder")
    add("generate-model-config-garbage", lambda k: ["generate", "--model", str(k.model_copy(lambda m: (m / "config.json").write_text("{{"))), "--prompt", "hi"],
        "config.json is not valid JSON")
    # stage
    add("stage-model-missing", lambda k: ["stage", "--model", str(k.tmp / "gone"), "--root", str(k.tmp / "ram")], "gone")
    add("stage-reserve-negative", lambda k: ["stage", "--model", str(k.model), "--root", str(k.tmp / "ram"), "--reserve-gib", "-1"],
        "--reserve-gib: expected 0 or more")
    add("stage-root-a-file", lambda k: ["stage", "--model", str(k.model), "--root", k.file("ram.txt", "mine")], "ram.txt")
    # make-demo-model
    add("demo-out-a-file", lambda k: ["make-demo-model", "--out", k.file("m.txt", "mine")], "--out")
    add("demo-out-not-empty", lambda k: ["make-demo-model", "--out", str(Path(k.file("m/x.txt", "mine")).parent)], "holds files (x.txt)")
    add("demo-steps-zero", lambda k: ["make-demo-model", "--out", str(k.tmp / "m"), "--steps", "0"], "--steps: expected at least 1")
    return c


def _snapshot(*folders: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for folder in folders for p in folder.rglob("*") if p.is_file()}


OUTPUTS = ("out", "m", "ram")  # the folders the commands above write to: what they may leave there is theirs


@pytest.mark.parametrize("build, expect", _cases())
def test_bad_input_is_one_line_and_exit_2(tmp_path, tiny_model_dir, capsys, build, expect):
    case = Case(tmp_path, tiny_model_dir)
    argv = build(case)
    before = _snapshot(tmp_path, tiny_model_dir)
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert code == 2, err
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in err, err  # progress bars may come before it
    assert expect in errors[0], errors[0]
    after = _snapshot(tmp_path, tiny_model_dir)
    changed = {p for p in after if after[p] != before.get(p)} | (set(before) - set(after))
    assert all(p.is_relative_to(tmp_path) and p.relative_to(tmp_path).parts[0] in OUTPUTS for p in changed), changed


# What train refuses before it loads anything (finetune/run/preflight.py): validate refuses it alike.
# Not among them: an output folder under /proc (root passes every access check; only creating it tells).
PREFLIGHT = {"model-flash-on-cpu", "quant-8bit-dora-cpu", "quant-fp16-cpu", "quant-4bit-odd-width-cpu", "train-fp16-cpu", "train-fp8-cpu",
             "train-optimizer-offload-cpu", "fsdp-cpu-offload-cpu", "logging-tracker-unknown", "train-output-dir-a-file",
             "train-output-dir-under-a-file", "train-output-dir-foreign"}


@pytest.mark.parametrize("build, expect", [c for c in _cases() if c.id in PREFLIGHT])
def test_validate_refuses_what_train_refuses_before_loading(tmp_path, tiny_model_dir, capsys, build, expect):
    argv = build(Case(tmp_path, tiny_model_dir))
    assert argv[0] == "train"
    capsys.readouterr()
    assert main(["validate", *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert expect in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out" / "config.json").exists()  # validate writes nothing


def test_preflight_cases_exist():
    assert PREFLIGHT <= {c.id for c in _cases()}


def test_what_the_user_plainly_meant_is_accepted(tmp_path, tiny_model_dir, capsys):
    """YAML reads an unquoted `no` as false: train.mixed_precision: no still means no autocast."""
    case = Case(tmp_path, tiny_model_dir)
    assert main(["validate", "--config", case.config(), "--set", "train.mixed_precision=no"]) == 0
    assert "mixed_precision: 'no'" in capsys.readouterr().out
    assert main(["validate", "--config", case.config("model: {name_or_path: %s}\ndata: {train: %s, max_seq_len: 128}\ntrain: {mixed_precision: no}\n"
                                                     % (tiny_model_dir, DEMO_DATA / "train.jsonl"))]) == 0


def test_a_model_named_by_id_meets_the_refusals_a_folder_meets(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """preflight reads a hub id's config as loading does (here from the Hub's cache, offline): a vision-language family not
    built is refused in one line, as for a folder, not passed as a text model to fail later."""
    from transformers import PaliGemmaConfig

    PaliGemmaConfig().save_pretrained(tmp_path / "vlm")
    model = hub_cached(monkeypatch, tmp_path / "hub", "acme/tiny-vlm", tmp_path / "vlm")
    case = Case(tmp_path, tiny_model_dir)
    assert main(["validate", "--config", case.config(model={"name_or_path": model})]) == 2
    from finetune.model.vision import FAMILIES

    assert capsys.readouterr().err.strip() == ("error: model: paligemma is a vision-language model finetune does not fine-tune yet; it "
                                               f"fine-tunes {', '.join(FAMILIES.values())} (docs/vision.md)")


def test_a_student_named_by_id_is_checked_against_its_teacher_by_their_configs(tmp_path, tiny_model_dir, monkeypatch):
    """The vocabulary check reads both models' text configs as loading reads them: a student named by id passes against a
    teacher of its vocabulary, and a teacher of another width is refused naming both widths."""
    from transformers import AutoConfig, AutoTokenizer

    from finetune.config.errors import UserError
    from finetune.config.schema import ModelConfig
    from finetune.model.teacher import teacher_source

    student = ModelConfig(name_or_path=hub_cached(monkeypatch, tmp_path / "hub", "acme/tiny-student", tiny_model_dir))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert teacher_source(str(tiny_model_dir), student, tokenizer)[0].name_or_path == str(tiny_model_dir)
    wider = tmp_path / "wider"
    shutil.copytree(tiny_model_dir, wider)
    config = AutoConfig.from_pretrained(wider)
    config.vocab_size += 64
    config.save_pretrained(wider)
    with pytest.raises(UserError, match=rf"distill.teacher: its model has {config.vocab_size} logits per token, the student "
                                        rf"{config.vocab_size - 64}; distillation needs the same vocabulary size"):
        teacher_source(str(wider), student, tokenizer)


def test_programming_errors_are_not_bad_rows_and_a_lost_exit_code_is_said(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """A chat template's refusal is a bad row (one line); a message that is not a dict is the caller's bug and surfaces as
    such, never dropped by data.bad_rows: skip. An exit code the launch script cannot be told of is said on stderr."""
    from transformers import AutoTokenizer

    from finetune.config.errors import EXIT_FILE_VAR, EXIT_PREEMPTED, UserError, record_exit
    from finetune.data.chat import render

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = "{{ raise_exception('no system turns') if messages[0]['role'] == 'system' }}{{ messages[0]['content'] }}"
    with pytest.raises(UserError, match="data: the chat template cannot render a row: no system turns"):
        render(tokenizer, [{"role": "system", "content": "x"}])
    with pytest.raises(AttributeError):
        render(tokenizer, ["a message that is not a dict"])
    monkeypatch.setenv(EXIT_FILE_VAR, str(tmp_path / "gone" / "exit"))
    record_exit(EXIT_PREEMPTED)
    assert capsys.readouterr().err.startswith(f"error: exit code 75 not recorded in {EXIT_FILE_VAR}={tmp_path / 'gone' / 'exit'} (")
