"""Public entry points of the RG-LRU kernels (see docs/kernels.md, "RG-LRU linear scan").

- ``linear_scan(x, a, h0=None, *, reverse=False, interpret=False) -> (y, h_last)``
- ``rg_lru(x, gate_x_logits, gate_a_logits, a_param, reset=None, h0=None, *, interpret=False)
  -> (y, h_last)``: the fused RG-LRU layer.
- ``sequence_parallel_linear_scan(x, a, h0=None, *, mesh, axis_name, reverse=False,
  interpret=False) -> (y, h_last)``: T split over a mesh axis.
- ``linear_scan_reference`` and ``rg_lru_reference``: the pure-JAX references.

Shapes: ``x, a``, the gate logits and ``y``: ``[B, T, D]``; ``h0, h_last``: ``[B, D]`` float32;
``a_param``: ``[D]``; ``reset``: bool ``[B, T]``.
"""

from pallas_kernels.rg_lru_fused import rg_lru
from pallas_kernels.scan_linear import linear_scan
from pallas_kernels.scan_reference import linear_scan_reference, rg_lru_reference
from pallas_kernels.scan_sequence_parallel import sequence_parallel_linear_scan

__all__ = ["linear_scan", "linear_scan_reference", "rg_lru", "rg_lru_reference",
           "sequence_parallel_linear_scan"]
