"""Mosaic GPU matmul skeletons (Hopper; Pallas' Mosaic GPU interpreter on a CPU).

Public call: ``persistent.tiles``, the body of a warp-specialised kernel of persistent CTAs
over output tiles with an epilogue of the caller's; used by ``mlp.gated_up`` and
``sampling.greedy``.
"""
