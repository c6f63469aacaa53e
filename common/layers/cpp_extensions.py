"""Our C++ kernels for the CPU (ch04-05), compiled on first use.

Each is one file in common/layers/csrc/ that PyTorch compiles into a Python
module (torch.utils.cpp_extension.load: g++ and PyTorch's headers, about
30 s a file on two cores) and caches in this checkout's
.cache/torch_extensions/ (git ignores it), so later processes only load
it, and two checkouts never rebuild over each other. `make setup` builds
them all once.

A build killed halfway (Ctrl-C at a server's first start) would leave
torch's lock file behind, and every later start would wait on it
forever. So a build holds an OS file lock of its own (`fcntl.flock`, let
go by the kernel when its process dies, however it dies); whoever holds
it is the only builder, and removes a lock file that a dead build left.

- paged_attention_cpu: decode attention reading the paged cache in place
  (common/layers/cpu_attention.py);
- prefill_attention_cpu: prefill attention over query tiles, reading the
  paged cache in place (the same module);
- fused_ops_cpu: RMSNorm with the residual add, the rotary embedding
  (common/layers/elementwise.py).

Left out: building ahead of time as a wheel (vLLM's setup.py does), other
architectures' flags.
"""
from __future__ import annotations

import fcntl
import functools
import logging
import os
import shutil
import sysconfig
from pathlib import Path

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
BUILD_ROOT = Path(__file__).resolve().parents[2] / ".cache" / "torch_extensions"
# -O3 -march=native: this CPU's vector instructions; -fopenmp: at::parallel_for
# spreads the rows over torch's intra-op threads.
COMMON_FLAGS = ("-O3", "-march=native", "-fopenmp")
FLAGS = {
    # -ffast-math (compile only, not at link): the float sums over head_dim
    # may be reordered, and exp vectorized.
    "paged_attention_cpu": COMMON_FLAGS + ("-ffast-math",),
    "prefill_attention_cpu": COMMON_FLAGS + ("-ffast-math", "-mprefer-vector-width=512"),
    # -ffp-contract=off: no fused multiply-add, PyTorch's roundings exactly.
    "fused_ops_cpu": COMMON_FLAGS + ("-ffp-contract=off",),
}


def ninja_on_path() -> None:
    """torch.utils.cpp_extension runs `ninja` from PATH: where there is
    none, the one pip installed beside this Python (requirements.txt) is put
    first on PATH, as activating the venv would."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def build(name: str):
    """Compile (or load the cached) csrc/NAME.cpp; returns its Python module."""
    from torch.utils.cpp_extension import load
    ninja_on_path()
    build_dir = BUILD_ROOT / name
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "builder.flock", "w") as builder:
        fcntl.flock(builder, fcntl.LOCK_EX)  # one builder at a time; freed if it dies
        (build_dir / "lock").unlink(missing_ok=True)  # torch's, left by a killed build
        return load(name=f"course_{name}", sources=[str(CSRC / f"{name}.cpp")],
                    extra_cflags=list(FLAGS[name]), build_directory=str(build_dir),
                    verbose=False)


def build_all() -> list[str]:
    """Every extension (`make setup`); returns where they are."""
    return [build(name).__file__ for name in FLAGS]


def kernels_or_reference(build_kernels, kernels: type, reference: type, what: str) -> type:
    """`kernels` where `build_kernels()` succeeds; else `reference`, with a
    warning that says why (no compiler, no headers...)."""
    try:
        build_kernels()
    except Exception as exc:  # noqa: BLE001 - whatever stops the build, the reference runs
        text = str(exc).strip()  # the compiler's output, then the error on the last line
        log.warning("%s: the PyTorch reference (the C++ kernels did not build: %s)", what,
                    text.splitlines()[-1] if text else type(exc).__name__)
        return reference
    return kernels
