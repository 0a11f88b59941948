"""What watches a run: checks before it starts (preflight), the divergence guard (guard), metrics and
trackers (metrics), and the watchdog and preemption (supervise).

May import: objectives, parallel, model, data, checkpoint, config.
"""
