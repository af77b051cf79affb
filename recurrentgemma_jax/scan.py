"""The one entry point the RG-LRU calls for its linear recurrence ``h_t = a_t * h_{t-1} + x_t``.

``impl`` (``model.scan_impl`` in the config) picks the implementation:

- ``xla_linear``: ``lax.scan`` over time, the float32 carry in registers; simple and exact.
- ``xla_associative``: ``lax.associative_scan``, O(log T) depth, more memory traffic.
- ``pallas``: the Pallas kernel of ``pallas_kernels.linear_scan`` (Mosaic on TPU, a GPU kernel on
  GPU, TPU interpret mode on CPU).
- ``auto``: ``pallas`` on TPU and GPU, ``xla_linear`` on CPU (where interpret mode is slow).

All take and return the same shapes: ``x, a: [B, T, D]``, ``h0: [B, D]`` float32 or None; they
return ``y: [B, T, D]`` in ``x``'s dtype and ``h_last: [B, D]`` float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from pallas_kernels import dispatch
from sharding import partitioning

SCAN_IMPLS = ("auto", "pallas", "xla_linear", "xla_associative")
# Logical axes (sharding/partitioning.RULES) of the RG-LRU's [B, T, D] rows and [B, D] states.
ROW_AXES, STATE_AXES = ("batch", None, "lru"), ("batch", "lru")


def resolve_impl(impl: str) -> str:
  if impl not in SCAN_IMPLS:
    raise ValueError(f"scan impl {impl!r} is not one of {'|'.join(SCAN_IMPLS)}")
  if impl == "auto":
    return "pallas" if dispatch.target_platform() in ("tpu", "gpu") else "xla_linear"
  return impl


def linear_scan(
    x: Float[Array, "b t d"],
    a: Float[Array, "b t d"],
    h0: Float[Array, "b d"] | None = None,
    *,
    impl: str = "auto",
) -> tuple[Float[Array, "b t d"], Float[Array, "b d"]]:
  impl = resolve_impl(impl)
  if impl == "pallas":
    import pallas_kernels  # pylint: disable=g-import-not-at-top  (optional GPU/TPU kernels)
    # Per device under a mesh: rows over ``data``, channels over ``model``.
    return partitioning.shard_local(pallas_kernels.linear_scan,
                                    (ROW_AXES, ROW_AXES, STATE_AXES), (ROW_AXES, STATE_AXES))(
                                        x, a, h0)
  if impl == "xla_associative":
    return associative_scan(x, a, h0)
  return sequential_scan(x, a, h0)


def sequential_scan(x, a, h0=None):
  """``lax.scan`` over time with a float32 carry (the same arithmetic as the official scan)."""
  acc = jnp.promote_types(x.dtype, jnp.float32)
  h = jnp.zeros((x.shape[0], x.shape[2]), acc) if h0 is None else h0.astype(acc)

  def step(h, xa):
    x_t, a_t = xa
    h = a_t.astype(acc) * h + x_t.astype(acc)
    return h, h.astype(x.dtype)

  h_last, y = jax.lax.scan(step, h, (jnp.swapaxes(x, 0, 1), jnp.swapaxes(a, 0, 1)),
                           unroll=8)
  return jnp.swapaxes(y, 0, 1), h_last


def associative_scan(x, a, h0=None):
  """Parallel prefix over pairs ``(a, x)`` composed as affine maps, in float32."""
  acc = jnp.promote_types(x.dtype, jnp.float32)
  x32 = x.astype(acc)
  a32 = a.astype(acc)
  if h0 is not None:
    x32 = x32.at[:, 0].add(a32[:, 0] * h0)

  def combine(left, right):
    a_l, x_l = left
    a_r, x_r = right
    return a_l * a_r, a_r * x_l + x_r

  _, h = jax.lax.associative_scan(combine, (a32, x32), axis=1)
  return h.astype(x.dtype), h[:, -1]
