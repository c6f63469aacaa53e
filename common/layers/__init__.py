"""The model's building blocks the engine calls (ch03-04): paged attention
(PyTorch reference and Triton kernels) and the sampler."""
