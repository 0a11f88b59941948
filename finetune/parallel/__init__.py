"""How a step spreads over processes: one engine per strategy, DDP, FSDP2 or ZeRO (engines), the
process group and sharded loading (distributed), sequence parallelism and the tiled MLP
(sequence_parallel), the process around a run (runtime), and the optimizer each engine builds (optim).

May import: model, data, checkpoint, config.
"""
