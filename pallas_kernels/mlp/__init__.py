"""The gated MLP's GeLU gating with a one-pass Triton backward (GPU; interpreted on a CPU).

Public calls: ``gated_gelu(up, bias, *, interpret=False)`` and ``supported(m)``. TPUs and
CPUs take XLA's autodiff of the jnp form (``model.MLPBlock``). ``gated_up``: a decoding step's
up-projection and gating in one forward-only kernel (``model.mlp_impl``).
"""

from pallas_kernels.mlp.gating import gated_gelu, supported

__all__ = ["gated_gelu", "supported"]
