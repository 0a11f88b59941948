"""One run's state (state) and the recipe's parts that act on it: what it is built from (build), a step's
data (steps), resume, saves and rollbacks (recovery); and what watches a run: checks before it starts
(preflight), the divergence guard (guard), metrics and trackers (metrics), the watchdog and preemption
(supervise), elastic jobs (elastic).

May import: objectives, parallel, model, data, checkpoint, config.
"""
