"""The tokenizer as llama.cpp reads it from a GGUF file, and the proof that it reads it so.

Two of llama.cpp's tokenizer models cover the families we export: "gpt2" (byte-level BPE: tokens, merges, and
`tokenizer.ggml.pre`, the name of the regex that splits text before merging, found here by behaviour) and "llama"
(SentencePiece-style BPE over "▁"-joined text with byte fallback, as Gemma's tokenizer.json: tokens with scores,
which llama.cpp merges highest first). The npm and hub tokenizer.json files carry no SentencePiece scores, so each
merged token's score is minus the rank of its first merge: llama.cpp then merges in the order transformers does.

Before any weight is written the vocabulary alone goes through llama.cpp (llama-cpp-python, vocab_only): the token
ids of HARD_STRINGS and of every special token must be transformers' own, or the export stops in one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path

from finetune.config.errors import UserError

# Strings where tokenizers part ways: contractions, digit runs, leading and repeated spaces, tabs and newlines,
# accents, CJK, emoji, code, punctuation runs.
HARD_STRINGS = ["It isn't red, it's BLUE and they'll see.", "Hello world 12345! 3.14159 and 1,000,000", "  two leading spaces   and more",
                "\ttab\tseparated\nnew line\n\n\nthree", "naïve café résumé Ångström", "東京は日本の首都です。", "emoji 🤗🚀 here 👍🏽",
                "def f(x):\n    return x**2  # squared", "I'm, you're, we've, I'd, he'll", "...!!! ??? --- ###", "CamelCaseWord mixed123abc 42nd",
                " \n leading newline"]


def write_vocabulary(writer, tokenizer, folder: Path, embedding_rows: int) -> None:
    """Every token by id, one per embedding row (llama.cpp's rule): rows beyond the tokenizer's, as Qwen's 151,936 for
    151,669 tokens, get UNUSED placeholders; added tokens beyond the rows, as Gemma-3-1B's `<image_soft_token>` (its
    tokenizer is the multimodal releases'), are left out, as the model cannot take them. Their types, the special ids
    and the chat template; then the tokenizer model's own part."""
    import gguf

    data = json.loads(tokenizer.backend_tokenizer.to_str())
    added = {t.content: t for t in tokenizer.added_tokens_decoder.values()}
    rows = embedding_rows or len(tokenizer)
    vocab = {t: i for t, i in tokenizer.get_vocab().items() if i < rows}
    beyond = sorted(set(tokenizer.get_vocab()) - set(vocab) - set(added))
    if beyond:
        raise UserError(f"--model: {folder}'s tokenizer has {len(beyond)} tokens past the model's {rows} embedding rows ({beyond[0]!r}, ...)")
    tokens = [f"[PAD{i}]" for i in range(rows)]
    for token, index in vocab.items():
        tokens[index] = token
    unused = set(range(rows)) - set(vocab.values())
    special = set(tokenizer.all_special_tokens) | {t for t, a in added.items() if a.special}
    if _byte_level(data):
        _gpt2_part(writer, tokenizer, data, folder)
        byte = set()
    elif _sentencepiece(data):
        _llama_part(writer, data, tokens, vocab)
        byte = {i for i, t in enumerate(tokens) if re.fullmatch(r"<0x[0-9A-F]{2}>", t)}
    else:
        raise UserError(f"--model: {folder}'s tokenizer is a {data['model']['type']} model llama.cpp reads neither as byte-level BPE "
                        "(gpt2) nor as SentencePiece BPE with byte fallback (llama); it is not exported")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.UNUSED if i in unused else gguf.TokenType.BYTE if i in byte else gguf.TokenType.CONTROL if t in special
                            else gguf.TokenType.USER_DEFINED if t in added else gguf.TokenType.NORMAL for i, t in enumerate(tokens)])
    for key in ("bos", "eos", "pad", "unk"):
        value = getattr(tokenizer, f"{key}_token_id")
        if value is not None:
            getattr(writer, f"add_{key}_token_id")(value)
    bos, eos = added_ends(tokenizer)
    writer.add_add_bos_token(bos)
    writer.add_add_eos_token(eos)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def added_ends(tokenizer) -> tuple[bool, bool]:
    """Whether encoding a text adds BOS, and EOS, as llama.cpp is told to."""
    probe = tokenizer("a").input_ids
    return (tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id],
            tokenizer.eos_token_id is not None and probe[-1:] == [tokenizer.eos_token_id])


def _byte_level(data: dict) -> bool:
    return data["model"]["type"] == "BPE" and "ByteLevel" in json.dumps(data.get("pre_tokenizer"))


def _sentencepiece(data: dict) -> bool:
    return data["model"]["type"] == "BPE" and data["model"].get("byte_fallback") and "\u2581" in json.dumps(data.get("decoder"), ensure_ascii=False)


def _gpt2_part(writer, tokenizer, data: dict, folder: Path) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer(tokenizer, folder))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])


def _llama_part(writer, data: dict, tokens: list[str], vocab: dict) -> None:
    """SentencePiece's scores from the merges, and whether a "▁" goes before the text as its normalizer says. A token
    no merge makes (single characters, bytes, added tokens) keeps 0; were llama.cpp to merge a pair into one that
    transformers would not, check_in_llama_cpp's strings would show it and stop the export."""
    first = {}
    for rank, merge in enumerate(data["model"]["merges"]):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        first.setdefault(left + right, rank)
    scores = [0.0] * len(tokens)
    for token, index in vocab.items():
        if token in first:
            scores[index] = -float(first[token])
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_scores(scores)
    pre = data.get("pre_tokenizer") or {}
    metaspace = [p for p in (pre, *pre.get("pretokenizers", [])) if p.get("type") == "Metaspace"]
    writer.add_add_space_prefix(any(p.get("prepend_scheme", "always") != "never" for p in metaspace) or '"Prepend"' in json.dumps(data.get("normalizer")))


def pre_tokenizer(tokenizer, folder: Path) -> str:
    """llama.cpp's name for how this byte-level BPE splits text before merging (its `tokenizer.ggml.pre`), found
    by behaviour: the tokenizer's own splits of HARD_STRINGS against each split llama.cpp implements (the table of
    them transformers' GGUF reader keeps, and GPT-2's). A split llama.cpp has none for is refused in one line."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    own = tokenizer.backend_tokenizer.pre_tokenizer
    if own is None:
        raise UserError(f"--model: {folder}'s tokenizer does not split text before merging; llama.cpp has no pre-tokenizer for that")
    candidates = {"gpt-2": pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)}
    for name in ("llama-bpe", "qwen2", "tekken", "gpt-4o", "qwen35"):  # one llama.cpp name for each distinct split
        candidates[name] = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[name]), behavior="isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    splits = [[piece for piece, _ in own.pre_tokenize_str(text)] for text in HARD_STRINGS]
    for name, candidate in candidates.items():
        if all([piece for piece, _ in candidate.pre_tokenize_str(text)] == split for text, split in zip(HARD_STRINGS, splits)):
            return name
    raise UserError(f"--model: {folder}'s tokenizer splits text as none of llama.cpp's pre-tokenizers does ({', '.join(candidates)}); "
                    "llama.cpp would tokenize it otherwise, so it is not exported")


def check_in_llama_cpp(arch: str, write_header, tokenizer, folder: Path, rows: int) -> int:
    """The vocabulary alone (`write_header(writer)` puts the metadata and tokens in) read by llama.cpp: the token ids
    of HARD_STRINGS, of every special token and of a chat turn against transformers'. Returns how many strings agree;
    the first that does not stops the export in one line, before any weight is written."""
    import gguf
    from llama_cpp import Llama

    specials = "".join(t for t in tokenizer.all_special_tokens if t != tokenizer.pad_token and tokenizer.convert_tokens_to_ids(t) < rows)
    texts = [*HARD_STRINGS, f"special tokens: {specials} and after them", " a text that starts with a space"]
    adds_bos = added_ends(tokenizer)[0]
    cases = [(text, tokenizer(text).input_ids, adds_bos) for text in texts]
    if tokenizer.chat_template:  # as rendered, its special tokens in the text
        turn = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Sure."}], tokenize=False)
        cases.append((turn, tokenizer(turn, add_special_tokens=False).input_ids, False))
    with tempfile.TemporaryDirectory(prefix="finetune-vocab-") as tmp:
        path = Path(tmp) / "vocab.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        write_header(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        with quiet_stderr():
            llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
        try:
            _same_tokens(llm, cases, folder)
        finally:
            llm.close()
    return len(cases)


def _same_tokens(llm, cases: list, folder: Path) -> None:
    for text, ours, bos in cases:
        theirs = llm.tokenize(text.encode(), add_bos=bos, special=True)
        if ours != theirs:
            prefix = " (llama.cpp puts SentencePiece's \"▁\" before every text and after every special token; this tokenizer.json does " \
                     "not where the text starts with a space)" if llm.metadata.get("tokenizer.ggml.add_space_prefix") == "true" else ""
            raise UserError(f"--model: llama.cpp would tokenize {text!r} as {theirs[:10]}, transformers as {ours[:10]}{prefix}; "
                            f"{folder} is not exported")


@contextlib.contextmanager
def quiet_stderr():
    """llama.cpp's C++ side writes notes past verbose=False (its context size against a vocabulary-only file's, its
    sliding-window cache); they would read as errors under a one-line message."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):  # its log callback prints to sys.stderr
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
