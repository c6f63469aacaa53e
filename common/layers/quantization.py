"""Weight-only quantization of the linear layers (ch08: `--quantization`).

A decode step reads every weight once to produce one token per sequence, so
its speed on a GPU is set by the bytes of the weights, and the bytes the
weights take on the card are bytes the KV cache cannot have. Quantization
stores each weight as a small integer and a few float scales:

- `int8` (`QuantScheme.INT8`): symmetric, one scale per output channel (row `n` of the weight):
  `w[n, k] ~= q[n, k] * scale[n]`, q in [-127, 127]. 1 byte per weight.
- `int4` (`QuantScheme.INT4`): asymmetric, one scale and one offset per *group* of 32 input
  channels: `w[n, k] ~= q[n, k] * scale[n, g] + min[n, g]`, g = k // 32, q in
  [0, 15], two values per byte, float16 scale and offset. 5 bits per weight.
  These are the group-wise scales and offsets of AWQ and GPTQ checkpoints,
  with the offset kept as a float, as in GGUF's Q4_1: the embedded model's
  linear weights *are* Q4_1 blocks of 32, so rounding them back to the
  nearest grid point gives exactly the values the publisher shipped.

Activations stay in the model's dtype; only the weights are small. Three
implementations, one interface (`QuantOps.quantize` stores a weight,
`QuantOps.linear` multiplies by it), as for attention:

1. `ReferenceQuantOps`: int8 multiplies by the integers and scales the
   outputs (`int8_linear`); int4 dequantizes to the activations' dtype,
   then `F.linear`. Readable, and the definition the others are tested against.
2. `CpuPackedQuantOps`: PyTorch's packed CPU kernels
   (`torch._weight_int8pack_mm`, `torch._weight_int4pack_mm_for_cpu`, the
   ones torchao uses). Their fast path takes bfloat16 activations, so a
   float32 model's activations are rounded to bfloat16 for these matmuls
   (measured, with its quality cost, in bench/experiments/levers.py).
3. `common.layers.quant_kernels`: Triton kernels for CUDA that dequantize
   tiles of the weight in registers (tested on the CPU under the interpreter).

The scheme is a `QuantScheme` (a `StrEnum`: `QuantScheme("int8")` turns the
flag into it once, and it prints as the flag). `quantize_linears` swaps the
linear layers it is given (the model says
which: `quantizable_linears` in common/models/, the q/k/v/o and
gate/up/down projections of each decoder layer) for `QuantLinear` modules,
in place. The card then books the weights at their real size
(`Card.charge_weights` counts buffers too).

Left out: activation quantization (W8A8, FP8), AWQ's activation-aware scale
search and GPTQ's error correction (we round to the nearest grid point),
loading pre-quantized checkpoints, quantized embeddings and LM head (they
are tied in SmolLM2 and stay float), a quantized KV cache.
"""
from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
from torch import nn

GROUP_SIZE = 32  # input channels per int4 group (GGUF Q4_1's block)


class QuantScheme(enum.StrEnum):
    """`--quantization`: how a weight is stored (see above)."""
    INT8 = "int8"  # per output channel, 1 byte a weight
    INT4 = "int4"  # groups of 32 with a scale and an offset, 5 bits a weight


# ---------------------------------------------------------------- rounding
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: (N, K) -> q (N, K) int8, scales (N,) float32."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # (N,)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight: (N, K) -> q (N, K) uint8 in 0..15, scales and mins (N, K // group_size)
    float16. Each group's smallest weight maps to 0, its largest to 15."""
    num_out, num_in = weight.shape
    if num_in % group_size:
        raise ValueError(f"int4 needs in_features divisible by {group_size}, got {num_in}")
    groups = weight.float().view(num_out, num_in // group_size, group_size)
    mins = groups.amin(dim=-1).half()  # (N, G), rounded as they are stored
    scales = ((groups.amax(dim=-1) - mins.float()) / 15).clamp(min=1e-7).half()
    q = torch.round((groups - mins.float()[..., None]) / scales.float()[..., None])
    return q.clamp(0, 15).to(torch.uint8).view(num_out, num_in), scales, mins


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: (N, K) uint8 values 0..15 -> (N, K // 2) uint8, two per byte:
    byte j holds k = 2j in its low 4 bits and k = 2j + 1 in its high 4 bits."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K // 2) uint8 -> (N, K) uint8 values 0..15 (inverse of pack_int4)."""
    low, high = packed & 0xF, packed >> 4  # (N, K // 2) each
    return torch.stack((low, high), dim=-1).view(packed.shape[0], -1)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(N, K) int8, (N,) -> (N, K) float32."""
    return qweight.float() * scales.float()[:, None]


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: (M, K); qweight: (N, K) int8; scales: (N,); bias: (N,) or None
    -> (M, N) in x's dtype: `x @ (qweight * scales[:, None]).T + bias`,
    without the float weight. Row n has one scale, so it leaves the sum
    over k: y[m, n] = s[n] * sum_k x[m, k] q[n, k]. Multiply by the integers,
    then scale the (M, N) outputs, in float32 as a kernel's accumulator
    (float16 sums of q could overflow). PyTorch has no int8 x float matmul:
    `.float()` copies q whole, where a kernel converts a tile at a time."""
    acc = x.float() @ qweight.float().T  # (M, N): sums of x times integers
    out = (acc * scales.float()).to(x.dtype)  # (M, N) * (N,): column n times s[n]
    return out if bias is None else out + bias


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                    group_size: int = GROUP_SIZE) -> torch.Tensor:
    """(N, K // 2) packed, (N, G), (N, G) -> (N, K) float32: q * scale + min."""
    num_out, half = qweight.shape
    # byte j holds k = 2j and 2j + 1, both in group (2j) // group_size
    scale = scales.float().repeat_interleave(group_size // 2, dim=1)  # (N, K // 2)
    offset = mins.float().repeat_interleave(group_size // 2, dim=1)
    w = torch.empty(num_out, 2 * half, device=qweight.device)
    w[:, 0::2] = (qweight & 0xF).float() * scale + offset  # even k: low 4 bits
    w[:, 1::2] = (qweight >> 4).float() * scale + offset  # odd k: high 4 bits
    return w


# --------------------------------------------------------------- the ops
class ReferenceQuantOps:
    """int8: `int8_linear` (the integers, then the scales). int4: dequantize,
    then an ordinary matmul in the activations' dtype (its scales change
    along k, so they cannot leave the sum)."""
    name = "reference (int8: scales after the matmul; int4: dequantize + F.linear)"

    @staticmethod
    def quantize(weight: torch.Tensor, scheme: QuantScheme) -> dict[str, torch.Tensor]:
        """The tensors a QuantLinear keeps for `weight` (N, K)."""
        if scheme is QuantScheme.INT8:
            qweight, scales = quantize_int8(weight)
            return {"qweight": qweight, "scales": scales}
        q, scales, mins = quantize_int4(weight)
        return {"qweight": pack_int4(q), "scales": scales, "mins": mins}

    @staticmethod
    def linear(x: torch.Tensor, layer: "QuantLinear") -> torch.Tensor:
        """x: (M, K) -> (M, N)."""
        if layer.scheme is QuantScheme.INT8:
            return int8_linear(x, layer.qweight, layer.scales, layer.bias)
        w = dequantize_int4(layer.qweight, layer.scales, layer.mins)
        return F.linear(x, w.to(x.dtype), layer.bias)


class CpuPackedQuantOps:
    """PyTorch's packed int8/int4 CPU matmuls, bfloat16 activations."""
    name = "cpu packed (torch int8/int4 kernels, bfloat16 activations)"

    @staticmethod
    def quantize(weight: torch.Tensor, scheme: QuantScheme) -> dict[str, torch.Tensor]:
        if scheme is QuantScheme.INT8:
            qweight, scales = quantize_int8(weight)
            return {"qweight": qweight, "scales": scales.bfloat16()}
        q, scales, mins = quantize_int4(weight)
        # torch's int4 layout: its own packing, and per group (scale, zero)
        # with w = (q - 8) * scale + zero, so zero = min + 8 * scale.
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        scales32, mins32 = scales.float(), mins.float()
        scales_and_zeros = torch.stack((scales32.T, (mins32 + 8 * scales32).T), dim=-1)
        return {"qweight": packed,  # (N, K // 2) uint8
                "scales_and_zeros": scales_and_zeros.contiguous().bfloat16()}  # (G, N, 2)

    @staticmethod
    def linear(x: torch.Tensor, layer: "QuantLinear") -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if layer.scheme is QuantScheme.INT8:
            out = torch._weight_int8pack_mm(xb, layer.qweight, layer.scales)
        else:
            out = torch._weight_int4pack_mm_for_cpu(xb, layer.qweight, GROUP_SIZE,
                                                    layer.scales_and_zeros)
        out = out.to(x.dtype)
        return out if layer.bias is None else out + layer.bias


# ------------------------------------------------------------ the module
class QuantLinear(nn.Module):
    """A drop-in for nn.Linear whose weight is stored quantized (buffers)."""

    def __init__(self, linear: nn.Linear, scheme: QuantScheme | str, ops):
        super().__init__()
        try:
            self.scheme = QuantScheme(scheme)  # "int8" too (bench/gpu/gpu_kernels_check.py)
        except ValueError:
            raise ValueError(f"unknown quantization {scheme!r}: choose from "
                             f"{tuple(map(str, QuantScheme))}") from None
        self.ops = ops
        self.out_features, self.in_features = linear.weight.shape
        with torch.no_grad():
            for name, tensor in ops.quantize(linear.weight.data, self.scheme).items():
                self.register_buffer(name, tensor.to(linear.weight.device))
        self.bias = linear.bias  # Qwen2's q/k/v biases stay float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., K) -> (..., N), like nn.Linear."""
        flat = x.reshape(-1, self.in_features)  # (M, K)
        return self.ops.linear(flat, self).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.scheme}, {self.ops.name}"


def quantize_linears(model: nn.Module, paths: list[str], scheme: QuantScheme, ops) -> int:
    """Swap each linear layer at `paths` (as `model.get_submodule` reads
    them) for a QuantLinear, in place. Returns the number swapped."""
    for path in paths:
        parent_path, name = path.rsplit(".", 1)
        parent = model.get_submodule(parent_path)
        setattr(parent, name, QuantLinear(getattr(parent, name), scheme, ops))
    return len(paths)
