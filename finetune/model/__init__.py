"""The model being trained: loading it through transformers' Auto classes (loading), torchao's 4-bit base
that FSDP2 can shard (nf4), staging its files in RAM first (stage), its adapters (adapters), the
packed-row attention kernels (attention), what differs between model families (families), and vision-language models' processor and parts (vision).

May import: data, checkpoint, config.
"""
