"""The trainer's speed-ups change no number: chunked linear cross-entropy, logits on trained tokens
only, and attention run per packed sample all give the losses and gradients of the plain paths."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, documented_varlen, gpu_branch_on_cpu, loss_and_grads, packed_batch
from transformers import AutoModelForCausalLM

from finetune.data.rows import IGNORE
from finetune.model import attention
from finetune.model.attention import PACKED_SDPA, register, sample_bounds
from finetune.objectives import loss


@pytest.mark.parametrize("weight_trains", [False, True])
def test_linear_cross_entropy_equals_cross_entropy(monkeypatch, weight_trains):
    monkeypatch.setattr(loss, "CHUNK_ELEMENTS", 7 * 50)  # 7 tokens a chunk: several chunks and a ragged last one
    torch.manual_seed(0)
    hidden = torch.randn(30, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=weight_trains)
    targets = torch.randint(0, 50, (30,))
    fused = loss.linear_cross_entropy(hidden, weight, targets) * 0.5
    fused.backward()
    grads = hidden.grad.clone(), weight.grad.clone() if weight_trains else None
    hidden.grad, weight.grad = None, None
    plain = F.cross_entropy(hidden @ weight.t(), targets, reduction="sum") * 0.5
    plain.backward()
    assert abs(fused.item() - plain.item()) < 1e-9
    assert torch.allclose(grads[0], hidden.grad, atol=1e-12)
    if weight_trains:
        assert torch.allclose(grads[1], weight.grad, atol=1e-12)
    with torch.no_grad():  # eval: the loss only
        assert abs(loss.linear_cross_entropy(hidden, weight, targets).item() - 2 * plain.item()) < 1e-9


@pytest.mark.parametrize("method", ["lora", "full"])
def test_trained_token_loss_equals_full_logits_loss(tiny_model_dir, monkeypatch, method):
    """token_loss_sum's fused path == logits of every position + cross-entropy (the textbook loss)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    if method == "lora":
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False))
    model.train()
    batch = packed_batch(tiny_model_dir)
    assert loss.fusable_parts(model) is not None
    fused = loss_and_grads(model, batch)

    def textbook(model, batch):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE, reduction="sum")

    monkeypatch.setattr(loss, "token_loss_sum", textbook)
    plain = loss_and_grads(model, batch)
    assert abs(fused[0] - plain[0]) < 1e-4 * plain[0]
    assert fused[1].keys() == plain[1].keys() and len(fused[1]) > 0
    for name, grad in plain[1].items():
        assert torch.allclose(fused[1][name], grad, atol=1e-5), (name, (fused[1][name] - grad).abs().max())
    monkeypatch.undo()
    monkeypatch.setattr(loss, "fusable_parts", lambda model: None)  # the logits_to_keep path of other architectures
    kept = loss_and_grads(model, batch)
    assert abs(kept[0] - plain[0]) < 1e-4 * plain[0]


def test_the_cpu_kernel_choice_follows_what_was_measured_on_each_cpu(monkeypatch):
    """finetune's kernel for samples up to SHORT_SAMPLE where SDPA_FIRST is off (the AMD EPYC SHORT_SAMPLE was measured on);
    on (an Intel Xeon with AMX: bench/results/attention.md), torch's sdpa for every fp32 sample and past 256 tokens in
    bf16, but for heads scaled otherwise than by 1/sqrt(head size) (Gemma 4's, scale 1: torch's fp32 flash drifts there).
    FINETUNE_CPU_ATTENTION
    chooses in a process of its own."""
    import subprocess
    import sys

    monkeypatch.setattr(attention, "SDPA_FIRST", False)
    assert attention.short_sample(torch.float32, 64, 1 / 8) == attention.short_sample(torch.bfloat16, 64, 1 / 8) == attention.SHORT_SAMPLE
    monkeypatch.setattr(attention, "SDPA_FIRST", True)
    assert attention.short_sample(torch.float32, 64, 1 / 8) == 0 and attention.short_sample(torch.bfloat16, 256, 1 / 16) == 256
    assert attention.short_sample(torch.float32, 512, 1.0) == attention.short_sample(torch.float32, 256, 1.0) == attention.SHORT_SAMPLE
    for chosen, first in (("sdpa", "True"), ("finetune", "False")):
        out = subprocess.run([sys.executable, "-c", "from finetune.model import attention; print(attention.SDPA_FIRST)"], capture_output=True,
                             text=True, env={**os.environ, "FINETUNE_CPU_ATTENTION": chosen}, cwd=REPO, timeout=120)
        assert out.stdout.strip().splitlines()[-1] == first, out.stderr[-2000:]


@pytest.mark.parametrize("short_sample, sdpa_first", [(attention.SHORT_SAMPLE, False), (0, False), (attention.SHORT_SAMPLE, True)],
                         ids=["causal_attention", "torch-sdpa", "sdpa-first"])
def test_packed_sdpa_equals_masked_attention_in_training(tiny_model_dir, monkeypatch, short_sample, sdpa_first):
    """Per-sample attention (GQA model, padded second row), by our kernel or torch's, == eager attention
    over the block-diagonal mask: logits and gradients; in eval too, and outside packed_rows() (generation)
    it is plain sdpa. sdpa-first: a CPU where torch's kernel is the faster (attention.SDPA_FIRST) sends fp32 samples to it."""
    monkeypatch.setattr(attention, "SHORT_SAMPLE", short_sample)
    monkeypatch.setattr(attention, "SDPA_FIRST", sdpa_first)
    ours, kernel = [], attention.causal_attention
    monkeypatch.setattr(attention, "causal_attention", lambda *a, **k: ours.append(a) or kernel(*a, **k))
    batch = packed_batch(tiny_model_dir)
    assert [len(b) for b in sample_bounds(batch["position_ids"])] == [5, 4]  # 4 samples | 2 samples + pad
    results = {}
    for impl in ("eager", register()):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=impl).train()
        assert model.config._attn_implementation == impl
        with attention.packed_rows():
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        logits.float().pow(2).mean().backward()
        results[impl] = logits.detach(), {n: p.grad for n, p in model.named_parameters()}
    (eager_logits, eager_grads), (packed_logits, packed_grads) = results["eager"], results[PACKED_SDPA]
    assert torch.allclose(packed_logits, eager_logits, atol=1e-5), (packed_logits - eager_logits).abs().max()
    for name, grad in eager_grads.items():
        assert torch.allclose(packed_grads[name], grad, atol=1e-5), name
    assert bool(ours) == (short_sample > 0 and not sdpa_first)
    model.eval()
    with torch.no_grad(), attention.packed_rows():
        evaluated = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    calls = []
    monkeypatch.setattr(attention, "sample_bounds", lambda *a: calls.append(a))  # plain sdpa never splits rows
    with torch.no_grad():
        again = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    assert not calls
    for other in (evaluated, again):
        assert torch.allclose(other, eager_logits, atol=1e-5)


def test_fused_loss_follows_autocast_inside_the_forward(tiny_model_dir, monkeypatch):
    """fp32 base under bf16 autocast applied to the forward (as accelerate does): the fused loss
    computes the head in bf16 like the model's own lm_head would, not in fp32."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").train()
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    batch = packed_batch(tiny_model_dir)
    fused = loss_and_grads(model, batch)
    monkeypatch.setattr(loss, "fusable_parts", lambda model: None)
    kept = loss_and_grads(model, batch)
    assert abs(fused[0] - kept[0]) < 1e-3 * kept[0], (fused[0], kept[0])
    head = fused[1]["lm_head.weight"]
    assert head.dtype == torch.float32 and torch.allclose(head, kept[1]["lm_head.weight"], atol=2e-2 * head.abs().max().item())


@pytest.mark.parametrize("sink", [False, True], ids=["diffuse", "attention-sink"])
def test_causal_attention_in_bf16_is_as_close_to_exact_as_eager_attention(sink):
    """Against a float64 reference: output and q/k/v gradients in bf16 no further off than textbook
    bf16 attention (transformers' eager: fp32 softmax, bf16 matmuls), also where every query puts
    nearly all its weight on the first key, as trained models do; fp32 inputs under bf16 autocast
    compute in bf16 and hand back fp32 gradients."""
    torch.manual_seed(0)
    heads, length, dim = 4, 200, 32
    q, k, v = (torch.randn(heads, length, dim, dtype=torch.float64) for _ in range(3))
    if sink:
        toward = F.normalize(torch.randn(dim, dtype=torch.float64), dim=0)
        q += 6 * toward
        k[:, 0] = 6 * dim**0.5 * toward
        v[:, 0] *= 4
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    grad_out = torch.randn(heads, length, dim, dtype=torch.float64)
    exact_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    exact_out.backward(grad_out)
    exact = [exact_out.detach(), q.grad, k.grad, v.grad]

    def errors(fn):
        inputs = [x.detach().to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
        out = fn(*inputs)
        out.backward(grad_out.to(out.dtype))
        return [((got.double() - e).abs().max() / e.abs().max()).item() for got, e in zip([out.detach()] + [x.grad for x in inputs], exact)]

    def eager(q, k, v):
        scores = (q @ k.transpose(1, 2) * dim**-0.5).masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype) @ v

    def ours(q, k, v):  # one sample as a packed batch of one row
        return attention.causal_attention(q[None], k[None], v[None], [(0, 0, length)], dim**-0.5)[0].transpose(0, 1)

    ours, textbook = errors(ours), errors(eager)
    assert all(o <= 1.1 * t for o, t in zip(ours, textbook)) and (sink or max(ours) < 0.01), (ours, textbook)

    fp32 = [x.detach().float().requires_grad_() for x in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention.causal_attention(*(x[None] for x in fp32), [(0, 0, length)], dim**-0.5)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and all(x.grad.dtype == torch.float32 for x in fp32)


def test_sinks_through_sdpa_in_bf16_are_as_close_to_exact_as_eager_attention():
    """gpt-oss's sinks through torch's sdpa (attention._with_sink_key: a sink key, widened heads, grouped-query heads kept
    grouped): against gpt-oss's eager attention in float64, output and the q/k/v and sink gradients in bf16 no further
    off than its eager attention in bf16, sinks large enough to take most of each row's weight."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, length, dim = 8, 2, 300, 64
    inputs = [torch.randn(1, n, length, dim, generator=generator, dtype=torch.float64) * 2 for n in (heads, kv_heads, kv_heads)]
    inputs.append(torch.randn(heads, generator=generator, dtype=torch.float64) * 2 + 4)
    grad_out = torch.randn(1, length, heads, dim, generator=generator, dtype=torch.float64)

    def eager(q, k, v, sinks):  # transformers' gpt-oss eager_attention_forward, its masks causal
        k, v = (x.repeat_interleave(heads // kv_heads, 1) for x in (k, v))
        scores = (q @ k.transpose(2, 3) * dim**-0.5).masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(1, -1, length, 1)], -1)
        return (torch.softmax(scores, -1, dtype=scores.dtype)[..., :-1] @ v).transpose(1, 2)

    def sdpa(q, k, v, sinks):
        return attention._with_sink_key(q, k, v, attention._sink_mask(length, None, q.dtype, q.device), dim**-0.5, sinks)

    def run(fn, dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
        out = fn(*leaves)
        out.backward(grad_out.to(dtype))
        return [out.detach().double(), *(x.grad.double() for x in leaves)]

    exact = run(eager, torch.float64)
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-10) for a, b in zip(run(sdpa, torch.float64), exact))
    ours, theirs = ([((a - e).norm() / e.norm()).item() for a, e in zip(run(fn, torch.bfloat16), exact)] for fn in (sdpa, eager))
    assert all(o <= 1.1 * t for o, t in zip(ours, theirs)), (ours, theirs)


def test_grouped_query_gradients_add_up_in_the_inputs_dtype():
    """fp32 inputs under bf16 autocast (fp32 weights: RoPE hands attention fp32 queries and keys),
    grouped-query: the key/value gradients of the heads that share them are added in fp32, exactly as
    autograd adds them for keys and values repeated before the call (bf16 sums made the demo's
    fine-tune reach 61% instead of 92% exact match)."""
    torch.manual_seed(0)
    heads, kv_heads, length, dim = 4, 2, 30, 16
    spans = [(0, 0, 12), (0, 12, 30)]
    query, key, value = torch.randn(1, heads, length, dim), torch.randn(1, kv_heads, length, dim), torch.randn(1, kv_heads, length, dim)
    grad_out = torch.randn(1, length, heads, dim)

    def grads(repeat_first: bool):
        inputs = [x.clone().requires_grad_() for x in (query, key, value)]
        q, k, v = inputs
        if repeat_first:
            k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = attention.causal_attention(q, k, v, spans, dim**-0.5)
        out.backward(grad_out.to(out.dtype))
        return [x.grad for x in inputs]

    grouped, repeated = grads(False), grads(True)
    assert all(g.dtype == torch.float32 for g in grouped)
    for got, want in zip(grouped, repeated):
        assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("with_gqa", [True, False], ids=["enable_gqa", "torch-2.11"])
@pytest.mark.parametrize("window", [None, 3])
def test_varlen_layout_equals_attention_per_sample(monkeypatch, with_gqa, window):
    """CUDA's one call per layer hands torch's varlen kernel the right tokens, cuts, windows and heads,
    and puts the output back where each sample was: equal to sdpa run on each sample alone."""
    monkeypatch.setattr(attention, "_varlen", lambda: documented_varlen(with_gqa))
    torch.manual_seed(0)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 0, 1, 0, 0, 0]])
    bounds = sample_bounds(position_ids)
    query, key, value = torch.randn(2, 4, 12, 16), torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
    got = attention.varlen_attention(query, key, value, bounds, 0.25, torch.float32, window)
    want = attention._split_sdpa(query, key, value, bounds, window, 0.25, 0.0, True)
    assert got.shape == (2, 12, 4, 16) and torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


@pytest.mark.parametrize("branch", ["cpu", "gpu-varlen", "gpu-sdpa-mask"])
def test_a_training_batch_from_the_host_gives_the_loss_of_eager_attention(tiny_model_dir, monkeypatch, branch):
    """A micro-batch as the loop moves it (loss.to_device: sample bounds, trained positions and targets
    from the host; transformers builds no mask) == eager attention over transformers' block mask, on
    each branch the attention takes: CPU's, and the GPU's two run here on CPU tensors (the varlen
    kernel as its documented contract; sdpa over the mask finetune builds from the bounds)."""
    batch = packed_batch(tiny_model_dir)
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").train()
    want = loss_and_grads(eager, batch)
    if branch != "cpu":
        gpu_branch_on_cpu(monkeypatch)
        # varlen computes in bf16/fp16 only: an fp32 run takes the sdpa-mask branch.
        monkeypatch.setattr(attention, "_varlen", (lambda: documented_varlen(True)) if branch == "gpu-varlen" else (lambda: None))
        monkeypatch.setattr(attention, "_varlen_dtype", lambda query, value, dropout: torch.float32 if attention._varlen() else None)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=register()).train()
    got = loss_and_grads(model, loss.to_device(batch, "cpu"))
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    for name, grad in want[1].items():
        assert torch.allclose(got[1][name], grad, atol=1e-5), (name, (got[1][name] - grad).abs().max())


def test_packed_rows_and_the_bounds_cache_belong_to_the_thread_that_set_them():
    """The async rollouts sample in a thread while the step trains: one thread inside packed_rows() leaves another's forwards
    as they were, and a bounds lookup in one thread never returns another thread's position_ids' bounds."""
    import threading

    inside, leave, seen = threading.Event(), threading.Event(), {}

    def rollout():
        with attention.packed_rows():
            seen["thread"] = attention.in_packed_rows()
            sample_bounds(torch.tensor([[0, 1, 2, 0, 1]]))
            inside.set()
            leave.wait(10)

    worker = threading.Thread(target=rollout)
    worker.start()
    assert inside.wait(10)
    ours = torch.tensor([[0, 1, 0, 1, 2, 3]])
    assert not attention.in_packed_rows() and seen["thread"]
    assert sample_bounds(ours) == [[0, 2, 6]]
    leave.set()
    worker.join(10)
    assert not attention.in_packed_rows()


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_attention_that_keeps_no_probabilities_computes_the_same_bits(monkeypatch, sinks):
    """finetune's textbook attention past KEPT_PROBS (gpt-oss's sink attention on long samples) keeps no probabilities for
    its backward: it computes them again, a group of heads at a time (here one key/value head's 4 query heads). Output
    and the gradients of q, k, v and the sinks equal those of the path that keeps them, bit for bit, over two packed
    samples with grouped-query heads and a sliding window."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, heads, 40, 16, generator=generator, requires_grad=True) for heads in (8, 2, 2))
    sink = torch.randn(8, generator=generator, requires_grad=True) if sinks else None
    grad = torch.randn(1, 40, 8, 16, generator=generator)
    results = []
    for kept in (attention.KEPT_PROBS, 4 * 25 * 26 * 4):  # room for one group's probabilities of the 25-token sample
        monkeypatch.setattr(attention, "KEPT_PROBS", kept)
        for t in (query, key, value, sink):
            if t is not None:
                t.grad = None
        out = attention.causal_attention(query, key, value, [(0, 0, 15), (0, 15, 40)], 0.25, window=12, sinks=sink)
        out.backward(grad)
        results.append([out.detach(), *(t.grad for t in (query, key, value, sink) if t is not None)])
    assert attention._head_chunks(8, 4, 25) == [slice(0, 4), slice(4, 8)]
    assert all(torch.equal(a, b) for a, b in zip(*results)), [(a - b).abs().max() for a, b in zip(*results)]
