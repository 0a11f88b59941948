"""What a model does in the guessing game (guess.py): the probability of each first guess, the share of later
guesses' probability inside the range the answers leave (over 40 positions of random games within the rules), and
the greedy game for each secret from 1 to 16 (a guess is the number whose tokens are likeliest whole).

    python demo/agent/show_guesses.py outputs/agent-guess-sft                        # after the SFT
    python demo/agent/show_guesses.py outputs/agent-guess-sft outputs/agent-guess    # with GRPO's adapter
"""

import argparse
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = Path(__file__).parent
PROMPT = [{"role": "user", "content": "Guess my number from 1 to 16."}]


def guess_probabilities(model, tokenizer, messages: list[dict]) -> dict[int, float]:
    context = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"][0]
    numbers = {n: tokenizer(str(n) + tokenizer.eos_token, add_special_tokens=False)["input_ids"] for n in range(1, 17)}
    rows = torch.nn.utils.rnn.pad_sequence([torch.cat([context, torch.tensor(ids)]) for ids in numbers.values()], batch_first=True)
    with torch.no_grad():
        logps = model(rows).logits.float().log_softmax(-1)
    start = len(context) - 1
    return {n: logps[i, start:start + len(ids)].gather(-1, torch.tensor(ids)[:, None]).sum().exp().item() for i, (n, ids) in enumerate(numbers.items())}


def greedy_game(model, tokenizer, secret: int, turns: int = 4) -> list[str]:
    messages = list(PROMPT)
    for _ in range(turns):
        chances = guess_probabilities(model, tokenizer, messages)
        guess = max(chances, key=chances.get)
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            break
        messages.append({"role": "user", "content": "higher" if guess < secret else "lower"})
    return [m["content"] for m in messages[1:]]


def inside_share(model, tokenizer, positions: int = 40) -> float:
    rng, shares = random.Random(5), []
    while len(shares) < positions:
        secret, low, high, messages = rng.randint(1, 16), 1, 16, list(PROMPT)
        for _ in range(rng.randint(1, 3)):
            guess = rng.randint(low, high)
            if guess == secret:
                break
            messages += [{"role": "assistant", "content": str(guess)}, {"role": "user", "content": "higher" if guess < secret else "lower"}]
            low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
        if len(messages) > 1:
            chances = guess_probabilities(model, tokenizer, messages)
            shares.append(sum(p for n, p in chances.items() if low <= n <= high) / sum(chances.values()))
    return sum(shares) / len(shares)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="the SFT model's folder")
    parser.add_argument("adapter", nargs="?", help="a GRPO run's adapter folder over it")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.chat_template = (HERE / "agent.jinja").read_text()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter).eval()
    first = guess_probabilities(model, tokenizer, PROMPT)
    print("first guess:", "  ".join(f"{n}: {p:.2f}" for n, p in first.items()))
    print(f"later guesses inside the range left: {inside_share(model, tokenizer):.1%} of their probability")
    games = {secret: greedy_game(model, tokenizer, secret) for secret in range(1, 17)}
    for secret, game in games.items():
        print(f"secret {secret:2d}: {' '.join(game)}")
    print(f"found: {sum(game[-1] == str(secret) for secret, game in games.items())} of 16")


if __name__ == "__main__":
    main()
