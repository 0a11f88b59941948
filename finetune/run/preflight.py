"""Preflight: everything `train` refuses before it loads anything, in one place.

`finetune validate` and `train` both call `check`, so a config that validates is not refused later
for this machine's hardware, its installed packages, the launcher's processes or the output folder.
The config schema (config/schema.py) checks what holds on any machine; this adds what depends on this one.
Each check raises UserError with the key at fault and what to do; none of them changes anything.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from finetune.config.errors import UserError
from finetune.config.files import job_key
from finetune.config.schema import CONFIG_FILE, SUMMARY_FILE, RunConfig, looks_local


def check(cfg: RunConfig, warn=None) -> None:
    """Raise UserError for what train would refuse. `warn` (validate's) takes what concerns a run
    rather than the config: a finished run in the output folder is named, not refused, since the
    config itself is fine and only `train` would overwrite that run."""
    from finetune.model import loading
    from finetune.parallel import distributed, optim, runtime

    loading.check_supported(cfg)
    if cfg.model.quantization is not None and cfg.model.quantization.chosen_backend == "torchao":
        from finetune.model import nf4

        nf4.check_available()
    optim.check_optimizer(cfg.train)
    distributed.check_strategy(cfg)
    config = model_json(cfg, warn)
    check_long_context(cfg, launched=warn is None or "WORLD_SIZE" in os.environ, config=config)
    check_vision(cfg, config)
    check_gpu_features(cfg)
    check_trackers(cfg)
    runtime.launcher_strategy(cfg)
    check_processes(cfg)
    if cfg.train.objective == "grpo":  # a reward function that does not import stops here, before any data or model loads
        from finetune.objectives.rewards import load_rewards

        load_rewards(cfg.grpo)
        if cfg.grpo.environment:
            from finetune.data.chat import choose_template
            from finetune.objectives.agent import check_template, load_environment

            load_environment(cfg.grpo.environment)
            tokenizer = loading.load_tokenizer(cfg.model)
            choose_template(tokenizer, cfg.data.chat_template, cfg.data.format, say=lambda *_: None)
            check_template(tokenizer)
    if int(os.environ.get("RANK", "0")) == 0:  # the process that will create and lock it
        check_output_dir(Path(cfg.train.output_dir))
        finished = finished_run(Path(cfg.train.output_dir), cfg.checkpoint.resume)
        if finished and warn is None:
            raise UserError(finished)
        if finished:
            warn(f"{finished} (train refuses this folder)")


def model_json(cfg: RunConfig, warn=None) -> dict:
    """The model's config as a dict, resolved as loading resolves it (a local folder, or a hub id from the cache or the
    Hub), so that a model named by id meets the same refusals as a folder. One that cannot be read stops train in one
    line, as loading would; validate (`warn`) says so and skips what needs it, for a hub id not downloaded here."""
    from finetune.model.configs import model_config

    try:
        return model_config(cfg.model).to_dict()
    except UserError as err:
        if warn is None or looks_local(cfg.model.name_or_path):
            raise
        warn(f"{err} (validate skips the checks that need the model's config; train stops here)")
        return {}


def check_long_context(cfg: RunConfig, launched: bool, config: dict | None = None) -> None:
    """distributed.sequence_parallel against the model's heads and, once
    launched (train, or validate under a launcher), the process count (tensor_parallel's and expert_parallel's too); both it and
    model.tiled_mlp need DeepSpeed."""
    from finetune.config.strategy import Strategy
    from finetune.parallel import sequence_parallel

    size, world = cfg.distributed.sequence_parallel, int(os.environ.get("WORLD_SIZE", "1"))
    for key in ("tensor_parallel", "sequence_parallel", "expert_parallel") if launched else ():
        check_group(key, getattr(cfg.distributed, key), world)
    if cfg.model.tiled_mlp > 1:
        if importlib.util.find_spec("deepspeed") is None:
            raise UserError("model.tiled_mlp: runs DeepSpeed's TiledMLP; pip install 'finetune-kit[deepspeed]'")
        if Strategy.of(cfg.distributed.strategy, world).name == "ddp":
            raise UserError("model.tiled_mlp: TiledMLP adds each MLP weight's gradient once per chunk, and DDP takes one per step; "
                            "use distributed.strategy fsdp or a zero strategy with it, or one process")
    if size == 1:
        return
    sequence_parallel.check(size, model_json(cfg) if config is None else config)


def check_group(key: str, size: int, world: int) -> None:
    """distributed.KEY's groups of `size` consecutive processes must tile the `world` started."""
    if world % size:
        raise UserError(f"distributed.{key}: {size} does not divide the {world} processes started; start a multiple of {size}")


def check_vision(cfg: RunConfig, config: dict) -> None:
    """A vision-language model (a config with a vision_config): its family, and what
    its picture batches do not support yet (docs/vision.md)."""
    from finetune.config.strategy import Strategy
    from finetune.model import vision

    if not vision.is_vision(config):
        return
    strategy = Strategy.of(cfg.distributed.strategy)  # as named: validate, in one process, says what a launch would refuse
    refused = [
        vision.refusal(config),
        cfg.train.objective not in ("sft", "dpo", "orpo", "cpo", "simpo", "grpo") and
        f"train.objective: {cfg.train.objective} on pictures is not built yet; vision-language models train with sft, dpo, orpo, cpo, simpo or grpo",
        cfg.train.objective != "sft" and not vision.packable(config) and
        f"train.objective: {cfg.train.objective} lays " + ("a group's completions" if cfg.train.objective == "grpo" else "a pair's two sequences")
        + f" in one row, which {config.get('model_type')}'s pictures cannot share (as packing: {', '.join(sorted(vision.PACKABLE))} can)",
        cfg.train.objective == "grpo" and cfg.grpo.environment and
        "grpo.environment: episodes with a vision-language model are not built yet (single-turn GRPO on prompts with pictures is)",
        cfg.train.objective == "grpo" and cfg.grpo.kv_cache == "static" and
        "grpo.kv_cache: static is not tested with a vision-language model; use dynamic",
        cfg.data.packing and not vision.packable(config) and
        f"data.packing: {config.get('model_type')}'s rows with pictures are not packed (its pictures' attention or its "
        f"cross-attended pictures span a row); set data.packing: false (packed: {', '.join(sorted(vision.PACKABLE))})",
        cfg.distributed.sequence_parallel > 1 and "distributed.sequence_parallel: not with a vision-language model (a picture's tokens would be split)",
        cfg.model.tiled_mlp > 1 and "model.tiled_mlp: not with a vision-language model yet",
        cfg.model.quantization is not None and cfg.model.quantization.chosen_backend == "torchao" and
        "model.quantization.backend: torchao's 4-bit base is not built for vision-language models yet; use bitsandbytes",
        cfg.model.quantization is not None and strategy.deepspeed and
        f"model.quantization: a quantized vision-language model under distributed.strategy {strategy.name} is not tested yet; use ddp",
        cfg.model.quantization is not None and cfg.adapter.vision == "lora" and
        "adapter.vision: lora on a quantized vision-language model is not built; its tower stays unquantized: use frozen or full",
        cfg.adapter.vision == "lora" and cfg.adapter.method == "full" and "adapter.vision: lora needs adapter.method lora or dora",
    ]
    problem = next((p for p in refused if p), None)
    if problem:
        raise UserError(problem)


def check_gpu_features(cfg: RunConfig) -> None:
    """What needs a GPU: fp16 and fp8 mixed precision, LoftQ, offloaded activations."""
    import torch

    mp, cuda = cfg.train.mixed_precision, torch.cuda.is_available()
    if cfg.train.offload_activations and not cuda:
        raise UserError("train.offload_activations: moves saved activations from a GPU to CPU memory; without one they are in CPU memory already; "
                        "set it to false")
    if cfg.adapter.init == "loftq" and not cuda:
        raise UserError("adapter.init: loftq needs an NVIDIA GPU (peft's replace_lora_weights_loftq computes on CUDA); use init: default here")
    if mp == "fp16" and not cuda:
        raise UserError("train.mixed_precision: fp16 needs a GPU (accelerate runs fp16 with loss scaling on GPUs only); use bf16 on CPU")
    if mp == "fp8":
        if not cuda or torch.cuda.get_device_capability() < (8, 9):
            raise UserError("train.mixed_precision: fp8 needs an NVIDIA GPU of compute capability 8.9+ (Ada/Hopper); use bf16")
        if not any(importlib.util.find_spec(p) for p in ("torchao", "transformer_engine")):
            raise UserError("train.mixed_precision: fp8 needs torchao or transformer_engine installed")


def check_trackers(cfg: RunConfig) -> None:
    for name in cfg.logging.report_to:
        if importlib.util.find_spec(name) is None:
            raise UserError(f"logging.report_to: '{name}' is not installed (pip install finetune-kit[{name}]) or remove it")
    if "wandb" in cfg.logging.report_to and not wandb_can_log():
        raise UserError("logging.report_to: wandb has no API key here (WANDB_API_KEY, or the ~/.netrc entry `wandb login` writes) and is "
                        "not offline; log in, or set WANDB_MODE=offline to keep the run on disk (`wandb sync` uploads it later)")
    # MLflow 3 keeps runs in a database (sqlite:///mlflow.db in the working directory unless
    # MLFLOW_TRACKING_URI says otherwise); mlflow-skinny alone cannot open one.
    store = os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    if "mlflow" in cfg.logging.report_to and "://" in store and not store.startswith(("http", "file", "databricks")) and (
            importlib.util.find_spec("sqlalchemy") is None or importlib.util.find_spec("alembic") is None):
        raise UserError(f"logging.report_to: mlflow's store {store} needs sqlalchemy and alembic (pip install finetune-kit[mlflow]); "
                        "or set MLFLOW_TRACKING_URI to your tracking server")


def wandb_can_log() -> bool:
    """What wandb.init reads before it would ask for a key and fail deep inside the run: offline or
    disabled mode, a key or identity token in the environment, or a key for its host in the netrc
    file (NETRC, else ~/.netrc), as wandb 0.31 looks for them."""
    import netrc
    from urllib.parse import urlsplit

    env = os.environ
    if env.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled") or env.get("WANDB_DISABLED", "").lower() in ("true", "1"):
        return True
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    path = Path(env.get("NETRC") or "~/.netrc").expanduser()
    try:
        return path.is_file() and netrc.netrc(path).authenticators(urlsplit(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname) is not None
    except (netrc.NetrcParseError, OSError):
        return False


def check_processes(cfg: RunConfig) -> None:
    """A launcher's process count (WORLD_SIZE) against distributed.strategy: none means one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.distributed.strategy == "none" and world > 1:
        raise UserError(f"distributed.strategy: none, but {world} processes were started; choose ddp, fsdp or a zero strategy, or start one process")
    q = cfg.model.quantization
    if q is not None and q.chosen_backend == "torchao" and cfg.distributed.strategy == "ddp" and world > 1:
        raise UserError("model.quantization.backend: torchao's 4-bit base is not replicated by ddp (it broadcasts plain tensors); "
                        "use distributed.strategy: fsdp, or backend: bitsandbytes")


def check_output_dir(out: Path) -> None:
    """The output folder can be made (or is there and writable) and holds nothing but a finetune run's
    files: a run writes README.md, config.json and more, and must not replace a user's."""
    from finetune.checkpoint import store
    from finetune.checkpoint.locks import LOCK_FILE, check_free

    if out.exists() and not out.is_dir():
        raise UserError(f"train.output_dir: {out} is a file; expected a folder (or a path to create)")
    if not out.exists():
        parent = next((p for p in out.absolute().parents if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise UserError(f"train.output_dir: cannot create {out} ({parent} is not a writable folder)")
        return
    if not os.access(out, os.W_OK | os.X_OK):
        raise UserError(f"train.output_dir: {out} is not writable")
    check_free(out)
    names = {p.name for p in out.iterdir()}
    if names and not names & {CONFIG_FILE, LOCK_FILE, store.CHECKPOINTS}:  # a run's, or checkpoints brought here to resume from
        raise UserError(f"train.output_dir: {out} holds files that are not a finetune run's ({', '.join(sorted(names)[:3])}); "
                        "choose an empty or new folder")


def finished_job(cfg: RunConfig) -> str | None:
    """What to say, if this worker's job has finished already: torchrun starts its workers again when a node joins an
    elastic job, and a join in the moment between the last save and the workers' exit starts them on a finished run. There
    `train` ends at once with code 0 on every rank that sees the folder, where a refusal (exit 2) would be restarted
    again and again, and the other nodes' workers would wait for rank 0 until their timeout."""
    import json

    out, key = Path(cfg.train.output_dir), job_key(cfg)
    if key is None or cfg.checkpoint.resume not in ("auto", "never"):
        return None
    try:
        done = json.loads((out / SUMMARY_FILE).read_text()).get("job") == key
    except (OSError, ValueError, AttributeError):  # none yet, or not a summary of ours
        return None
    return f"{out} holds this job's finished run (rendezvous id {os.environ['TORCHELASTIC_RUN_ID']}, {SUMMARY_FILE}): nothing left to do" if done else None


def finished_run(out: Path, resume: str) -> str | None:
    """Why train must not use this folder, if it holds a finished run: resuming from its last
    checkpoint (or starting afresh) would replace the finished adapter or model. Resuming from a
    checkpoint named on purpose (to train on with more steps) is allowed."""
    if resume in ("auto", "never") and (out / SUMMARY_FILE).is_file():
        from finetune.checkpoint import store

        newest = next(reversed(store.step_dirs(out / store.CHECKPOINTS)), None)
        again = f"; or continue it on purpose with --resume {newest} (and a higher --max-steps)" if newest else ""
        return f"train.output_dir: {out} holds a finished run ({SUMMARY_FILE}); start a new run with --output-dir NEW_DIR{again}"
    return None
