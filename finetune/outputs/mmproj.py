"""`finetune export --format gguf` of a vision-language model: two files, as llama.cpp's multimodal tools take them.

The language model is written as export.py writes any text model (from a text-only folder made of the model's language
model and head, then checked in llama.cpp like any export). The vision tower and its projector go to a second file,
`mmproj-NAME.gguf` beside it, in llama.cpp's `clip` architecture: the tensor names and metadata keys of the `gguf`
package (llama.cpp's own), the layout llama.cpp's mtmd library reads for the family's projector type.

The projector file is checked in llama.cpp itself where llama-cpp-python was built with its multimodal library (mtmd):
a picture's embeddings, as llama.cpp computes them from the file, against the model's own features for the same
picture. Where that library is missing the file is written unchecked, said in one line.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
import tempfile
from pathlib import Path

import numpy as np
import torch

from finetune.config.errors import EXIT_MERGE_CHECK, Stopped, UserError

# model_type -> llama.cpp's projector type (LLaVA: a tower, two linear layers with a GELU between; Gemma 3: the tower's last
# layer normed, its patches average-pooled to mm_tokens_per_image, an RMS norm and one matrix; Idefics3 and SmolVLM: the
# tower's last layer normed, its patches shuffled scale_factor x scale_factor into one, one matrix)
FAMILIES = {"llava": "mlp", "gemma3": "gemma3", "idefics3": "idefics3", "smolvlm": "idefics3", "qwen2_vl": "qwen2vl_merger",
            "qwen2_5_vl": "qwen2.5vl_merger", "qwen3_vl": "qwen3vl_merger", "qwen3_vl_moe": "qwen3vl_merger", "internvl": "internvl",
            "qwen3_5": "qwen3vl_merger", "qwen3_5_moe": "qwen3vl_merger", "gemma4": "gemma4v", "mistral3": "pixtral"}
SHUFFLED = ("idefics3", "smolvlm")  # a tower of their own, SigLIP's layers
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")  # a tower of their own: 2-D rotary positions, 2 x 2 patches merged into one token
QWEN35 = ("qwen3_5", "qwen3_5_moe")  # Qwen3-VL's tower without DeepStack; a language model transformers has a causal LM of
PIXTRAL_FEWEST = 8  # llama.cpp's pixtral graph enlarges a picture of fewer tokens (and shrinks one of over 1,024)
GEMMA3_POOLING = 4  # llama.cpp's pooling of Gemma 3's patches when the file names none (64 x 64 patches into 16 x 16 tokens)
TOLERANCE = {"f32": 1e-3, "f16": 1e-2}  # largest |embedding difference| published, over the largest |embedding|
# Towers written: SigLIP's. llama.cpp's LLaVA graph (llama-cpp-python 0.3.36) puts a CLIP tower's class token after the
# patches and hands it on in place of the first patch, so no file of a CLIP tower gives the model's embeddings
# (docs/platform-notes.md).
TOWERS = ("siglip_vision_model", "idefics3_vision", "smolvlm_vision")


def refusal(config: dict) -> str | None:
    """Why this vision-language model's projector file is not written, or None."""
    family = config.get("model_type")
    if family == "mllama":
        return ("llama.cpp's multimodal library reads no Mllama projector (its cross-attention layers have no place in its graphs); "
                "finetune merge writes the folder transformers and vLLM load")
    if family == "llava_onevision":
        return ("llama.cpp's converter writes no LLaVA-OneVision projector, and its LLaVA projector (mlp with grid pinpoints) encodes the "
                "tiles as pictures of their own, without the newline feature after each row of the unpadded grid; finetune merge "
                "writes the folder transformers and vLLM load")
    if family not in FAMILIES:
        return (f"{family} is a vision-language model whose projector file (mmproj) finetune does not write; it writes "
                f"{', '.join(sorted(FAMILIES))} (finetune merge writes the folder transformers and vLLM load)")
    tower = config["vision_config"].get("model_type")
    if family == "internvl" and (config["vision_config"].get("use_qk_norm") or config.get("vision_feature_layer", -1) != -1):
        return ("its tower normalizes queries and keys, or hands on a layer other than its last: InternVL's projector file is "
                "written (and checked) for towers that do neither, as InternViT-300M")
    if family == "mistral3":
        return _pixtral_refusal(config)
    if family in (*QWEN, *QWEN35, "internvl", "gemma4"):
        return _qwen_refusal(config["vision_config"]) if family == "qwen2_5_vl" else None
    if tower == "clip_vision_model":
        return ("its vision tower is CLIP's, whose class token llama.cpp's LLaVA graph hands on in place of the first patch (its "
                "embeddings would not be the model's); the projector file is written for SigLIP towers")
    if tower not in TOWERS:
        return f"its vision tower is {tower}; the projector file is written for {', '.join(TOWERS)}"
    if family == "llava" and not isinstance(config.get("vision_feature_layer", -2), int):
        return "it reads several tower layers (a list in vision_feature_layer); llama.cpp's LLaVA projector reads one"
    return None


def _pixtral_refusal(config: dict) -> str | None:
    """What llama.cpp's pixtral graph (llama-cpp-python 0.3.36) would compute otherwise than this Mistral 3, or None."""
    vision = config["vision_config"]
    theta = (vision.get("rope_parameters") or {}).get("rope_theta", vision.get("rope_theta", 10000.0))
    if theta != 10000.0:
        return f"its tower's rotary base is {theta:g}; llama.cpp's pixtral graph takes the releases' 10000"
    if config.get("vision_feature_layer", -1) != -1:
        return "it hands on a tower layer other than its last; llama.cpp's pixtral graph hands on the last"
    most = vision["image_size"] // (vision["patch_size"] * config.get("spatial_merge_size", 2))
    if most ** 2 < PIXTRAL_FEWEST:
        return (f"its pictures have {most ** 2} tokens at most, fewer than llama.cpp's pixtral graph enlarges every picture to "
                f"({PIXTRAL_FEWEST}); its embeddings would be of another picture")
    return None


def _qwen_refusal(vision: dict) -> str | None:
    """What llama.cpp's qwen2.5vl graph (llama-cpp-python 0.3.36) would compute otherwise than this Qwen2.5-VL tower, or None."""
    window, whole = vision.get("window_size", 112), list(vision.get("fullatt_block_indexes") or [])
    if window != 112:
        return f"its tower attends within {window}-pixel windows; llama.cpp's qwen2.5vl graph within the releases' 112"
    every = whole[0] + 1 if whole else 0
    if not every or whole != list(range(every - 1, vision["depth"], every)):
        return (f"its tower's whole-picture layers ({whole}) are not every n-th layer, the pattern llama.cpp's qwen2.5vl graph takes "
                "(the releases': 7, 15, 23, 31)")
    return None


def text_folder(model, tokenizer, out: Path) -> Path:
    """The language model and its head as a text model folder (its config the model's text config), for export.py."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    config = model.config.get_text_config()
    if model.config.model_type in QWEN:  # transformers has no causal LM of its text config: Qwen2's (Qwen3's), its rotary sections beside
        values = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures", "rope_scaling", "rope_parameters")}
        rope = dict(config.rope_parameters)
        kind = {"qwen3_vl": Qwen3Config, "qwen3_vl_moe": Qwen3MoeConfig}.get(model.config.model_type, Qwen2Config)
        extra = {"deepstack_layers": len(model.config.vision_config.deepstack_visual_indexes)} if kind is not Qwen2Config else {}
        if kind is Qwen3MoeConfig:  # Qwen3-VL-MoE's router always normalizes its chosen experts' weights
            extra["norm_topk_prob"] = True
        config = kind(**values, rope_parameters={"rope_type": "default", "rope_theta": rope["rope_theta"]}, mrope_section=rope["mrope_section"], **extra)
    text = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = {f"model.{k}": v for k, v in _language_model(model).state_dict().items()}
    weights["lm_head.weight"] = model.lm_head.weight
    text.load_state_dict(weights, strict=True)
    text.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _language_model(model):
    return model.model.text_model if model.config.model_type in SHUFFLED else model.model.language_model


def _tower(model):
    if model.config.model_type in SHUFFLED:
        return model.model.vision_model
    return getattr(model.model.vision_tower, "vision_model", model.model.vision_tower)


def write(model, processor, path: Path, kind: str) -> None:
    """The tower and projector of `model` (a family in FAMILIES) as llama.cpp's clip file at `path`."""
    import gguf

    config = model.config
    dtype = np.float16 if kind == "f16" else np.float32
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if kind == "f16" else gguf.LlamaFileType.ALL_F32)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, FAMILIES[config.model_type])
    if config.model_type in ("qwen3_vl", "qwen3_vl_moe", *QWEN35):
        tensors = _qwen3_header(writer, model, processor)
    elif config.model_type == "internvl":
        tensors = _internvl_header(writer, model, processor)
    elif config.model_type == "gemma4":
        tensors = _gemma4_header(writer, model, processor)
    elif config.model_type == "mistral3":
        tensors = _pixtral_header(writer, model, processor)
    elif config.model_type in QWEN:
        tensors = _qwen_header(writer, model, processor)
    else:
        tensors = _header(writer, model, processor)
    for name, tensor in tensors.items():
        data = tensor.detach().float().numpy()
        # norms, biases, position embeddings and a class token in f32: llama.cpp's CPU kernels add (and join) no f16 to f32
        # (Gemma 3's f16 file, and InternVL's, aborted there)
        whole = data.ndim == 1 or ".position_embd." in name or name == _name(gguf.MODEL_TENSOR.V_ENC_EMBD_CLS)
        writer.add_tensor(name, data if whole else data.astype(dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _header(writer, model, processor) -> dict[str, torch.Tensor]:
    """A SigLIP tower's metadata (LLaVA, Gemma 3, Idefics3, SmolVLM2); its tensors."""
    import gguf

    config, vision = model.config, model.config.vision_config
    layers = vision.num_hidden_layers
    _tower_keys(writer, processor.image_processor, vision.image_size, vision.patch_size, vision.hidden_size, vision.intermediate_size,
                config.get_text_config().hidden_size, layers, vision.num_attention_heads, vision.layer_norm_eps)
    writer.add_bool(gguf.Keys.ClipVision.USE_GELU, True)  # SigLIP's tanh GELU (llama.cpp's default is CLIP's quick GELU)
    if config.model_type == "llava":
        # the hidden states LLaVA reads: transformers' index (0: the encoder's input), as llama.cpp counts its feature layers
        writer.add_array("clip.vision.feature_layer", [config.vision_feature_layer % (layers + 1)])
    elif config.model_type in SHUFFLED:  # each scale_factor x scale_factor patches shuffled into one token
        writer.add_uint32(gguf.Keys.ClipVision.Projector.SCALE_FACTOR, config.scale_factor)
    else:  # Gemma 3: each side's patches pooled by this factor into the side of mm_tokens_per_image
        pooling = vision.image_size // vision.patch_size // round(config.mm_tokens_per_image ** 0.5)
        if pooling != GEMMA3_POOLING:
            writer.add_uint32(gguf.Keys.ClipVision.Projector.SCALE_FACTOR, pooling)
    return _tensors(model, layers)


def _qwen_header(writer, model, processor) -> dict[str, torch.Tensor]:
    """Qwen2-VL's and Qwen2.5-VL's tower: its metadata as llama.cpp's converter writes it; its tensors, the 3-D patch
    embedding as two 2-D ones (its two frames), each layer's fused query/key/value split."""
    import gguf

    vision, newer = model.config.vision_config, model.config.model_type == "qwen2_5_vl"
    tower, images = model.model.visual, processor.image_processor
    width = vision.hidden_size if newer else vision.embed_dim
    # image size 560 and eps 1e-6, as llama.cpp's converter writes them: these towers take pictures of any size
    _tower_keys(writer, images, 560, vision.patch_size, width, vision.intermediate_size if newer else int(width * vision.mlp_ratio),
                vision.out_hidden_size if newer else vision.hidden_size, vision.depth, vision.num_heads, 1e-6)
    # the processor's bounds on a picture's pixels (llama.cpp's own default would enlarge a small picture)
    writer.add_uint32(gguf.Keys.ClipVision.IMAGE_MIN_PIXELS, images.size.shortest_edge)  # transformers keeps min_pixels here
    writer.add_uint32(gguf.Keys.ClipVision.IMAGE_MAX_PIXELS, images.size.longest_edge)
    if newer:  # SiLU-gated MLPs; every n-th layer attends over the whole picture, the rest within windows
        writer.add_bool(gguf.Keys.ClipVision.USE_SILU, True)
        writer.add_uint32(gguf.Keys.ClipVision.N_WA_PATTERN, vision.fullatt_block_indexes[0] + 1)
        writer.add_uint32(gguf.Keys.ClipVision.WINDOW_SIZE, vision.window_size)
    else:
        writer.add_bool(gguf.Keys.ClipVision.USE_GELU, True)
    T, name = gguf.MODEL_TENSOR, _name
    patches = tower.patch_embed.proj.weight  # (width, 3, frames, patch, patch)
    out = {f"{name(T.V_ENC_EMBD_PATCH)}.weight": patches[:, :, 0], f"{name(T.V_ENC_EMBD_PATCH)}.weight.1": patches[:, :, 1]}
    mlp = {T.V_ENC_FFN_GATE: "mlp.gate_proj", T.V_ENC_FFN_UP: "mlp.up_proj", T.V_ENC_FFN_DOWN: "mlp.down_proj"} if newer else \
        {T.V_ENC_FFN_UP: "mlp.fc1", T.V_ENC_FFN_DOWN: "mlp.fc2"}
    for i, block in enumerate(tower.blocks):
        qkv = block.attn.qkv
        for kind, w, b in zip((T.V_ENC_ATTN_Q, T.V_ENC_ATTN_K, T.V_ENC_ATTN_V), qkv.weight.chunk(3), qkv.bias.chunk(3)):
            out |= {f"{name(kind, i)}.weight": w, f"{name(kind, i)}.bias": b}
        parts = {T.V_ENC_ATTN_O: "attn.proj", T.V_ENC_INPUT_NORM: "norm1", T.V_ENC_POST_ATTN_NORM: "norm2", **mlp}
        for kind, module in parts.items():
            out |= _pair(name(kind, i), block.get_submodule(module))
    merger = tower.merger
    return out | _pair(name(T.V_POST_NORM), merger.ln_q) | _pair(name(T.V_MMPROJ, 0), merger.mlp[0]) | _pair(name(T.V_MMPROJ, 2), merger.mlp[2])


def _tensors(model, layers: int) -> dict[str, torch.Tensor]:
    """The tower's and projector's weights under llama.cpp's clip names (LLaVA: the tower's last layers past the one it
    reads are written too, llama.cpp stops at the feature layer as transformers' LLaVA does, no post-layernorm; Gemma 3,
    Idefics3 and SmolVLM2 read the last layer through the post-layernorm)."""
    import gguf

    T, name, tower = gguf.MODEL_TENSOR, _name, _tower(model)
    embeddings = tower.embeddings
    out = {f"{name(T.V_ENC_EMBD_PATCH)}.weight": embeddings.patch_embedding.weight,
           f"{name(T.V_ENC_EMBD_POS)}.weight": embeddings.position_embedding.weight}
    if embeddings.patch_embedding.bias is not None:
        out[f"{name(T.V_ENC_EMBD_PATCH)}.bias"] = embeddings.patch_embedding.bias
    parts = {T.V_ENC_ATTN_Q: "self_attn.q_proj", T.V_ENC_ATTN_K: "self_attn.k_proj", T.V_ENC_ATTN_V: "self_attn.v_proj",
             T.V_ENC_ATTN_O: "self_attn.out_proj", T.V_ENC_INPUT_NORM: "layer_norm1", T.V_ENC_POST_ATTN_NORM: "layer_norm2",
             T.V_ENC_FFN_UP: "mlp.fc1", T.V_ENC_FFN_DOWN: "mlp.fc2"}
    for i in range(layers):
        layer = tower.encoder.layers[i]
        for kind, module in parts.items():
            out |= _pair(name(kind, i), layer.get_submodule(module))
    if model.config.model_type in SHUFFLED:
        return out | _pair(name(T.V_POST_NORM), tower.post_layernorm) | _pair(name(T.V_MMPROJ_FC), model.model.connector.modality_projection.proj)
    projector = model.model.multi_modal_projector
    if model.config.model_type == "gemma3":
        out |= _pair(name(T.V_POST_NORM), tower.post_layernorm)
        # Gemma's RMS norm scales by 1 + its weight, llama.cpp's by the weight
        return out | {f"{name(T.V_MM_INP_PROJ)}.weight": projector.mm_input_projection_weight,
                      f"{name(T.V_MM_SOFT_EMB_NORM)}.weight": projector.mm_soft_emb_norm.weight + 1}
    out |= _pair(name(T.V_MMPROJ, 0), projector.linear_1) | _pair(name(T.V_MMPROJ, 2), projector.linear_2)
    return out


def _qwen3_header(writer, model, processor) -> dict[str, torch.Tensor]:
    """Qwen3-VL's tower: its metadata as llama.cpp's converter writes it (its learned positions' grid, the layers whose
    features DeepStack hands on); its tensors under gguf's own names for them, the 3-D patch embedding as its two frames."""
    import gguf

    vision, tower, images = model.config.vision_config, model.model.visual, processor.image_processor
    keys = gguf.Keys.ClipVision
    _tower_keys(writer, images, round(vision.num_position_embeddings ** 0.5) * vision.patch_size, vision.patch_size, vision.hidden_size,
                vision.intermediate_size, vision.out_hidden_size, vision.depth, vision.num_heads,
                model.config.get_text_config().rms_norm_eps)  # the text's eps, as llama.cpp's converter writes it
    writer.add_bool(keys.USE_GELU, True)
    writer.add_uint32(keys.SPATIAL_MERGE_SIZE, vision.spatial_merge_size)
    writer.add_array(keys.IS_DEEPSTACK_LAYERS, [i in vision.deepstack_visual_indexes for i in range(vision.depth)])
    T, names = gguf.MODEL_TENSOR, gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.depth)
    patch = _name(T.V_ENC_EMBD_PATCH)
    weights = tower.patch_embed.proj.weight  # (width, 3, frames, patch, patch)
    out = {f"{patch}.weight": weights[:, :, 0], f"{patch}.weight.1": weights[:, :, 1], f"{patch}.bias": tower.patch_embed.proj.bias}
    parts = {"norm": T.V_DS_NORM, "linear_fc1": T.V_DS_FC1, "linear_fc2": T.V_DS_FC2}
    for j, layer in enumerate(vision.deepstack_visual_indexes):
        for part, kind in parts.items():
            out |= _pair(_name(kind, layer), tower.deepstack_merger_list[j].get_submodule(part))
    out |= _pair(_name(T.V_POST_NORM), tower.merger.norm) | _pair(_name(T.V_MMPROJ, 0), tower.merger.linear_fc1) \
        | _pair(_name(T.V_MMPROJ, 2), tower.merger.linear_fc2)
    for name, value in tower.named_parameters():
        if name.startswith(("blocks.", "pos_embed.")):
            base, _, suffix = f"visual.{name}".rpartition(".")
            out[f"{names.get_name(base)}.{suffix}"] = value
    return out


def _internvl_header(writer, model, processor) -> dict[str, torch.Tensor]:
    """InternVL's tower (a class token, layer scales) and projector (patches shuffled 1 / downsample_ratio x that into one
    token, a norm and two matrices): its metadata as llama.cpp's converter writes it; its tensors under gguf's own names."""
    import gguf

    vision, keys = model.config.vision_config, gguf.Keys.ClipVision
    _tower_keys(writer, processor.image_processor, vision.image_size[0], vision.patch_size[0], vision.hidden_size, vision.intermediate_size,
                model.config.get_text_config().hidden_size, vision.num_hidden_layers, vision.num_attention_heads, vision.layer_norm_eps)
    writer.add_bool(keys.USE_SILU if vision.hidden_act == "silu" else keys.USE_GELU, True)
    writer.add_uint32(keys.Projector.SCALE_FACTOR, round(1 / model.config.downsample_ratio))
    names, out = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers), {}
    for name, value in model.model.vision_tower.named_parameters(prefix="model.vision_tower"):
        base, _, suffix = name.rpartition(".") if name.endswith((".weight", ".bias")) else (name, "", "weight")
        mapped = names.get_name(base)  # the class token bare, as llama.cpp reads it; layer scales and positions as weights
        out[mapped if mapped == _name(gguf.MODEL_TENSOR.V_ENC_EMBD_CLS) else f"{mapped}.{suffix}"] = value
    projector = model.model.multi_modal_projector
    for i, module in ((0, projector.layer_norm), (1, projector.linear_1), (3, projector.linear_2)):  # the releases' mlp1.0, .1, .3
        out |= _pair(_name(gguf.MODEL_TENSOR.V_MMPROJ_MLP, i), module)
    return out


def _gemma4_header(writer, model, processor) -> dict[str, torch.Tensor]:
    """Gemma 4's tower (2-D rotary positions and a learned table for each axis, each kernel x kernel patches averaged into
    one token) and its projector (a norm and one matrix): its metadata as llama.cpp's converter writes it (the picture
    size is not read); its tensors under gguf's own names, the patch embedding's (row, column, colour) columns as a
    convolution's kernels, the clipped linears' bounds as 1-element tensors beside their weights, the standardization's
    bias and scale where the tower has them."""
    import gguf

    vision, tower = model.config.vision_config, model.model.vision_tower
    _tower_keys(writer, processor.image_processor, 224, vision.patch_size, vision.hidden_size, vision.intermediate_size,
                model.config.get_text_config().hidden_size, vision.num_hidden_layers, vision.num_attention_heads, vision.rms_norm_eps)
    writer.add_bool(gguf.Keys.ClipVision.USE_GELU, True)
    if vision.pooling_kernel_size != 3:  # llama.cpp's default, the releases'
        writer.add_uint32(gguf.Keys.ClipVision.Projector.SCALE_FACTOR, vision.pooling_kernel_size)
    names, out = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers), {}
    bounds = (".input_max", ".input_min", ".output_max", ".output_min")
    kept = [(name, value) for name, value in tower.named_buffers(prefix="model.vision_tower") if name.endswith((*bounds, "std_bias", "std_scale"))]
    for name, value in [*tower.named_parameters(prefix="model.vision_tower"), *kept, *model.model.embed_vision.named_parameters(prefix="model.embed_vision")]:
        name = name.replace("model.vision_tower.encoder.", "vision_model.model.").replace(".linear.weight", ".weight")
        if name.endswith(("layer_scalar", "position_embedding_table")):
            name += ".weight"
        if name.endswith("patch_embedder.input_proj.weight"):  # (width, row * column * colour) -> (width, colour, row, column)
            side = vision.patch_size
            value = value.unflatten(1, (side, side, 3)).permute(0, 3, 1, 2)
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias", *bounds))
        if mapped is None:
            raise UserError(f"--model: no GGUF name for Gemma 4's tower tensor {name}")
        out[mapped] = value.reshape(1) if name.endswith(bounds) else value
    return out


def _pixtral_header(writer, model, processor) -> dict[str, torch.Tensor]:
    """Mistral 3's tower (Pixtral's: RMS norms, SiLU- or GELU-gated MLPs, 2-D rotary positions) and projector (a norm, each
    2 x 2 patches merged by one matrix, two matrices): its metadata as llama.cpp's converter writes it; its tensors under
    gguf's own names, the queries' and keys' rows in llama.cpp's rotary order, and the `[IMG_BREAK]` token's embedding,
    which llama.cpp puts after each row of a picture's tokens as the processor puts the token."""
    import gguf

    vision, config = model.config.vision_config, model.config
    _tower_keys(writer, processor.image_processor, vision.image_size, vision.patch_size, vision.hidden_size, vision.intermediate_size,
                config.get_text_config().hidden_size, vision.num_hidden_layers, vision.num_attention_heads, 1e-5)  # Pixtral's norms' eps
    writer.add_bool(gguf.Keys.ClipVision.USE_SILU if vision.hidden_act == "silu" else gguf.Keys.ClipVision.USE_GELU, True)
    writer.add_uint32(gguf.Keys.ClipVision.SPATIAL_MERGE_SIZE, config.spatial_merge_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(vision.num_hidden_layers, 3))  # the projector's linear_2 counts as a block
    out = {}
    for name, value in [*model.model.vision_tower.named_parameters(prefix="vision_tower"),
                        *model.model.multi_modal_projector.named_parameters(prefix="multi_modal_projector")]:
        base, _, suffix = name.rpartition(".")
        if base.endswith(("q_proj", "k_proj")):
            value = torch.from_numpy(rotary_rows(value.detach().float().numpy(), vision.num_attention_heads))
        out[f"{names.get_name(base)}.{suffix}"] = value
    return out | {_name(gguf.MODEL_TENSOR.V_TOK_EMBD_IMG_BREAK): model.get_input_embeddings().weight[processor.image_break_token_id]}


def rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Llama's query/key rows in llama.cpp's order: within each head the two rotary halves interleaved
    (as convert_hf_to_gguf.py permutes them; transformers' GGUF loader undoes it). A Llama-style language model's (export.py)
    and Pixtral's tower's."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tower_keys(writer, images, size: int, patch: int, width: int, ffn: int, projection: int, depth: int, heads: int, eps: float) -> None:
    """The keys every clip file carries: the tower's shape, and the processor's normalization of a picture."""
    import gguf

    keys = gguf.Keys.ClipVision
    for key, value in ((keys.IMAGE_SIZE, size), (keys.PATCH_SIZE, patch), (keys.EMBEDDING_LENGTH, width), (keys.FEED_FORWARD_LENGTH, ffn),
                       (keys.PROJECTION_DIM, projection), (keys.BLOCK_COUNT, depth), (keys.Attention.HEAD_COUNT, heads)):
        writer.add_uint32(key, value)
    writer.add_float32(keys.Attention.LAYERNORM_EPS, eps)
    writer.add_array(keys.IMAGE_MEAN, [float(x) for x in images.image_mean])
    writer.add_array(keys.IMAGE_STD, [float(x) for x in images.image_std])


def _name(kind, bid: int | None = None) -> str:
    """gguf's own name for a tensor kind (of tower layer `bid`)."""
    import gguf

    text = gguf.TENSOR_NAMES[kind]
    return text.format(bid=bid) if bid is not None else text


def _pair(prefix: str, module) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{key}": value for key in ("weight", "bias") if (value := getattr(module, key, None)) is not None}  # an RMS norm: no bias


def has_mtmd() -> bool:
    """Whether llama-cpp-python was built with llama.cpp's multimodal library (mtmd), which reads projector files."""
    if importlib.util.find_spec("llama_cpp") is None:
        return False
    try:
        import llama_cpp.mtmd_cpp  # noqa: F401 - loads the library, or fails where it was not built
    except (OSError, FileNotFoundError, RuntimeError):
        return False
    return True


@torch.no_grad()
def check(model, processor, text_gguf: Path, mmproj: Path, picture) -> float:
    """The largest |difference| between llama.cpp's embeddings of `picture` (a PIL image of the tower's size), from the
    projector file over the text file, and the model's own features for it, over their largest |value|. llama.cpp runs in
    a child process: where it aborts on a file (a GGML assertion ends its process), the export ends in one line and
    removes what it wrote, instead of dying with it."""
    family = model.config.model_type
    # Idefics3 / SmolVLM: the picture as one crop of the tower's size (llama.cpp's encoding of a picture that size)
    whole = {"do_image_splitting": False, "size": {"longest_edge": picture.width}} if family in SHUFFLED else {}
    inputs = processor.image_processor(images=[picture], return_tensors="pt", **whole)
    pixels = inputs["pixel_values"]
    features = model.model.get_image_features(pixel_values=pixels, **_feature_arguments(model.config, inputs))
    ours = torch.cat(list(features.pooler_output if hasattr(features, "pooler_output") else features)).float()
    # Qwen3-VL: each DeepStack layer's features beside the picture's, as llama.cpp hands them on (n_embd_inp wide)
    ours = torch.cat([ours, *(torch.cat(list(layer)).float() for layer in getattr(features, "deepstack_features", None) or [])], dim=-1)
    if family == "mistral3":
        ours = _with_row_breaks(model, processor, ours, inputs["image_sizes"][0])
    theirs = _llama_cpp_embeddings(text_gguf, mmproj, picture)
    if theirs.shape != ours.shape:
        raise Stopped(f"GGUF check failed: llama.cpp makes {tuple(theirs.shape)} embeddings of a picture, the model {tuple(ours.shape)}",
                      exit_code=EXIT_MERGE_CHECK)
    return (theirs - ours).abs().max().item() / ours.abs().max().item()


def _with_row_breaks(model, processor, features: torch.Tensor, size) -> torch.Tensor:
    """Mistral 3's picture as its language model reads it, and llama.cpp hands it on: the `[IMG_BREAK]` token's embedding
    after each row of the picture's tokens but the last (the processor's `[IMG_END]` after the last is text to llama.cpp)."""
    across = int(size[1]) // (model.config.vision_config.patch_size * model.config.spatial_merge_size)
    token = model.get_input_embeddings().weight[processor.image_break_token_id].float()
    rows = [torch.cat([row, token[None]]) for row in features.split(across)]
    return torch.cat(rows)[:-1]


def _feature_arguments(config, inputs) -> dict:
    """What the family's get_image_features takes beside the pixels: Qwen-VL's picture grid, Gemma 4's patch places,
    LLaVA's and InternVL's feature layer; Gemma 3's and Idefics3's nothing."""
    if config.model_type in ("gemma3", *SHUFFLED):
        return {}
    if config.model_type in (*QWEN, *QWEN35):
        return {"image_grid_thw": inputs["image_grid_thw"]}
    if config.model_type == "gemma4":
        return {"image_position_ids": inputs["image_position_ids"]}
    if config.model_type == "mistral3":
        return {"image_sizes": inputs["image_sizes"], "vision_feature_layer": config.vision_feature_layer}
    return {"vision_feature_layer": config.vision_feature_layer, "vision_feature_select_strategy": config.vision_feature_select_strategy}


def _llama_cpp_embeddings(text_gguf: Path, mmproj: Path, picture) -> torch.Tensor:
    """llama.cpp's embeddings of `picture`, computed by `python -m finetune.outputs.mmproj` in a process of its own."""
    import subprocess
    import sys

    with tempfile.TemporaryDirectory(prefix="finetune-mtmd-") as scratch:
        image, out = Path(scratch) / "picture.png", Path(scratch) / "embeddings.npy"
        picture.save(image)
        done = subprocess.run([sys.executable, "-m", "finetune.outputs.mmproj", str(text_gguf), str(mmproj), str(image), str(out)],
                              capture_output=True, text=True)
        if done.returncode or not out.exists():
            said = [line for line in done.stderr.splitlines() if "GGML_ASSERT" in line or "unsupported" in line or "error" in line.lower()]
            why = re.sub(r"^\S*/", "", said[-1].strip())[:200] if said else f"exit {done.returncode}"  # no build path
            raise Stopped(f"GGUF check failed: llama.cpp stopped on the projector file {mmproj.name} ({why}); nothing written",
                          exit_code=EXIT_MERGE_CHECK)
        return torch.from_numpy(np.load(out))


def _embeddings_here(text_gguf: str, mmproj: str, image: str, out: str) -> int:
    """The child's work: llama.cpp's embeddings of the picture at `image`, saved to `out` (.npy); 1 where llama.cpp does not
    load the projector file."""
    import sys

    import llama_cpp
    import llama_cpp.mtmd_cpp as mtmd
    from PIL import Image

    text = llama_cpp.llama_model_load_from_file(text_gguf.encode(), llama_cpp.llama_model_default_params())
    settings = mtmd.mtmd_context_params_default()
    settings.use_gpu, settings.n_threads, settings.warmup = False, max(1, torch.get_num_threads()), False
    ctx = mtmd.mtmd_init_from_file(mmproj.encode(), text, settings)
    try:
        if not ctx:
            print(f"error: llama.cpp does not load the projector file {Path(mmproj).name}", file=sys.stderr)
            return 1
        np.save(out, _embeddings(mtmd, ctx, Image.open(image), llama_cpp.llama_model_n_embd_inp(text)))
        return 0
    finally:
        if ctx:
            mtmd.mtmd_free(ctx)
        llama_cpp.llama_model_free(text)


def _embeddings(mtmd, ctx, picture, width: int) -> np.ndarray:
    """llama.cpp's embeddings of one picture: the prompt "<marker>" tokenized into its image chunk, which is encoded."""
    rgb = np.ascontiguousarray(np.asarray(picture.convert("RGB"), dtype=np.uint8))
    bitmap = mtmd.mtmd_bitmap_init(picture.width, picture.height, rgb.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
    chunks = mtmd.mtmd_input_chunks_init()
    try:
        marker = mtmd.mtmd_default_marker()
        text = mtmd.mtmd_input_text(text=marker, text_len=len(marker), add_special=False, parse_special=True)
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        if mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) != 0:
            raise RuntimeError("error: llama.cpp does not tokenize a picture with the projector file")
        image = next(mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks))
                     if mtmd.mtmd_input_chunk_get_type(mtmd.mtmd_input_chunks_get(chunks, i)) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE)
        if mtmd.mtmd_encode_chunk(ctx, image) != 0:
            raise RuntimeError("error: llama.cpp does not encode a picture with the projector file")
        count = mtmd.mtmd_input_chunk_get_n_tokens(image)
        flat = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(count * width,))
        return flat.copy().reshape(count, width)
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)


def export_vision(folder: Path, out: Path, kind: str, export_text, say=print) -> dict:
    """The language model at `out` (export_text: export.export_gguf) and the projector file beside it, both checked; the
    pair or nothing. The model is one refusal() passes."""
    from transformers import AutoModelForImageTextToText

    from finetune.config.schema import ModelConfig
    from finetune.model import vision

    projector = projector_path(out)
    projector_kind = "f16" if kind == "f16" else "f32"  # llama.cpp's quantizer takes the language model; the tower stays unquantized
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    processor = vision.load_processor(ModelConfig(name_or_path=str(folder)), model.config.model_type)
    with tempfile.TemporaryDirectory(prefix="finetune-text-") as scratch:
        report = export_text(str(text_folder(model, processor.tokenizer, Path(scratch) / "text")), str(out), kind, say)
    tmp = projector.with_name(f".{projector.name}.tmp")
    published = False
    try:
        write(model, processor, tmp, projector_kind)
        worst = None
        if has_mtmd():
            worst = check(model, processor, out, tmp, _picture(*_check_size(model.config, processor.image_processor)))
            say(f"projector file ({projector_kind}) in llama.cpp itself (mtmd): a picture's embeddings within {worst:.3g} of the model's "
                "(largest difference over largest value)")
            if worst > TOLERANCE[projector_kind]:
                raise Stopped(f"GGUF check failed: the projector file's embeddings differ by up to {worst:.4g} of their largest value "
                              f"(tolerance {TOLERANCE[projector_kind]:g}); nothing written to {projector}", exit_code=EXIT_MERGE_CHECK)
        else:
            say("projector file written unchecked: llama-cpp-python here was built without llama.cpp's multimodal library (mtmd)")
        tmp.replace(projector)
        published = True
    finally:
        tmp.unlink(missing_ok=True)
        if not published:  # the language model's file written above goes too
            out.unlink(missing_ok=True)
    return {**report, "mmproj": str(projector), "mmproj_type": projector_kind, "mmproj_max": worst}


def projector_path(out: Path) -> Path:
    """Where the projector file of an export to `out` goes: beside it, as llama.cpp's tools name theirs (a new file)."""
    path = out.with_name(f"mmproj-{out.name}")
    if path.exists():
        raise UserError(f"--out: {path} (the projector file) exists; name a new file")
    return path


def _check_size(config, images) -> tuple[int, int]:
    """The check picture's width and height, which neither the processor nor llama.cpp resizes: the tower's size; Qwen-VL's
    take any: 8 x 8 patches (4 x 4 tokens); Mistral 3's its processor's longest side, at most 16 x 16 tokens (llama.cpp's
    pixtral graph takes 8 to 1,024); Gemma 4's the processor's most tokens (10 x 7 pooled cells for its smallest setting,
    70) and llama.cpp's fewest (70)."""
    vision = config.vision_config
    if config.model_type == "gemma4":
        cell = vision.patch_size * vision.pooling_kernel_size
        across = next(n for n in range(round(images.max_soft_tokens ** 0.5), images.max_soft_tokens + 1) if images.max_soft_tokens % n == 0)
        return cell * across, cell * (images.max_soft_tokens // across)
    if config.model_type == "mistral3":
        cell = vision.patch_size * config.spatial_merge_size
        side = cell * min(images.size["longest_edge"] // cell, 16)
        return side, side
    side = getattr(vision, "image_size", 8 * vision.patch_size)
    side = side[0] if isinstance(side, (list, tuple)) else side
    return side, side


def _picture(width: int, height: int | None = None):
    """A picture of that size with structure in it (two gradients and a checkerboard), for the check."""
    from PIL import Image

    height = height or width
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, ((x // 8 + y // 8) % 2) * 255], axis=-1).astype(np.uint8)
    return Image.fromarray(rgb)


if __name__ == "__main__":  # _llama_cpp_embeddings' child: TEXT_GGUF MMPROJ PICTURE OUT
    import sys

    sys.exit(_embeddings_here(*sys.argv[1:5]))
