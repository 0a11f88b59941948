"""Architectures beyond the tested matrix: does finetune keep the samples of a packed row apart?

Each architecture is built tiny from its transformers config class (random weights, dropout off) and
loaded through finetune's own loader. Per architecture:

  attention      the implementation finetune picks (sdpa_packed: finetune's packed attention; sdpa:
                 the model's own; eager where transformers has none, said at load)
  leak fp32/bf16 attention.leak: how far a packed sample's logits move towards having the sample
                 before it as context (0: apart; train refuses packing above LEAK_TOLERANCE)
  mixer          mixers.unhandled: an SSM, linear-attention or convolution layer that
                 carries a state along the row and that finetune does not run one packed sample at a time
                 (model/mixers.py; train refuses packing where there is one, and nothing else is measured)
  loss, grads    where it does not leak: finetune's loss over packed and unpacked rows, in training and
                 in eval, against the library's eager attention on each sample alone (full fine-tuning;
                 largest relative difference; a gradient that is zero in exact arithmetic is measured
                 against 1e-4 of the model's largest)
  packed vs one  finetune's packed rows against its own rows of one sample each: what packing alone changes
                 (where fp32's rounding exceeds the bounds, again in fp64: rounding, or packing?)

The families of tests/test_families.py (and GPT-2, OPT, GPT-J, Bloom, Falcon, Qwen3-Next, Qwen3.5, LFM2, Jamba,
Bamba, GraniteMoE-Hybrid, Mamba, RecurrentGemma, Gemma 4, Llama 4) are tested in `make test`; this sweep covers the rest. About 3 minutes on 2 CPU cores.

usage: python bench/families.py [--only gpt2,opt]   (results: bench/results/families.md)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from common import loss_and_grads, report

VOCAB = 512
T = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)
KV = dict(T, num_key_value_heads=2)
GPT = dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
LINEAR_ATTENTION = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                        layer_types=["linear_attention", "full_attention"])
GEMMA4 = dict(KV, num_hidden_layers=4, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
              hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1)
ARCHS = {  # name: (model_type, config)
    "llama (reference)": ("llama", KV),
    "gpt2": ("gpt2", GPT),
    "gpt_bigcode": ("gpt_bigcode", dict(GPT, multi_query=True)),
    "gptj": ("gptj", dict(GPT, rotary_dim=8)),
    "codegen": ("codegen", dict(GPT, rotary_dim=8)),
    "gpt_neo": ("gpt_neo", dict(hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=8,
                                max_position_embeddings=512, resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0)),
    "gpt_neox": ("gpt_neox", dict(T, rotary_pct=0.25)),
    "opt": ("opt", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64,
                        max_position_embeddings=512, dropout=0.0)),
    "bloom": ("bloom", dict(hidden_size=64, n_layer=2, n_head=4)),
    "mpt": ("mpt", dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=512)),
    "falcon": ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True, num_kv_heads=2)),
    "falcon (alibi)": ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True)),
    "phi": ("phi", T),
    "stablelm": ("stablelm", KV),
    "persimmon": ("persimmon", T),
    "olmo": ("olmo", T),
    "olmo2": ("olmo2", KV),
    "olmo3": ("olmo3", dict(KV, sliding_window=8)),
    "olmoe": ("olmoe", dict(KV, num_experts=4, num_experts_per_tok=2)),
    "granite": ("granite", KV),
    "granitemoe": ("granitemoe", dict(KV, num_local_experts=4, num_experts_per_tok=2)),
    "cohere": ("cohere", KV),
    "cohere2": ("cohere2", dict(KV, sliding_window=8)),
    "gemma": ("gemma", dict(KV, head_dim=16)),
    "starcoder2": ("starcoder2", dict(KV, sliding_window=8)),
    "smollm3": ("smollm3", KV),
    "glm": ("glm", dict(KV, head_dim=16)),
    "glm4": ("glm4", dict(KV, head_dim=16)),
    "exaone4": ("exaone4", dict(KV, sliding_window=8)),
    "ernie4_5": ("ernie4_5", KV),
    "seed_oss": ("seed_oss", KV),
    "nemotron": ("nemotron", KV),
    "arcee": ("arcee", KV),
    "apertus": ("apertus", KV),
    "gpt_oss": ("gpt_oss", dict(KV, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"])),
    "jamba": ("jamba", dict(KV, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                            expert_layer_offset=1, mamba_d_state=8, mamba_expand=2, use_mamba_kernels=False)),
    "lfm2": ("lfm2", dict(KV, layer_types=["conv", "full_attention"])),
    "qwen3_next": ("qwen3_next", dict(KV, **LINEAR_ATTENTION, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32)),
    # Dense MLPs (mlp_only_layers): with experts, finetune's path one sample a row, unpacked, already differs from eager attention's
    # by up to 6e-5 in the linear attention's dt_bias and A_log gradients (fp32 rounding that experts amplify)
    "qwen3_next (dense)": ("qwen3_next", dict(KV, **LINEAR_ATTENTION, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=32, mlp_only_layers=[0, 1])),
    "qwen3_5_text": ("qwen3_5_text", dict(KV, **LINEAR_ATTENTION)),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", dict(KV, **LINEAR_ATTENTION, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=32)),
    "lfm2_moe": ("lfm2_moe", dict(KV, layer_types=["conv", "full_attention"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  num_dense_layers=1)),
    "mamba2": ("mamba2", dict(hidden_size=64, num_hidden_layers=2, state_size=8, num_heads=8, head_dim=16, n_groups=1, expand=2)),
    "falcon_h1": ("falcon_h1", dict(KV, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1)),
    "bamba": ("bamba", dict(KV, attn_layer_indices=[1], **MAMBA2)),
    "granitemoehybrid": ("granitemoehybrid", dict(KV, layer_types=["mamba", "attention"], num_local_experts=2, num_experts_per_tok=1, **MAMBA2)),
    "zamba2": ("zamba2", dict(KV, mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8, layers_block_type=["mamba", "hybrid"], num_mem_blocks=1,
                              attention_head_dim=16)),
    "mamba": ("mamba", dict(hidden_size=64, num_hidden_layers=2, state_size=8)),
    "falcon_mamba": ("falcon_mamba", dict(hidden_size=64, num_hidden_layers=2, state_size=8)),
    "recurrent_gemma": ("recurrent_gemma", dict(KV, block_types=["recurrent", "attention"], lru_width=64, attention_window_size=8)),
    "nemotron_h": ("nemotron_h", dict(KV, hybrid_override_pattern="M*", mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=8, n_groups=1,
                                      head_dim=16)),
    # Gemma 4's text side: per-layer inputs, the last layers reading earlier layers' keys and values; then with experts beside
    # the dense MLP, where finetune's path one sample a row, unpacked, already differs from eager attention's by about 4e-5 in the
    # MLPs' gradients (rounding that the experts amplify, as in Qwen3-Next), packed rows equal to unpacked
    "gemma4_text": ("gemma4_text", GEMMA4),
    "gemma4_text (experts)": ("gemma4_text", dict(GEMMA4, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)),
    # Kimi Linear: Kimi Delta Attention (gated delta rule with channel-wise gates, short convolutions on q, k and v) beside MLA
    "kimi_linear": ("kimi_linear", dict(T, num_key_value_heads=4, linear_attn_config={"kda_layers": [1], "full_attn_layers": [2], "num_heads": 4,
                                                                                   "head_dim": 16, "short_conv_kernel_size": 4},
                                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_experts=4,
                                        num_experts_per_token=2, moe_intermediate_size=32)),
}
LENGTHS = (30, 12, 25, 9, 40)  # samples, most longer than the windows above


def build(work: Path, name: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, extra = ARCHS[name]
    out = work / name.split()[0] / kind
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)).save_pretrained(out)
    return out


def without_dropout(model):
    """Dropout off everywhere (modules and the rates attention layers keep as floats): paths are compared number for number."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if "dropout" in key and isinstance(value, float):
                setattr(module, key, 0.0)
    return model


def samples() -> list[tuple[list[int], list[int]]]:
    from finetune.data.rows import IGNORE

    generator = torch.Generator().manual_seed(1)
    out = []
    for n in LENGTHS:
        ids = torch.randint(3, VOCAB, (n,), generator=generator).tolist()
        out.append((ids, [IGNORE] * (n // 3) + ids[n // 3 :]))
    return out


def batch(data, packed: bool) -> dict[str, torch.Tensor]:
    from finetune.data.packing import Row, collate

    groups = [data[:3], data[3:]] if packed else [[s] for s in data]
    rows = [Row([t for s in g for t in s[0]], [t for s in g for t in s[1]], [p for s in g for p in range(len(s[0]))]) for g in groups]
    return collate(rows, pad_id=0)



def relative(ours: tuple[float, dict], theirs: tuple[float, dict]) -> tuple[float, float]:
    """Relative loss and largest relative gradient difference (a gradient that is zero in exact arithmetic against 1e-4 of
    the largest)."""
    floor = 1e-4 * max(g.abs().max().item() for g in theirs[1].values())
    return (abs(ours[0] - theirs[0]) / theirs[0],
            max((ours[1][n] - g).abs().max().item() / max(g.abs().max().item(), floor) for n, g in theirs[1].items()))


def compare(model) -> tuple[float, float, tuple[float, float]]:
    """Largest relative loss and gradient difference of finetune's paths from eager attention on each sample alone, and of
    finetune's packed rows from its own rows of one sample each (what packing alone changes)."""
    from finetune.data.rows import IGNORE
    from finetune.objectives import loss

    data = samples()
    ours = [loss_and_grads(model, lambda packed=packed: loss.token_loss_sum(model, batch(data, packed))) for packed in (True, False)]
    with torch.no_grad():
        evaluated = loss.token_loss_sum(model.eval(), batch(data, packed=True)).item()
    model.train().set_attn_implementation("eager")

    def textbook():
        total = 0
        for ids, labels in data:
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1]
            total = total + F.cross_entropy(logits.float(), torch.tensor(labels[1:]), ignore_index=IGNORE, reduction="sum")
        return total

    reference = loss_and_grads(model, textbook)
    loss_diff = max(abs(value - reference[0]) / reference[0] for value in (ours[0][0], ours[1][0], evaluated))
    grad_diff = max(relative(path, reference)[1] for path in ours)
    return loss_diff, grad_diff, relative(ours[0], ours[1])


def measure(folder: Path) -> dict:
    from finetune.config.schema import ModelConfig
    from finetune.model import experts
    from finetune.model.attention import LEAK_TOLERANCE, leak
    from finetune.model.loading import load_model
    from finetune.model.mixers import unhandled

    said = []
    model = without_dropout(load_model(ModelConfig(name_or_path=str(folder)), say=said.append)).train()
    row = {"attention": model.config._attn_implementation, "notice": "; ".join(said), "mixer": unhandled(model)}
    if row["mixer"]:  # refused before anything is measured, as train refuses it (its attention may not even run packed)
        return {**row, "apart": False, "leak": float("nan"), "leak bf16": float("nan"), "loss": float("nan"), "grads": float("nan"),
                "packing": (float("nan"), float("nan"))}
    row["leak"] = leak(model, VOCAB, "cpu")
    half = without_dropout(load_model(ModelConfig(name_or_path=str(folder), dtype="bfloat16"), say=lambda _: None)).train()
    row["leak bf16"] = leak(half, VOCAB, "cpu")
    row["apart"] = not row["leak"] > LEAK_TOLERANCE and not row["leak bf16"] > LEAK_TOLERANCE
    row["loss"], row["grads"], row["packing"] = compare(model)  # also where refused: what packing would have done
    if row["apart"] and not within(row["packing"]):  # fp32's rounding, or packing? again in fp64, transformers' own experts loop
        wide = without_dropout(load_model(ModelConfig(name_or_path=str(folder)), say=lambda _: None)).train()
        if experts.fused_experts(wide):
            wide.set_experts_implementation("eager")  # torch's grouped_mm takes no fp64
        row["fp64"] = compare(wide.double())[2]
    return row


def within(diffs: tuple[float, float]) -> bool:
    """A loss and gradient difference that count as exact."""
    return diffs[0] < 2e-6 and diffs[1] < 2e-5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help=f"comma-separated, of: {', '.join(ARCHS)}")
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n] or list(ARCHS)
    unknown = set(names) - set(ARCHS)
    if unknown:
        p.error(f"--only: unknown {', '.join(sorted(unknown))}")
    lines = ["| architecture | attention | leak fp32 | leak bf16 | mixer outside attention | with packing | loss diff | grad diff | packed vs one a row |",
             "|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as work:
        for name in names:
            try:
                row = measure(build(Path(work), name))
            except Exception as err:  # noqa: BLE001 - a row of the table, not the end of the sweep
                lines.append(f"| {name} | error: {type(err).__name__}: {str(err).splitlines()[0][:120]} | | | | | | | |")
                print(lines[-1], flush=True)
                continue
            packing = within(row["packing"]) or within(row.get("fp64", (1, 1)))
            verdict = (("exact" if within((row["loss"], row["grads"])) else "exact packing, the paths' rounding apart" if packing
                        else "MISMATCH") if row["apart"] else "refused at start")
            fp64 = f"; fp64: {row['fp64'][0]:.1e} / {row['fp64'][1]:.1e}" if "fp64" in row else ""
            lines.append(f"| {name} | {row['attention']} | {row['leak']:.3f} | {row['leak bf16']:.3f} | {row['mixer'] or '-'} | {verdict} | "
                         f"{row['loss']:.1e} | {row['grads']:.1e} | {row['packing'][0]:.1e} / {row['packing'][1]:.1e}{fp64} |")
            print(lines[-1], flush=True)
    lines += ["", f"torch {torch.__version__}, transformers {__import__('transformers').__version__}; "
              "tiny random models (2 layers, 64 wide, vocabulary 512), 5 samples of 9-40 tokens in 2 packed rows, full fine-tuning, fp32. "
              "Loss and grad diff: finetune's paths against eager attention on each sample alone; for refused models, what packing would have trained. "
              "Packed vs one a row: finetune's packed rows against its own rows of one sample each, loss / gradients (what packing alone "
              "changes; where only that is within 2e-6 / 2e-5, the paths' kernels round apart from eager's, packing is exact). Where "
              "that is above them too, it is measured again in fp64 with transformers' own experts loop (torch's grouped matmul takes "
              "no fp64; a linear attention's fallback kernel computes in fp32 whatever the model's dtype)."]
    report("families", lines)


if __name__ == "__main__":
    main()
