"""Tools for agentic GRPO: the calls a model writes, parsed in its family's format, and run with a time limit.

Formats (grpo.tool_format; auto reads the chat template):
  hermes   Hermes / Qwen 2.5-3 / the built-in chatml: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a call
  llama3   Llama 3.1-3.3: the turn is a JSON object `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or not),
           several joined by `;`
  mistral  `[TOOL_CALLS]` then a JSON list of {"name", "arguments"} (v3), or `name[ARGS]{...}` once a call (v11+)

A call that cannot be read is not an error of the run: the model sees "invalid tool call: why" as the tool's answer.
A tool that raises answers with its error; one that runs past grpo.tool_timeout answers that it timed out (its thread
is left to finish in the background: Python cannot stop a thread, and the run does not wait for it).
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


def run(tools: dict[str, Callable], call: Call, timeout: float) -> str:
    """The tool's answer to one call as text: its result, its error, or that it timed out or does not exist."""
    function = tools.get(call.name)
    if function is None:
        return f"invalid tool call: no tool named {call.name!r} (tools: {', '.join(tools) or 'none'})"
    outcome: dict = {}

    def target():
        try:
            outcome["result"] = function(**call.arguments)
        except Exception as err:  # noqa: BLE001 - a tool's failure is the model's observation, never the run's
            outcome["error"] = f"{type(err).__name__}: {err}"

    worker = threading.Thread(target=target, name=f"tool {call.name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return f"error: tool {call.name} did not answer within {timeout:g} s"
    if "error" in outcome:
        return f"error: {outcome['error']}"
    result = outcome.get("result")
    return result if isinstance(result, str) else json.dumps(result, default=str)
