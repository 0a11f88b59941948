"""What a run is asked to do: the typed config schema (schema), config files found, read, overridden and
written (files), the reference of every key (reference), the errors that end a run with one clear line
(errors), what a distributed strategy means (strategy), and the faults tests inject (faults).

The bottom layer: it imports no other part of finetune, and no torch (`finetune validate` and the
planner read configs before anything heavy loads; `make lint` holds both).
"""
