"""The card: how much memory the engine may use, and out-of-memory (ch02).

`--device-memory-gb N` plays a card of N GiB, and `--gpu-memory-utilization`
is the share of it the engine may fill (vLLM's meaning).

- On CUDA the cap is real: `torch.cuda.set_per_process_memory_fraction`, so
  an allocation past it fails inside PyTorch's allocator with CUDA's own
  `torch.OutOfMemoryError`.
- On the CPU there is no device memory, so an *accountant* keeps the books:
  every KV-cache allocation (and the weights) goes through `Card.allocate`
  or `Card.reserve`, and going past the budget raises
  `torch.OutOfMemoryError` with a message shaped like CUDA's that says the
  card is simulated.

With tensor parallelism (ch08) every rank has a card of its own, the same
size: N cards, each holding 1/N of the weights and of every KV block.

Left out: activations are estimated, not measured, on the CPU (PyTorch's CPU
allocator keeps no statistics); fragmentation inside the CUDA caching
allocator; cards of different sizes.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator

import torch

GiB = 1024 ** 3
MiB = 1024 ** 2


def kv_cache_shape(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a HF config (Llama or GPT-2 names)."""
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return layers, kv_heads, head_dim


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V that one token costs, over all layers.

    2 (K and V) x layers x kv_heads x head_dim x bytes per element.
    """
    layers, kv_heads, head_dim = kv_cache_shape(config)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * kv_heads * head_dim * element


def static_cache_bytes(config, dtype: torch.dtype, max_model_len: int) -> int:
    """What chapter 02 reserves for every request, whatever its length: a
    static cache of `max_model_len` tokens (the worst case)."""
    return kv_bytes_per_token(config, dtype) * max_model_len


def activation_bytes_estimate(config, num_tokens: int, dtype: torch.dtype,
                              tensor_parallel_size: int = 1) -> int:
    """A generous estimate of one forward pass's live activations.

    Per token: a few hidden-size vectors, the MLP's intermediate vectors and
    one row of logits; plus the attention scores of a square prefill.
    ch08: on one of N ranks, the MLP, the logits and the heads are 1/N.
    """
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    inter = getattr(config, "intermediate_size", None) or 4 * hidden
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    element = torch.empty((), dtype=dtype).element_size()
    n = tensor_parallel_size
    per_token = 8 * hidden + (3 * inter + config.vocab_size) // n
    return (num_tokens * per_token + heads // n * num_tokens * num_tokens) * element


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each tensor once (a tied
    LM head is the embedding; quantized weights are buffers, ch08)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def format_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.2f} MiB"


class Card:
    """The memory budget of one (possibly simulated) accelerator."""

    def __init__(self, device: torch.device, device_memory_gb: float | None = None,
                 gpu_memory_utilization: float = 0.9):
        self.device = device
        self.simulated = device.type != "cuda"
        self.utilization = gpu_memory_utilization
        self._lock = threading.Lock()
        self._allocated = 0  # accountant's books (CPU only)
        self._peak = 0
        if self.simulated:
            gb = device_memory_gb if device_memory_gb is not None else 2.0  # CPU default
            self.total_bytes = int(gb * GiB)
        else:
            real = torch.cuda.get_device_properties(device).total_memory
            self.total_bytes = int(device_memory_gb * GiB) if device_memory_gb else real
            if device_memory_gb:
                # Utilization is applied on top, as on a real card of that size.
                fraction = min(1.0, self.budget_bytes / real)
                index = device.index if device.index is not None else torch.cuda.current_device()
                torch.cuda.set_per_process_memory_fraction(fraction, index)

    # -- what the engine may use ------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return int(self.total_bytes * self.utilization)

    def allocated_bytes(self) -> int:
        if self.simulated:
            return self._allocated
        return torch.cuda.memory_allocated(self.device)

    def peak_bytes(self) -> int:
        if self.simulated:
            return self._peak
        return torch.cuda.max_memory_allocated(self.device)

    def free_bytes(self) -> int:
        return max(0, self.budget_bytes - self.allocated_bytes())

    def describe(self) -> str:
        kind = "simulated card (CPU accountant)" if self.simulated else str(self.device)
        return (f"{kind}: {format_bytes(self.total_bytes)} total, engine budget "
                f"{format_bytes(self.budget_bytes)} "
                f"({self.utilization:.0%}), {format_bytes(self.allocated_bytes())} allocated")

    # -- the accountant ------------------------------------------------------
    def _out_of_memory(self, nbytes: int, what: str) -> torch.OutOfMemoryError:
        return torch.OutOfMemoryError(
            f"CUDA out of memory (simulated card: CPU accountant, no real GPU). "
            f"Tried to allocate {format_bytes(nbytes)} for {what}; "
            f"{format_bytes(self.budget_bytes)} total (the engine's "
            f"{self.utilization:.0%} of a {format_bytes(self.total_bytes)} card); "
            f"{format_bytes(self._allocated)} already allocated; "
            f"{format_bytes(self.free_bytes())} free.")

    def _charge(self, nbytes: int, what: str) -> None:
        with self._lock:
            if self._allocated + nbytes > self.budget_bytes:
                raise self._out_of_memory(nbytes, what)
            self._allocated += nbytes
            self._peak = max(self._peak, self._allocated)

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._allocated -= nbytes

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
        """torch.zeros on the card; on the CPU the bytes are returned to the
        budget when the tensor is garbage-collected."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if not self.simulated:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        self._charge(nbytes, what)
        tensor = torch.zeros(shape, dtype=dtype, device=self.device)
        weakref.finalize(tensor, self._release, nbytes)
        return tensor

    @contextlib.contextmanager
    def reserve(self, nbytes: int, what: str) -> Iterator[None]:
        """Hold `nbytes` of the budget for the duration of a `with` block.

        Used where a library allocates for us (HF's StaticCache in ch02): on
        CUDA the real allocation is capped anyway, so nothing is booked.
        """
        if not self.simulated:
            yield
            return
        self._charge(nbytes, what)
        try:
            yield
        finally:
            self._release(nbytes)

    def charge_weights(self, model: torch.nn.Module, packed_bytes: int = 0) -> int:
        """Book the model's weights against the card (they live there too),
        with `packed_bytes` of packed copies (ch05: common/layers/cpu_gemm.py)."""
        nbytes = weight_bytes(model) + packed_bytes
        if self.simulated:
            self._charge(nbytes, "model weights")
        return nbytes
