"""What a step minimises and how it is scored: the token loss (loss), SFT, preference, KTO and reward-model
objectives (objective), GRPO and its rewards (grpo, rewards, score), evaluation (evaluate), and the
table that picks one for a config (table).

May import: parallel, model, data, checkpoint, config.
"""
