"""The calculator environment of `make demo-agent`: arithmetic the demo model cannot do in its head, and a
`calculate` tool it can call. An episode scores 1 when its final answer is the row's answer, 0.5 when it called
the tool on the question but answered something else.

    grpo:
      environment: demo/agent/calculator.py:Calculator
"""

from __future__ import annotations

import ast
import operator

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of whole numbers with +, - and *.

    Args:
        expression: The expression, for example "37 * 91".
    """

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"cannot evaluate {ast.unparse(node)!r}: whole numbers with +, - and * only")

    return str(value(ast.parse(expression, mode="eval").body))


def final_answer(messages: list[dict]) -> str:
    return next((m["content"] or "" for m in reversed(messages) if m["role"] == "assistant"), "").strip()


def right_call(messages: list[dict], answer: str) -> bool:
    """Whether the episode called calculate on an expression whose value is the answer."""
    for m in messages:
        for call in m.get("tool_calls") or []:
            try:
                if calculate(**call["function"]["arguments"]) == answer:
                    return True
            except (TypeError, ValueError, SyntaxError):
                continue
    return False


class Calculator:
    """1 for the right final answer; 0.5 for a wrong one after calling calculate on the question (partial credit:
    the demo model learns the call before it learns to copy the call's result into its answer)."""

    tools = [calculate]

    def __init__(self, row: dict):
        self.answer = str(row["answer"])

    def reward(self, messages: list[dict]) -> float:
        return 1.0 if final_answer(messages) == self.answer else 0.5 if right_call(messages, self.answer) else 0.0
