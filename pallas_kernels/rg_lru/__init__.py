"""The RG-LRU kernels: the linear scan and the fused RG-LRU layer (docs/kernels.md).

Public calls:

- ``linear_scan(x, a, h0=None, *, reverse=False, interpret=False) -> (y, h_last)``:
  ``h_t = a_t * h_{t-1} + x_t``.
- ``rg_lru(x, gate_x_logits, gate_a_logits, a_param, reset=None, h0=None, *, interpret=False)
  -> (y, h_last)``: the fused RG-LRU layer (gates, decay, normalisation and the scan).
- ``sequence_parallel_linear_scan(x, a, h0=None, *, mesh, axis_name, reverse=False,
  interpret=False) -> (y, h_last)``: T split over a mesh axis.
- ``linear_scan_reference`` and ``rg_lru_reference``: the pure-JAX references.

Shapes: ``x, a``, the gate logits and ``y``: ``[B, T, D]``; ``h0, h_last``: ``[B, D]`` float32;
``a_param``: ``[D]``; ``reset``: bool ``[B, T]``.

Modules: ``scan`` and ``fused`` (the custom VJPs) run their steps through ``blocked``'s
sequential driver, which runs ``tpu`` (Mosaic TPU; its interpreter on a CPU) or ``gpu``
(Triton); ``gpu_mosaic`` runs the same step functions forward through Mosaic GPU on Hopper
(the linear scan's forward and the fused layer's forward, by default; ``fused.MOSAIC_FORWARD``);
``reference`` the pure-JAX references; ``decode`` a recurrent block's one-token decoding step
after XLA's Conv1D (both gates and the update in one Triton kernel, ``model.decode_impl``). Which runs where:
``pallas_kernels.dispatch``.
"""

from pallas_kernels.rg_lru.fused import rg_lru
from pallas_kernels.rg_lru.scan import linear_scan
from pallas_kernels.rg_lru.reference import linear_scan_reference, rg_lru_reference
from pallas_kernels.rg_lru.sequence_parallel import sequence_parallel_linear_scan

__all__ = ["linear_scan", "linear_scan_reference", "rg_lru", "rg_lru_reference",
           "sequence_parallel_linear_scan"]
