"""The run configuration: one typed schema, the single source of truth for every option and default.

A run is described by one YAML file (read by config/files.load_config). `validate_config` checks
everything that can be checked without loading a model, the rules between sections included, and
returns a `RunConfig`; every problem becomes a `UserError` that names the file and key and what was
expected.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator

from finetune.config.errors import UserError
from finetune.config.strategy import Name as StrategyName
from finetune.config.strategy import Strategy


class _Section(BaseModel):
    # Unknown keys are errors: a typo must never silently fall back to a default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class QuantizationConfig(_Section):
    bits: Literal[4, 8] = Field(4, description="4 (QLoRA: NF4/FP4 through bitsandbytes) or 8 (LLM.int8).")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type; NF4 is QLoRA's.")
    double_quant: bool = Field(True, description="4-bit: quantize the quantization constants too (~0.4 bit/param saved).")
    compute_dtype: Literal["bfloat16", "float32", "float16"] = Field("bfloat16", description="4-bit: dtype the dequantized weights are multiplied in.")
    skip_modules: list[str] | None = Field(None, description="Modules left unquantized besides transformers' defaults (lm_head is always kept).")
    backend: Literal["auto", "bitsandbytes", "torchao"] = Field(
        "auto", description="Who quantizes: bitsandbytes (4- and 8-bit, one process, ddp, zero2/zero3; a distill teacher not under zero3), "
        "or torchao's NF4Tensor (4-bit NF4 with LoRA, one process, ddp or fsdp: the 4-bit base FSDP2 shards). auto: torchao under "
        "distributed.strategy fsdp, else bitsandbytes.")
    _strategy: str = PrivateAttr("none")  # the run's distributed.strategy, set by RunConfig: what auto picks by (the saved config keeps auto)

    @property
    def chosen_backend(self) -> str:
        return self.backend_for(self._strategy)

    def backend_for(self, strategy: str) -> str:
        """What `auto` picks under distributed.strategy `strategy`: torchao under FSDP (its NF4 shards), else bitsandbytes."""
        return self.backend if self.backend != "auto" else "torchao" if strategy == "fsdp" else "bitsandbytes"


DEFAULT_RAMDISK = "/dev/shm/finetune"
CONFIG_FILE = "finetune_config.yaml"  # the resolved config, written beside every output and in every checkpoint
SUMMARY_FILE = "summary.json"  # written last by a finished run: its presence means the run is done
# One vocabulary of precisions: the short names (train.mixed_precision, merge --dtype) of the dtype
# names model.dtype takes (torch's), and each dtype's bytes.
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CHAT_TEMPLATES = ("chatml", "llama3", "alpaca")  # built-in templates (finetune/data/chat.py)
MUTATED_INITS = ("pissa", "olora")  # adapter.init values with which peft changes the base weights


class ModelConfig(_Section):
    name_or_path: str = Field(description="Local HF model folder, or a hub id where a hub is reachable.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the base weights are loaded in ('auto' = as saved)."
    )
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"] = (
        Field("sdpa", description="Attention kernel; flash attention needs a CUDA GPU and flash-attn.")
    )
    trust_remote_code: bool = Field(False, description="Run Python code shipped with the model. Off unless you trust it.")
    quantization: QuantizationConfig | None = Field(None, description="Load the base quantized (QLoRA / 8-bit); adapters train on top.")
    ramdisk: bool | str = Field(False, description="Stage the model folder in RAM once (true: /dev/shm/finetune, or a tmpfs path) and load "
                                "from there; later runs reuse the copy. Falls back to the source, with a warning, if it does not fit.")
    ramdisk_reserve_gib: float = Field(4.0, ge=0, description="RAM that must stay available after staging; else the run loads from the source.")
    tiled_mlp: int = Field(1, ge=1, description="Run each decoder layer's MLP over this many chunks of the row, recomputed chunk by chunk in "
                           "the backward (DeepSpeed's TiledMLP, from ALST): the MLP's intermediate activations shrink as many times, for "
                           "one more MLP forward a step. For rows of many thousand tokens; dense MLPs only; needs DeepSpeed installed.")
    compile: bool = Field(False, description="torch.compile each decoder layer in place (regional compilation): one compiled layer serves "
                          "them all; the first steps take longer while it compiles. docs/speed.md has its measured effect.")
    config_overrides: dict[str, Any] = Field({}, description="Settings of the model's config.json replaced before loading, e.g. "
                                             "{rope_parameters: {rope_type: linear, factor: 2.0, rope_theta: 10000.0}} for a longer context; "
                                             "merge and generate apply them to the base too.")
    processor: dict[str, Any] = Field({}, description="A vision-language model's processor settings, given to AutoProcessor: picture "
                                      "size (Qwen-VL: {min_pixels: 3136, max_pixels: 401408}; Idefics3: {do_image_splitting: false}). "
                                      "docs/vision.md.")

    @property
    def ramdisk_root(self) -> str | None:
        """Where the model is staged, or None when staging is off."""
        return DEFAULT_RAMDISK if self.ramdisk is True else (self.ramdisk or None)


class AdapterConfig(_Section):
    method: Literal["lora", "dora", "full"] = Field("lora", description="lora, dora, or full fine-tuning.")
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r, or alpha / sqrt(r) with rslora).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: str | list[str] = Field(
        "all-linear", description="'all-linear' or a list of module names (e.g. [q_proj, v_proj])."
    )
    rslora: bool = Field(False, description="Rank-stabilised LoRA scaling.")
    init: Literal["default", "gaussian", "pissa", "olora", "loftq"] = Field(
        "default", description="peft's LoRA initialisation: default (B = 0), gaussian, pissa (A, B from the weight's principal singular "
        "vectors, the rest left in the base) or olora (from its QR decomposition); pissa and olora: the saved adapter is converted "
        "by peft to a plain LoRA adapter (rank 2r) for the original base. loftq (4-bit bases): A, B the best rank-r fix of each "
        "layer's quantization error, from the original weights in the model's safetensors files.")
    modules_to_save: list[str] | None = Field(None, description="Extra modules trained in full and saved with the adapter.")
    vision: Literal["frozen", "lora", "full"] = Field("frozen", description="A vision-language model's vision tower: frozen, adapted "
                                                      "by LoRA (with method lora/dora), or trained whole.")
    projector: Literal["frozen", "full"] = Field("frozen", description="A vision-language model's projector (the vision tower's output "
                                                 "into the language model): frozen, or trained whole.")

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not value:
            raise ValueError("name at least one module, or all-linear")
        return value


# a format's field -> the file's column
Columns = dict[Literal["text", "instruction", "input", "output", "messages", "conversations", "prompt", "chosen", "rejected", "answer",
                       "completion", "label", "images"], str]
Format = Literal["completion", "alpaca", "chat", "preference", "prompt", "unpaired"]


class SourceConfig(_Section):
    path: str = Field(description="A local .jsonl/.json/.parquet/.csv/.txt file (gzipped too, but parquet), a folder of them or one "
                      "datasets' save_to_disk wrote, or a hub dataset name.")
    format: Format | None = Field(None, description="This source's format (null: data.format).")
    columns: Columns | None = Field(None, description="This source's column names (null: data.columns).")
    weight: float = Field(1.0, gt=0, description="Sampling weight: 2 repeats every sample twice, 0.5 takes a seeded half, 1.5 both.")
    bad_rows: Literal["fail", "skip"] | None = Field(None, description="This source's bad-row policy (null: data.bad_rows).")
    split: str | None = Field(None, description="This source's split, of a folder or hub dataset (null: data.split).")


class DataConfig(_Section):
    train: str | list[str | SourceConfig] = Field(description="Training data: local .jsonl/.json/.parquet/.csv/.txt file(s) (or .gz), folders "
                                                  "of them, or hub dataset names, or a list of sources {path, format, columns, weight, bad_rows, "
                                                  "split} to mix.")
    format: Format = Field(
        "alpaca", description="completion: {text}; alpaca: {instruction, input?, output}; chat: {messages: [{role, content}]} (content may be a "
        "list of text parts) or ShareGPT's {conversations: [{from, value}]}; preference (train.objective dpo/orpo/cpo/simpo): {prompt, chosen, "
        "rejected} as text, or chat messages {messages or prompt, chosen, rejected}; prompt (train.objective grpo): {prompt (text or chat "
        "messages), answer?, any other columns the reward functions read}; unpaired (train.objective kto): {prompt, completion, label: "
        "true/false}. docs/data.md: every accepted shape."
    )
    columns: Columns = Field({}, description="The format's fields under other column names, e.g. {instruction: question, output: answer}.")
    eval: str | list[str | SourceConfig] | None = Field(None, description="Held-out eval file(s) or sources; or use eval_fraction.")
    eval_fraction: float = Field(0.0, ge=0, lt=1, description="Share of the training rows held out for eval when no eval file is given.")
    max_seq_len: int = Field(512, ge=2, description="Longest row in tokens; longer samples are truncated (completion documents: see long_documents; "
                             "preference pairs: each answer with its prompt, the pair in one row of twice this).")
    long_documents: Literal["chunk", "truncate"] = Field("chunk", description="completion rows longer than max_seq_len: chunk (trained as windows "
                                                         "of max_seq_len tokens, every token once) or truncate (the rest is dropped).")
    chunk_overlap: int = Field(0, ge=0, description="chunk: tokens each window repeats from the one before, as context (not trained again).")
    packing: bool = Field(True, description="Pack samples into rows of max_seq_len, attention kept inside each sample.")
    train_on_prompt: bool = Field(False, description="Also compute the loss on prompt tokens (default: responses only).")
    chat_template: str | None = Field(None, description="Template that renders chat rows (and alpaca rows, where there is one): null = the "
                                      "model's own; chatml, llama3 or alpaca (built-in, with generation markers); or a .jinja file.")
    bad_rows: Literal["fail", "skip"] = Field("fail", description="Invalid rows: fail with file:line, or skip and count them.")
    cache_dir: str | None = Field(None, description="Tokenized-data cache (default $FINETUNE_CACHE or ~/.cache/finetune).")
    split: str = Field("train", description="Split to read from folders and hub datasets, found by datasets' rules (train-*, data/train-*, "
                       "a train/ folder; a folder without splits is all train); a source's own split comes first.")
    num_proc: int | None = Field(None, gt=0, description="Processes for tokenization (null: every core for sources of 10,000+ rows, else 1).")
    tokenize_wait_minutes: float = Field(120, gt=0, description="How long a process waits for another one tokenizing the same data on this node.")

    @model_validator(mode="after")
    def _overlap_fits(self) -> DataConfig:
        if self.chunk_overlap >= self.max_seq_len - 1:
            raise ValueError(f"chunk_overlap: {self.chunk_overlap} leaves no new token in a window of max_seq_len={self.max_seq_len}; "
                             "keep it below max_seq_len - 1")
        return self

    @field_validator("chat_template")
    @classmethod
    def _template_known(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and value not in CHAT_TEMPLATES and not _paths_unchecked(info) and not Path(value).expanduser().is_file():
            raise ValueError(f"expected {', '.join(CHAT_TEMPLATES)} or a Jinja template file; no file {value}")
        return value


class TrainConfig(_Section):
    output_dir: str = Field("outputs/run", description="Where the adapter/model, logs and plots go.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training data (ignored when max_steps is set).")
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps to run; overrides epochs.")
    micro_batch_size: int = Field(4, gt=0, description="Rows per forward pass, per process.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "lion", "lion_8bit", "sgd"] = Field(
        "adamw", description="adamw (torch, fused where available); *_8bit, paged_*, lion* through bitsandbytes; sgd."
    )
    optimizer_offload: bool = Field(False, description="Keep optimizer states in CPU RAM (torchao CPUOffloadOptimizer; CUDA only).")
    lr: float = Field(2e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay (AdamW) / L2 (SGD).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum.")
    scheduler: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="LR after warmup: cosine or linear decay to min_lr_ratio, constant, or wsd (warmup-stable-decay: "
        "constant, then a linear decay over the last decay_ratio of the steps).")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup, in optimizer steps.")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Linear warmup as a share of all optimizer steps (instead of warmup_steps).")
    min_lr_ratio: float = Field(0.0, ge=0, lt=1, description="cosine, linear, wsd: the LR decays to lr x this, not to 0.")
    decay_ratio: float = Field(0.1, gt=0, le=1, description="wsd: share of the steps after warmup spent decaying.")
    loraplus_lr_ratio: float | None = Field(None, gt=0, description="LoRA+: the LR of the B matrices (and of 1-D adapter weights, as peft's "
                                             "LoRA+ groups them) is lr x this (the LoRA+ paper suggests 16); null: one LR.")
    neftune_alpha: float | None = Field(None, gt=0, description="NEFTune: uniform noise of alpha / sqrt(tokens x hidden) added to the input "
                                        "embeddings while training (the paper and TRL use 5); null: off.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping; null turns it off.")
    skip_data: list[tuple[int, int]] = Field([], description="Data to skip by hand, as [[from_step, batches], ...]: from that optimizer step on, "
                                             "that many steps' batches are left out (manual recovery after a spike).")
    mixed_precision: Literal["no", "bf16", "fp16", "fp8"] = Field("no", description="Autocast precision (fp16/fp8 need a GPU).")
    tf32: bool = Field(False, description="Allow TF32 matmuls on CUDA.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward (non-reentrant).")
    offload_activations: bool = Field(False, description="GPU: keep the tensors saved for the backward (with gradient checkpointing, "
                                      "each layer's input) in pinned CPU memory, copied back as the backward needs them "
                                      "(torch.autograd.graph.save_on_cpu); for long rows whose activations outgrow the GPU.")
    router_aux_loss_coef: float | None = Field(None, ge=0, description="Mixture-of-experts models: weight of the router's load-balancing loss "
                                               "added to the training loss (null: the model config's router_aux_loss_coef; 0: off).")
    seed: int = Field(42, description="Seed for weights init, dropout and data order.")
    objective: Literal["sft", "dpo", "orpo", "cpo", "simpo", "kto", "reward", "grpo", "distill"] = Field(
        "sft", description="sft: cross-entropy on the answers; dpo, orpo, cpo or simpo: preference pairs (data.format: preference), "
        "settings under preference:. dpo holds the policy to a reference (the base); orpo, cpo and simpo need none. kto: unpaired examples "
        "labelled desirable or not (data.format: unpaired), held to the reference as dpo. reward: a reward model (a sequence-classification "
        "head scoring each sequence's last token) trained on preference pairs with the Bradley-Terry loss. grpo: online RL on "
        "prompts (data.format: prompt): completions sampled by the policy, scored by reward functions, settings under grpo:. distill: "
        "a teacher model's next-token distributions on the answers (sft's rows), settings under distill:.")
    overfit_batch: int = Field(0, ge=0, description="Sanity check: train this many steps on the first batch only (0 = off).")

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value):
        return "no" if value is False else value  # YAML reads an unquoted `no` as false

    @model_validator(mode="after")
    def _one_warmup(self) -> TrainConfig:
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("warmup_steps and warmup_ratio: set one of them")
        if self.min_lr_ratio and self.scheduler == "constant":
            raise ValueError("min_lr_ratio: a constant schedule does not decay; use cosine, linear or wsd")
        return self


class PreferenceConfig(_Section):
    beta: float = Field(0.1, gt=0, description="DPO's (and CPO's, SimPO's, KTO's) beta: how strongly the policy is held to the reference "
                        "(its rewards are beta x the log-probability ratios).")
    dpo_loss: Literal["sigmoid", "ipo", "hinge"] = Field("sigmoid", description="DPO's loss: sigmoid (the paper's), ipo (squared, on "
                                                          "per-token averages) or hinge (SLiC); as TRL computes them.")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo_loss sigmoid: the share of pairs assumed flipped (conservative DPO).")
    orpo_lambda: float = Field(0.1, gt=0, description="ORPO: weight of the odds-ratio term added to the chosen answers' cross-entropy "
                               "(TRL's beta).")
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO: the target margin between the chosen and rejected answers' average "
                               "log-probabilities, in units of beta (TRL's simpo_gamma).")
    kto_desirable_weight: float = Field(1.0, gt=0, description="KTO: weight of the desirable examples' losses (TRL's desirable_weight); "
                                        "with more undesirable than desirable examples, the KTO paper suggests their count ratio (to 4/3 of it).")
    kto_undesirable_weight: float = Field(1.0, gt=0, description="KTO: weight of the undesirable examples' losses (TRL's undesirable_weight).")
    center_rewards_coefficient: float | None = Field(None, ge=0, description="Reward models: weight of the mean squared sum of the pair's "
                                                     "rewards added to the loss, keeping rewards centred on 0 (TRL's; 0.01 in its docs); null: off.")
    cpo_alpha: float | None = Field(None, ge=0, description="CPO and SimPO: weight of the chosen answers' mean cross-entropy added to the "
                                    "preference loss (TRL's cpo_alpha). null: 1.0 for cpo (the paper's), 0 for simpo (plain SimPO).")


class ImportanceSamplingConfig(_Section):
    level: Literal["token", "sequence"] = Field("sequence", description="The weight per token (its own ratio), or per completion (the "
                                                "product of its tokens' ratios, at every token of it).")
    mode: Literal["truncate", "mask"] = Field("mask", description="A weight above cap: capped at cap (truncate), or 0 (mask: the token or "
                                              "completion leaves the loss).")
    cap: float = Field(3.0, gt=0, description="The largest weight kept (TRL's vllm_importance_sampling_clip_max).")


class GRPOConfig(_Section):
    rewards: list[str] | None = Field(None, description="Reward functions, summed (weighted; null: exact_match, or none beside "
                                      "grpo.environment's own reward): exact_match (1 where the "
                                      "completion, stripped, equals the row's answer), format (1 where it matches format_pattern whole), length "
                                      "(minus the share of max_completion_length used), reward_model:PATH (a reward model train.objective: reward "
                                      "saved: its score), or module:function / path/to/file.py:function, called as TRL calls them: f(prompts=, "
                                      "completions=, completion_ids=, **the rows' other columns) -> a float per completion.")
    reward_weights: list[float] | None = Field(None, description="A weight per reward function (null: 1 each).")
    format_pattern: str = Field(r"\S.*", description="The format reward's regular expression (Python re, matched against the whole completion, "
                                "DOTALL).")
    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (the group whose rewards are normalised).")
    max_completion_length: int = Field(64, gt=0, description="Tokens a completion may have (it ends earlier at the EOS token).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the completions.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens whose probabilities sum to this.")
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens (0: all).")
    beta: float = Field(0.0, ge=0, description="Weight of the KL term to the reference (the base with the adapter off; a frozen copy for full "
                        "fine-tuning); 0 (TRL's default) loads no reference and skips its forward.")
    epsilon: float = Field(0.2, gt=0, description="The policy ratio's clipping range below 1 (and above, unless epsilon_high).")
    epsilon_high: float | None = Field(None, gt=0, description="The clipping range above 1 (DAPO's clip-higher; null: epsilon).")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "cispo", "sapo"] = Field(
        "dapo", description="grpo: each completion's mean over its tokens, then the mean over completions; dr_grpo: the sum over tokens / "
        "(completions x max_completion_length); dapo (TRL's bnpo at one micro-batch): the mean over every completion token of the step; "
        "cispo (MiniMax-M1): the policy gradient weighted by the ratio capped at epsilon_high (no gradient through the weight), the "
        "mean over the step's completion tokens; sapo: a soft gate on the ratio, sigmoid(tau (ratio - 1)) x 4 / tau, tau "
        "sapo_temperatures' first for a positive advantage, else its second, averaged as grpo. As TRL 1.16's loss types of those names.")
    ratio: Literal["token", "sequence"] = Field("token", description="The policy ratio to the sampling policy per token (GRPO), or per "
                                                "completion, the geometric mean of its tokens' (sequence: GSPO, TRL's importance_sampling_level: "
                                                "sequence); the clipping and the KL's bias correction take it.")
    sapo_temperatures: tuple[float, float] = Field((1.0, 1.05), description="loss_type sapo's gate temperatures for positive and for other "
                                                   "advantages (TRL's sapo_temperature_pos and _neg).")
    scale_rewards: Literal["group", "none"] = Field("group", description="Advantages: a group's rewards less their mean, divided by their "
                                                    "standard deviation (group) or not (none: Dr. GRPO).")
    advantage: Literal["mean", "rloo", "reinforce_pp"] = Field("mean", description="The baseline a completion's reward is measured from: "
                                                               "its group's mean (GRPO), the mean of the group's other completions (rloo: "
                                                               "REINFORCE Leave-One-Out, Ahmadian et al. 2024, there with scale_rewards: "
                                                               "none), or its group's mean and then whitened over every completion token of "
                                                               "the step, on every process (reinforce_pp: REINFORCE++-baseline, as verl; "
                                                               "scale_rewards does not apply).")
    num_iterations: int = Field(1, ge=1, description="Policy updates per generation (GRPO's mu, TRL's num_iterations): each step's sampled "
                                "completions are trained on this many optimizer steps, the ratio to the log-probabilities they were sampled "
                                "with clipped by epsilon. Steps count updates: epochs x steps per epoch x num_iterations, and a run of "
                                "max_steps samples max_steps / num_iterations times.")
    kv_cache: Literal["dynamic", "static"] = Field("dynamic", description="The KV cache completions are sampled with: dynamic, or static "
                                                   "(on CUDA transformers compiles the decoding step: 2.3-3.3x dynamic's tokens/s for a 1.1B "
                                                   "model on an H200, bench/rollouts.py; not yet run through a GRPO run on a GPU). In bf16 the "
                                                   "two sample other completions, each repeatably.")
    async_rollouts: int = Field(0, ge=0, description="Sample the next k data steps' completions in a background thread while a step "
                                "trains (true: k = 1; 0 or false: in line), each by a copy of the policy as the step that began it (up to k "
                                "updates off-policy, a bounded staleness: the ratio to the log-probabilities they were sampled with is clipped "
                                "by epsilon, the importance-sampling correction). The first step samples in line, as does one whose data step "
                                "was not the one foreseen (a rollback skipped a window). LoRA copies the adapter, full fine-tuning the whole "
                                "model: one copy per sampling not yet finished, up to k. Not under fsdp or zero3 (sampling gathers their shards "
                                "with collectives).")
    importance_sampling: ImportanceSamplingConfig | None = Field(
        None, description="Correct the loss for the gap between the sampler's log-probabilities of the sampled tokens (generate with its KV "
        "cache, kept with each rollout) and the trainer's at the sampling weights: each token's policy loss times exp(trainer - "
        "sampler), per token or per completion, capped or masked above cap (TRL's vllm_importance_sampling_correction, whose "
        "defaults level sequence, mode mask, cap 3.0 are these; null: off). The gap is logged either way (mismatch_kl, mismatch_max). "
        "Single-turn GRPO (not grpo.environment's episodes).")
    shared_prompts: bool = Field(True, description="Write each group's prompt once in its training row, every completion reading it "
                                 "(attention.sample_prefixes): the prompt's tokens computed once a step, not num_generations times. "
                                 "Where a model cannot read a shared prompt (attention with sinks, linear-attention or state-space layers, "
                                 "eager attention), with router_replay, pictures or an environment's episodes, and on GPUs until "
                                 "the varlen kernel's handling of such rows is checked there: a copy of it a completion.")
    router_replay: bool = Field(False, description="Mixture-of-experts policies: record the experts each token was routed to while "
                                "the sampler ran it, and route the training forwards' tokens to the same experts (their gate weights from "
                                "the trainer's own router logits, so the router still learns), as Megatron-LM's and verl's router replay. "
                                "Logged: routing_mismatch, the share of (token, layer) choices the trainer's router would have made "
                                "otherwise. Refused on a dense model; single-turn GRPO, sampled in line with the dynamic KV cache.")
    environment: str | None = Field(None, description="Agentic GRPO: an environment class, path/to/file.py:Class or module:Class, built from "
                                    "each prompt row; each completion is then an episode of up to max_turns assistant turns, tool calls run "
                                    "and answered, the environment's reward added to the reward functions' (docs/agents.md).")
    max_turns: int = Field(4, gt=0, description="Environment episodes: assistant turns at most (each up to max_completion_length tokens).")
    max_episode_tokens: int = Field(1024, gt=0, description="Environment episodes: tokens at most (prompt, turns, tool and environment "
                                    "answers); an episode ends where its next turn would not fit.")
    tool_format: Literal["auto", "hermes", "llama3", "mistral"] = Field("auto", description="How the model writes tool calls: hermes "
                                                                         "(<tool_call> JSON: Qwen, Hermes, the built-in chatml), llama3 (a JSON "
                                                                         "object), mistral ([TOOL_CALLS]); auto reads the chat template.")
    tool_timeout: float = Field(10.0, gt=0, description="Seconds a tool call may take; past it the model is told it timed out.")
    episode_timeout: float = Field(60.0, gt=0, description="Seconds an episode may spend in its environment and tools; past it the episode ends.")


class DistillConfig(_Section):
    teacher: str | None = Field(None, description="train.objective distill: the teacher, a model folder, or an adapter folder (a finetune "
                                "run's output: merged into its base). Its tokenizer must be the student's, id by id, unless "
                                "distill.cross_tokenizer.")
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = Field("forward_kl", description="What is minimised on each trained token: "
                                                                 "forward_kl KL(teacher || student), reverse_kl KL(student || teacher), "
                                                                 "or jsd, the generalised Jensen-Shannon divergence of weight beta (TRL's "
                                                                 "GKD: beta 0 is forward_kl, 1 reverse_kl).")
    beta: float = Field(0.5, gt=0, lt=1, description="jsd: the teacher's weight in the mixture the two are compared with.")
    temperature: float = Field(1.0, gt=0, description="Both models' logits are divided by this before the divergence (softer "
                               "distributions above 1).")
    ce_weight: float = Field(0.0, ge=0, le=1, description="The loss is (1 - ce_weight) x the divergence + ce_weight x the cross-entropy "
                             "on the data's answer tokens (on-policy steps: the divergence alone, their tokens being the student's).")
    top_k: int = Field(0, ge=0, description="forward_kl: only the teacher's k most likely tokens at each position (its probabilities "
                       "renormalised over them); 0: the whole vocabulary.")
    lmbda: float = Field(0.0, ge=0, le=1, description="On-policy distillation (GKD's lambda): the share of steps whose answers the student "
                         "samples itself for the data's prompts (at distill.temperature), the teacher then judging every token; 1: "
                         "every step, 0: the data's answers only. Which steps is a function of train.seed and the step.")
    max_new_tokens: int = Field(64, gt=0, description="On-policy steps and distill.sequence_level: tokens an answer may have (it ends "
                                "earlier at EOS).")
    sequence_level: bool = Field(False, description="Sequence-level distillation: before training, the teacher answers each training "
                                 "sample's prompt (greedy, up to distill.max_new_tokens), once per node, cached beside the tokenized data; "
                                 "its answers replace the data's (a chat's first answer, later turns dropped). ce_weight 1 then trains "
                                 "on them alone; below 1 the divergence is taken on them too. Eval keeps the data's answers.")
    cross_tokenizer: bool = Field(False, description="A teacher whose tokenizer differs from the student's (another family): each "
                                  "sample's text is tokenized by both, split into spans where their tokens end at the same character, "
                                  "and at each span's first trained token the two next-token distributions are compared sorted (ULD's "
                                  "distance, as TRL's GOLD; no map between the vocabularies), in place of distill.divergence. Off- and "
                                  "on-policy (lmbda); not with top_k, sequence_level or pictures.")
    teacher_quantization: QuantizationConfig | None = Field(None, description="Load the teacher quantized (as model.quantization: "
                                                            "4-bit NF4/FP4 or 8-bit through bitsandbytes; backend torchao, 4-bit NF4, "
                                                            "the one FSDP2 shards). Not under zero3.")


class EvalConfig(_Section):
    every: int = Field(0, ge=0, description="Eval loss every N optimizer steps (0 = only at the end).")
    on_start: bool = Field(True, description="Also evaluate before the first step: the curve's baseline, and the guard's start point "
                           "for the final eval loss (a run that ends worse than it started stops with exit 3).")
    max_batches: int | None = Field(None, gt=0, description="Cap on eval batches per evaluation.")
    generate_samples: int = Field(0, ge=0, description="Greedy-generate answers for this many eval prompts before and after training; "
                                  "report exact-match accuracy.")
    max_new_tokens: int = Field(48, gt=0, description="Token budget for those generations.")


class LoggingConfig(_Section):
    log_every: int = Field(1, gt=0, description="Write a metrics row every N optimizer steps.")
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Trackers (through accelerate); each gets the whole resolved config and the scalars of metrics.jsonl."
    )
    project: str = Field("finetune", description="The trackers' project (W&B project, MLflow experiment).")
    run_name: str | None = Field(None, description="The run's name in the trackers (null: the output folder's name).")
    entity: str | None = Field(None, description="W&B entity (team or user); null: your default.")
    tags: list[str] = Field([], description="Tags of the run in W&B and MLflow.")
    progress_bar: bool = Field(True, description="Show a progress bar on the main process.")
    plot: bool = Field(True, description="Write loss_curve.png at the end.")
    sample_ids: bool = Field(False, description="Write the ids of the samples every step trained (all processes', sorted) into its "
                             "metrics.jsonl row: proof of which data a resumed or elastic run used.")


class CheckpointConfig(_Section):
    save_every: int = Field(0, ge=0, description="Save a checkpoint every N optimizer steps (0 = none; the final output is always saved).")
    save_every_minutes: float = Field(0, ge=0, description="Also save when this many minutes have passed since the last save (0 = off).")
    allow_config_change: bool = Field(False, description="Resume even when settings that change the run (model, adapter, data, batch) "
                                      "differ from the checkpoint's.")
    max_restarts_without_progress: int = Field(3, ge=1, description="Refuse to start again after this many starts in a row resumed from the same checkpoint.")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints to keep; older ones are deleted once a newer one is complete.")
    async_save: bool | None = Field(None, description="Write checkpoints in the background (one process, ddp, fsdp): training waits only "
                                    "for a copy of the trained weights and optimizer state in host memory. null: on for adapters, off for full "
                                    "fine-tuning (whose copy costs ~12 bytes per parameter of host memory). ZeRO saves synchronously.")
    resume: str = Field("auto", description="auto: resume from the newest complete checkpoint in output_dir/checkpoints; never; or a checkpoint path.")

    @field_validator("resume")
    @classmethod
    def _resume_path_exists(cls, value: str, info: ValidationInfo) -> str:
        if value not in ("auto", "never") and not _paths_unchecked(info) and not Path(value).expanduser().is_dir():
            raise ValueError(f"expected auto, never or a checkpoint folder; no folder {value}")
        return value


class GuardConfig(_Section):
    enabled: bool = Field(True, description="Watch every step for non-finite losses, spikes and drift, and repair (skip, roll back, stop).")
    window: int = Field(50, gt=1, description="Steps of history for the spike statistics, the anomaly count and the drift test.")
    min_history: int = Field(20, gt=0, description="Healthy steps needed before anything but non-finite values is judged.")
    loss_spike_ratio: float = Field(3.0, gt=1, description="A spike: a loss this many times the recent median loss...")
    loss_spike_sigmas: float = Field(6.0, gt=0, description="...and this many robust deviations (1.4826 x median absolute deviation) above it.")
    grad_spike_ratio: float = Field(100.0, gt=1, description="A gradient norm this many times the recent median is a spike too (clipping bounds lesser ones).")
    drift: float = Field(0.1, ge=0, description="Roll back when the loss level (median of the last 10 steps) rises this fraction above its lowest "
                         "within the window, or ends the run that far above the run's best (0 = off)...")
    drift_sigmas: float = Field(6.0, gt=0, description="...and the rise is this many times the noise of a difference of two levels "
                                "(from the window's step-to-step "
                                "deviation), so that noisy small batches do not read as a drift.")
    min_rise: float | None = Field(None, ge=0, description="...and a spike or drift raises the loss by more than this (absolute). null: 0 for "
                                   "sft and orpo; for dpo the loss it starts at (ln 2 for sigmoid): its per-batch loss swings that much "
                                   "between pairs it already ranks well and a few it does not, without any divergence.")
    grad_collapse: float = Field(20.0, ge=0, description="Within the first `window` steps, stop when the gradient norm's level has fallen this many times "
                                 "more than the loss has (both from step 1): Adam pushed the weights into a flat, saturated region, the mark of a "
                                 "learning rate too high from the start (healthy runs measured: at most 3.4). 0 = off.")
    max_kl: float | None = Field(None, gt=0, description="GRPO with grpo.beta > 0: a step whose mean KL to the reference is above this is a "
                                 "divergence, rolled back (LR lowered) to the last step whose KL was at most half of it; null: the KL is "
                                 "not judged.")
    skips_before_rollback: int = Field(3, gt=0, description="Skipped steps within the window that trigger a rollback.")
    lr_backoff: float = Field(0.5, gt=0, le=1, description="LR multiplier applied at each rollback.")
    clip_after_rollback: float | None = Field(None, gt=0, description="Gradient clipping after a rollback (OPT went from 1.0 to 0.3); "
                                              "null keeps train.max_grad_norm.")
    max_rollbacks: int = Field(3, ge=0, description="Rollbacks before the run stops with a message.")


class WatchdogConfig(_Section):
    factor: float = Field(20.0, gt=1, description="A step or checkpoint save taking this many times the median recent step is hung.")
    min_seconds: float = Field(600.0, gt=0, description="...and at least this many seconds (evals are not timed: distributed.collective_timeout bounds them).")
    enabled: bool = Field(True, description="Dump every thread's stack and exit with code 4 when a step or save hangs (a stuck collective, a dead peer).")


class DistributedConfig(_Section):
    strategy: StrategyName = Field(
        "ddp", description="none (one process only), or with several processes: ddp (replicas, accelerate), fsdp (torch FSDP2 fully_shard per decoder layer), "
        "zero2 / zero3 (DeepSpeed ZeRO: optimizer+gradients / also parameters sharded), zero3_offload (ZeRO-3 with parameters and optimizer in CPU RAM)."
    )
    fsdp_reshard_after_forward: bool = Field(True, description="FSDP: free gathered weights after forward (full shard); "
                                             "false keeps them (less communication, more memory).")
    fsdp_shard_size: int | None = Field(None, gt=0, description="FSDP: processes that share one sharded copy (default: all). "
                                        "Set it to the GPUs per node for hybrid sharding (HSDP): shard within a node, replicate across nodes.")
    fsdp_cpu_offload: bool = Field(False, description="FSDP: keep sharded parameters, gradients and optimizer states in CPU RAM (GPU runs).")
    sequence_parallel: int = Field(1, ge=1, description="Split every row's tokens over this many processes (DeepSpeed's Ulysses attention: "
                                   "an all-to-all over the heads around each attention); the data is spread over world / N groups. It must "
                                   "divide the process count and the model's attention and key/value heads; sft only.")
    tensor_parallel: int = Field(1, ge=1, description="Split each decoder layer's weights over this many processes (transformers' own "
                                 "tensor-parallel plan of the family on torch's DTensor: attention heads and MLP columns), FSDP2 sharding "
                                 "over the rest on a 2-D mesh; those processes see the same rows. fsdp, sft, LoRA or full fine-tuning "
                                 "of a 16/32-bit dense model; it must divide the process count and the model's heads.")
    expert_parallel: int = Field(1, ge=1, description="Split each mixture-of-experts layer's frozen base experts over this many "
                                 "processes (consecutive ranks): each holds num_experts / N of them and computes the routed tokens sent to it "
                                 "(all-to-all), the experts' LoRA whole on every process. ddp (4-bit or 8-bit experts too) or fsdp (16-bit: "
                                 "FSDP2 shards the rest), sft, LoRA; it must divide the process count and the experts.")
    collective_timeout: float = Field(1800.0, gt=0, description="Seconds a collective (gloo's or NCCL's) waits for the other processes "
                                      "before it fails the run (torch's process-group timeout). A stuck step usually meets the hang "
                                      "watchdog first (watchdog.min_seconds); keep this above it, and above the longest save or eval.")
    elastic_batch: Literal["fixed", "flexible"] = Field(
        "fixed", description="A run resumed at another process count (an elastic job that lost or regained a node) keeps its global batch: "
        "train.grad_accum is re-derived so that micro x accum x processes is the checkpoint's. fixed: where no accumulation gives that batch, "
        "the run refuses in one line (an elastic job launched by launch/multi_node.sh waits for its nodes instead); flexible: it goes on "
        "with the nearest batch, said in events.jsonl (the steps then cover other samples than an unchanged run's).")
    elastic_wait: float = Field(1800.0, gt=0, description="Seconds an elastic job that cannot keep its global batch at its size waits for "
                                "nodes to join (distributed.elastic_batch: fixed); past it the run stops in one line (exit 2).")

    @property
    def row_group(self) -> int:
        """The processes that share each row: sequence_parallel's (a slice each) or tensor_parallel's (a share of the weights each)."""
        return self.sequence_parallel * self.tensor_parallel


def _teacher_quantization_refused(q: QuantizationConfig, strategy: str) -> str | None:
    """Why distill.teacher_quantization cannot run under `strategy` (None: it can)."""
    if strategy == "zero3":
        return "distributed.strategy zero3 (its partitioned loading is not tested with a quantized frozen model)"
    if strategy == "fsdp" and q.chosen_backend != "torchao":
        return f"backend {q.chosen_backend} under distributed.strategy fsdp (torchao's NF4 is what FSDP2 shards)"
    if q.chosen_backend == "torchao" and (q.bits != 4 or q.quant_type != "nf4"):
        return "backend torchao with bits 8 or fp4 (it has 4-bit NF4)"
    return None


def _expert_parallel_refusal(cfg) -> None:
    """What distributed.expert_parallel does not run with (a ValueError naming it)."""
    d = cfg.distributed
    why = ("distributed.strategy ddp or fsdp (DeepSpeed would gather each split stack whole)" if d.strategy not in ("ddp", "fsdp")
           else "a 16-bit base under distributed.strategy fsdp (its 4-bit experts are sharded as they are quantized; under "
                "ddp they split)" if d.strategy == "fsdp" and cfg.model.quantization is not None
           else "distributed.tensor_parallel 1" if d.tensor_parallel > 1
           else f"train.objective sft (not {cfg.train.objective})" if cfg.train.objective != "sft"
           else "adapter.method lora (the base experts it splits are frozen)" if cfg.adapter.method != "lora"
           else "sequence_parallel 1" if d.sequence_parallel > 1
           else "eval.generate_samples 0 (the main process generates alone, and every process holds a part of the experts)"
           if cfg.eval.generate_samples else None)
    if why:
        raise ValueError(f"distributed.expert_parallel: {d.expert_parallel} runs with {why}; set it to 1, or change that")


def _tensor_parallel_refusal(cfg) -> None:
    """What distributed.tensor_parallel does not run with (a ValueError naming it)."""
    d, q = cfg.distributed, cfg.model.quantization
    why = ("distributed.strategy fsdp (FSDP2 shards over the data-parallel side of the mesh)" if d.strategy != "fsdp"
           else "sequence_parallel 1 (the two meshes are not composed yet)" if d.sequence_parallel > 1
           else f"train.objective sft (not {cfg.train.objective})" if cfg.train.objective != "sft"
           else "adapter.method lora or full" if cfg.adapter.method not in ("lora", "full")
           else "a 16/32-bit base (the plan shards plain weights, not quantized ones)" if q is not None
           else "no distributed.fsdp_shard_size (HSDP's replicas are another mesh dimension)" if d.fsdp_shard_size
           else "distributed.fsdp_cpu_offload false" if d.fsdp_cpu_offload
           else "adapter.modules_to_save empty" if cfg.adapter.modules_to_save else None)
    if why:
        raise ValueError(f"distributed.tensor_parallel: {d.tensor_parallel} runs with {why}; set it to 1, or change that")


class RunConfig(_Section):
    model: ModelConfig
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    data: DataConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)

    @property
    def runs_reference(self) -> bool:
        """Whether each step runs a reference's forward after the policy's: DPO, KTO and GRPO with a KL term (beta)."""
        return self.train.objective in ("dpo", "kto") or self.train.objective == "grpo" and bool(self.grpo.beta)

    @property
    def needs_reference(self) -> bool:
        """Whether the run holds a frozen copy of the base beside the policy: a reference (runs_reference) under full
        fine-tuning. With an adapter the reference is the base with the adapter off: no second model. The recipe
        builds it and the planner counts it from this one rule."""
        return self.runs_reference and self.adapter.method == "full"

    @field_validator("data")
    @classmethod
    def _data_files_exist(cls, data: DataConfig, info: ValidationInfo) -> DataConfig:
        for key in ("train", "eval") if not _paths_unchecked(info) else ():
            sources = _as_list(getattr(data, key))
            if key == "train" and not sources:
                raise ValueError("train: the list of training sources is empty")
            for source in sources:
                path = source.path if isinstance(source, SourceConfig) else source
                if looks_local(path) and not Path(path).exists():
                    raise ValueError(f"{key}: file not found: {path}")
        return data

    @model_validator(mode="after")
    def _quantization_backend(self) -> RunConfig:
        """Tell backend auto the strategy it picks by, and refuse what each backend cannot run."""
        q, strategy = self.model.quantization, self.distributed.strategy
        if q is None:
            return self
        q._strategy = strategy
        if q.chosen_backend == "bitsandbytes" and strategy == "fsdp":
            raise ValueError("model.quantization.backend: FSDP2 drops bitsandbytes' quantization state on CPU and shards no 4-bit base of "
                             "its; use backend: torchao (its NF4Tensor is sharded by FSDP2) or distributed.strategy zero3 or ddp")
        if q.chosen_backend == "torchao":
            why = ("bits: 4" if q.bits != 4 else "quant_type: nf4" if q.quant_type != "nf4" else "adapter.method: lora"
                   if self.adapter.method != "lora" else "adapter.init other than loftq" if self.adapter.init == "loftq"
                   else "distributed.strategy none, ddp or fsdp" if strategy.startswith("zero") else None)
            if why:
                raise ValueError(f"model.quantization.backend: torchao quantizes 4-bit NF4 bases trained with LoRA, in one process or under "
                                 f"ddp or fsdp; it needs {why} (backend: bitsandbytes runs the others)")
        return self

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        if self.data.eval is not None and self.data.eval_fraction > 0:
            raise ValueError("data: set either data.eval or data.eval_fraction, not both")
        asked = Strategy.of(self.distributed.strategy)
        if self.model.tiled_mlp > 1 and self.model.compile:
            raise ValueError("model.tiled_mlp: its MLPs run through an autograd function of DeepSpeed's that model.compile is not supported "
                             "with yet; set one of them off")
        if self.distributed.sequence_parallel > 1 and self.train.objective != "sft":
            raise ValueError(f"distributed.sequence_parallel: splits the rows of sft runs only, not {self.train.objective}'s pairs; set it to 1")
        strategy = asked.name
        if self.distributed.tensor_parallel > 1:
            _tensor_parallel_refusal(self)
        if self.distributed.expert_parallel > 1:
            _expert_parallel_refusal(self)
        if asked.shards_weights and self.eval.generate_samples:
            raise ValueError(f"eval.generate_samples: not available with distributed.strategy {strategy} (the parameters are sharded); set it to 0")
        if asked.shards_states and self.train.mixed_precision in ("fp16", "fp8"):
            raise ValueError(f"train.mixed_precision: {strategy} runs no/bf16 here (fp16 would need a sharded grad scaler); use bf16")
        q = self.model.quantization
        if asked.deepspeed and q is not None and q.bits == 8:
            raise ValueError(f"model.quantization: an 8-bit base is not supported under {strategy}; use bits: 4 (QLoRA) or distributed.strategy: ddp")
        if asked.deepspeed and self.train.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"train.optimizer: {self.train.optimizer} is not tested under DeepSpeed ZeRO; use adamw or sgd")
        if strategy == "fsdp" and self.train.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"train.optimizer: {self.train.optimizer} (bitsandbytes') steps plain tensors, not FSDP2's sharded ones; use adamw or sgd "
                             "(each process holds only its shard of the states)")
        if self.adapter.init in MUTATED_INITS:
            why = ("adapter.method lora" if self.adapter.method != "lora" else "a quantized base" if q is not None
                   else f"distributed.strategy {strategy}" if not asked.replicated else None)
            if why:
                raise ValueError(f"adapter.init: {self.adapter.init} moves part of each weight into the adapter; it runs with adapter.method: lora "
                                 f"on an unquantized base in one process or under ddp (not with {why})")
        formats = {(None if isinstance(s, str) else s.format) or self.data.format for s in _as_list(self.data.train)}
        if self.train.objective not in ("sft", "distill") and self.data.train_on_prompt:
            raise ValueError(f"data.train_on_prompt: {self.train.objective} takes its loss on the answers only; set it to false")
        wanted = {"sft": None, "distill": None, "grpo": "prompt", "kto": "unpaired"}.get(self.train.objective, "preference")
        if wanted is None and formats & {"preference", "prompt", "unpaired"}:
            raise ValueError("train.objective: sft trains on answers; set train.objective: dpo, orpo, cpo or simpo for data.format: preference, "
                             "kto for data.format: unpaired, grpo for data.format: prompt")
        if wanted is not None and formats != {wanted}:
            raise ValueError(f"train.objective: {self.train.objective} trains on " + {
                "preference": "preference pairs: set data.format: preference", "prompt": "prompts: set data.format: prompt ({prompt, answer?, ...} rows)",
                "unpaired": "unpaired examples: set data.format: unpaired ({prompt, completion, label} rows)"}[wanted])
        g = self.grpo
        if g.rewards is None:
            g.rewards = [] if g.environment else ["exact_match"]
        if g.reward_weights is not None and len(g.reward_weights) != len(g.rewards):
            raise ValueError(f"grpo.reward_weights: {len(g.reward_weights)} weights for {len(g.rewards)} reward functions; give one each")
        if g.kv_cache == "static" and asked.shards_weights:
            raise ValueError(f"grpo.kv_cache: static compiles the decoding step, which sharded weights (distributed.strategy {strategy}) "
                             "gather in each forward; use dynamic")
        if g.async_rollouts and asked.shards_weights:
            raise ValueError(f"grpo.async_rollouts: sampling in the background would gather distributed.strategy {strategy}'s sharded "
                             "weights with collectives racing the step's; use ddp or zero2, or set async_rollouts: false")
        if g.async_rollouts and g.advantage == "reinforce_pp":
            raise ValueError("grpo.advantage: reinforce_pp whitens over the whole step's completions on every process, which the background "
                             "sampler (grpo.async_rollouts) cannot gather; use mean or rloo with it")
        if g.async_rollouts and self.train.objective != "grpo":
            raise ValueError(f"grpo.async_rollouts: samples GRPO's completions; set train.objective: grpo (not {self.train.objective})")
        if not g.rewards and not g.environment:
            raise ValueError("grpo.rewards: no reward function, and no grpo.environment to score the episodes; name at least one")
        if self.guard.max_kl and (self.train.objective != "grpo" or not g.beta):
            raise ValueError("guard.max_kl: the KL to the reference is measured by GRPO with grpo.beta > 0 "
                             f"(here train.objective {self.train.objective}, grpo.beta {g.beta:g}); set both, or drop guard.max_kl")
        if g.environment and self.train.objective != "grpo":
            raise ValueError(f"grpo.environment: environments run GRPO episodes; set train.objective: grpo (not {self.train.objective})")
        if g.router_replay and (g.environment or g.async_rollouts or g.kv_cache == "static" or self.train.objective != "grpo"):
            why = ("an environment's episodes come from several generate calls" if g.environment else "the background sampler's copy of "
                   "the policy keeps its own routes" if g.async_rollouts else "the static cache compiles the decoding step it records in"
                   if g.kv_cache == "static" else f"it replays GRPO's sampling, not train.objective {self.train.objective}'s")
            raise ValueError(f"grpo.router_replay: {why}; set router_replay: false (or drop what it cannot run with)")
        if g.environment and g.importance_sampling is not None:
            raise ValueError("grpo.importance_sampling: an environment's episodes keep no sampler log-probabilities of their turns yet; "
                             "drop grpo.importance_sampling, or grpo.environment")
        d = self.distill
        if self.train.objective == "distill" and not d.teacher:
            raise ValueError("distill.teacher: train.objective distill needs a teacher model folder (or a finetune run's adapter folder)")
        if d.teacher_quantization is not None:
            d.teacher_quantization._strategy = strategy
            why = _teacher_quantization_refused(d.teacher_quantization, strategy)
            if why:
                raise ValueError(f"distill.teacher_quantization: a quantized teacher cannot run with {why}")
        if d.sequence_level and "completion" in formats:
            raise ValueError("distill.sequence_level: the teacher answers each sample's prompt; data.format completion has none "
                             "(use chat or alpaca rows)")
        if d.cross_tokenizer and (d.top_k or d.sequence_level or d.divergence != "forward_kl"):
            what = "distill.top_k" if d.top_k else "distill.sequence_level" if d.sequence_level else f"distill.divergence {d.divergence}"
            raise ValueError(f"distill.cross_tokenizer: compares the two models' sorted distributions (ULD), so {what} does not apply; "
                             "drop it, or distill.cross_tokenizer")
        if d.top_k and d.divergence != "forward_kl":
            raise ValueError(f"distill.top_k: the teacher's top k tokens bound forward_kl only ({d.divergence} weighs the student's "
                             "probabilities outside them too); set distill.divergence: forward_kl or distill.top_k: 0")
        if self.train.objective == "reward":
            why = ("model.quantization (quantized reward models are not supported yet)" if q is not None else
                   f"distributed.strategy {strategy} (the score head is not in the base's files it streams; use ddp or zero2)"
                   if asked.shards_weights else "eval.generate_samples (a reward model scores, it does not generate)"
                   if self.eval.generate_samples else None)
            if why:
                raise ValueError(f"train.objective: reward trains a sequence-classification head; it cannot run with {why}")
        if self.adapter.init == "loftq":
            why = ("adapter.method lora" if self.adapter.method != "lora" else "model.quantization bits: 4" if q is None or q.bits != 4
                   else f"not distributed.strategy {strategy}" if not asked.replicated else None)
            if why:
                raise ValueError(f"adapter.init: loftq fits LoRA to a 4-bit base's quantization error, in one process or under ddp; it needs {why}")
        if self.model.quantization is not None and self.adapter.method == "full":
            raise ValueError("model.quantization: quantized weights cannot be fully fine-tuned; use adapter.method lora or dora (QLoRA)")
        if self.train.mixed_precision == "fp16" and self.model.dtype == "bfloat16":
            raise ValueError("train.mixed_precision: fp16 autocast over bfloat16 weights; use bf16")
        return self


def _paths_unchecked(info: ValidationInfo) -> bool:
    """Paths in the config need not exist from here: a run's saved config read back (merge, generate;
    its paths were checked when it ran, relative to where it ran), or a plan (it reads the model alone)."""
    return bool(info.context and info.context.get("check_paths") is False)


def _as_list(value: str | list | None) -> list:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def looks_local(path: str) -> bool:
    """A data or model reference is a local path if it exists or looks like a file path rather than a hub id."""
    return Path(path).exists() or path.startswith((".", "/", "~")) or Path(path).suffix in {".jsonl", ".json", ".parquet", ".csv", ".txt", ".gz"}


def data_sources(value, data: DataConfig) -> list[SourceConfig]:
    """data.train or data.eval as sources, each with its format and bad-row policy filled in."""
    return [SourceConfig(path=s, format=data.format, bad_rows=data.bad_rows, columns=data.columns, split=data.split) if isinstance(s, str)
            else s.model_copy(update={"format": s.format or data.format, "bad_rows": s.bad_rows or data.bad_rows,
                                      "columns": data.columns if s.columns is None else s.columns, "split": s.split or data.split})
            for s in _as_list(value)]


# ----------------------------------------------------------------------------------------------
# Loading, overrides and errors


def validate_config(raw: dict, source: str, check_paths: bool = True) -> RunConfig:
    try:
        return RunConfig.model_validate(raw, context={"check_paths": check_paths})
    except ValidationError as err:
        raise UserError(f"{source}: {_describe(err)}") from None


def _describe(err: ValidationError) -> str:
    # With a union (a data source is a path or a {path, ...} mapping) pydantic reports every branch;
    # the deepest location is the branch the input was meant for.
    first = max(err.errors(), key=lambda e: len(e["loc"]))
    loc = ".".join(str(part) for part in first["loc"] if not (isinstance(part, str) and (_UNION_TAG.match(part) or part == "[key]")))
    kind, msg = first["type"], first["msg"]
    if kind == "extra_forbidden":
        return f"{loc}: unknown key"
    if kind == "missing":
        return f"{loc}: required key is missing"
    msg = msg.removeprefix("Value error, ")
    got = first.get("input")
    shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {json.dumps(got, default=str)})"
    return f"{loc}: {msg}{shown}" if loc else f"{msg}{shown}"


_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|tuple\[.*\]|[A-Z]\w*Config)$")  # a union branch's name in a location


def flatten(tree: dict, prefix: str = "") -> dict:
    """A config's nested sections as one level of dotted keys (`train.lr`)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat
