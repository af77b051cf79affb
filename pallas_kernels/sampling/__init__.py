"""Kernels of the sampling loop: ``greedy.greedy_token``, the greedy token from the tied output
layer without writing the logits (Triton GPU, or Mosaic GPU on request; interpreted on a CPU)."""
