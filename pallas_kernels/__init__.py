"""Pallas kernels, one package per operation, each with a pure-JAX reference beside it.

- ``rg_lru``: the linear scan and the fused RG-LRU layer (Mosaic TPU, Triton and Mosaic GPU).
- ``gla``: chunkwise Gated Linear Attention (Mosaic TPU, Triton GPU).
- ``gates``: the RG-LRU's block-diagonal gate matmuls (Triton GPU).
- ``mlp``: the gated MLP's GeLU gating with a one-pass backward (Triton GPU).
- ``conv1d``: the recurrent block's causal Conv1D with a one-pass backward (Triton GPU).
- ``norm``: a pre-norm block's RMSNorm with a one-pass backward that adds the skip's gradient
  (Triton GPU).
- ``loss``: the training loss's cross-entropy with a one-pass log-sum-exp (Triton GPU).
- ``sampling``: greedy decoding's output layer and argmax in one kernel that never writes the
  logits (Triton GPU).
- ``attention``: splash attention on TPU; MQA's decode attention on Hopper's tensor cores
  (Mosaic GPU).
- ``dispatch``: which kernel runs on which platform (the platform compiled for, not the host).
"""

from pallas_kernels.gla import chunk_gla, gla_recurrent_step, gla_reference
from pallas_kernels.rg_lru import (linear_scan, linear_scan_reference, rg_lru, rg_lru_reference,
                                   sequence_parallel_linear_scan)

__all__ = ["chunk_gla", "gla_recurrent_step", "gla_reference", "linear_scan",
           "linear_scan_reference", "rg_lru", "rg_lru_reference",
           "sequence_parallel_linear_scan"]
