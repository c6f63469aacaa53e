"""Our C++ kernels for the CPU (ch04-05), compiled on first use.

Each is one file in common/layers/csrc/ that PyTorch compiles into a Python
module (torch.utils.cpp_extension.load: g++ and PyTorch's headers, about
30 s a file on two cores) and caches under ~/.cache/torch_extensions, so
later processes only load it. `make setup` builds them all once.

- paged_attention_cpu: decode attention reading the paged cache in place
  (common/layers/cpu_attention.py);
- fused_ops_cpu: RMSNorm with the residual add, the rotary embedding
  (common/layers/elementwise.py).

Left out: building ahead of time as a wheel (vLLM's setup.py does), other
architectures' flags.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import sysconfig
from pathlib import Path

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
# -O3 -march=native: this CPU's vector instructions; -fopenmp: at::parallel_for
# spreads the rows over torch's intra-op threads.
COMMON_FLAGS = ("-O3", "-march=native", "-fopenmp")
FLAGS = {
    # -ffast-math (compile only, not at link): the float sums over head_dim
    # may be reordered, and exp vectorized.
    "paged_attention_cpu": COMMON_FLAGS + ("-ffast-math",),
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
    return load(name=f"course_{name}", sources=[str(CSRC / f"{name}.cpp")],
                extra_cflags=list(FLAGS[name]), verbose=False)


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
