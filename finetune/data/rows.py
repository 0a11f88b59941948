"""Rows as each format has them: what makes a row valid for its format (one line saying what is wrong
otherwise), and a row brought to its format's own shape (`canonical`: mapped columns, ShareGPT
conversations, OpenAI content parts). Reading them: data/readers; turning them into token ids with a
loss mask (-100, IGNORE, where none is taken): data/encoding.
"""

from __future__ import annotations

from finetune.data import images

IGNORE = -100

CHAT_ROLES = {"system", "user", "assistant", "tool"}
FORMATS = ("alpaca", "chat", "completion", "preference", "prompt", "unpaired")
# ShareGPT's speakers (`from`) as chat roles: its own names, OpenAI's, and those of LLaMA-Factory's tool rows.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant", "system": "system",
                  "tool": "tool", "function": "tool", "observation": "tool", "function_call": "assistant"}


def _row_problem(row: object, fmt: str) -> str | None:
    """Why a row can't be used in this format, or None."""
    if not isinstance(row, dict):
        return "expected a JSON object"

    def text(key: str, required: bool = True) -> str | None:
        value = row.get(key)
        if value is None:
            return f"missing field '{key}'" if required else None
        if not isinstance(value, str):
            return f"field '{key}' must be a string"
        if required and not value.strip():
            return f"field '{key}' is empty"
        return None

    if fmt == "completion":
        return text("text")
    if fmt == "alpaca":
        return text("instruction") or text("input", required=False) or text("output")
    if fmt == "preference":
        return _pair_problem(row, text)
    if fmt == "prompt":
        return _prompt_problem(row, text)
    if fmt == "unpaired":
        return _unpaired_problem(row, text)
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        return "missing or empty field 'messages'"
    for i, msg in enumerate(messages):
        parts = images.has_images(row) and isinstance(msg, dict) and isinstance(msg.get("content"), list)
        if not isinstance(msg, dict) or msg.get("role") not in CHAT_ROLES or not (isinstance(msg.get("content"), str) or parts):
            return f"messages[{i}] must be {{role: system|user|assistant|tool, content: string}}"
        calls = msg.get("tool_calls")
        if calls is not None and (msg["role"] != "assistant" or not isinstance(calls, list) or not all(_is_call(c) for c in calls)):
            return f"messages[{i}].tool_calls must be an assistant's list of {{function: {{name: string, arguments: object or JSON string}}}}"
    if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls")) for m in messages):
        return "no non-empty assistant message"
    if row.get("tools") is not None and not isinstance(row["tools"], list):
        return "field 'tools' must be a list of function schemas"
    return None


def _pair_problem(row: dict, text) -> str | None:
    """A preference pair: prompt, chosen and rejected all text, or all chat messages (chosen and
    rejected the assistant's answers to the prompt's conversation)."""
    return _text_or_messages(row, text, ("prompt", "chosen", "rejected"), "chosen and rejected")


def _prompt_problem(row: dict, text) -> str | None:
    """A prompt to sample completions for (GRPO): text, or chat messages to answer; `answer` (what the
    exact_match reward compares with) a string or a number if present."""
    problem = _text_or_messages(row, text, ("prompt",), None)
    if problem:
        return problem
    answer = row.get("answer")
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        return "field 'answer' must be a string or a number"
    return None


def _unpaired_problem(row: dict, text) -> str | None:
    """An unpaired example (KTO): a prompt, one completion, and whether it is desirable (a boolean label)."""
    if "label" not in row:
        return "missing field 'label' (true: a desirable completion, false: an undesirable one)"
    if not isinstance(row["label"], bool):
        return "field 'label' must be true or false"
    return _text_or_messages(row, text, ("prompt", "completion"), "the completion")


def _text_or_messages(row: dict, text, keys: tuple[str, ...], answers: str | None) -> str | None:
    """The fields `keys` all text (the first decides), or all non-empty lists of chat messages, those after the
    first (the answers) the assistant's."""
    if isinstance(row.get(keys[0]), str):
        return next((p for p in map(text, keys) if p), None)
    for key in keys:
        messages = row.get(key)
        if not isinstance(messages, list) or not messages:
            if messages is None:
                return f"missing field '{key}' (text, or a list of chat messages)"
            return f"field '{key}' must be text or a non-empty list of messages"
        for i, msg in enumerate(messages):
            parts = key == keys[0] and images.has_images(row) and isinstance(msg, dict) and isinstance(msg.get("content"), list)
            if not isinstance(msg, dict) or msg.get("role") not in CHAT_ROLES or not (isinstance(msg.get("content"), str) or parts):
                return f"{key}[{i}] must be {{role: system|user|assistant|tool, content: string}}"
    if answers and any(m["role"] != "assistant" for key in keys[1:] for m in row[key]):
        return f"{answers} must be assistant messages"
    return None


def _is_call(call: object) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str) and isinstance(function.get("arguments"), (dict, str))


def canonical(row: object, fmt: str, columns: dict[str, str] | None = None) -> tuple[object, str | None]:
    """(the row in its format's own shape, why it cannot be used or None). data.columns renames the
    file's columns to the format's fields; a chat row may also come as ShareGPT (`conversations` of
    {from, value}) and its messages' content as OpenAI's list of text parts."""
    if not isinstance(row, dict):
        return row, "expected a JSON object"
    if columns:
        row = dict(row)
        for field, column in columns.items():
            if column in row:
                row[field] = row.pop(column)
    if fmt == "chat":
        row, problem = _chat_shape(row)
        if problem:
            return row, problem
    if fmt == "prompt" and "prompt" not in row and isinstance(row.get("messages"), list):
        row = {**{k: v for k, v in row.items() if k != "messages"}, "prompt": row["messages"]}
    if fmt in ("preference", "unpaired", "prompt"):
        if fmt != "prompt":
            row = _pair_shape(row, ("chosen", "rejected") if fmt == "preference" else ("completion",))
        prompt = row.get("prompt")
        if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt) and (
                row.get("images") or any(isinstance(m.get("content"), list) for m in prompt)):
            # TRL's vision pairs and GRPO prompts: the prompt shows them
            shown, problem = images.gather({"messages": prompt, **({"images": row["images"]} if "images" in row else {})})
            if problem:
                return row, problem.replace("messages", "prompt", 1)
            row = {**row, "prompt": shown["messages"], **({"images": shown["images"]} if "images" in shown else {})}
    return row, _row_problem(row, fmt)


def _pair_shape(row: dict, answers: tuple[str, ...]) -> dict:
    """A chat pair as TRL's conversational rows: the shared history under `prompt` (also accepted as
    `messages`), each answer a list of messages (one given as a string or a single message is wrapped)."""
    if "prompt" not in row and isinstance(row.get("messages"), list):
        row = {**{k: v for k, v in row.items() if k != "messages"}, "prompt": row["messages"]}
    if isinstance(row.get("prompt"), list):
        for key in answers:
            answer = row.get(key)
            if isinstance(answer, str):
                row = {**row, key: [{"role": "assistant", "content": answer}]}
            elif isinstance(answer, dict):
                row = {**row, key: [answer]}
    return row


def _chat_shape(row: dict) -> tuple[dict, str | None]:
    if "messages" not in row and isinstance(row.get("conversations"), list):
        messages = []
        for i, turn in enumerate(row["conversations"]):
            speaker = turn.get("from") if isinstance(turn, dict) else None
            if speaker not in SHAREGPT_ROLES or not isinstance(turn.get("value"), str):
                return row, f"conversations[{i}] must be {{from: human|gpt|system|tool, value: string}}"
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn["value"]})
        row = {**{k: v for k, v in row.items() if k != "conversations"}, "messages": messages}
    messages = row.get("messages")
    if isinstance(messages, list) and any(isinstance(m, dict) and m.get("content") is None and m.get("tool_calls") for m in messages):
        messages = [{**m, "content": ""} if isinstance(m, dict) and m.get("content") is None and m.get("tool_calls") else m
                    for m in messages]  # OpenAI's null content beside tool calls
        row = {**row, "messages": messages}
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages) and (
            row.get("images") or any(isinstance(m.get("content"), list) for m in messages)):
        return images.gather(row)
    return row, None
