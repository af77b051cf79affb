"""The gated MLP's ``gelu(up_0 + b_0) * (up_1 + b_1)`` with a one-pass backward (custom VJP).

``gated_gelu(up, bias) -> h`` with ``up: [N, 2, M]`` (the up-projection's matmul output, both
branches), ``bias: [2, M]``, ``h: [N, M]`` in ``up``'s dtype; tanh GeLU, as ``jax.nn.gelu``.

Autodiff of the jnp form keeps the GeLU's ``tanh`` as a residual (one more ``[N, M]`` array
written in the forward and read in the backward), and XLA computes the backward in bfloat16
with the bias gradients as a reduction over the ``N`` token rows fused into the same pass. On
an H100 that pass took 0.88 ms a layer at MQA-400M's shape (N = 32768, M = 4608), against
0.64 ms for its bytes at the copy ceiling (docs/bench/performance_log.md, session 15).

Here the forward is jnp (XLA fuses it into one pass that writes ``h`` alone) and keeps ``up``
and ``bias``. The backward is one Triton kernel over tiles of ``[rows, 2, cols]``: it reads
``dh`` and ``up``, recomputes the tanh in float32, writes ``dup: [N, 2, M]`` and a float32
partial of the bias gradient per tile row, summed outside (``N / rows`` partials).

``interpret=True``: Pallas' interpreter (the CPU tests). ``backward_reference`` is the same
backward in jnp, float32: the path where ``supported`` says no.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Token rows per program. H100, session 19, at MQA-400M's shape (N = 32768, M = 4608): 0.619 ms
# (86% of the bytes floor) with 32 rows, 0.693 with 64 and 2.35 with 128 (128 columns, 4 warps).
_ROWS = 32
_COLS = (128, 64, 32, 16)        # feature columns per program: the largest that divides M
_WARPS = 4                       # 8: 0.640 ms at 32 rows
_C = float(np.sqrt(2.0 / np.pi))
_K = 0.044715


def supported(m: int) -> bool:
  """Whether the kernel takes ``up: [N, 2, m]`` (any ``N``: rows are padded): ``m`` a
  multiple of 16."""
  return m % 16 == 0


def _branch_grads(gate, lin, b0, b1, dh):
  """The gradients of ``gelu(gate + b0) * (lin + b1)`` for ``dh`` with respect to ``gate``
  and ``lin``, in float32 (tanh GeLU; the tanh recomputed)."""
  f32 = jnp.float32
  g = gate.astype(f32) + b0.astype(f32)
  u = lin.astype(f32) + b1.astype(f32)
  dh = dh.astype(f32)
  t = jnp.tanh(_C * (g + _K * g * g * g))
  gelu = 0.5 * g * (1.0 + t)
  d_gelu = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _C * (1.0 + 3.0 * _K * g * g)
  return dh * u * d_gelu, dh * gelu


def forward(up, bias):
  """``gelu(up_0 + b_0) * (up_1 + b_1)`` in ``up``'s dtype (jnp; XLA fuses it)."""
  b = bias.astype(up.dtype)
  return jax.nn.gelu(up[..., 0, :] + b[0]) * (up[..., 1, :] + b[1])


def backward_reference(up, bias, dh):
  """``(dup, dbias)`` of ``forward`` in float32 jnp, cast to the inputs' dtypes."""
  dg, du = _branch_grads(up[..., 0, :], up[..., 1, :], bias[0], bias[1], dh)
  dup = jnp.stack([dg, du], axis=-2).astype(up.dtype)
  lead = tuple(range(dg.ndim - 1))
  dbias = jnp.stack([dg.sum(lead), du.sum(lead)]).astype(bias.dtype)
  return dup, dbias


def _bwd_kernel(dh_ref, gate_ref, lin_ref, b_ref, dup_ref, db_ref):
  dg, du = _branch_grads(gate_ref[...], lin_ref[...], b_ref[0, :][None, :], b_ref[1, :][None, :],
                         dh_ref[...])
  dup_ref[:, 0, :] = dg.astype(dup_ref.dtype)
  dup_ref[:, 1, :] = du.astype(dup_ref.dtype)
  db_ref[0, :] = dg.sum(axis=0)
  db_ref[1, :] = du.sum(axis=0)


def _backward_kernel(up, bias, dh, interpret):
  n, _, m = up.shape
  cols = next(c for c in _COLS if m % c == 0)
  extra = -n % _ROWS
  if extra:  # zero rows of dh give zero gradients: the padding adds nothing to the sums
    up = jnp.pad(up, ((0, extra), (0, 0), (0, 0)))
    dh = jnp.pad(dh, ((0, extra), (0, 0)))
  rows = up.shape[0]
  branch = lambda c: pl.BlockSpec((_ROWS, None, cols), lambda i, j: (i, c, j))
  dup, partials = pl.pallas_call(
      _bwd_kernel,
      name="pallas_mlp_gating_bwd",
      out_shape=(jax.ShapeDtypeStruct((rows, 2, m), up.dtype),
                 jax.ShapeDtypeStruct((rows // _ROWS, 2, m), jnp.float32)),
      grid=(rows // _ROWS, m // cols),
      in_specs=[pl.BlockSpec((_ROWS, cols), lambda i, j: (i, j)), branch(0), branch(1),
                pl.BlockSpec((2, cols), lambda i, j: (0, j))],
      out_specs=(pl.BlockSpec((_ROWS, 2, cols), lambda i, j: (i, 0, j)),
                 pl.BlockSpec((None, 2, cols), lambda i, j: (i, 0, j))),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=_WARPS),
      interpret=interpret,
  )(dh, up, up, bias)
  return dup[:n], partials.sum(axis=0).astype(bias.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gated_gelu(up, bias, interpret):
  return forward(up, bias)


def _gated_gelu_fwd(up, bias, interpret):
  return forward(up, bias), (up, bias)


def _gated_gelu_bwd(interpret, residuals, dh):
  up, bias = residuals
  if not supported(up.shape[-1]):
    return backward_reference(up, bias, dh)
  return _backward_kernel(up, bias, dh.astype(up.dtype), interpret)


_gated_gelu.defvjp(_gated_gelu_fwd, _gated_gelu_bwd)


def gated_gelu(up: jax.Array, bias: jax.Array, *, interpret: bool = False) -> jax.Array:
  """``up: [..., 2, M]``, ``bias: [2, M]`` -> ``[..., M]`` (see the module docstring)."""
  if up.ndim < 2 or up.shape[-2] != 2 or bias.shape != (2, up.shape[-1]):
    raise ValueError(f"gated_gelu takes up [..., 2, M] and bias [2, M]; got {up.shape} and "
                     f"{bias.shape}")
  lead, m = up.shape[:-2], up.shape[-1]
  h = _gated_gelu(up.reshape(-1, 2, m), bias, interpret)
  return h.reshape(*lead, m)
