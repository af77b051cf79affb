"""The RG-LRU's block-diagonal gate matmuls as Triton kernels (GPU; interpreted on a CPU).

Public calls: ``block_diagonal_matmul(x, w, b=None, *, interpret=False)``,
``block_diagonal_with_skip(x, ws, bs, *, interpret=False)`` (both gates from one read of ``x``,
the form the model uses) and ``supported(in_block, out_block)``. TPUs take XLA's batched matmul
(``model.gate_impl``).
"""

from pallas_kernels.gates.block_diagonal import (block_diagonal_matmul, block_diagonal_with_skip,
                                                 supported)

__all__ = ["block_diagonal_matmul", "block_diagonal_with_skip", "supported"]
