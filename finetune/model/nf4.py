"""4-bit NF4 bases through torchao's `NF4Tensor` (model.quantization.backend: torchao): QLoRA that FSDP2 can shard.

bitsandbytes keeps a 4-bit weight's quantization state beside the tensor, where FSDP2 does not carry it
(docs/platform-notes.md); torchao's NF4Tensor holds the packed codes and their scales inside one tensor
subclass that implements FSDP2's all-gather hooks, which is how torchtune runs QLoRA under FSDP2.

The numerics are QLoRA's, as bitsandbytes computes them: blocks of 64 weights scaled by their absmax onto the
16 NF4 levels, the absmax values double-quantized to int8 in blocks of 256. torchao keeps the code book in
the weights' dtype (bf16) where bitsandbytes keeps it in fp32, so a few codes land on the neighbouring level
(tests/test_quantized.py bounds it). A tensor whose blocks do not divide by 256 takes the largest power of two
that does and that the processes can split evenly, where bitsandbytes would pad its last block.

The weights are quantized after the adapter is applied (peft would otherwise give the adapter the 4-bit
weight's dtype) and only those of frozen linear layers inside the decoder layers: embeddings, norms and
the head stay unquantized as in bitsandbytes' QLoRA, in the dtype they loaded in (bitsandbytes' path
upcasts them to fp32).
"""

from __future__ import annotations

import importlib.util
import math

import torch

from finetune.config.errors import UserError
from finetune.config.schema import ModelConfig

BLOCK = 64  # weights per absmax scale (bitsandbytes' 4-bit blocksize)
SCALER_BLOCK = 256  # absmax scales per double-quantization block (bitsandbytes' nested blocksize)
SHAPES = "_nf4_shapes"  # a module's {parameter name: shape} for weights quantized in another shape than their own


def used(cfg: ModelConfig) -> bool:
    """Whether a ModelConfig's base is quantized by torchao."""
    return cfg.quantization is not None and cfg.quantization.chosen_backend == "torchao"


def after_adapter(cfg: ModelConfig) -> bool:
    """Whether weights are quantized after transformers loads the base: a torchao base's linear layers once the adapter is
    on, and any quantized base's fused expert weights, which bitsandbytes leaves as they are (model/experts.py: 4-bit NF4,
    or 8-bit int8 codes; the policy's as they load where it loads whole, else once the adapter is on)."""
    return used(cfg) or cfg.quantization is not None


def check_available() -> None:
    if importlib.util.find_spec("torchao") is None:
        raise UserError("model.quantization.backend: torchao needs torchao (pip install 'finetune-kit[torchao]')")


def scaler_block(numel: int, shards: int = 1) -> int:
    """SCALER_BLOCK, or the largest power of two below it that divides the tensor's blocks into a count of
    scale groups that `shards` processes can split evenly (FSDP2 shards the groups too). Released models'
    layers take 256 at any count of processes up to 256; tests' tiny ones need the rest."""
    blocks, size = numel // BLOCK, SCALER_BLOCK
    while size > 1 and (blocks % size or (blocks // size) % shards):
        size //= 2
    return size


def quantizable(module: torch.nn.Module, skip: tuple[str, ...], name: str) -> bool:
    """A frozen linear layer of the base: not one of an adapter's own (peft freezes those too when it
    loads an adapter for inference), nor one the config keeps."""
    weight, parts = getattr(module, "weight", None), name.split(".")
    adapters = any(part.startswith("lora_") or part in ("modules_to_save", "original_module") for part in parts)
    return (isinstance(module, torch.nn.Linear) and weight is not None and not weight.requires_grad and weight.numel() % BLOCK == 0
            and not is_nf4(weight) and not adapters and not any(part in skip for part in parts))


def uneven_rows(rows: dict[str, int], shards: int) -> str | None:
    """FSDP2 splits each NF4 weight's rows into `shards` equal parts (torchao's split asserts they are):
    the first weight whose rows do not divide, said with the process counts that would, or None."""
    uneven = next(((name, count) for name, count in rows.items() if count % shards), None)
    if uneven is None:
        return None
    return (f"model.quantization: torchao's 4-bit weights are sharded by rows, evenly: {uneven[0]} has {uneven[1]:,} rows, which {shards} "
            f"processes do not divide; shard over a count that divides {math.gcd(*rows.values())} (distributed.fsdp_shard_size, "
            "the rest replicated) or run on fewer processes")


def quantize_frozen_linears(module: torch.nn.Module, dtype: torch.dtype, skip: list[str] | None = None, shards: int = 1) -> int:
    """Replace the weight of every frozen linear layer under `module` with its NF4 form, from the weight cast
    to `dtype` (the compute dtype: what the 4-bit matmul dequantizes to), in blocks `shards` processes
    can split. Returns how many were replaced."""
    chosen = [(name, layer) for name, layer in module.named_modules() if quantizable(layer, tuple(skip or ()), name)]
    why = uneven_rows({name.replace(".base_layer", ""): layer.weight.shape[0] for name, layer in chosen}, shards)  # peft's wrapping left out
    if why:
        raise UserError(why)
    for _, layer in chosen:
        weight = layer.weight.detach().to(dtype)
        layer.weight = torch.nn.Parameter(to_nf4(weight, shards), requires_grad=False)
    return len(chosen)


def to_nf4(weight: torch.Tensor, shards: int = 1) -> torch.Tensor:
    """torchao's `to_nf4` of a 2-D weight in blocks `shards` processes can split, bit for bit, made CHUNK values at a time
    with torchao's own steps: each block's absmax and its 4-bit codes depend on that block alone, and the absmax values'
    double quantization (one mean over all of them) runs once on the whole vector of them. torchao's own call holds a few
    times the weight's bytes beside it while it quantizes; this one the codes and a chunk's copies (bench/results/moe.md)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs, get_block_absmax

    flat, size = weight.detach().reshape(-1), scaler_block(weight.numel(), shards)
    step, blocks = CHUNK - CHUNK % BLOCK, weight.numel() // BLOCK
    absmax = torch.cat([get_block_absmax(flat[first:first + step], BLOCK) for first in range(0, flat.numel(), step)])
    scalers, factors, mean = NF4Tensor.double_quantize_scalers(absmax, 1, size)  # absmax of blocks of one: the values themselves
    table = NF4Tensor.from_tensor(weight.new_zeros(BLOCK * size), BLOCK, size).nf4  # torchao's code book, in the weight's dtype
    data = torch.empty(flat.numel() // 2, dtype=torch.uint8, device=weight.device)
    for first in range(0, flat.numel(), step):
        part = flat[first:first + step]
        data[first // 2:(first + part.numel()) // 2] = NF4Tensor.convert_to_norm_float_weight(part, part.numel() // BLOCK, BLOCK, table)
    meta = SubclassTensorArgs(weight.size(), weight.stride(), weight.storage_offset(), weight.dtype, weight.device, False)
    return NF4Tensor(meta, BLOCK, blocks, size, scalers, factors, mean, data, table)


CHUNK = 1 << 22  # weights quantized at a time


def share(weight: torch.Tensor, index: int, size: int) -> torch.Tensor:
    """Rows index/size of an NF4 weight quantized in blocks `size` processes split (to_nf4's shards): torchao's own chunk
    of it, its codes and scales copied out so that the whole weight's are freed."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs

    part = torch.chunk(weight, size)[index]
    meta = SubclassTensorArgs(part.size(), part.stride(), 0, part.dtype, part.device, False)
    return NF4Tensor(meta, part.block_size, part.n_blocks, part.scaler_block_size, part.quantized_scalers.clone(),
                     part.quantization_factor.clone(), part.scaler_mean, part.quantized_data.clone(), part.nf4)


def quantizing_bytes(numel: int, dtype_bytes: int) -> float:
    """What `to_nf4` holds beside a weight of `numel` values while it quantizes it: the codes with their scales, and a
    chunk's copies (its absmax and scaled values, its one-byte codes, and the distances to the 16 levels torchao's nearest
    step takes for 2**20 values at a time), as measured for a 128M-weight tensor (bench/results/moe.md)."""
    return numel * (0.5 + dtype_bytes / BLOCK) + CHUNK * (2 * dtype_bytes + 1) + 2 * 16 * 2**20 * dtype_bytes


def is_nf4(tensor: torch.Tensor | None) -> bool:
    local = getattr(tensor, "_local_tensor", tensor)  # an FSDP2 shard is a DTensor around it
    return type(local).__name__ == "NF4Tensor"


def packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of 4-bit codes and their int8 scales with the scales' factors this process holds (its shards
    under FSDP2; each weight's one-number mean of its scales is left out: every rank holds it)."""
    total = 0
    for param in model.parameters():
        if is_nf4(param):
            local = getattr(param, "_local_tensor", param)
            parts = (local.quantized_data, local.quantized_scalers, local.quantization_factor)
            total += sum(part.numel() * part.element_size() for part in parts)
    return total
