"""Rows to batches: reading and checking rows (rows), chat templates (chat), pictures in rows (images), the tokenized cache on
disk (tokenized), packing without leaks between samples (packing), and the data step that mixes the
sources, splits off eval and places a step's batches (datasets).

May import: checkpoint (locks), config.
"""
