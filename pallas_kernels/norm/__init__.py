"""RMSNorm with a one-pass Triton backward that also adds the residual stream's gradient (GPU;
interpreted on a CPU).

Public calls: ``forward(x, scale, eps)`` (the jnp form every path uses),
``rms_norm_with_skip(x, scale, *, eps, interpret=False)`` and ``supported(d)``. TPUs take XLA's
autodiff of the jnp form (``layers.RMSNorm``).
"""

from pallas_kernels.norm.rms import forward, rms_norm_with_skip, supported

__all__ = ["forward", "rms_norm_with_skip", "supported"]
