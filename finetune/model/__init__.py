"""The model being trained: loading it through transformers' Auto classes (loading), staging its files in
RAM first (stage), its adapters (adapters), the packed-row attention kernels (attention), and what
differs between model families (families).

May import: data, checkpoint, config.
"""
