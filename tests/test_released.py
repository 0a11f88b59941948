"""Released families' real tokenizers and chat templates (tests/released.py) through finetune's data step: the
tokens trained are the assistant's answer and its end-of-turn token, token by token, as each template renders them
(Qwen3's <think> blocks, tool calls), and what a template cannot write is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
from released import tokenizer_dir
from transformers import AutoTokenizer

from finetune.data.chat import choose_template
from finetune.data.encoding import tokenize_pairs, tokenize_rows

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6, of course."}]
THINKING = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
            {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n6"}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOLS = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
         {"role": "tool", "content": "18C, sunny"}, {"role": "assistant", "content": "It is 18C and sunny."}]
SCHEMA = [{"type": "function", "function": {"name": "get_weather", "description": "The weather now",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# family -> what each conversation's trained spans decode to (a string: the one-line refusal)
EXPECTED = {
    "llama3": {"conversation": ["4<|eot_id|>", "6, of course.<|eot_id|>"],
               "thinking": ["<think>\nadd them\n</think>\n\n4<|eot_id|>", "<think>\nadd again\n</think>\n\n6<|eot_id|>"],
               "tools": "data: the chat template does not write the tool calls of assistant message 1 (get_weather)"},
    # Qwen3's template drops the reasoning of turns before the last question and marks the last turn's (empty) reasoning.
    "qwen3": {"conversation": ["4<|im_end|>", "<think>\n\n</think>\n\n6, of course.<|im_end|>"],
              "thinking": ["4<|im_end|>", "<think>\nadd again\n</think>\n\n6<|im_end|>"],
              "tools": ['Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                        "<think>\n\n</think>\n\nIt is 18C and sunny.<|im_end|>"]},
    # gpt-oss's harmony: each answer after the generation prompt `<|start|>assistant`, its channel header included (the model
    # writes it); a past answer ends `<|end|>`, the last `<|return|>`; a call's preamble is dropped once an answer follows.
    "gptoss": {"conversation": ["<|channel|>final<|message|>4<|end|>", "<|channel|>final<|message|>6, of course.<|return|>"],
               "thinking": ["<|channel|>final<|message|><think>\nadd them\n</think>\n\n4<|end|>",
                            "<|channel|>final<|message|><think>\nadd again\n</think>\n\n6<|return|>"],
               "tools": [' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
                         "<|channel|>final<|message|>It is 18C and sunny.<|return|>"]},
    "gemma3": {"conversation": ["4<end_of_turn>", "6, of course.<end_of_turn>"],
               "thinking": ["<think>\nadd them\n</think>\n\n4<end_of_turn>", "<think>\nadd again\n</think>\n\n6<end_of_turn>"],
               "tools": "data: the chat template cannot render a row: Conversation roles must alternate"},
}


@pytest.fixture(scope="module")
def tokenizers():
    loaded = {}

    def get(family):
        if family not in loaded:
            loaded[family] = AutoTokenizer.from_pretrained(tokenizer_dir(family))
            choose_template(loaded[family], None, "chat", say=lambda *_: None)
        return loaded[family]

    return get


def _trained_spans(ids: list[int], trained: list[bool], tokenizer) -> list[str]:
    spans, current = [], []
    for token, keep in zip(ids + [None], trained + [False]):
        if keep:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    return spans


@pytest.mark.parametrize("family", list(EXPECTED))
def test_the_trained_tokens_are_the_answers_and_their_end_of_turn_token(tokenizers, family):
    tokenizer = tokenizers(family)
    rows = [{"messages": CONVERSATION}, {"messages": THINKING}, {"messages": TOOLS, "tools": SCHEMA}]
    for name, row, result in zip(("conversation", "thinking", "tools"), rows, tokenize_rows(rows, tokenizer, "chat")):
        expected = EXPECTED[family][name]
        if isinstance(expected, str):
            assert isinstance(result, str) and result.startswith(expected), (name, result)
            continue
        assert not isinstance(result, str), (name, result)
        ids, trained = result
        assert _trained_spans(ids, trained, tokenizer) == expected, name
        assert ids == tokenizer.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=True, return_dict=True)["input_ids"], name


def test_gpt_oss_trains_its_reasoning_channel_where_its_template_renders_it(tokenizers):
    """Harmony's reasoning (a message's `thinking`) is rendered, and so trained, on the last answer only, as the analysis
    channel before the final one; a past answer's is dropped by the template and nowhere in the row."""
    tokenizer = tokenizers("gptoss")
    row = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4", "thinking": "add them"},
           {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6", "thinking": "add again"}]
    (ids, trained), = tokenize_rows([{"messages": row}], tokenizer, "chat")
    assert _trained_spans(ids, trained, tokenizer) == [
        "<|channel|>final<|message|>4<|end|>",
        "<|channel|>analysis<|message|>add again<|end|><|start|>assistant<|channel|>final<|message|>6<|return|>"]
    assert "add them" not in tokenizer.decode(ids)


@pytest.mark.parametrize("family", ["llama3", "qwen3", "gemma3", "gptoss"])
def test_preference_pairs_train_each_answer_through_the_real_template(tokenizers, family):
    """A DPO pair in chat form: each side is the prompt rendered by the template and one answer; what the template
    adds after the prompt is trained, as TRL takes it: the answer, its end-of-turn token and the newline Qwen3's
    and Gemma 3's templates write after it (Qwen3's empty reasoning mark before it)."""
    tokenizer = tokenizers(family)
    row = {"prompt": [{"role": "user", "content": "Name a colour."}], "chosen": [{"role": "assistant", "content": "Blue."}],
           "rejected": [{"role": "assistant", "content": "I would rather not."}]}
    ids, trained, chosen_length, _ = tokenize_pairs([row], tokenizer, 256)[0]
    sides = [(ids[:chosen_length], trained[:chosen_length]), (ids[chosen_length:], trained[chosen_length:])]
    before, after = {"llama3": ("", "<|eot_id|>"), "qwen3": ("<think>\n\n</think>\n\n", "<|im_end|>\n"), "gemma3": ("", "<end_of_turn>\n"),
                     "gptoss": ("<|channel|>final<|message|>", "<|return|>")}[family]
    got = [_trained_spans(side_ids, side_trained, tokenizer) for side_ids, side_trained in sides]
    assert got == [[f"{before}Blue.{after}"], [f"{before}I would rather not.{after}"]]


SUMS = [{"messages": [{"role": "user", "content": f"What is {a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"}]} for a in range(5) for b in range(5)]
# shape -> the data format it trains on: its family's chat template, or (the Llama 2 tokenizer has none) the demo's alpaca
# rows. One shape a template, and Phi-3's fused projections; the other shapes' architectures are these.
PATHS = {"llama-3.2-1b": "chat", "qwen3-0.6b": "chat", "gemma-3-1b": "chat", "phi-3-mini-4k": "alpaca"}


@pytest.mark.parametrize("name", list(PATHS))
def test_a_released_shape_trains_merges_and_answers_as_transformers_does(tmp_path, released, name, capsys):
    """LoRA SFT through the family's template (the trained tokens: above), its loss falling; `finetune merge` (which
    checks the merged model's logits against base + adapter); `finetune generate --chat` on the merged model gives the
    greedy tokens transformers' own generate gives for the template's rendering of the same turn."""
    import json

    import torch
    from conftest import base_config, finetune_cli, read_jsonl, write_config
    from transformers import AutoModelForCausalLM

    fmt = PATHS[name]
    data = {"format": "alpaca", "eval": None}
    if fmt == "chat":
        (tmp_path / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in SUMS))
        data.update(train=str(tmp_path / "sums.jsonl"), format="chat")
    cfg = base_config(released(name), tmp_path / "run", data=data, train={"max_steps": 6, "lr": 2e-2})
    assert finetune_cli(capsys, "train", "--config", str(write_config(tmp_path / "c.yaml", cfg))).returncode == 0
    losses = [row["loss"] for row in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in row]
    assert losses[-1] < losses[0] - 0.3, losses
    merged = finetune_cli(capsys, "merge", "--adapter", str(tmp_path / "run"), "--out", str(tmp_path / "merged"))
    assert merged.returncode == 0, merged.stderr
    (tmp_path / "ask.jsonl").write_text(json.dumps({"prompt": "What is 2+3?"}) + "\n")
    chat = ["--chat"] if fmt == "chat" else []
    asked = finetune_cli(capsys, "generate", "--model", str(tmp_path / "merged"), "--prompts", str(tmp_path / "ask.jsonl"), *chat,
                         "--max-new-tokens", "6", "--out", str(tmp_path / "answers.jsonl"))
    assert asked.returncode == 0, asked.stderr
    ours = read_jsonl(tmp_path / "answers.jsonl")[0]["completion"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    if fmt == "chat":
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
    else:
        ids = tokenizer("What is 2+3?", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    assert ours == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), ours


@pytest.mark.parametrize("family", list(EXPECTED))
def test_grpo_prompts_are_the_templates_generation_prompt(tokenizers, family):
    """A GRPO prompt of chat messages is sampled after what transformers' apply_chat_template gives with the
    generation prompt (Llama 3's assistant header, Qwen3's `<|im_start|>assistant`, Gemma 3's `<start_of_turn>model`)."""
    from finetune.data.encoding import tokenize_prompts

    tokenizer = tokenizers(family)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}] if family != "gemma3" else \
        [{"role": "user", "content": "What is 2+2?"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert tokenize_prompts([{"prompt": messages}], tokenizer)[0][0] == expected


@pytest.mark.parametrize("name", ["llama-3.2-1b"])  # Gemma-3-1B passes too (47 s here: its 262k vocabulary), left out of make test
def test_qlora_trains_a_released_shape_and_merges(tmp_path, released, name, capsys):
    """A 4-bit base of the released shape (Gemma 3's four norms and q/k norms kept in fp32 beside it), LoRA through the
    family's template: the loss falls, and the adapter merges into the dequantized base with merge's check passed."""
    import json

    from conftest import base_config, finetune_cli, read_jsonl, write_config

    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in SUMS))
    cfg = base_config(released(name, hidden_size=128, intermediate_size=256), tmp_path / "run",  # 4-bit blocks of 64: widths of 128
                      model={"quantization": {"bits": 4, "compute_dtype": "float32"}},
                      data={"train": str(tmp_path / "sums.jsonl"), "format": "chat", "eval": None}, train={"max_steps": 6, "lr": 2e-2})
    assert finetune_cli(capsys, "train", "--config", str(write_config(tmp_path / "c.yaml", cfg))).returncode == 0
    losses = [row["loss"] for row in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in row]
    assert losses[-1] < losses[0] - 0.3, losses
    merged = finetune_cli(capsys, "merge", "--adapter", str(tmp_path / "run"), "--out", str(tmp_path / "merged"))
    assert merged.returncode == 0, merged.stderr


def test_dpo_trains_through_a_released_template(tmp_path, released, capsys):
    """Qwen3's shape and template: the demo's preference pairs (chat messages) rendered by the real template, DPO from
    ln 2: the loss falls below it."""
    from conftest import DEMO_DATA, base_config, finetune_cli, read_jsonl, write_config

    cfg = base_config(released("qwen3-0.6b"), tmp_path / "run", data={"train": str(DEMO_DATA / "pairs-train.jsonl"), "format": "preference",
                                                                     "eval": None, "max_seq_len": 128},
                      train={"objective": "dpo", "max_steps": 6, "micro_batch_size": 4, "lr": 2e-2})
    result = finetune_cli(capsys, "train", "--config", str(write_config(tmp_path / "c.yaml", cfg)))
    assert result.returncode == 0, result.stderr
    losses = [row["loss"] for row in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in row]
    # the policy starts as the reference (ln 2); after one step every batch's loss is below it: each prefers its chosen
    # answers over its rejected ones more than the reference does (measured 0.666-0.692 over the next 5)
    assert abs(losses[0] - 0.6931) < 1e-3 and max(losses[1:]) < 0.6931 and min(losses) < 0.675, losses


# The releases' generation_config.json eos_token_id (Llama-3.1-8B-Instruct; gemma-3-1b-pt, whose tokenizer's EOS is <eos>)
# and the end token each model writes where its tokenizer's EOS is not that token.
ENDS = {"llama3": ([128001, 128008, 128009], None, 128008), "gemma3": ([1, 106], "<eos>", 106)}


@pytest.mark.parametrize("family", sorted(ENDS))
def test_every_sampler_stops_at_any_end_token_the_model_names(family):
    """A model (its weights set so that it writes ' big world', then an end token, then ' after' for ever) whose end token
    is in its generation_config but is not its tokenizer's EOS: GRPO's sampler, eval's and `finetune generate`'s (one prompt
    or a batch) stop there, as transformers' own generate does with the model's generation_config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.model.loading import end_tokens
    from finetune.objectives.evaluate import generate
    from finetune.objectives.sampling import generate as sample
    from finetune.outputs.generate import generate_batch

    configured, eos, end = ENDS[family]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(family))
    if eos:
        tokenizer.eos_token = eos
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    assert end != tokenizer.eos_token_id
    prompt = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    big, world, after = (tokenizer(w, add_special_tokens=False)["input_ids"][-1] for w in (" big", " world", " after"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, tie_word_embeddings=False)).eval()
    chain = [prompt[-1], big, world, end, after, after]  # each token's successor is the next: attention and MLP add nothing
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        for k, (token, successor) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token, k] = 1.0
            model.lm_head.weight[successor, k] = 10.0
    model.generation_config.eos_token_id = configured
    assert end_tokens(model, tokenizer) == [tokenizer.eos_token_id, *[t for t in configured if t != tokenizer.eos_token_id]]
    assert sample(model, tokenizer, [np.array(prompt)], 6, "cpu") == [[big, world, end]]
    assert generate(model, tokenizer, "Hello", 6, add_special_tokens=False) == tokenizer.decode([big, world]) == " big world"
    assert generate_batch(model, tokenizer, ["Hello", "Hello"], False, 6, 0.0) == [" big world"] * 2
    model.generation_config.eos_token_id = None  # the tokenizer's EOS alone: it writes on past the end token
    assert generate(model, tokenizer, "Hello", 6, add_special_tokens=False).startswith(" big world after")
