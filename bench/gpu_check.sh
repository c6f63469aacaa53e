#!/usr/bin/env bash
# The GPU check (bench/gpu/gpu_check.py), for a GPU machine that has torch,
# triton and transformers but not the web stack: install the wheels of .whl/
# (made here by `make gpu-wheels`) into /tmp/site, then run its five steps,
# each under 3 minutes and each writing its own file as it finishes.
#
#   bash bench/gpu_check.sh                        # files in $OUT, or bench/results/
#   bash bench/gpu_check.sh --steps graphs decode-kernel   # rerun some steps
#   bash bench/gpu_check.sh --rehearse             # without CUDA: what the CPU can run
set -uo pipefail
cd "$(dirname "$0")/.."
# The wheels are for the GPU machine's Python (3.12, as `make gpu-wheels` asks).
if compgen -G ".whl/*.whl" > /dev/null &&
   python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
# the embedded model's config and tokenizer (make gpu-wheels copies them; no weights)
[ -d .whl/llm-course-cache ] && export LLM_COURSE_CACHE="$PWD/.whl/llm-course-cache"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -m bench.gpu.gpu_check --out "${OUT:-bench/results}" "$@"
