"""Tools for agentic GRPO: the calls a model writes, parsed in its family's format, and run with a time limit.

Formats (grpo.tool_format; auto reads the chat template):
  hermes   Hermes / Qwen 2.5-3 / the built-in chatml: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a call
  llama3   Llama 3.1-3.3: the turn is a JSON object `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or not),
           several joined by `;`
  mistral  `[TOOL_CALLS]` then a JSON list of {"name", "arguments"} (v3), or `name[ARGS]{...}` once a call (v11+)

A call that cannot be read is not an error of the run: the model sees "invalid tool call: why" as the tool's answer.
A tool that raises answers with its error; one that runs past grpo.tool_timeout answers that it timed out, and its
episode ends there (objectives/agent.py waits for its thread before the environment is used again: Python cannot stop
a thread). Each is counted as a failed call by what happened, never by the answer's text.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

FORMATS = ("hermes", "llama3", "mistral")
_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_MISTRAL_V11 = re.compile(r"\s*([\w.-]+)\[ARGS\]")


@dataclass
class Call:
    name: str
    arguments: dict

    def as_message_part(self) -> dict:
        """The call as an assistant message's `tool_calls` entry (OpenAI's shape, which chat templates render)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    content: str  # the turn's text outside its calls
    calls: list[Call] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per call that could not be read


def format_of(chat_template: str | None) -> str:
    """The tool-call format a chat template writes (hermes where it says nothing)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:  # Llama 3's headers: its JSON calls (3.1+ templates)
        return "llama3"
    return "hermes"


def parse(text: str, fmt: str) -> Parsed:
    """The calls in one assistant turn (its text with special tokens kept, its end-of-turn token removed)."""
    return {"hermes": _hermes, "llama3": _llama3, "mistral": _mistral}[fmt](text)


def _call(value, names=("arguments",)) -> Call | str:
    """A decoded call object, or why it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return "expected a JSON object with a string 'name'"
    arguments = next((value[n] for n in names if n in value), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            return f"the arguments of {value['name']} are not JSON ({err.msg})"
    if not isinstance(arguments, dict):
        return f"the arguments of {value['name']} must be a JSON object"
    return Call(value["name"], arguments)


def _decoded(body: str, names=("arguments",)) -> Call | str:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return f"not JSON ({err.msg} at character {err.pos}): {body.strip()[:80]!r}"
    return _call(value, names)


def _sorted(parsed: Parsed, results: list) -> Parsed:
    for result in results:
        (parsed.calls if isinstance(result, Call) else parsed.errors).append(result)
    return parsed


def _hermes(text: str) -> Parsed:
    results = []
    for body, closing in _HERMES.findall(text):
        result = _decoded(body)
        results.append(result if closing or not isinstance(result, Call) else "no closing </tool_call>")
    return _sorted(Parsed(_HERMES.sub("", text).strip()), results)


def _llama3(text: str) -> Parsed:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return Parsed(text.strip())
    decoder, results, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError as err:
            results.append(f"not JSON ({err.msg} at character {err.pos}): {body[at:][:80]!r}")
            break
        results.append(_call(value, ("parameters", "arguments")))
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return _sorted(Parsed(""), results)


def _mistral(text: str) -> Parsed:
    if "[TOOL_CALLS]" not in text:
        return Parsed(text.strip())
    content, _, body = text.partition("[TOOL_CALLS]")
    parsed = Parsed(content.strip())
    body = body.strip()
    if body.startswith("["):
        try:
            values = json.loads(body)
        except json.JSONDecodeError as err:
            return _sorted(parsed, [f"not JSON ({err.msg} at character {err.pos}): {body[:80]!r}"])
        return _sorted(parsed, [_call(v) for v in values] if isinstance(values, list) else ["expected a JSON list of calls"])
    results = []
    for piece in filter(None, (p.strip() for p in body.split("[TOOL_CALLS]"))):
        named = _MISTRAL_V11.match(piece)
        if not named:
            results.append(f"expected name[ARGS]{{...}}: {piece[:80]!r}")
            continue
        try:
            results.append(_call({"name": named.group(1), "arguments": json.loads(piece[named.end():])}))
        except json.JSONDecodeError as err:
            results.append(f"the arguments of {named.group(1)} are not JSON ({err.msg} at character {err.pos})")
    return _sorted(parsed, results)


def schemas(tools: dict[str, Callable]) -> list[dict]:
    """Each tool's JSON schema, from its signature's type hints and its docstring (transformers' get_json_schema,
    as `apply_chat_template(tools=[functions])` makes them)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(function) for function in tools.values()]


@dataclass
class Outcome:
    """What a function run in a thread of its own with a time limit gave: its value, or its error, or (past the limit) its
    thread, still running: Python cannot stop a thread, so its caller must not use what that thread may still change."""

    value: object = None
    error: BaseException | None = None
    running: threading.Thread | None = None


def bounded(function: Callable, seconds: float, name: str) -> Outcome:
    """function() in a daemon thread, waited for up to `seconds`."""
    outcome = Outcome()

    def target():
        try:
            outcome.value = function()
        except Exception as err:  # noqa: BLE001 - handed to the caller, which says whose failure it is
            outcome.error = err

    worker = threading.Thread(target=target, name=name, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        outcome.running = worker
    return outcome


@dataclass
class Answer:
    text: str  # the tool's answer as the model reads it
    failed: bool = False  # no such tool, it raised, or it timed out
    running: threading.Thread | None = None  # timed out: the tool's thread, still running


def run(tools: dict[str, Callable], call: Call, timeout: float) -> Answer:
    """The tool's answer to one call: its result as text, its error, or that it timed out or does not exist."""
    function = tools.get(call.name)
    if function is None:
        return Answer(f"invalid tool call: no tool named {call.name!r} (tools: {', '.join(tools) or 'none'})", failed=True)
    outcome = bounded(lambda: function(**call.arguments), timeout, f"tool {call.name}")
    if outcome.running is not None:
        return Answer(f"error: tool {call.name} did not answer within {timeout:g} s", failed=True, running=outcome.running)
    if outcome.error is not None:  # a tool's failure is the model's observation, never the run's
        return Answer(f"error: {type(outcome.error).__name__}: {outcome.error}", failed=True)
    result = outcome.value
    return Answer(result if isinstance(result, str) else json.dumps(result, default=str))
