"""The recurrent block's causal Conv1D with a one-pass Triton backward (GPU; interpreted on a CPU).

Public calls: ``causal_conv1d(x, w, b, doc, *, interpret=False)``, ``forward`` (the jnp sum that
``layers.Conv1D`` computes with on every path) and ``supported(d)``.
"""

from pallas_kernels.conv1d.causal import causal_conv1d, forward, supported

__all__ = ["causal_conv1d", "forward", "supported"]
