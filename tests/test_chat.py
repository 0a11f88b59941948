"""Chat loss masks that cannot lie: with templates that behave like the families' real ones (history
rewriting, <think> blocks, injected system prompts, turns with and without an end token, generation
markers or none), the trained tokens of a multi-turn row are exactly what the assistant writes."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from finetune.config.errors import UserError
from finetune.config.schema import CHAT_TEMPLATES
from finetune.data.chat import BUILTIN, assistant_mask, choose_template, ends_turns
from finetune.data.encoding import tokenize_row

# Qwen3's rule, written small: the <think> block of an answer is rendered only after the last user
# turn; past answers lose theirs (their content is cut at </think>).
QWEN3_LIKE = (
    "{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- set reasoning = m.content.split('</think>')[0].split('<think>')[-1].strip('\\n') if '</think>' in m.content else '' -%}"
    "{{- '<|im_start|>assistant\\n' -}}{%- if loop.index0 > ns.last -%}{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Llama 3's: a default system prompt when the row has none, contents trimmed, <|eot_id|> ends turns.
LLAMA3_LIKE = (
    "{{- bos_token -}}{%- if messages[0].role == 'system' -%}{%- set system = messages[0].content -%}{%- set messages = messages[1:] -%}"
    "{%- else -%}{%- set system = 'Cutting Knowledge Date: December 2023' -%}{%- endif -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' -}}"
    "{%- for m in messages -%}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
# Mistral v0.3's: the system prompt goes into the *last* user turn (history rewritten at every turn),
# answers end in EOS, no generation prompt at all.
MISTRAL_LIKE = (
    "{%- if messages[0].role == 'system' -%}{%- set system = messages[0].content -%}{%- set messages = messages[1:] -%}{%- endif -%}"
    "{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{{- bos_token -}}{%- for m in messages -%}{%- if m.role == 'user' -%}"
    "{%- if loop.index0 == ns.last and system is defined -%}{{- '[INST] ' + system + '\\n\\n' + m.content + ' [/INST]' -}}"
    "{%- else -%}{{- '[INST] ' + m.content + ' [/INST]' -}}{%- endif -%}"
    "{%- else -%}{{- ' ' + m.content + eos_token -}}{%- endif -%}{%- endfor -%}"
)
# Gemma's: no system role (folded into the first user turn), the assistant is "model".
GEMMA_LIKE = (
    "{{- bos_token -}}{%- if messages[0].role == 'system' -%}{%- set first = messages[0].content + '\\n\\n' -%}{%- set messages = messages[1:] -%}"
    "{%- else -%}{%- set first = '' -%}{%- endif -%}"
    "{%- for m in messages -%}{%- set role = 'model' if m.role == 'assistant' else m.role -%}"
    "{{- '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + m.content | trim + '<end_of_turn>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)
# A plain-text template whose answers end with nothing a model could learn to stop at.
PLAIN_TEXT = (
    "{%- for m in messages -%}{{- m.role + ': ' + m.content + '\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<start_of_turn>", "<end_of_turn>"]

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "<think>\nplan it\n</think>\n\nanswer one"},
    {"role": "user", "content": "second question"},
    {"role": "assistant", "content": "answer two"},
]


@pytest.fixture()
def tok(demo_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tok


def trained_runs(tok, ids, trained) -> list[str]:
    """The trained tokens, decoded, one string per contiguous run."""
    runs, current = [], []
    for i, t in zip(ids, trained):
        if t:
            current.append(i)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs + ([tok.decode(current)] if current else [])


@pytest.mark.parametrize("template, messages, expected", [
    # The last answer's think block is what the model must write; the past one was rewritten away.
    (QWEN3_LIKE, CONVERSATION, ["answer one<|im_end|>", "<think>\n\n</think>\n\nanswer two<|im_end|>"]),
    (LLAMA3_LIKE, CONVERSATION[1:3] + [{"role": "user", "content": "again"}, {"role": "assistant", "content": " answer two  "}],
     ["<think>\nplan it\n</think>\n\nanswer one<|eot_id|>", "answer two<|eot_id|>"]),
    (MISTRAL_LIKE, [CONVERSATION[0], CONVERSATION[1], {"role": "assistant", "content": "answer one"}] + CONVERSATION[3:],
     ["answer one</s>", "answer two</s>"]),
    (GEMMA_LIKE, [CONVERSATION[0], CONVERSATION[1], {"role": "assistant", "content": "answer one"}] + CONVERSATION[3:],
     ["answer one<end_of_turn>", "answer two<end_of_turn>"]),
    (PLAIN_TEXT, [CONVERSATION[1], {"role": "assistant", "content": "answer one"}] + CONVERSATION[3:], ["answer one", "answer two"]),
    (BUILTIN["chatml"], CONVERSATION, ["<think>\nplan it\n</think>\n\nanswer one<|im_end|>", "answer two<|im_end|>"]),
], ids=["qwen3-rewrites-history", "llama3-default-system", "mistral-system-in-last-turn", "gemma-no-system-role", "no-end-token",
        "chatml-generation-markers"])
def test_trained_tokens_are_exactly_the_assistant_turns(tok, template, messages, expected):
    tok.chat_template = template
    ids, trained = assistant_mask(tok, messages)
    assert trained_runs(tok, ids, trained) == expected
    full = tok.decode(ids)
    assert "question" in full and "Be brief" in full or messages[0]["role"] != "system"
    sample = tokenize_row({"messages": messages}, tok, "chat", train_on_prompt=False)  # the data path uses the same mask
    assert [i if t else -100 for i, t in zip(ids, trained)] == sample["labels"]


def test_templates_that_end_turns_are_told_from_those_that_do_not(tok):
    for template, ends in [(QWEN3_LIKE, True), (LLAMA3_LIKE, True), (MISTRAL_LIKE, True), (GEMMA_LIKE, True), (PLAIN_TEXT, False)]:
        tok.chat_template = template
        assert ends_turns(tok) is ends, template[:40]


def test_a_rewritten_answer_that_cannot_be_found_is_refused(tok):
    """Past answers upper-cased: not a prefix of the whole, and not in it as written."""
    tok.chat_template = ("{%- for m in messages -%}{{- m.role + ': ' + (m.content | upper if m.role == 'assistant' and not loop.last else m.content)"
                         " + '\\n' -}}{%- endfor -%}")
    with pytest.raises(UserError, match="rewrites assistant message 1"):
        assistant_mask(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
                             {"role": "user", "content": "and?"}, {"role": "assistant", "content": "bye"}])


def test_chat_template_choice(tok, tmp_path):
    assert set(BUILTIN) == set(CHAT_TEMPLATES)
    tok.chat_template = None
    with pytest.raises(UserError, match="data.chat_template: the model's tokenizer has no chat template"):
        choose_template(tok, None, "chat")
    choose_template(tok, None, "alpaca")  # alpaca rows without a template take the classic prompt
    choose_template(tok, "llama3", "chat", say=lambda _: None)
    assert tok.chat_template == BUILTIN["llama3"] and tok.eos_token == "<|eot_id|>"
    jinja = tmp_path / "t.jinja"
    jinja.write_text(GEMMA_LIKE)
    choose_template(tok, str(jinja), "chat")
    assert tok.chat_template == GEMMA_LIKE
    said = []
    jinja.write_text(PLAIN_TEXT)
    choose_template(tok, str(jinja), "chat", say=said.append)
    assert said == ["data: the chat template ends answers with no special token: the model will not learn where an answer stops"]
    plain = AutoTokenizer.from_pretrained(tok.name_or_path)  # the demo tokenizer: no <|im_end|> token
    with pytest.raises(UserError, match=r"chatml is written in tokens this tokenizer does not have \(<\|im_end\|>, <\|im_start\|>\)"):
        choose_template(plain, "chatml", "chat")


TOOL_ROW = {
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny."},
    ],
}


def test_tool_calls_are_trained_and_tool_results_and_schemas_are_not(tok):
    """OpenAI-style tool calls through the built-in chatml: the call (as Qwen's <tool_call> JSON) and the
    final answer are what the assistant writes; the tool's result and the tool schemas are context."""
    from finetune.data.encoding import tokenize_rows
    from finetune.data.rows import canonical

    choose_template(tok, "chatml", "chat", say=lambda _: None)
    row, problem = canonical(TOOL_ROW, "chat")
    assert problem is None
    ids, trained = tokenize_rows([row], tok, "chat")[0]
    assert trained_runs(tok, ids, trained) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>', "It is sunny.<|im_end|>"]
    text = tok.decode(ids)
    assert '"name": "get_weather", "parameters"' in text and "sunny, 21 C" in text  # in the input, not trained
    bad = {**TOOL_ROW, "messages": [TOOL_ROW["messages"][0], {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}]}
    assert canonical(bad, "chat")[1] == "messages[1].tool_calls must be an assistant's list of {function: {name: string, arguments: object or JSON string}}"
