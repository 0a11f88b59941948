"""Chat templates: which one renders the conversations, and which of its tokens are the assistant's.

The loss mask comes from the template's own output, never from guesses about its markup:
1. a template with generation markers (`{% generation %}`, as the built-ins here have) says itself
   which characters are the assistant's (transformers' `return_assistant_tokens_mask`);
2. otherwise each assistant turn is what the template adds after the generation prompt, found by
   rendering the conversation up to that turn, when those renders are prefixes of the whole one;
3. where the template rewrites earlier turns (Qwen3 drops the `<think>` blocks of past answers, gpt-oss
   ends past answers differently from the last, some templates trim or re-order), each assistant
   message is located in the final text, in order, with the end-of-turn token that follows it and the
   markup before it that the model writes (gpt-oss's channel header); one that cannot be found stops
   with one line.

Trained: what the model must write after the generation prompt, up to and including the end-of-turn
token; never the whitespace that separates turns, the role headers or any other message.
"""

from __future__ import annotations

import re
from pathlib import Path

from jinja2.exceptions import TemplateError

from finetune.config.errors import UserError

# Built-in templates, for models that have none or to replace theirs (data.chat_template). Each marks
# the assistant's part with generation markers, so the loss mask comes from the template itself.
# Tool calls (an assistant message's `tool_calls`) are written as JSON, in Qwen's <tool_call> tags in
# chatml; the row's `tools` (function schemas) go into a system turn before the conversation.
BUILTIN = {
    "chatml": (
        "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
        "{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% for c in (m.tool_calls or []) %}"
        "{{ ('\\n' if m['content'] or not loop.first else '') + '<tool_call>\\n' "
        "+ ({'name': c.function.name, 'arguments': c.function.arguments} | tojson) + '\\n</tool_call>' }}"
        "{% endfor %}{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
        "{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% for c in (m.tool_calls or []) %}"
        "{{ ({'name': c.function.name, 'parameters': c.function.arguments} | tojson) }}{% endfor %}{{ '<|eot_id|>' }}{% endgeneration %}"
        "{% else %}{{ m['content'] + '<|eot_id|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    "alpaca": (
        "{% if bos_token %}{{ bos_token }}{% endif %}{% for m in messages %}"
        "{% if m['role'] == 'system' %}{{ m['content'] + '\\n\\n' }}"
        "{% elif m['role'] == 'assistant' %}{{ '### Response:\\n' }}{% generation %}{{ m['content'] + eos_token }}{% endgeneration %}{{ '\\n\\n' }}"
        "{% else %}{{ '### Instruction:\\n' + m['content'] + '\\n\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}"
    ),
}
# The tokens a built-in is written in, the first being its end of turn; the tokenizer must know them.
BUILTIN_TOKENS = {"chatml": ["<|im_end|>", "<|im_start|>"], "llama3": ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]}
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def choose_template(tokenizer, choice: str | None, fmt: str, say=print) -> None:
    """Give the tokenizer the template data.chat_template names (None: keep the model's own), for rows
    of format `fmt`.

    With a built-in whose end of turn is not the tokenizer's EOS, that token becomes the EOS, so that
    generation stops at the end of an answer (LLaMA-Factory does the same)."""
    if choice is not None:
        if choice in BUILTIN:
            missing = [t for t in BUILTIN_TOKENS.get(choice, []) if not _is_one_token(tokenizer, t)]
            if missing:
                raise UserError(f"data.chat_template: {choice} is written in tokens this tokenizer does not have ({', '.join(missing)}); "
                                "use alpaca (works with any tokenizer) or a .jinja file of your own")
            tokenizer.chat_template = BUILTIN[choice]
            end = BUILTIN_TOKENS.get(choice, [None])[0]
            if end and tokenizer.eos_token != end:
                say(f"data.chat_template: {choice}: the tokenizer's EOS becomes {end} (was {tokenizer.eos_token}), where answers end")
                tokenizer.eos_token = end
        else:
            path = Path(choice).expanduser()
            try:
                tokenizer.chat_template = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise UserError(f"data.chat_template: {choice}: cannot read it as a Jinja template file ({err.__class__.__name__})") from None
    if fmt == "chat" and not tokenizer.chat_template:
        raise UserError("data.chat_template: the model's tokenizer has no chat template to render chat rows; "
                        f"set data.chat_template to one of {', '.join(BUILTIN)} or a .jinja file")
    if fmt != "completion" and tokenizer.chat_template and not ends_turns(tokenizer):
        say("data: the chat template ends answers with no special token: the model will not learn where an answer stops")


def _is_one_token(tokenizer, text: str) -> bool:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 1


# What a chat template raises for a row it refuses: Jinja's errors (its own raise_exception() among them) and transformers'
# ValueError. Anything else (an AttributeError on a message that is not a dict) is a bug of the caller's, not a bad row.
TEMPLATE_ERRORS = (TemplateError, ValueError)


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt)
    except TEMPLATE_ERRORS as err:  # the template refuses this row (its own raise_exception(), a Jinja error)
        raise UserError(f"data: the chat template cannot render a row: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None


def assistant_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation, and for each token whether it is trained."""
    result = assistant_masks(tokenizer, [messages])[0]
    if isinstance(result, str):
        raise UserError(result)
    return result


def assistant_masks(tokenizer, conversations: list[list[dict]], tools: list[list | None] | None = None) -> list[tuple[list[int], list[bool]] | str]:
    """assistant_mask for many conversations (with each one's tool schemas, if any), tokenized in one
    batch call; a conversation the template cannot render or mask gets the reason instead."""
    tools = tools or [None] * len(conversations)
    if GENERATION_MARKER.search(tokenizer.chat_template or ""):
        out = []
        for messages, schemas in zip(conversations, tools):
            try:
                enc = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
                out.append((list(enc["input_ids"]), [bool(m) for m in enc["assistant_masks"]]))
            except TEMPLATE_ERRORS as err:  # the template refuses this conversation
                out.append(f"data: the chat template cannot render a row: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
        return out
    texts, spans, out = [], [], []
    for messages, schemas in zip(conversations, tools):
        try:
            full = render(tokenizer, messages, tools=schemas)
            spans.append(assistant_spans(tokenizer, messages, full, schemas))
            texts.append(full)
            out.append(None)
        except UserError as err:
            out.append(str(err))
    if not texts:
        return out
    batch = tokenizer(texts, add_special_tokens=False)
    done = 0
    for i, result in enumerate(out):
        if result is None:
            ids = batch["input_ids"][done]
            out[i] = ids, _token_mask(batch, done, len(ids), spans[done])
            done += 1
    return out


def _token_mask(batch, index: int, length: int, spans: list[tuple[int, int]]) -> list[bool]:
    """Which tokens of text `index` of a batch encoding overlap the character spans: a token that
    overlaps an answer is trained (sentencepiece's "▁answer" carries the space before it). Found from
    each span's first and last character, not token by token."""
    mask = [False] * length
    for s, e in spans:
        first = next((t for c in range(s, e) if (t := batch.char_to_token(index, c)) is not None), None)
        last = next((t for c in range(e - 1, s - 1, -1) if (t := batch.char_to_token(index, c)) is not None), None)
        if first is not None:
            mask[first : last + 1] = [True] * (last + 1 - first)
    return mask


def assistant_spans(tokenizer, messages: list[dict], full: str, tools: list | None = None) -> list[tuple[int, int]]:
    """Character ranges of `full` (the whole conversation rendered) that the assistant writes."""
    spans, cursor, upto = [], 0, _Prefixes(tokenizer, messages, full, tools)
    for i, msg in enumerate(messages):
        if msg["role"] == "system":
            continue  # templates move system prompts (Mistral's into the last user turn): no landmark
        if msg["role"] != "assistant":
            found = _locate(full, text_of(msg["content"]), cursor)  # an answer is searched for after the turns before it
            cursor = found[1] if found else cursor
            continue
        span = _turn_by_prefixes(upto, i, full)
        if span is None or span[0] < cursor:
            span = (_turn_after_prompt(tokenizer, upto, i, full, cursor) if msg.get("tool_calls") else None) or \
                   _with_its_header(upto, i, full, _located_turn(tokenizer, full, msg.get("content") or "", cursor))
        if span is None or span[0] < cursor:
            raise UserError(f"data: the chat template rewrites assistant message {i} so that its text is not in the rendered "
                            "conversation; give the template generation markers ({% generation %}) or set data.chat_template")
        unwritten = [name for name in _called(msg) if name not in full[span[0] : span[1]]]
        if unwritten:
            raise UserError(f"data: the chat template does not write the tool calls of assistant message {i} ({', '.join(unwritten)}): the model "
                            "would learn an empty turn; set data.chat_template to a template that renders tool_calls")
        spans.append(span)
        cursor = span[1]
    return spans


class _Prefixes:
    """The template's renders of the conversation's first messages, each made once: `(k)` the first k, `(k, True)` with
    the generation prompt after them."""

    def __init__(self, tokenizer, messages: list[dict], full: str, tools: list | None):
        self.messages, self.done = messages, {(len(messages), False): full}
        self.render = lambda k, asked: render(tokenizer, messages[:k], add_generation_prompt=asked, tools=tools)

    def __call__(self, k: int, asked: bool = False) -> str:
        if (k, asked) not in self.done:
            self.done[(k, asked)] = self.render(k, asked) if k or asked else ""
        return self.done[(k, asked)]

    def prompt(self, i: int) -> str:
        """What the template writes to ask for message i: the generation prompt alone (`<|im_start|>assistant\\n`, gpt-oss's
        `<|start|>assistant`); empty where the template cannot say."""
        try:
            asked, plain = self(i, True), self(i)
        except UserError:  # templates that refuse a conversation with no user turn yet
            return ""
        return asked[len(plain):] if i and asked.startswith(plain) else ""


def _turn_by_prefixes(upto: _Prefixes, i: int, full: str) -> tuple[int, int] | None:
    """What the template adds for message i after the generation prompt, if both renders are
    prefixes of the whole conversation; whitespace around it (between turns) excluded."""
    try:
        before = upto(i, True) if i else ""
    except UserError:  # templates that refuse a conversation with no user turn yet
        return None
    through = upto(i + 1).rstrip()
    if not (full.startswith(before) and full.startswith(through)) or not through[len(before):].strip():
        return None
    added = through[len(before):]
    return len(before) + len(added) - len(added.lstrip()), len(through)


def _header(text: str, prompt: str, answer: int) -> str | None:
    """The text between the last generation prompt before `answer` and the answer, or None where there is none."""
    at = text.rfind(prompt, 0, answer) if prompt else -1
    return text[at + len(prompt) : answer] if at >= 0 else None


def _with_its_header(upto: _Prefixes, i: int, full: str, span: tuple[int, int] | None):
    """A located answer widened back to the end of its generation prompt when what lies between is markup the model
    writes itself: gpt-oss renders a past answer `<|start|>assistant<|channel|>final<|message|>TEXT<|end|>` but the
    same answer as the last turn with `<|return|>` (and drops past reasoning), so the renders are not prefixes, and
    the channel header after the prompt is the model's to write. The markup qualifies when the template writes it
    after the prompt for this answer as the conversation's last turn (Qwen3's past answers have none)."""
    prompt = upto.prompt(i) if span else ""
    gap = _header(full, prompt, span[0]) if prompt else None
    if not gap:
        return span
    try:
        alone = upto(i + 1)
    except UserError:
        return span
    answer = alone.rfind(text_of(upto.messages[i].get("content") or ""))
    header = _header(alone, prompt, answer) if answer >= 0 else None
    return (span[0] - len(gap), span[1]) if header is not None and header.endswith(gap) else span


def _turn_after_prompt(tokenizer, upto: _Prefixes, i: int, full: str, cursor: int) -> tuple[int, int] | None:
    """An assistant turn that calls tools, where rendering it alone differs from the whole conversation (Qwen3 marks a
    last turn's empty reasoning, gpt-oss drops a call's preamble once an answer follows): from the end of its
    generation prompt up to and with the special token that closes it, the first after the calls' names that the next
    turn (or the end) follows."""
    prompt = upto.prompt(i)
    names = _called(upto.messages[i])
    first = min((at for name in names if (at := full.find(name, cursor)) >= 0), default=-1)
    begin = full.rfind(prompt, cursor, first) if prompt and first >= 0 else -1
    if begin < 0:
        return None
    begin += len(prompt)
    at = max(found + len(name) for name in names if (found := full.find(name, begin)) >= 0)
    specials = _special_strings(tokenizer)
    opener = next((t for t in specials if prompt.startswith(t)), prompt)
    while hits := [(found, t) for t in specials if (found := full.find(t, at)) >= 0]:
        found, token = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
        at = found + len(token)
        if full[at:].lstrip().startswith(opener) or not full[at:].strip():
            return begin, at
    return None


def _called(message: dict) -> list[str]:
    """The names of the functions an assistant message calls (OpenAI's tool_calls)."""
    return [(call.get("function") or call).get("name", "") for call in message.get("tool_calls") or []]


def _special_strings(tokenizer) -> list[str]:
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return sorted({t for t in tokenizer.all_special_tokens + added if t}, key=len, reverse=True)


def text_of(content: str | list) -> str:
    """A message's text (a message that shows pictures has its text in parts)."""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def _locate(full: str, content: str, cursor: int) -> tuple[int, int] | None:
    """Where a message's text stands in `full` after `cursor`: as written, or stripped, or, for a
    reasoning model's past answer whose <think> block the template dropped, its final part."""
    for text in dict.fromkeys((content, content.strip(), content.split("</think>")[-1].strip())):
        at = full.find(text, cursor) if text else -1
        if at >= 0:
            return at, at + len(text)
    return None


def _located_turn(tokenizer, full: str, content: str, cursor: int) -> tuple[int, int] | None:
    found = _locate(full, content, cursor)
    if found is None:
        return None
    start, end = found
    # The end-of-turn token right after the answer is trained too: it is how the model learns to stop.
    after = next((t for t in _special_strings(tokenizer) if full.startswith(t, end)), "")
    return start, end + len(after)


def ends_turns(tokenizer) -> bool:
    """Whether the template closes an assistant turn with a special token (else a model trained on it
    never learns to stop)."""
    probe = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]
    try:
        ids, trained = assistant_mask(tokenizer, probe)
    except UserError:  # a template that refuses this conversation: judged on real rows instead
        return True
    last = max((k for k, t in enumerate(trained) if t), default=None)
    return last is not None and ids[last] in set(tokenizer.all_special_ids)
