"""The building blocks our forward passes and the engine call (ch03-06):
paged attention (PyTorch reference and Triton kernels, ch03-04), the
sampler, the LM head, the pieces of tensor parallelism and the quantized
linear layers (ch06). No layer knows a model's family (common/models/
says which matrix is cut or quantized) or the engine."""
