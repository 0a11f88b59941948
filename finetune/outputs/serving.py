"""Whether a saved adapter loads in vLLM as a LoRA adapter, and what to do where it would not.

The rules are vLLM's own (its `PEFTHelper` reading adapter_config.json, and its LoRA config): no
`modules_to_save` (full copies of layers), no DoRA, no bias trained, a rank within `--max-lora-rank`
(one of 8, 16, 32, 64, 128, 256, 320, 512), and LoRA on linear modules (peft's `target_parameters`, the
expert weights of a mixture-of-experts model, are not read). The fix for each is the same: merge the
adapter (`finetune merge`) and serve the merged model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from finetune.config.files import read_json_object

VLLM_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's --max-lora-rank takes


@dataclass
class Serving:
    problems: list[str] = field(default_factory=list)
    max_lora_rank: int | None = None  # the smallest --max-lora-rank that takes the adapter

    @property
    def loads(self) -> bool:
        return not self.problems

    def line(self) -> str:
        if self.loads:
            return f"serving: vLLM loads this adapter (vllm serve BASE --enable-lora --max-lora-rank {self.max_lora_rank} --lora-modules NAME=DIR)"
        return f"serving: vLLM would not load this adapter: {'; '.join(self.problems)}; merge it first (finetune merge) and serve the merged model"


def check_vllm(adapter_dir: str | Path) -> Serving:
    config = read_json_object(Path(adapter_dir) / "adapter_config.json", "adapter")
    problems = []
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save {config['modules_to_save']} (full copies of layers; vLLM takes LoRA weights only)")
    if config.get("use_dora"):
        problems.append("DoRA (vLLM does not support it)")
    if config.get("bias", "none") != "none":
        problems.append(f"bias '{config['bias']}' trained (vLLM loads adapter biases only with --enable-lora-bias)")
    if config.get("target_parameters"):
        problems.append("LoRA on expert weights (target_parameters), which vLLM does not read")
    rank = max([config.get("r", 0), *(config.get("rank_pattern") or {}).values()])
    fits = next((r for r in VLLM_RANKS if r >= rank), None)
    if fits is None:
        problems.append(f"rank {rank} (vLLM's --max-lora-rank goes up to {VLLM_RANKS[-1]})")
    return Serving(problems, fits)
