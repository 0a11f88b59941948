"""One benchmark run of a peer trainer: Hugging Face `Trainer` + peft LoRA, or TRL's `SFTTrainer`.

Started by bench/compare.py as a fresh process. Trains one epoch over the harness's pre-tokenized
samples (identical token ids and labels to what finetune trains on), saves the adapter, and writes
the wall-clock time and real-token count of every optimizer step to --result.

    python bench/peer.py --trainer hf --precision bf16 --collator flatten --work DIR --result FILE
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", choices=["hf", "trl"], required=True)
    p.add_argument("--precision", choices=["fp32", "bf16"], required=True,
                   help="fp32 weights; or bf16 weights + bf16 autocast (TrainingArguments.bf16)")
    p.add_argument("--collator", choices=["padded", "flatten"], required=True,
                   help="pad each batch to its longest sample, or flatten the batch into one padding-free row")
    p.add_argument("--work", required=True, help="the harness's folder: model/, tokens.jsonl, settings.json")
    p.add_argument("--out", required=True, help="where the adapter is saved")
    p.add_argument("--result", required=True)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args()

    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    settings = json.loads(open(f"{args.work}/settings.json").read())
    rows = [json.loads(line) for line in open(f"{args.work}/tokens.jsonl")]
    tokenizer = AutoTokenizer.from_pretrained(f"{args.work}/model")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(f"{args.work}/model", dtype=dtype, attn_implementation="sdpa")
    lora = LoraConfig(task_type="CAUSAL_LM", r=settings["lora_r"], lora_alpha=settings["lora_alpha"], lora_dropout=0.0,
                      target_modules="all-linear")
    real_tokens = [0]  # counted as the collator builds each batch: padding excluded

    class Timing(TrainerCallback):
        def __init__(self):
            self.steps: list[dict] = []

        def on_train_begin(self, *_args, **_kwargs):
            if args.device == "cuda":  # the peak of training, as finetune reports it (loading excluded)
                torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, _args, state, _control, **_kwargs):
            self.steps.append({"step": state.global_step, "time": time.time(), "tokens": real_tokens[0]})

    common = dict(
        output_dir=args.out, per_device_train_batch_size=settings["peer_micro_batch"], gradient_accumulation_steps=settings["peer_grad_accum"],
        num_train_epochs=1, learning_rate=settings["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, optim="adamw_torch", logging_steps=1, save_strategy="no", report_to="none", use_cpu=args.device == "cpu",
        bf16=args.precision != "fp32", seed=settings["seed"], data_seed=settings["seed"], disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if args.trainer == "hf":
        from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, Trainer, TrainingArguments

        collate = (DataCollatorWithFlattening() if args.collator == "flatten"
                   else DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100))
        trainer_cls, training_args, extra = Trainer, TrainingArguments(**common, remove_unused_columns=False), {}
        model = get_peft_model(model, lora)
    else:
        from trl import SFTConfig, SFTTrainer

        # TRL's documented settings for SFT: the loss on completions only, and padding-free batches.
        flat = args.collator == "flatten"
        collate = None  # SFTTrainer builds its own (and refuses a custom one when padding-free)
        trainer_cls = SFTTrainer
        # The samples come truncated to max_seq_len already (TRL refuses max_length with padding-free and no packing).
        training_args = SFTConfig(**common, max_length=None if flat else settings["max_seq_len"], padding_free=flat, packing=False,
                                  completion_only_loss=True, dataset_num_proc=None)
        extra = {"peft_config": lora, "processing_class": tokenizer}

    dataset = Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    timing = Timing()
    trainer = trainer_cls(model=model, args=training_args, train_dataset=dataset, data_collator=collate, callbacks=[timing], **extra)
    collate = trainer.data_collator

    def counting_collator(features):
        real_tokens[0] += sum(len(f["input_ids"]) for f in features)
        return collate(features)

    trainer.data_collator = counting_collator  # read when train() builds its dataloader
    trainer.train()
    trainer.model.save_pretrained(args.out)
    with open(args.result, "w") as fh:
        gpu = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else None
        json.dump({"steps": timing.steps, "peak_gpu_mib": gpu}, fh)


if __name__ == "__main__":
    main()
