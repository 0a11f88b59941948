"""Released families' real tokenizers and chat templates (tests/released.py) through finetune's data step: the
tokens trained are the assistant's answer and its end-of-turn token, token by token, as each template renders them
(Qwen3's <think> blocks, tool calls), and what a template cannot write is refused in one line."""

from __future__ import annotations

import pytest
from released import tokenizer_dir
from transformers import AutoTokenizer

from finetune.chat import choose_template
from finetune.rows import tokenize_pairs, tokenize_rows

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


@pytest.mark.parametrize("family", ["llama3", "qwen3", "gemma3"])
def test_preference_pairs_train_each_answer_through_the_real_template(tokenizers, family):
    """A DPO pair in chat form: each side is the prompt rendered by the template and one answer; what the template
    adds after the prompt is trained, as TRL takes it: the answer, its end-of-turn token and the newline Qwen3's
    and Gemma 3's templates write after it (Qwen3's empty reasoning mark before it)."""
    tokenizer = tokenizers(family)
    row = {"prompt": [{"role": "user", "content": "Name a colour."}], "chosen": [{"role": "assistant", "content": "Blue."}],
           "rejected": [{"role": "assistant", "content": "I would rather not."}]}
    ids, trained, chosen_length, _ = tokenize_pairs([row], tokenizer, 256)[0]
    sides = [(ids[:chosen_length], trained[:chosen_length]), (ids[chosen_length:], trained[chosen_length:])]
    before, after = {"llama3": ("", "<|eot_id|>"), "qwen3": ("<think>\n\n</think>\n\n", "<|im_end|>\n"), "gemma3": ("", "<end_of_turn>\n")}[family]
    got = [_trained_spans(side_ids, side_trained, tokenizer) for side_ids, side_trained in sides]
    assert got == [[f"{before}Blue.{after}"], [f"{before}I would rather not.{after}"]]
