"""How the model is spread over processes: DDP replicas (through accelerate), FSDP2 shards or
DeepSpeed ZeRO partitions.

FSDP2 and ZeRO are applied by calling torch's `fully_shard` and `deepspeed.initialize` directly:
accelerate's FSDP plugin silently becomes DDP on a CPU and accelerate + DeepSpeed fails there
(docs/platform-notes.md); the same calls run on gloo and nccl.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import torch

from finetune.config.errors import UserError
from finetune.config.schema import PRECISIONS, RunConfig
from finetune.config.strategy import Strategy
from finetune.model import experts, nf4, vision
from finetune.model.loading import DTYPES, decoder_layers, quantize_layer
from finetune.parallel import expert_parallel, tensor_parallel


def stream_source(cfg: RunConfig, say) -> Path | None:
    """The model folder rank 0 streams the weights from under FSDP, or None (said why) where it loads
    the whole model and sends its state dict."""
    from finetune.model.stage import resolve_source

    folder = resolve_source(cfg.model.name_or_path, cfg.model.revision)
    why_not = streaming_refusal(cfg, folder)
    if why_not:
        say(f"fsdp: rank 0 loads the whole model before sending the shards: {why_not}")
    return None if why_not else folder


def streaming_refusal(cfg: RunConfig, folder: Path) -> str | None:
    """Why rank 0 cannot stream this model's weights from its files under FSDP (None: it can). Every
    rank asks and gets the same answer: it reads the config, the files' headers and a meta skeleton."""
    from finetune.model.loading import load_model, weight_files

    if cfg.model.quantization is not None and not nf4.used(cfg.model):
        return "bitsandbytes quantizes the base while it loads"
    if cfg.adapter.method == "dora":
        return "DoRA's magnitudes are computed from the loaded weights"
    if cfg.adapter.modules_to_save:
        return "adapter.modules_to_save copies loaded weights"
    if cfg.distributed.tensor_parallel > 1:
        return "distributed.tensor_parallel (streaming by layers is built for a 1-D mesh)"
    if cfg.distributed.expert_parallel > 1:
        return "distributed.expert_parallel (rank 0 sends each expert stack whole, for every process to keep its share)"
    files = weight_files(folder) if folder.is_dir() else {}
    if not files:
        return f"{folder} holds no safetensors files"
    stored = {key for keys in files.values() for key in keys}
    model = load_model(cfg.model, skeleton="meta", say=lambda _: None)
    missing = sorted(set(_names_once(model)) - stored)
    if missing:
        return f"{missing[0]} is not in the weight files (transformers converts this checkpoint's weights while loading)"
    return None


def _names_once(model: torch.nn.Module) -> list[str]:
    """State-dict keys, a tied weight (lm_head = embed_tokens) under its first name only."""
    seen, names = set(), []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            names.append(name)
    return names


def shard_fsdp2(model: torch.nn.Module, cfg: RunConfig, device: torch.device, world: int, stream_from: Path | None = None,
                settings: dict | None = None) -> torch.nn.Module:
    """Shard the model over the processes, then fill every rank's shards from rank 0.

    Ranks other than 0 hold a meta-device skeleton (load_model(skeleton="meta")). Rank 0 holds either
    the loaded model, whose state dict it sends whole, or (stream_from: the model folder) an
    uninitialized one (skeleton="empty") plus the adapter as peft initialized it: then it reads the
    weights one decoder layer at a time from the safetensors files and sends those, so that no
    process ever holds more than its shards, one layer and the adapter. settings: fsdp_settings' made
    beforehand (`finetune plan --simulate` makes its mesh outside its fake tensors)."""
    import torch.distributed as dist

    kwargs = dict(settings or fsdp_settings(cfg, device.type, world))
    tp_mesh = kwargs.pop("tensor_parallel", None)
    rank0, spread = dist.get_rank() == 0, cfg.distributed.expert_parallel
    stacks = expert_parallel.shares_from_rank0(model, spread, dist.get_rank()) if spread > 1 else {}
    if stacks:  # each process's share of the experts, whole: fully_shard leaves them alone
        kwargs["ignored_params"] = expert_parallel.local_stacks(model)
    if stream_from is None:  # keeps rank 0's full weights alive until sent
        full = {k: v for k, v in model.state_dict().items() if k not in stacks} if rank0 and not nf4.used(cfg.model) else {}
    else:  # the adapter's initial values (small), before sharding splits them
        full = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad and rank0 and cfg.adapter.method != "full"}
    if nf4.used(cfg.model):
        read = _reader(model, stream_from, full) if stream_from is not None and rank0 else None
        return _shard_nf4(model, cfg, device, kwargs, read)
    if tp_mesh is not None:  # the layers split over their group first: FSDP2 then shards those parts over the rest
        tensor_parallel.parallelize(model, tp_mesh)
    shard_layers(model, kwargs)
    if not rank0:
        model.to_empty(device=device)  # room for this rank's shards, filled from rank 0 next
    if stream_from is None:
        _send(model, full)
    else:
        _stream(model, stream_from, full)
    del full
    if stacks:
        expert_parallel.send_shares(model, stacks, spread, device, kwargs["mp_policy"].param_dtype)
        expert_parallel.split(model, spread, dist.get_rank(), world)
    for buffer in model.buffers():  # not in the state dict when non-persistent (rotary frequencies)
        dist.broadcast(buffer, src=0)
    return model


def fsdp_settings(cfg: RunConfig, device_type: str, world: int) -> dict:
    """`fully_shard`'s arguments for this config: the device mesh, mixed precision, offload, resharding; with
    distributed.tensor_parallel, also `tensor_parallel`: the mesh each layer is split over (not fully_shard's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    shard, tp = cfg.distributed.fsdp_shard_size or world, cfg.distributed.tensor_parallel
    if world % shard:
        raise UserError(f"distributed.fsdp_shard_size: {shard} does not divide the {world} processes")
    # 1-D mesh: full shard. 2-D (replicate, shard): HSDP, gradients all-reduced across the replicas. 2-D (shard,
    # tensor_parallel): FSDP2 over the first dimension, each layer split over the second (consecutive ranks).
    split = {}
    if tp > 1:
        grid = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("shard", "tensor_parallel"))
        mesh, split = grid["shard"], {"tensor_parallel": grid["tensor_parallel"]}
    elif shard == world:
        mesh = init_device_mesh(device_type, (world,))
    else:
        mesh = init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    mp = cfg.train.mixed_precision
    low = DTYPES[PRECISIONS[mp]] if mp in ("bf16", "fp16") else None
    # Compute in low precision, reduce gradients in fp32: the usual FSDP mixed-precision recipe.
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy() if cfg.distributed.fsdp_cpu_offload else OffloadPolicy()
    return dict(mesh=mesh, mp_policy=policy, offload_policy=offload, reshard_after_forward=cfg.distributed.fsdp_reshard_after_forward, **split)


def shard_layers(model: torch.nn.Module, settings: dict) -> None:
    """FSDP2's units: each decoder layer, Qwen-VL's tower (with its projector, which it holds: vision.TOWER_UNIT),
    then the root (embeddings, final norm, head, other families' towers and projectors)."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, **settings)
    tower = vision.part_names(model).get("tower") if model.config.model_type in vision.TOWER_UNIT else None
    if tower:
        fully_shard(model.get_submodule(tower), **settings)
    fully_shard(model, **settings)


def _shard_nf4(model: torch.nn.Module, cfg: RunConfig, device: torch.device, kwargs: dict, read=None) -> torch.nn.Module:
    """FSDP2 over a 4-bit base: rank 0's values of one decoder layer at a time (the adapter's as peft
    initialized them too) go to every rank, each rank quantizes them as rank 0 would (the same code,
    the same values: the same 4-bit weights) and keeps its shards; then the rest of the model. No rank
    holds more than its shards and one layer in the compute dtype. read (rank 0, streaming: _reader):
    rank 0's model is an uninitialized skeleton, each layer filled from the files just before it goes."""
    from torch.distributed.fsdp import fully_shard

    names = {id(m): name for name, m in model.named_modules()}
    experts.group(model)  # what reads the 4-bit expert stacks
    for layer in decoder_layers(model):
        if read is not None:
            _fill(layer, read, names[id(layer)] + ".")
        _broadcast_from_rank0(layer, device)
        quantize_layer(layer, cfg.model, shards=kwargs["mesh"].size(-1))
        fully_shard(layer, **kwargs)
    if read is not None:
        _fill(model, read, "")
    _broadcast_from_rank0(model, device)  # what no layer holds: embeddings, final norm, head, rotary buffers
    fully_shard(model, **kwargs)
    return model


def _fill(module: torch.nn.Module, read, prefix: str) -> None:
    """Rank 0: the module's unsharded state-dict entries (not a layer's already sent) from the files, in place."""
    from torch.distributed.tensor import DTensor

    local = {k: v for k, v in module.state_dict().items() if not isinstance(v, DTensor)}
    with torch.no_grad():
        for key, value in read(prefix, list(local), local).items():
            local[key].copy_(value)


def _broadcast_from_rank0(module: torch.nn.Module, device: torch.device) -> None:
    """Rank 0's values of the module's unsharded tensors to the other ranks, whose meta tensors are
    replaced by room for them first, on `device`, where rank 0's (loaded in CPU RAM) are moved (one new
    parameter for each old one: tied weights stay tied)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    def placed(tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(tensor, device=device) if tensor.is_meta else tensor.to(device)

    made: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and not isinstance(param, DTensor) and (param.is_meta or param.device != device):
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(placed(param.data), param.requires_grad)
                sub._parameters[name] = made[id(param)]
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and (buffer.is_meta or buffer.device != device):
                sub._buffers[name] = placed(buffer)
    unsharded = [p for p in module.parameters() if not isinstance(p, DTensor)] + list(module.buffers())
    for tensor in {id(t): t for t in unsharded}.values():
        dist.broadcast(tensor.data, src=0)


def _send(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Rank 0's values of some of `module`'s state-dict entries to every rank's shards (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False))


def _stream(model: torch.nn.Module, folder: Path, adapter: dict[str, torch.Tensor]) -> None:
    """Rank 0 reads the weights from the model's safetensors files one decoder layer at a time (then
    the rest one tensor at a time) and sends them; the adapter's own weights come from `adapter`."""
    import torch.distributed as dist

    read = _reader(model, folder, adapter) if dist.get_rank() == 0 else lambda *_: {}
    layers = decoder_layers(model)
    names = {id(m): name for name, m in model.named_modules()}
    for layer in layers:
        prefix, local = names[id(layer)] + ".", layer.state_dict()
        _send(layer, read(prefix, list(local), local))
    inside = tuple(names[id(layer)] + "." for layer in layers)
    local = model.state_dict()
    for key in [k for k in _names_once(model) if not k.startswith(inside)]:
        _send(model, read("", [key], local))


def _reader(model: torch.nn.Module, folder: Path, adapter: dict[str, torch.Tensor]):
    """Rank 0's read(prefix, keys, like): the values of those state-dict entries of `model` (under
    `prefix`) from the safetensors files in `folder`, each in like's dtype, the adapter's own from `adapter`."""
    from safetensors import safe_open

    from finetune.model.loading import weight_files

    where = {key: name for name, keys in weight_files(folder).items() for key in keys}
    listed = set(_names_once(model))  # a tied weight's second name is filled through its first

    def read(prefix: str, keys: list[str], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k: adapter[prefix + k] for k in keys if prefix + k in adapter}
        stored = {k: _stored_key(prefix + k) for k in keys if prefix + k not in adapter and _stored_key(prefix + k) in where}
        for file in {where[s] for s in stored.values()}:  # opened per group: the mapping goes when it closes
            with safe_open(folder / file, "pt") as f:
                out.update({k: f.get_tensor(s).to(like[k].dtype) for k, s in stored.items() if where[s] == file})
        unfilled = [prefix + k for k in keys if k not in out and prefix + k in listed]
        if unfilled:  # streaming_refusal let through a weight that nothing fills: never train on uninitialized memory
            raise RuntimeError(f"fsdp streaming load: no value for {unfilled[0]} in {folder}")
        return out

    return read


def _stored_key(name: str) -> str:
    """The file's name for a state-dict entry of the model as trained (peft's wrapping taken off: an experts module with
    LoRA on two stacks is wrapped twice, `.base_layer.base_layer.`)."""
    return re.sub(r"\.base_layer(?=\.)", "", name.removeprefix("base_model.model."))


def clip_sharded(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ for FSDP2's gradients, whose DTensors may lie on two meshes (tensor parallelism: the
    split layers' on the 2-D mesh, the rest on its FSDP side), which one norm cannot mix: each mesh's norm, then
    theirs. Returns the norm before clipping, on the device (no host sync)."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    norms = [torch.nn.utils.get_total_norm(grads) for grads in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in by_mesh.values():
        torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef)
    return total


def full_state_dict(model: torch.nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """Gather a sharded model's full state dict onto rank 0's CPU (a collective: every rank calls it).
    trainable_only: the adapter's weights, not the frozen base's (an adapter is saved without them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only))


def check_strategy(cfg: RunConfig) -> None:
    """Refuse, before loading, a strategy whose engine is missing."""
    if Strategy.of(cfg.distributed.strategy).deepspeed and importlib.util.find_spec("deepspeed") is None:
        raise UserError(f"distributed.strategy: {cfg.distributed.strategy} needs DeepSpeed (pip install 'finetune[deepspeed]')")
    if cfg.distributed.fsdp_cpu_offload and not torch.cuda.is_available():
        raise UserError("distributed.fsdp_cpu_offload: needs a GPU (without one the shards already live in CPU RAM); set it to false")
    if cfg.distributed.fsdp_cpu_offload and nf4.used(cfg.model) and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # torch's FSDP2 skips the all-gather of a one-process group and copies one input per parameter: NF4Tensor's
        # three parts then fail in its fsdp_post_all_gather (docs/platform-notes.md)
        raise UserError("distributed.fsdp_cpu_offload: with a torchao 4-bit base it needs 2+ processes (torch's FSDP2 loses NF4Tensor's parts "
                        "in one process); set it to false, or run on 2+ GPUs")


def build_deepspeed_cpu_ops() -> list[str]:
    """Compile DeepSpeed's CPU ops now: CPU Adam (optimizer offload) and the shared-memory comm op, which
    every ZeRO process loads as it starts, though training never calls it. Unbuilt, the first ZeRO run on
    a machine compiles them inside its launch (20-35 s each on 2 cores). `make test` calls this first; they
    land where torch keeps JIT extensions ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions).
    Nothing where DeepSpeed is absent or its accelerator is not the CPU (on a GPU it builds CUDA ops)."""
    if importlib.util.find_spec("deepspeed") is None or os.environ.get("DS_ACCELERATOR") != "cpu":
        return []
    from deepspeed.accelerator import get_accelerator

    built = []
    for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible():
            builder.load(verbose=False)
            built.append(builder.NAME)
    return built


def deepspeed_config(cfg: RunConfig, world: int, layer_params: int | None = None) -> dict:
    """The DeepSpeed config for a ZeRO strategy, derived from the run config (nothing to keep in sync).

    layer_params (the largest decoder layer's parameter count) sizes the buckets: DeepSpeed's defaults
    (5e8 elements per gradient bucket, up to 1e9 parameters kept gathered) are for GPUs beside a large
    host; a 1.1B model's ZeRO-3 LoRA rank held 8.9 GB of CPU RAM for its 2.1 GB shard (5.8 GB with
    these). With them, a rank holds about its shards, two gathered layers and a layer's gradient bucket."""
    t, strategy = cfg.train, Strategy.of(cfg.distributed.strategy)
    zero = {"stage": strategy.zero_stage, "contiguous_gradients": True, "overlap_comm": False}
    if layer_params:
        zero.update(reduce_bucket_size=layer_params, allgather_bucket_size=layer_params)
        if zero["stage"] == 3:
            # sub_group_size: the optimizer step flattens one sub-group's gradient partitions into a new
            # tensor; by default that is the whole partition (a 1.1B full fine-tune's rank went from
            # 10 to 12.4 GB in its first step and was OOM-killed). One layer's worth bounds the copy.
            zero.update(stage3_prefetch_bucket_size=layer_params, stage3_max_live_parameters=2 * layer_params,
                        stage3_max_reuse_distance=layer_params, sub_group_size=layer_params)
    if strategy.offload:
        pin = torch.cuda.is_available()
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * world,
        "gradient_clipping": t.max_grad_norm or 0.0,
        "bf16": {"enabled": t.mixed_precision == "bf16"},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # our optimizer, built by optim.py
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**62,
    }


def zero3_loading(cfg: RunConfig, world: int):
    """Under ZeRO-3, from_pretrained partitions the weights as it loads while this object is alive
    (transformers' documented route); no process then holds the whole model."""
    if Strategy.of(cfg.distributed.strategy, world).zero_stage != 3:
        return None
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed()  # adopts the process group accelerate made, so the config sees the world size
    return HfDeepSpeedConfig(deepspeed_config(cfg, world))


def init_deepspeed(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: RunConfig, world: int):
    import deepspeed

    layer = max((sum(getattr(p, "ds_numel", p.numel()) for p in block.parameters()) for block in decoder_layers(model)), default=None)
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg, world, layer))
    return engine, ds_optimizer  # optimizer None: a frozen model (DPO's reference), an engine that only computes


def gathered_trainable_state(model: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """Full state dict with the trainable weights gathered from their ZeRO-3 partitions (a
    collective: every rank calls it), one module at a time; only the rank that saves (keep) copies
    them, so no rank ever holds the whole model twice (a 1.1B full fine-tune was OOM-killed here when
    each rank gathered everything at once and cloned it). Frozen partitioned weights are left out: an
    adapter does not need them, and under full fine-tuning every weight is trainable."""
    import deepspeed

    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if value.requires_grad or not hasattr(value, "ds_id"):
            modules.setdefault(key.rpartition(".")[0], {})[key] = value
    state = {}
    for tensors in modules.values():
        with deepspeed.zero.GatheredParameters([t for t in tensors.values() if hasattr(t, "ds_id")], modifier_rank=None):
            if keep:
                state.update({k: v.detach().cpu().clone() for k, v in tensors.items()})
    return state


def local_numel(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> int:
    """Trainable elements whose state this rank holds: its FSDP shard, its ZeRO-3 partition, its
    ZeRO-2 partition of the fp32 master weights, or everything for DDP."""
    zero_optimizer = getattr(model, "optimizer", None)
    if hasattr(zero_optimizer, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        return sum(t.numel() for t in zero_optimizer.single_partition_of_fp32_groups)
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)


CHECKSUM_CHUNK = 1 << 18  # elements per slice: the check's memory is a few of these, whatever the model's size


def replica_checksum(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Sum, absolute sum and position-weighted sum of every trained value, in float64, one slice at a
    time: equal on two replicas only if their weights are, and O(1) memory (no flat copy of the model)."""
    total = torch.zeros(3, dtype=torch.float64, device=params[0].device if params else "cpu")
    offset = 0
    with torch.no_grad():
        for p in params:
            flat = p.detach().reshape(-1)
            for start in range(0, flat.numel(), CHECKSUM_CHUNK):
                x = flat[start : start + CHECKSUM_CHUNK].double()
                where = torch.arange(offset + start, offset + start + x.numel(), dtype=torch.float64, device=x.device)
                total += torch.stack([x.sum(), x.abs().sum(), (x * where).sum()])
            offset += flat.numel()
    return total


def replicas_identical(params: list[torch.nn.Parameter], accelerator) -> bool:
    """True when every rank holds the same trained weights (replicas that drift apart are a silent bug)."""
    gathered = accelerator.gather(replica_checksum(params).to(accelerator.device)[None]).cpu()
    return bool((gathered == gathered[0]).all())
