"""Kernels of the sampling loop: ``greedy.greedy_token``, the greedy token from the tied output
layer without writing the logits (Mosaic GPU on Hopper, Triton on other GPUs; interpreted on a CPU)."""
