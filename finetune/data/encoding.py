"""Rows into token ids with a loss mask: completion rows train on every token, alpaca and chat rows on the
answers as the chat template marks them (finetune/data/chat.py); preference pairs, unpaired examples and
GRPO's prompts their own way (a pair's chosen and rejected sequences share the prompt's tokens)."""

from __future__ import annotations

from finetune.config.errors import UserError
from finetune.data import images
from finetune.data.chat import assistant_masks, render
from finetune.data.rows import IGNORE

ALPACA_PROMPT = (
    "Below is an instruction that describes a task{with_input}. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
)


def _alpaca_messages(row: dict) -> list[dict]:
    user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]


def _alpaca_prompt(row: dict) -> str:
    has_input = bool(row.get("input"))
    return ALPACA_PROMPT.format(
        with_input=", paired with an input that provides further context" if has_input else "",
        instruction=row["instruction"],
        input_block=f"### Input:\n{row['input']}\n\n" if has_input else "",
    )


def tokenize_row(row: dict, tokenizer, fmt: str, train_on_prompt: bool) -> dict:
    """One row -> {'input_ids', 'labels'} (not yet truncated)."""
    result = tokenize_rows([row], tokenizer, fmt)[0]
    if isinstance(result, str):
        raise UserError(result)
    ids, trained = result
    return {"input_ids": ids, "labels": [t if (train_on_prompt or keep) else IGNORE for t, keep in zip(ids, trained)]}


def tokenize_rows(rows: list[dict], tokenizer, fmt: str) -> list[tuple[list[int], list[bool]] | str]:
    """Rows -> (input_ids, which tokens are trained) each, through the tokenizer's batch calls; a row the
    chat template refuses gets the reason instead."""
    if fmt == "completion":
        eos = tokenizer.eos_token_id
        out = []
        for ids in tokenizer([r["text"] for r in rows], add_special_tokens=True)["input_ids"]:
            if eos is not None and (not ids or ids[-1] != eos):
                ids = ids + [eos]
            out.append((ids, [True] * len(ids)))
        return out
    if fmt == "chat" or tokenizer.chat_template:
        return assistant_masks(tokenizer, [r["messages"] if fmt == "chat" else _alpaca_messages(r) for r in rows],
                               [r.get("tools") if fmt == "chat" else None for r in rows])
    # alpaca without a chat template: the classic Alpaca prompt
    prompts = tokenizer([_alpaca_prompt(r) for r in rows], add_special_tokens=True)["input_ids"]
    answers = tokenizer([r["output"] for r in rows], add_special_tokens=False)["input_ids"]
    return [(p + a + [tokenizer.eos_token_id], [False] * len(p) + [True] * (len(a) + 1)) for p, a in zip(prompts, answers)]


def tokenize_pairs(rows: list[dict], tokenizer, max_seq_len: int, processor=None,
                   pictures: list | None = None) -> list[tuple[list[int], list[bool], int, int] | str]:
    """Preference rows -> (chosen ids + rejected ids, which are trained, the chosen sequence's length,
    where the answer starts) each, or the reason a template refused the row. Each sequence is the prompt
    and one answer; as TRL tokenizes them, the answer is what follows the longest common start of the
    tokenized prompt and prompt + answer (text pairs get the EOS token after each answer; chat pairs are
    rendered by the chat template). Each is cut to max_seq_len (its start kept); a pair that keeps no
    answer token on one side comes back empty. A pair that shows pictures (pictures: images.row_pictures',
    per row) is tokenized by the processor, both sides with the prompt's pictures, and never cut."""
    def pair(row: dict, shown: list) -> tuple[list[int], list[bool], int, int] | str:
        sides = [_pair_side(row, key, tokenizer, images.encoder(processor, shown) if shown else None) for key in ("chosen", "rejected")]
        longest = max(len(ids) for _, ids in sides)
        if shown and longest > max_seq_len:
            return (f"data: the pair's longer side is {longest} tokens with its pictures, over data.max_seq_len={max_seq_len}; a "
                    "picture's tokens cannot be cut (raise data.max_seq_len)")
        start = min(_common_start(prompt, ids) for prompt, ids in sides)
        cut = [ids[:max_seq_len] for _, ids in sides]
        if start >= max_seq_len:
            return [], [], 0, start
        trained = [[i >= start for i in range(len(ids))] for ids in cut]
        return cut[0] + cut[1], trained[0] + trained[1], len(cut[0]), start

    return _per_row(rows, pictures, pair)


def tokenize_unpaired(rows: list[dict], tokenizer, max_seq_len: int) -> list[tuple[list[int], list[bool], int, int] | str]:
    """Unpaired rows (KTO) -> (prompt + completion ids cut to max_seq_len, which are trained, 1 for a desirable
    completion and 0 for an undesirable one, where the completion starts) each, tokenized as a pair's side is."""
    def example(row: dict, shown: list) -> tuple[list[int], list[bool], int, int]:
        prompt, ids = _pair_side(row, "completion", tokenizer)
        start = _common_start(prompt, ids)
        if start >= max_seq_len:
            return [], [], int(row["label"]), start
        ids = ids[:max_seq_len]
        return ids, [i >= start for i in range(len(ids))], int(row["label"]), start

    return _per_row(rows, None, example)


def tokenize_prompts(rows: list[dict], tokenizer, processor=None, pictures: list | None = None) -> list[tuple[list[int], list[bool]] | str]:
    """Prompt rows -> (the prompt's ids, nothing trained) each: text as generation reads it (special tokens
    where the tokenizer has no chat template), chat messages rendered with the generation prompt. A prompt that
    shows pictures (pictures: images.row_pictures', per row) is tokenized by the processor with them."""
    def prompt(row: dict, shown: list) -> tuple[list[int], list[bool]]:
        ids = images.encoder(processor, shown)(prompt_text(row, tokenizer)) if shown else prompt_ids(row, tokenizer)
        return ids, [False] * len(ids)

    return _per_row(rows, pictures, prompt)


def _per_row(rows: list[dict], pictures: list | None, encode) -> list:
    """encode(row, its pictures) for each row (pictures: images.row_pictures', per row; none by default); where a row's
    pictures were refused, or encode raised a UserError, that line in its place."""
    out = []
    for row, shown in zip(rows, pictures or [[] for _ in rows]):
        if isinstance(shown, str):
            out.append(shown)
            continue
        try:
            out.append(encode(row, shown))
        except UserError as err:
            out.append(str(err))
    return out


def prompt_text(row: dict, tokenizer) -> str:
    """A prompt row as the text the model completes."""
    if isinstance(row["prompt"], str):
        return row["prompt"]
    return render(tokenizer, row["prompt"], add_generation_prompt=True, tools=row.get("tools"))


def prompt_ids(row: dict, tokenizer) -> list[int]:
    add = isinstance(row["prompt"], str) and not tokenizer.chat_template  # as evaluate.generate tokenizes a prompt
    return tokenizer(prompt_text(row, tokenizer), add_special_tokens=add)["input_ids"]


def _pair_side(row: dict, key: str, tokenizer, encode=None) -> tuple[list[int], list[int]]:
    """(the prompt's ids, the prompt and one answer's ids); encode: a chat pair's text -> ids (a processor's, with the pictures)."""
    if isinstance(row["prompt"], str):
        eos = tokenizer.eos_token or ""
        answer = row[key] if row[key].endswith(eos) else row[key] + eos
        return tokenizer(row["prompt"])["input_ids"], tokenizer(row["prompt"] + answer)["input_ids"]
    tools = row.get("tools")
    prompt = render(tokenizer, row["prompt"], add_generation_prompt=True, tools=tools)
    full = render(tokenizer, row["prompt"] + row[key], tools=tools)
    encode = encode or (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    return encode(prompt), encode(full)


def _common_start(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def prompt_and_answer(row: dict, tokenizer, fmt: str) -> tuple[str, str]:
    """The prompt text a model should complete, and the reference answer (alpaca and chat rows)."""
    if fmt == "chat":
        last = max(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant")
        msgs = row["messages"]
        return render(tokenizer, msgs[:last], add_generation_prompt=True, tools=row.get("tools")), msgs[last]["content"]
    if fmt == "alpaca":
        if tokenizer.chat_template:
            return render(tokenizer, _alpaca_messages(row)[:1], add_generation_prompt=True), row["output"]
        return _alpaca_prompt(row), row["output"]
    if fmt == "prompt":
        return prompt_text(row, tokenizer), str(row.get("answer", ""))
    if fmt in ("preference", "unpaired"):  # the chosen answer; the completion (the data step keeps the desirable ones as examples)
        key = "chosen" if fmt == "preference" else "completion"
        if isinstance(row["prompt"], str):
            return row["prompt"], row[key]
        return render(tokenizer, row["prompt"], add_generation_prompt=True, tools=row.get("tools")), row[key][-1]["content"]
    raise ValueError("completion rows have no prompt/answer split")
