"""A guessing game: the environment holds a number (the row's `secret`), the model guesses, the environment
answers "higher" or "lower" until it is found or the turns run out. No tools: the user's side of a
multi-turn conversation. An episode scores 1 when it finds the number, less 0.1 for each wrong guess.

    grpo:
      environment: demo/agent/guess.py:GuessNumber
"""

from __future__ import annotations

import re


class GuessNumber:
    def __init__(self, row: dict):
        self.secret, self.wrong, self.found = int(row["secret"]), 0, False

    def step(self, message: dict) -> list[dict]:
        guess = re.search(r"-?\d+", message["content"] or "")
        if guess is None:
            self.wrong += 1
            return [{"role": "user", "content": "Say a number."}]
        if int(guess.group()) == self.secret:
            self.found = True
            return []  # the episode is over
        self.wrong += 1
        return [{"role": "user", "content": "higher" if int(guess.group()) < self.secret else "lower"}]

    def reward(self, messages: list[dict]) -> float:
        return max(0.0, 1.0 - 0.1 * self.wrong) if self.found else 0.0
