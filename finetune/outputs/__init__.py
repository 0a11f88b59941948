"""What a run leaves and what a user asks of it: the run's own saved model, summary and card (finish),
merged models (merge), GGUF files (export, gguf_vocab), generation (generate), the eval harness
(harness), model cards (model_card), the serving check (serving), the memory planner (plan, on the
model's shape: shape) and its step time (steptime), and rank 0's step simulated on fake tensors (simulate).

May import: every layer below: run, objectives, parallel, model, data, checkpoint, config.
"""
