"""`finetune` command line: train, validate, data, plan, stage, merge, export, eval, generate, configs, make-demo-model, make-vision-demo.

Bad input ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import re
import sys
import warnings
from typing import NoReturn

from finetune.config.errors import EXIT_MERGE_CHECK, Stopped, UserError, clear_recorded_exit, record_exit
from finetune.config.schema import DEFAULT_RAMDISK, ModelConfig, validate_config
from finetune.config.strategy import NAMES as STRATEGIES

# Flags that are shorthands for schema keys (they are applied as --set overrides, after the file).
SHORTHANDS = {"output_dir": "train.output_dir", "max_steps": "train.max_steps", "model": "model.name_or_path",
              "overfit_batch": "train.overfit_batch", "save_every": "checkpoint.save_every", "resume": "checkpoint.resume",
              "seq_len": "data.max_seq_len", "sequence_parallel": "distributed.sequence_parallel", "tensor_parallel": "distributed.tensor_parallel",
              "expert_parallel": "distributed.expert_parallel"}


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="run config YAML (see configs/ and docs/configuration.md for every key)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set train.lr=1e-4 --set adapter.r=8 (repeatable; values parsed as YAML)")
    p.add_argument("--output-dir", help="same as --set train.output_dir=DIR")
    p.add_argument("--max-steps", type=int, help="same as --set train.max_steps=N")
    p.add_argument("--model", help="same as --set model.name_or_path=PATH_OR_ID")
    p.add_argument("--overfit-batch", type=int, metavar="N", help="sanity check: train N steps on the first batch only; the loss should go near zero")
    p.add_argument("--save-every", type=int, metavar="N", help="same as --set checkpoint.save_every=N")
    p.add_argument("--resume", metavar="auto|never|PATH", help="same as --set checkpoint.resume=...")


def _model_or_adapter(p: argparse.ArgumentParser, adapter_help: str) -> None:
    """--model DIR or --adapter DIR, one of them: what export, eval and generate read."""
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="DIR", help="a model folder (e.g. the output of finetune merge)")
    which.add_argument("--adapter", metavar="DIR", help=adapter_help)


def _number(kind, low, expected: str):
    """An argparse type: a number of this kind, at least `low` (above it when expected says so)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; expected {expected}") from None
        if value < low or (value == low and "above" in expected):
            raise argparse.ArgumentTypeError(f"expected {expected}")
        return value
    return parse


def _size(text: str) -> str:
    if not re.fullmatch(r"\d+(\.\d+)?\s*([KMGT]i?)?B", text.strip(), re.IGNORECASE):
        raise argparse.ArgumentTypeError(f"{text}: expected a size like 5GB or 500MB")
    return text


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other bad input (argparse prints its usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _output_commands(sub) -> None:
    """`merge` and `generate`: what a trained adapter or model becomes, and how it answers."""
    p = sub.add_parser("merge", help="merge an adapter into its base and write a plain HF model, verified",
                       description="Merge a LoRA/DoRA/QLoRA adapter (a run's output folder or a checkpoint mid-run) into its base and "
                       "write an ordinary Hugging Face model folder (sharded safetensors + index, config, generation config, tokenizer "
                       "with its chat template) that transformers loads without peft. Every merge is checked: on a few training "
                       "samples (or --check-prompts) the saved model's logits are compared with base+adapter; the numbers are printed "
                       "and written to OUT/merge_report.json, and above the tolerance nothing is written (exit 5).")
    p.add_argument("--adapter", required=True, metavar="DIR", help="adapter folder (OUTPUT, or OUTPUT/checkpoints/step-N)")
    p.add_argument("--out", metavar="DIR", help="new folder for the merged model (must not exist or be empty)")
    p.add_argument("--check-serving", action="store_true", help="only say whether vLLM loads the adapter as it is (its LoRA rules: no "
                   "modules_to_save, no DoRA, no bias, the rank within --max-lora-rank, linear modules only) and with which "
                   "--max-lora-rank; exit 5 where it would not (then merge)")
    p.add_argument("--overwrite", action="store_true", help="--out may hold an earlier merge: its files are replaced, any others kept")
    p.add_argument("--base", metavar="PATH_OR_ID", help="base model (default: the one the adapter names)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="dtype written (default: the base's stored dtype)")
    p.add_argument("--max-shard-size", type=_size, default="5GB", help="largest safetensors shard, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--qlora-base", choices=["dequantized", "original"],
                   help="QLoRA: merge into the dequantized 4-bit weights the adapter was trained on, or the original ones "
                   "(default: whichever reproduces 4-bit+adapter more closely; both are measured and reported)")
    p.add_argument("--check-prompts", metavar="FILE", help="texts to compare logits on, one per line (default: training samples)")
    p.add_argument("--tolerance", type=_number(float, 0, "a number above 0"),
                   help="largest |logit difference| accepted (default by dtype: fp32 1e-3, fp16 0.05, bf16 0.25; 0.25 too when the 4-bit "
                   "reference computes in bf16)")

    p = sub.add_parser("export", help="write a model or an adapter as one GGUF file for llama.cpp and Ollama, verified",
                       description="Write a model folder (merged or fully fine-tuned), or an adapter merged first, as one GGUF file "
                       "through the gguf package (llama.cpp's own writer; k-quants by llama.cpp's quantizer), then read it in "
                       "llama.cpp itself (llama-cpp-python; else transformers' GGUF loader) and compare its token ids, logits and greedy "
                       "tokens with the model's; above the tolerance nothing is written (exit 5). An Ollama Modelfile is written beside "
                       "it. With --lora, an adapter alone as a GGUF LoRA file. Families: llama, mistral, qwen2, qwen3, gemma2.")
    _model_or_adapter(p, "a run's adapter (or a checkpoint): merged in fp32 first, then exported")
    p.add_argument("--lora", action="store_true", help="with --adapter: write the adapter alone as a GGUF LoRA file for llama.cpp "
                   "(llama-cli -m BASE.gguf --lora FILE), checked by applying it in llama.cpp to the base (needs llama-cpp-python)")
    p.add_argument("--format", choices=["gguf"], default="gguf", help="the file format (gguf)")
    p.add_argument("--out", required=True, metavar="FILE", help="the GGUF file to write (a new file)")
    p.add_argument("--type", choices=["f16", "q8_0", "q4_k_m", "q5_k_m", "q6_k"], default="f16",
                   help="f16 (default), q8_0 (8-bit blocks, llama.cpp's Q8_0), or a k-quant made by llama.cpp's own quantizer (needs llama-cpp-python)")

    p = sub.add_parser("eval", help="score a model or an adapter on lm-evaluation-harness tasks",
                       description="Run EleutherAI's lm-evaluation-harness on a model folder or on base + adapter as trained (a run "
                       "folder or a checkpoint), through its Python API: registered task names whose data is reachable, or task YAML "
                       "files in the harness's format (their local data files taken relative to the file). Prompts go through the "
                       "tokenizer's chat template where it has one. Prints the table and writes it as JSON to --out, by default "
                       "harness_eval.json in the current folder (harness_eval-2.json, ... if taken). A vision-language model runs through the "
                       "harness's hf-multimodal model (generate_until tasks). The demos' tasks: demo/eval/word_kind.yaml, "
                       "demo/eval/picture_shape.yaml.")
    _model_or_adapter(p, "an adapter folder or checkpoint; its base is loaded as in training")
    p.add_argument("--base", metavar="PATH_OR_ID", help="with --adapter: another base than the one it names")
    p.add_argument("--tasks", required=True, help="comma-separated task names or task YAML files")
    p.add_argument("--limit", type=_number(int, 1, "at least 1"), help="at most this many samples per task")
    p.add_argument("--batch-size", type=_number(int, 1, "at least 1"), default=8, help="samples per forward (default 8)")
    p.add_argument("--out", metavar="FILE", help="write the results here (a new file) instead of beside the model")
    p.add_argument("--log-samples", action="store_true", help="also write each sample's target and the model's answer into the results file")

    p = sub.add_parser("score", help="score rows with a reward model (train.objective: reward)",
                       description="Score each {prompt, completion} row of a JSONL/JSON/Parquet/CSV file (text, or chat messages with the "
                       "completion as an assistant message or string) with a reward model that train.objective: reward saved (its run "
                       "folder: an adapter over its base, or a full model folder): prompt and completion tokenized together as in "
                       "training, the score at the last token. Writes every row with its score as JSONL to --out.")
    p.add_argument("--model", metavar="DIR", required=True, help="the reward model: a run folder of train.objective: reward, or its model folder")
    p.add_argument("--data", metavar="FILE", required=True, help="rows {prompt, completion} to score")
    p.add_argument("--out", metavar="FILE", required=True, help="a new JSONL file: each row with its score")

    p = sub.add_parser("generate", help="try a model or an adapter on a prompt (tokens stream as they come), or answer a file of prompts",
                       description="Generate a continuation of a prompt with a model folder (merged or fully fine-tuned) or with "
                       "base + adapter as trained. Greedy unless --temperature is above 0.")
    _model_or_adapter(p, "an adapter folder or checkpoint; its base is loaded as in training")
    p.add_argument("--base", metavar="PATH_OR_ID", help="with --adapter: another base than the one it names")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="the prompt text (the answer streams to the terminal)")
    given.add_argument("--prompts", metavar="FILE", help='a JSONL file of {"prompt": ...} rows, answered in batches: each row comes back '
                       'with a "completion" added (other keys kept), to --out or standard output')
    p.add_argument("--out", metavar="FILE", help="with --prompts: write the JSONL here (a new file) instead of standard output")
    p.add_argument("--batch-size", type=_number(int, 1, "at least 1"), default=8, help="with --prompts: prompts per batch (default 8)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user turn through the tokenizer's chat template")
    p.add_argument("--image", metavar="PATH", help="with --prompt, a vision-language model: a picture the user turn shows (the chat template "
                   "is used)")
    p.add_argument("--max-new-tokens", type=_number(int, 1, "at least 1"), default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=_number(float, 0, "0 (greedy) or more"), default=0.0, help="sampling temperature; 0 = greedy (default)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="finetune", description="Fine-tune Hugging Face causal language models (LoRA, DoRA, full).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="fine-tune a model as a config describes",
                       description="Fine-tune a model as the config describes. Run it directly, or under "
                       "`accelerate launch` / `torchrun` for several processes (same flags).")
    _run_options(p)

    p = sub.add_parser("validate", help="check a config and print it fully resolved",
                       description="Validate a config (and overrides) without loading the model: everything `train` would refuse "
                       "before loading, this machine's hardware, packages, launcher and output folder included; then print every "
                       "key with its value. An output folder holding a finished run is named in a warning (train refuses it; "
                       "the config itself is fine).")
    _run_options(p)

    p = sub.add_parser("data", help="tokenize the data as train would and show what is trained",
                       description="Run train's data step alone: read and check every row, tokenize (filling the cache, so that "
                       "train then starts at once; on a cluster, do it once before launching), pack, print the counts train prints, "
                       "then the first sequences decoded as the model reads them, with the tokens the loss is taken on «marked».")
    _run_options(p)
    p.add_argument("--show", type=_number(int, 0, "0 or more"), default=3, metavar="N", help="sequences to print (default 3; 0: counts only)")

    p = sub.add_parser("plan", help="estimate memory per device before launching",
                       description="Estimate the memory a run needs per device (weights, gradients, optimizer states, "
                       "activations) from the model's config.json alone, say whether it fits, and which switch would make it fit.")
    _run_options(p)
    p.add_argument("--gpus", type=_number(int, 1, "at least 1"), default=1, metavar="N", help="devices the run is spread over (default 1)")
    p.add_argument("--gpu-mem", metavar="SIZE", help="memory per device, e.g. 80GiB (default: this machine's GPU, else its available RAM)")
    p.add_argument("--tflops", type=_number(float, 1e-9, "a positive number"), metavar="N",
                   help="peak dense TFLOP/s of one device in the training precision (e.g. 989 for an H100 SXM in bf16): also "
                        "predict the step time from FLOPs per token at --mfu, and the collectives at --bandwidth")
    p.add_argument("--mfu", type=_number(float, 1e-9, "a share of the peak, above 0"), default=0.4, metavar="F",
                   help="the share of --tflops the run reaches (default 0.4)")
    p.add_argument("--bandwidth", metavar="SIZE", help="collective bandwidth per device per second, e.g. 400GB (NVLink) or 50GB "
                   "(one 400 Gb/s NIC per GPU across nodes); default: communication not timed")
    p.add_argument("--seq-len", type=_number(int, 1, "at least 1"), metavar="N", help="plan rows of N tokens (same as --set data.max_seq_len=N)")
    p.add_argument("--sequence-parallel", type=_number(int, 1, "at least 1"), metavar="N",
                   help="each row's tokens over N of the --gpus devices (same as --set distributed.sequence_parallel=N)")
    p.add_argument("--tensor-parallel", type=_number(int, 1, "at least 1"), metavar="N",
                   help="each decoder layer split over N of the --gpus devices, FSDP over the rest (same as --set distributed.tensor_parallel=N)")
    p.add_argument("--expert-parallel", type=_number(int, 1, "at least 1"), metavar="N",
                   help="each mixture-of-experts layer's experts split over N of the --gpus devices, under ddp or fsdp "
                        "(same as --set distributed.expert_parallel=N)")
    p.add_argument("--strategy", choices=STRATEGIES, default=None,
                   help="as distributed.strategy (default: the config's): none/ddp: every device holds the whole model; fsdp: "
                        "weights, gradients and optimizer split over devices; zero2 (DeepSpeed): gradients and optimizer split; "
                        "zero3, zero3_offload (DeepSpeed): weights too (DeepSpeed adds an fp32 copy of each partition)")
    p.add_argument("--simulate", action="store_true",
                   help="also run rank 0's own training step (finetune's setup, one micro-batch, the optimizer step) on fake tensors "
                        "with a fake process group, and print its peak memory by role and its collectives beside the plan: "
                        "one process, ddp or fsdp (a 4-bit base with torchao); seconds to minutes on a CPU, no weights read")

    p = sub.add_parser("stage", help="copy a model into RAM once so runs load it in seconds; list or evict copies",
                       description="Copy a model folder (safetensors weights, configs, tokenizer) to a RAM-backed folder, verify it "
                       "with checksums, and reuse it while the source is unchanged (same sizes and mtimes). Runs with "
                       "model.ramdisk set do this themselves; one process per node copies, the others wait. Evicting a copy "
                       "does not disturb runs that are using it: they keep its pages until they exit.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", metavar="PATH_OR_ID", help="the model folder (or hub id) to stage")
    what.add_argument("--list", action="store_true", help="show what is staged, its size, source and whether it is current")
    what.add_argument("--evict", nargs="?", const="", metavar="NAME|SOURCE",
                      help="remove the copy of one model (its staged name or source path); with no value, remove all")
    p.add_argument("--root", default=DEFAULT_RAMDISK, help=f"staging folder on a tmpfs/ramfs mount (default {DEFAULT_RAMDISK})")
    p.add_argument("--reserve-gib", type=_number(float, 0, "0 or more"), default=ModelConfig.model_fields["ramdisk_reserve_gib"].default,
                   help="refuse to stage if less than this much RAM would stay available (default %(default)s)")
    p.add_argument("--revision", help="hub revision, for a hub id")
    p.add_argument("--verify", action="store_true", help="also compare checksums of the source and the copy; re-stage on a mismatch")

    _output_commands(sub)

    sub.add_parser("configs", help="list the shipped configs (train --config NAME takes any of them by name)",
                   description="List the configs shipped in configs/ and configs/presets/ with a line on each. `finetune train --config "
                   "qlora.yaml` (or just qlora) finds a shipped config by its name when no such file is in the working directory.")

    p = sub.add_parser("make-demo-model", help="build the small demo model from the shipped corpus",
                       description="Train a byte-level BPE tokenizer on the shipped corpus, build a small Llama model, "
                       "pretrain it briefly with finetune's own full fine-tuning, and save an ordinary HF model folder.")
    p.add_argument("--out", default="demo/model", help="output folder (default: demo/model)")
    p.add_argument("--steps", type=_number(int, 1, "at least 1"), default=None, help="pretraining steps (default: the demo's own)")
    p.add_argument("--overwrite", action="store_true", help="build even if the folder already holds files: the demo model's files "
                   "are replaced, any others are kept")
    p.add_argument("--hidden-size", type=_number(int, 16, "at least 16"), default=None, help="a narrower (or wider) model than the "
                   "demo's 256 (make demo-distill's student: 128); the same tokenizer, 4 heads")
    p.add_argument("--layers", type=_number(int, 1, "at least 1"), default=None, help="decoder layers (default: the demo's 4)")
    p = sub.add_parser("make-vision-demo", help="build the vision demo: synthetic pictures and a tiny LLaVA that describes them",
                       description="Draw pictures of shapes in colours (PIL), write rows about them (OUT/data: captions, and the demo's "
                       "question with train and held-out rows), build a tiny LLaVA (CLIP tower, Llama) and pretrain it whole to "
                       "describe the pictures (OUT/model). configs/vision.yaml then fine-tunes it on the question.")
    p.add_argument("--out", default="demo/vision", help="output folder (default: demo/vision)")
    p.add_argument("--steps", type=_number(int, 1, "at least 1"), default=None, help="pretraining steps (default: the demo's own)")
    p.add_argument("--overwrite", action="store_true", help="rebuild the pictures, rows and model")
    return parser


def resolve_config(args: argparse.Namespace, check_paths: bool = True):
    from finetune.config.files import load_config

    overrides = list(args.overrides)
    for flag, key in SHORTHANDS.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={value}")
    return load_config(args.config, overrides, check_paths=check_paths)


def quiet_libraries() -> None:
    """Our progress bar and summary lines are the output; libraries' load/save bars and notices are noise."""
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    # peft still calls transformers' pre-5.0 checkpointing names; the notice is for peft's authors.
    warnings.filterwarnings("ignore", message=r".*is deprecated and will be removed in v6", category=FutureWarning)
    # peft's advice to convert PiSSA/OLoRA adapters for the original base: finetune does it when it saves.
    warnings.filterwarnings("ignore", message=r"(PiSSA|OLoRA) changes the base weights", category=UserWarning)


# ------------------------------------------------------------------------------------------------
# The commands: one function each, named in COMMANDS


def train(args: argparse.Namespace) -> None:
    from finetune.run.supervise import watch_preemption

    watch_preemption()  # before the heavy imports: a SIGTERM during start-up still ends with 75
    from finetune.run.preflight import finished_job
    from finetune.train import run

    cfg = resolve_config(args)
    done = finished_job(cfg)
    if done:
        print(f"done: {done}")
        return
    run(cfg)


def validate(args: argparse.Namespace) -> None:
    from finetune.config.files import to_yaml
    from finetune.run import preflight

    cfg = resolve_config(args)
    preflight.check(cfg, warn=lambda line: print(f"warning: {line}", file=sys.stderr))  # what train would refuse, for this machine
    print(to_yaml(cfg), end="")


def data(args: argparse.Namespace) -> None:
    from finetune.data.chat import choose_template
    from finetune.data.datasets import load_data, show, summary_lines
    from finetune.model import vision
    from finetune.model.loading import load_tokenizer

    cfg = resolve_config(args)
    processor = vision.processor_for(cfg.model)
    tokenizer = load_tokenizer(cfg.model, processor)
    choose_template(tokenizer, cfg.data.chat_template, cfg.data.format, say=print)
    loaded = load_data(cfg.data, tokenizer, cfg.train.seed, processor=processor)
    print("\n".join(summary_lines(loaded, cfg.data.max_seq_len)))
    for text in show(loaded.train, tokenizer, args.show, picture_token=getattr(processor, "image_token", None)):
        print(text)


def plan(args: argparse.Namespace) -> None:
    from finetune.outputs import plan, steptime
    from finetune.run import preflight

    cfg = resolve_config(args, check_paths=False)  # a plan reads the model's shape alone
    gpu = args.gpu_mem is not None or __import__("torch").cuda.is_available()
    budget, where = (plan.parse_size(args.gpu_mem, "--gpu-mem"), "GPU") if args.gpu_mem else plan.available_memory()
    d = cfg.distributed
    for flag, size in (("--sequence-parallel", d.sequence_parallel), ("--tensor-parallel", d.tensor_parallel), ("--expert-parallel", d.expert_parallel)):
        if args.gpus % size:
            raise UserError(f"{flag} {size}: does not divide --gpus {args.gpus}")
    if d.expert_parallel > 1:
        from finetune.parallel import expert_parallel

        expert_parallel.check(preflight.model_json(cfg), d.expert_parallel)
    preflight.check_long_context(cfg, launched=False)  # the model's heads against the sequence-parallel size
    result = plan.checked_plan(cfg, devices=args.gpus, strategy=args.strategy, gpu=gpu)
    print(plan.render(result, budget, where, plan.alternatives(cfg, result, gpu)))
    print(plan.render_rows(cfg, result, budget, gpu))
    if args.mfu > 1:
        raise UserError(f"--mfu {args.mfu:g}: expected a share of the peak, above 0 and at most 1")
    if args.tflops:
        bandwidth = plan.parse_size(args.bandwidth, "--bandwidth") if args.bandwidth else 0.0
        print(steptime.render_time(steptime.step_time(cfg, result.setup, args.tflops, args.mfu, bandwidth), args.tflops, args.mfu, bandwidth))
    if args.simulate:
        from finetune.outputs import simulate

        # As planned (the --strategy asked, validated again: what depends on it, as the 4-bit backend, follows),
        # one micro-batch a step: the collectives of more repeat its gathers.
        raw = cfg.model_dump()
        raw["distributed"]["strategy"], raw["train"]["grad_accum"] = result.setup.strategy, 1
        cfg = validate_config(raw, "plan --simulate", check_paths=False)
        print(simulate.render(simulate.simulate(cfg, args.gpus), result, steptime.step_time(cfg, result.setup, 1.0, 1.0, 0.0).comm_bytes))


def stage(args: argparse.Namespace) -> None:
    from finetune.model import stage

    if args.list:
        rows = stage.listing(args.root)
        print(f"{'staged copy':<40} {'GiB':>7}  {'staged at':<19}  {'state':<24} source")
        for r in rows:
            print(f"{r['name']:<40} {r['bytes'] / 2**30:>7.2f}  {r['staged_at']:<19}  {r['state']:<24} {r['source']}")
        print(f"{len(rows)} staged under {args.root}" if rows else f"nothing staged under {args.root}")
    elif args.evict is not None:
        removed = stage.evict(args.root, args.evict or None)
        print(f"evicted {len(removed)}: {', '.join(removed)}" if removed else f"nothing staged under {args.root}")
    else:
        staged = stage.stage(args.model, args.root, args.reserve_gib, args.revision, verify=args.verify)
        verb = f"staged in {staged.seconds:.1f} s (verified)" if staged.copied else "already staged and current"
        print(f"{staged.path}: {staged.nbytes / 2**30:.2f} GiB, {verb}; set model.ramdisk: {args.root} "
              f"(or true for the default) to load from it")


def merge(args: argparse.Namespace) -> None:
    from finetune.outputs.merge import merge

    if args.check_serving:
        from finetune.model.adapters import find_adapter
        from finetune.outputs.serving import check_vllm

        serving = check_vllm(find_adapter(args.adapter, args.base).path)
        print(serving.line())
        if not serving.loads:
            raise Stopped("vLLM would not load this adapter as it is", exit_code=EXIT_MERGE_CHECK)
        return
    if not args.out:
        raise UserError("merge: --out is required (or --check-serving alone)")

    report = merge(args.adapter, args.out, base=args.base, dtype=args.dtype, max_shard_size=args.max_shard_size,
                   qlora_base=args.qlora_base, prompts_file=args.check_prompts, tolerance=args.tolerance, overwrite=args.overwrite)
    m, e = report["merged_vs_tuned"], report["adapter_effect"]
    print(f"merged {report['adapter']} into {report['base']} ({report['dtype']}"
          + (f", QLoRA: {report['qlora_base']} base" if "qlora_base" in report else "") + f") -> {args.out}\n"
          f"check on {report['check_texts']} texts" + (f" ({report['check_pictures']} pictures)" if report["check_pictures"] else "")
          + f": |logits - base+adapter| max {m['max']:.3g}, mean {m['mean']:.3g} "
          f"(tolerance {report['tolerance_max']:g}); the adapter moves the base's logits by max {e['max']:.3g}, mean {e['mean']:.3g}")


def generate(args: argparse.Namespace) -> None:
    from finetune.outputs.generate import answer_file, answer_picture, generate, load, processor_of, read_prompts

    if args.out and not args.prompts:
        raise UserError("--out: goes with --prompts (a --prompt's answer streams to the terminal)")
    rows = read_prompts(args.prompts) if args.prompts else None  # bad rows are refused before the model loads
    if args.out and os.path.exists(args.out):
        raise UserError(f"--out: {args.out} exists; name a new file")
    if args.image and not args.prompt:
        raise UserError("--image: goes with --prompt (a --prompts file names each row's picture under \"image\")")
    model, tokenizer = load(args.model, args.adapter, args.base)
    processor = processor_of(args.model, args.adapter, args.base) if args.image or any(r.get("image") for r in rows or []) else None
    if rows is None:
        if args.image:
            answer_picture(model, processor, args.prompt, args.image, args.max_new_tokens, args.temperature)
        else:
            generate(model, tokenizer, args.prompt, chat=args.chat, max_new_tokens=args.max_new_tokens, temperature=args.temperature)
        print()
        return
    answer_file(model, tokenizer, rows, args.out, args.batch_size, chat=args.chat, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                processor=processor)


def export(args: argparse.Namespace) -> None:
    from finetune.outputs.export import export

    if args.lora:
        from finetune.outputs.export import export_lora

        if not args.adapter:
            raise UserError("--lora: writes an adapter alone; give --adapter DIR")
        report = export_lora(args.adapter, args.out)
        print(f"wrote {report['out']} (GGUF LoRA, {report['bytes'] / 2**20:.2f} MiB) for a GGUF of {report['base']}")
        return
    report = export(args.model, args.adapter, args.out, args.type)
    pictures = f", its vision tower and projector in {report['mmproj']} ({report['mmproj_type']})" if "mmproj" in report else ""
    print(f"wrote {report['out']} ({report['type']}, {report['bytes'] / 2**20:.1f} MiB){pictures} and a Modelfile beside it")


def score(args: argparse.Namespace) -> None:
    from finetune.objectives.score import score_file

    count = score_file(args.model, args.data, args.out)
    print(f"scored {count} rows -> {args.out}")


def eval_tasks(args: argparse.Namespace) -> None:
    from finetune.outputs.harness import evaluate

    evaluate(args.model, args.adapter, [t.strip() for t in args.tasks.split(",") if t.strip()], args.base, args.limit, args.batch_size, args.out,
             samples=args.log_samples)


def configs(args: argparse.Namespace) -> None:
    from finetune.config.files import shipped_configs

    for name, about in shipped_configs():
        print(f"{name:<34} {about}")


def make_vision_demo(args: argparse.Namespace) -> None:
    from finetune.demo import make_vision_demo

    make_vision_demo(args.out, steps=args.steps, overwrite=args.overwrite)


def make_demo_model(args: argparse.Namespace) -> None:
    from finetune.demo import make_demo_model
    from finetune.model.tiny import MODEL_SHAPE, student_shape

    shape = None
    if args.hidden_size or args.layers:
        shape = student_shape(args.hidden_size or MODEL_SHAPE["hidden_size"], args.layers or MODEL_SHAPE["num_hidden_layers"])
    make_demo_model(args.out, steps=args.steps, overwrite=args.overwrite, shape=shape)


COMMANDS = {"train": train, "validate": validate, "data": data, "plan": plan, "stage": stage, "merge": merge, "export": export,
            "eval": eval_tasks, "score": score, "generate": generate, "configs": configs, "make-demo-model": make_demo_model,
            "make-vision-demo": make_vision_demo}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train":
        clear_recorded_exit()
    quiet_libraries()
    try:
        COMMANDS[args.command](args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        code, stopped = err.exit_code, isinstance(err, Stopped)
        record_exit(code)
    else:
        code, stopped = 0, False
    if args.command == "train" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if stopped:
            from finetune.parallel.runtime import stop_together

            stop_together()
        exit_rank(code)
    return code


def exit_rank(code: int) -> NoReturn:
    """End one rank of a multi-process run: exit handlers run, interpreter finalization does not.

    Gloo's worker threads drop the tensors of a finished collective a moment after it returns, and
    dropping a tensor made in Python takes the GIL. A thread that asks for the GIL while Python
    (3.11-3.13) is finalizing is killed inside that C++ destructor, and the rank aborts ("terminate
    called without an active exception", SIGABRT) after a run that succeeded: the launcher then
    reports a failure and SIGTERMs the other ranks. Seen in 2 of 65 runs of a 2-rank DDP job here, even
    with the process group destroyed first. Nothing is lost by skipping finalization: the run's files
    are closed (metrics are appended row by row) and trackers were finished by then.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
