"""The model being trained: loading it through transformers' Auto classes (loading), torchao's 4-bit base
that FSDP2 can shard (nf4), mixture-of-experts layers computed grouped (experts), staging its files in RAM
first (stage), its adapters (adapters), the packed-row attention kernels (attention) and the layers that carry
a state along the row run one packed sample at a time (mixers), what differs between model families (families),
vision-language models' processor and parts (vision), distillation's teacher (teacher), and small models
built from a config for the demo, tests and benchmarks (tiny).

May import: data, checkpoint, config.
"""
