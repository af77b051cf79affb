"""RMSNorm as Triton kernels, forward and backward (GPU; interpreted on a CPU).

Public calls: ``rms_norm(x, scale, *, eps=1e-6, interpret=False)``, its plain-jnp
``rms_norm_reference(x, scale, eps)`` and ``supported(d)``. Widths it does not take, and TPUs,
keep XLA's norm (``layers.RMSNorm``).
"""

from pallas_kernels.norm.rms_norm import rms_norm, rms_norm_reference, supported

__all__ = ["rms_norm", "rms_norm_reference", "supported"]
