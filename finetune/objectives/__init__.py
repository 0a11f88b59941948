"""What a step minimises and how it is scored: the token loss (loss), SFT, preference, KTO and reward-model
objectives (objective), sampling from the policy (sampling), GRPO, the agent's episodes and their rewards
(grpo, agent, tools, rewards, score), distillation (distill), evaluation (evaluate), and the registry that
picks one for a config (registry).

May import: parallel, model, data, checkpoint, config.
"""
