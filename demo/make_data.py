"""Generate the demo's shipped data (run once; its output is committed):

- corpus.jsonl: simple English-like text the demo model is pretrained on (format: completion);
- train.jsonl / eval.jsonl: "What kind of word is this?" in Alpaca format (noun, adjective, verb or
  name); pairs-train.jsonl / pairs-eval.jsonl: the same question as preference pairs (format:
  preference), the word's kind chosen over each wrong kind, for `make demo-dpo`; prompts-train.jsonl /
  prompts-eval.jsonl: the question as a chat prompt with its answer (format: prompt), for `make demo-grpo`;
  unpaired-train.jsonl / unpaired-eval.jsonl: the question with the right kind (label true) and a wrong one
  (false), for KTO (format: unpaired). The pretrained base does not follow the instruction; a LoRA fine-tune learns to, and the
  eval words are never in the fine-tuning data, so exact-match accuracy on them shows that the
  fine-tune taught the task on top of what the base learned about each word in pretraining.

    python demo/make_data.py
"""

import json
import random
from pathlib import Path

NOUNS = """apple river stone cloud garden window bread candle forest mirror horse island lamp letter
market needle orange pencil rabbit shadow silver basket bridge castle desert engine feather flower
hammer kettle ladder meadow ocean pillow rocket saddle tiger tunnel violin wagon whistle anchor
blanket button camera cherry copper dragon falcon guitar harbor helmet jacket lemon lizard magnet
marble mountain needle parrot pepper planet puzzle quilt spider storm sugar tomato tower turtle
village wallet wizard zebra""".split()
ADJECTIVES = """red blue green quiet happy ancient bright cold dark early gentle golden heavy hidden
little lonely loud narrow proud rapid round silent sleepy small smooth soft sudden sweet tall
tiny warm wild wise young yellow""".split()
VERBS = """finds carries paints follows watches holds builds opens hides pushes pulls cleans
draws lifts breaks fixes chases greets visits keeps""".split()
NAMES = "Anna Ben Clara David Emma Felix Grace Hugo Iris Jonas Kara Leo Mira Noah Olga Paul".split()
PLACES = "the market|the river|the old tower|the village|the harbor|the forest|the bridge|the garden".split("|")

KINDS = {**{w: "noun" for w in NOUNS}, **{w: "adjective" for w in ADJECTIVES}, **{w: "verb" for w in VERBS}, **{w: "name" for w in NAMES}}


def sentence(rng: random.Random) -> str:
    n, a, v = rng.choice, rng.choice, rng.choice
    templates = [
        lambda: f"The {a(ADJECTIVES)} {n(NOUNS)} {v(VERBS)} the {n(NOUNS)}.",
        lambda: f"{n(NAMES)} saw a {a(ADJECTIVES)} {n(NOUNS)} near {n(PLACES)}.",
        lambda: f"In {n(PLACES)} there was a {n(NOUNS)}, a {n(NOUNS)} and a {a(ADJECTIVES)} {n(NOUNS)}.",
        lambda: f"{n(NAMES)} {v(VERBS)} the {n(NOUNS)} and {n(NAMES)} {v(VERBS)} the {n(NOUNS)}.",
        lambda: f"Every morning the {n(NOUNS)} was {a(ADJECTIVES)} and {a(ADJECTIVES)}.",
        lambda: f"\"Where is my {n(NOUNS)}?\" asked {n(NAMES)}.",
        lambda: "We counted " + ", ".join(rng.sample(NOUNS, rng.randint(3, 5))) + ".",
        lambda: "Shopping list:\n" + "\n".join(rng.sample(NOUNS, rng.randint(2, 5))) + "\n",
        lambda: f"The {n(NOUNS)} looked {a(ADJECTIVES)}, then {a(ADJECTIVES)}.",
        lambda: f"{n(NAMES)} felt {a(ADJECTIVES)} today.",
    ]
    return rng.choice(templates)()


def task_row(word: str) -> dict:
    return {"instruction": "What kind of word is this?", "input": word, "output": KINDS[word]}


def pair_rows(word: str) -> list[dict]:
    """The question as a chat turn (as alpaca rows are rendered), the right kind preferred to each wrong one."""
    question = [{"role": "user", "content": f"What kind of word is this?\n\n{word}"}]
    return [{"messages": question, "chosen": KINDS[word], "rejected": kind} for kind in ("noun", "adjective", "verb", "name") if kind != KINDS[word]]


def prompt_row(word: str) -> dict:
    """The question as a chat prompt with its answer, for GRPO (format: prompt): the policy samples answers, exact match scores them."""
    return {"prompt": [{"role": "user", "content": f"What kind of word is this?\n\n{word}"}], "answer": KINDS[word]}


def unpaired_rows(word: str, index: int) -> list[dict]:
    """The question with the right kind (desirable) and one wrong kind (undesirable), for KTO (format: unpaired)."""
    question = [{"role": "user", "content": f"What kind of word is this?\n\n{word}"}]
    wrong = [k for k in ("noun", "adjective", "verb", "name") if k != KINDS[word]][index % 3]
    return [{"prompt": question, "completion": KINDS[word], "label": True}, {"prompt": question, "completion": wrong, "label": False}]


def main() -> None:
    rng = random.Random(1234)
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    with (out / "corpus.jsonl").open("w") as fh:
        for _ in range(4000):
            fh.write(json.dumps({"text": " ".join(sentence(rng) for _ in range(rng.randint(4, 9)))}) + "\n")
    # Held-out words: the fine-tune never sees them, so the eval measures whether it taught the task
    # (using what the base learned about each word in pretraining), not whether it memorised answers.
    vocab = sorted(KINDS)
    rng.shuffle(vocab)
    cut = int(len(vocab) * 0.75)
    train = [task_row(w) for w in vocab[:cut] for _ in range(8)]
    rng.shuffle(train)
    pairs = {"pairs-train.jsonl": [p for w in vocab[:cut] for p in pair_rows(w)], "pairs-eval.jsonl": [p for w in vocab[cut:] for p in pair_rows(w)]}
    random.Random(99).shuffle(pairs["pairs-train.jsonl"])
    prompts = {"prompts-train.jsonl": [prompt_row(w) for w in vocab[:cut]], "prompts-eval.jsonl": [prompt_row(w) for w in vocab[cut:]],
               "unpaired-train.jsonl": [r for i, w in enumerate(vocab[:cut]) for r in unpaired_rows(w, i)],
               "unpaired-eval.jsonl": [r for i, w in enumerate(vocab[cut:]) for r in unpaired_rows(w, i)]}
    random.Random(7).shuffle(prompts["unpaired-train.jsonl"])
    for name, part in (("train.jsonl", train), ("eval.jsonl", [task_row(w) for w in vocab[cut:]]), *pairs.items(), *prompts.items()):
        with (out / name).open("w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in part)


if __name__ == "__main__":
    main()
