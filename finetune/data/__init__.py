"""Rows to batches: what a valid row of each format is (rows), reading them from their sources (readers), turning
them into token ids with a loss mask (encoding), chat templates (chat), pictures in rows (images), the tokenized cache on
disk (tokenized), packing without leaks between samples (packing), and the data step that mixes the
sources, splits off eval and places a step's batches (datasets).

May import: checkpoint (locks), config.
"""
