"""Which attention operations run on a device (ch04), as vLLM's
`vllm/attention/selector.py` picks an attention backend.

- CUDA: the Triton kernels (common/layers/triton_kernels.py).
- CPU: decode attention in C++, reading the paged cache in place
  (common/layers/cpu_attention.py), with the PyTorch reference's store and
  prefill; the reference alone where the C++ kernel cannot be built.

Every set has the same three operations (common/layers/attention.py).
An exercise or a test passes its own instead (`attention_ops=`).

Left out: a switch to choose by hand (vLLM's VLLM_ATTENTION_BACKEND).
"""
from __future__ import annotations

import torch


def attention_ops_for(device: torch.device):
    """The attention operations for this device (see the module docstring)."""
    if device.type == "cuda":
        from common.layers import triton_kernels  # ch04: the same operations in Triton
        return triton_kernels
    from common.layers.cpu_attention import cpu_attention_ops  # ch04: decode in C++
    return cpu_attention_ops()
