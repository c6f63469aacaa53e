"""Exercise 08: int8 weight-only quantization of one linear layer.

You write the two functions behind `--quantization int8`: one stores a
linear layer's float weight as 1-byte integers and one float scale per
output channel, the other multiplies activations by that stored weight.
The activations stay float; only the weights shrink, to about a quarter
of their float32 bytes.

    weight (N, K) float     N = out_features (rows), K = in_features
    w[n, k] ~= q[n, k] * scales[n]        q int8 in [-127, 127]

Symmetric: 0.0 is stored as exactly 0, and the row's largest |w| as
+-127. Per output channel: row n has its own scale, so a row of small
weights keeps its precision next to a row of large ones.

The engine plugs them in through the ops object it takes
(`assemble_engine(config, parts, quant_ops=...)`, see `quant_ops_for` in
common/worker/worker.py): every `QuantLinear` (common/layers/quantization.py)
calls `quantize_int8` once per weight when the model is quantized, and
`int8_linear` at every forward pass, for the q/k/v/o and gate/up/down
projections of each of the 30 decoder layers.

Graded by `make exercise CH=08` (the tests marked `ex08` in
tests/test_ch08_quantization.py, which call your functions: on random
weights built to expose the classic mistakes, on the embedded model's
own weights, then in the engine, where your two functions quantize every
linear layer of the embedded model and its greedy tokens must be the
course's own). exercises/README.md has the tasks and the hints; a
failing test names the hint to read first. Once every test passes,
compare your functions with `quantize_int8` and `int8_linear` in
common/layers/quantization.py.

Left out on purpose, although the course has them: int4 (groups of 32
along k with an offset: `quantize_int4`, `pack_int4`; its scales change
along k, so the weight is dequantized instead), and the fast kernels
(`CpuPackedQuantOps`, PyTorch's packed CPU ones, and the Triton ones of
common/layers/quant_kernels.py), which the server runs. int8 per
channel is the one scheme whose scale leaves the sum; the kernels make
the same product fast. Given: `QuantLinear`, `quantize_linears` and the
ops interface the engine calls. Left out of both: activation
quantization (W8A8).
"""
from __future__ import annotations

import torch


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8, one scale per output channel (row).

    weight:  (N, K) float32 or bfloat16 (the model's dtype); not changed.
    returns: qweight (N, K) torch.int8, every value in [-127, 127];
             scales  (N,) torch.float32, with
             weight[n, k] ~= qweight[n, k] * scales[n] to within half a
             step: |qweight[n, k] * scales[n] - weight[n, k]| <= scales[n] / 2.

    The row's largest |weight| must land on +-127 (scales[n] is that
    absolute maximum over 127). A row of zeros is legal (a pruned
    channel): its qweight is 0 and its scale a tiny positive number,
    never 0 and never NaN.
    """
    # Stuck? exercises/README.md, hints 1 to 4.
    raise NotImplementedError("quantize_int8: return (qweight int8 (N, K), scales float32 (N,)), "
                              "symmetric, one scale per output row")


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """What nn.Linear computes, with the weight stored as `quantize_int8` left it.

    x:       (M, K) activations, float32 or bfloat16 (M: the step's tokens)
    qweight: (N, K) int8
    scales:  (N,) float32
    bias:    (N,) or None (Llama has none; Qwen2's q/k/v projections do)
    returns: (M, N) in x's dtype:
             x @ (qweight * scales[:, None]).T + bias

    Without building the float weight `qweight * scales[:, None]` (N, K):
    look at the sum behind one output, y[m, n] = sum_k x[m, k] q[n, k] s[n],
    and at what depends on k.
    """
    # Stuck? exercises/README.md, hints 5 and 6.
    raise NotImplementedError("int8_linear: return x @ (qweight * scales[:, None]).T + bias, "
                              "(M, N) in x's dtype")
