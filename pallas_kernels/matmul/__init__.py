"""Mosaic GPU matmul skeletons (Hopper; Pallas' Mosaic GPU interpreter on a CPU).

Public calls: ``persistent.tiles``, the body of a warp-specialised kernel of persistent CTAs
(in clusters that share operand tiles, where asked) over output tiles with an epilogue of the
caller's; ``persistent.schedule`` and ``persistent.cluster_launch``, its grid and launch
arguments. Used by ``mlp.gated_up`` and ``sampling.greedy``.
"""
