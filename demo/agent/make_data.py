"""Generate the agent demo's shipped data (run once; its output is committed):

- calc-sft.jsonl: 300 tool-call transcripts (format chat, with the tool's schema): a question, the call of
  `calculate`, its result, the answer; the short SFT that teaches the demo model the shape of a call;
- calc-train.jsonl / calc-eval.jsonl: 400 / 50 other questions as prompt rows with their answers, for GRPO in the
  calculator environment (calculator.py);
- guess-train.jsonl: 64 guessing-game prompts with their secret numbers (guess.py);
- guess-sft.jsonl: 2,000 guessing-game transcripts whose guesses are drawn at random from the numbers the answers so
  far leave possible: the rules, not a strategy (that is GRPO's to find);
- guess-eval.jsonl: the game for each secret number from 1 to 16.

    python demo/agent/make_data.py
"""

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from calculator import calculate  # noqa: E402


def question(rng: random.Random) -> tuple[str, str]:
    """Products of two-digit numbers of four digits: always the same shape, so each digit sits at the same distance
    from where it is copied to (the question's into the call, the tool's answer into the final one)."""
    expression = f"{rng.randrange(32, 100)} * {rng.randrange(32, 100)}"
    return expression, calculate(expression)


def transcript(expression: str, answer: str, schema: dict) -> dict:
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
    return {"tools": [schema], "messages": [{"role": "user", "content": f"What is {expression}?"},
                                            {"role": "assistant", "content": "", "tool_calls": [call]},
                                            {"role": "tool", "content": answer},
                                            {"role": "assistant", "content": answer}]}


GUESS = "Guess my number from 1 to 16."


def guesses(secret: int, rng: random.Random, turns: int = 4) -> dict:
    """A game played by guessing any number still possible: found, or `turns` guesses."""
    low, high, messages = 1, 16, [{"role": "user", "content": GUESS}]
    for turn in range(turns):
        guess = rng.randint(low, high)
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret or turn == turns - 1:
            break
        messages.append({"role": "user", "content": "higher" if guess < secret else "lower"})
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
    return {"messages": messages}


def main() -> None:
    from transformers.utils import get_json_schema

    rng, seen = random.Random(0), set()
    questions = []
    while len(questions) < 750:
        expression, answer = question(rng)
        if expression not in seen:
            seen.add(expression)
            questions.append((expression, answer))
    schema = get_json_schema(calculate)
    files = {"calc-sft.jsonl": [transcript(e, a, schema) for e, a in questions[:300]],
             "calc-train.jsonl": [{"prompt": [{"role": "user", "content": f"What is {e}?"}], "answer": a} for e, a in questions[300:700]],
             "calc-eval.jsonl": [{"prompt": [{"role": "user", "content": f"What is {e}?"}], "answer": a} for e, a in questions[700:]],
             "guess-train.jsonl": [{"prompt": [{"role": "user", "content": GUESS}], "secret": rng.randrange(1, 17)} for _ in range(64)]}
    games = random.Random(1)
    files["guess-sft.jsonl"] = [guesses(games.randint(1, 16), games) for _ in range(2000)]
    files["guess-eval.jsonl"] = [{"prompt": [{"role": "user", "content": GUESS}], "secret": secret} for secret in range(1, 17)]
    for name, rows in files.items():
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
