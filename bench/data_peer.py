"""The peer of bench/data.py: what an HF user writes for the same job, timed.

load_dataset("json") -> map(tokenize, batched, num_proc) with the loss on the answer only ->
Trainer + peft LoRA with DataCollatorWithFlattening (padding-free), two optimizer steps. Writes the
data step's time, the wall-clock time at the end of the first step, rows and tokens to OUT/result.json.

    python bench/data_peer.py --model DIR --data FILE.jsonl --out DIR --num-proc 2 --max-len 4096 --batch 30
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1, help="samples a step (flattened into one row)")
    args = p.parse_args()

    from datasets import load_dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def tokenize(batch):
        # The prompt through the chat template, the answer after it: labels only on the answer.
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": i + (f"\n\n{x}" if x else "")}], tokenize=False,
                                                 add_generation_prompt=True) for i, x in zip(batch["instruction"], batch["input"])]
        prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer([o + tokenizer.eos_token for o in batch["output"]], add_special_tokens=False)["input_ids"]
        ids = [(p + a)[: args.max_len] for p, a in zip(prompt_ids, answer_ids)]
        labels = [([-100] * len(p) + a)[: args.max_len] for p, a in zip(prompt_ids, answer_ids)]
        return {"input_ids": ids, "labels": labels}

    started = time.perf_counter()
    raw = load_dataset("json", data_files=args.data, split="train")
    data = raw.map(tokenize, batched=True, num_proc=args.num_proc, remove_columns=raw.column_names, desc="tokenizing")
    data_s = time.perf_counter() - started
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(args.model),
                           LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
    first = {}

    class Timing(TrainerCallback):
        def on_step_end(self, _args, state, _control, **_kwargs):
            first.setdefault("time", time.time())

    training = TrainingArguments(output_dir=args.out, per_device_train_batch_size=args.batch, max_steps=2, learning_rate=2e-4, logging_steps=1,
                                 save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, remove_unused_columns=False)
    Trainer(model=model, args=training, train_dataset=data, data_collator=DataCollatorWithFlattening(), callbacks=[Timing()]).train()
    import pyarrow.compute as pc

    tokens = int(pc.sum(pc.list_value_length(data.data.table.column("input_ids"))).as_py())  # after the timed part
    with open(f"{args.out}/result.json", "w") as fh:
        json.dump({"data_s": data_s, "first_step_time": first["time"], "rows": len(data), "tokens": tokens}, fh)


if __name__ == "__main__":
    main()
