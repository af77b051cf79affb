"""Block-diagonal matmul on the GPU without moving activations between layouts (custom VJP).

``block_diagonal_matmul(x, w, b) -> y`` with ``x: [N, H*I]``, ``w: [H, I, J]``, ``b: [H, J]``
or None, ``y: [N, H*J]``: ``y[:, h*J:(h+1)*J] = x[:, h*I:(h+1)*I] @ w[h] + b[h]``, float32
accumulation with the bias added before the one rounding to ``x``'s dtype (a bias added
outside was one more pass over ``y``: 1.5 ms of an H100 Griffin-400M step, session 18).
These are the RG-LRU gates. XLA computes them as a batched matmul over ``h``, so it
moves the ``[N, H, I]`` activations to ``[H, N, I]`` and back, forward and backward. On an H100
those transposes, plus the matmuls, took 4.8% of a Griffin-1.3B training step
(docs/performance.md).

Here each program reads its ``[rows, I]`` tile straight out of ``x``'s rows (a strided tile, each
row piece contiguous) and multiplies it by ``w[h]``:

- forward and ``dx``: grid ``(N / rows, H)``, ``y_tile = x_tile @ w[h]`` (``dx`` uses
  ``w[h]^T``);
- ``dw``: grid ``(N / 1024, H)``. Each program accumulates ``x_tile^T dy_tile`` over its 1024
  rows (8 tiles of 128 rows; 16 of 64 for float32) in float32 and writes one partial
  ``[I, J]``. The partials are summed outside, over ``N / 1024``.

Triton lowering (``interpret=True``: Pallas' generic interpreter, used by the tests on the CPU).
``I`` and ``J`` must be powers of two of at least 16 (``supported``); ``N`` is padded inside.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_ROWS = 128        # rows per tile
_DW_SPAN = 1024    # rows per dw program


def _dw_rows(dtype) -> int:
  """Rows per step of the dw loop: 128 for 2-byte inputs, 64 for float32. Triton pipelines the
  loop's loads through shared memory; float32 tiles of 128 rows asked an H100 for 320 KiB, more
  than its 227 KiB (a float32 Griffin-400M training step did not compile)."""
  return _ROWS * 2 // max(jnp.dtype(dtype).itemsize, 2)


def supported(in_block: int, out_block: int) -> bool:
  """Whether the kernels take blocks of this size (Triton's dot needs powers of two >= 16)."""
  def ok(n):
    return n >= 16 and n & (n - 1) == 0
  return ok(in_block) and ok(out_block)


def _matmul_kernel(x_ref, w_ref, b_ref, y_ref):
  y = jnp.dot(x_ref[...], w_ref[0], preferred_element_type=jnp.float32)
  y_ref[...] = (y + b_ref[0, :].astype(jnp.float32)[None, :]).astype(y_ref.dtype)


def _blocks(x, w, b, interpret):
  """``y`` of the docstring for ``x: [N, H*I]`` with ``N`` a multiple of ``_ROWS`` (``b``: None
  for no bias)."""
  n = x.shape[0]
  h, i, j = w.shape
  if b is None:
    b = jnp.zeros((h, j), jnp.float32)
  return pl.pallas_call(
      _matmul_kernel,
      out_shape=jax.ShapeDtypeStruct((n, h * j), x.dtype),
      grid=(n // _ROWS, h),
      in_specs=[pl.BlockSpec((_ROWS, i), lambda r, k: (r, k)),
                pl.BlockSpec((1, i, j), lambda r, k: (k, 0, 0)),
                pl.BlockSpec((1, j), lambda r, k: (k, 0))],
      out_specs=pl.BlockSpec((_ROWS, j), lambda r, k: (r, k)),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4),
      interpret=interpret,
  )(x, w.astype(x.dtype), b)


def _dw_kernel(x_ref, dy_ref, dw_ref, *, rows_per_step):
  def body(s, acc):
    rows = pl.ds(s * rows_per_step, rows_per_step)
    # x_rows^T dy_rows (``pl.dot`` is gone from JAX 0.12; dot_general works in both)
    return acc + jax.lax.dot_general(x_ref[rows, :], dy_ref[rows, :], (((0,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)

  i, j = dw_ref.shape[-2:]
  steps = _DW_SPAN // rows_per_step
  dw_ref[0, 0] = jax.lax.fori_loop(0, steps, body, jnp.zeros((i, j), jnp.float32))


def _weight_grad(x, dy, h, interpret):
  """``sum_n x_h^T dy_h`` per block, float32, for ``N`` a multiple of ``_DW_SPAN``."""
  n = x.shape[0]
  i, j = x.shape[1] // h, dy.shape[1] // h
  partials = pl.pallas_call(
      functools.partial(_dw_kernel, rows_per_step=_dw_rows(x.dtype)),
      out_shape=jax.ShapeDtypeStruct((n // _DW_SPAN, h, i, j), jnp.float32),
      grid=(n // _DW_SPAN, h),
      in_specs=[pl.BlockSpec((_DW_SPAN, i), lambda r, b: (r, b)),
                pl.BlockSpec((_DW_SPAN, j), lambda r, b: (r, b))],
      out_specs=pl.BlockSpec((1, 1, i, j), lambda r, b: (r, b, 0, 0)),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4),
      interpret=interpret,
  )(x, dy)
  return partials.sum(axis=0)


def _pad_rows(a, multiple):
  extra = -a.shape[0] % multiple
  return jnp.pad(a, ((0, extra), (0, 0))) if extra else a


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmul(x, w, b, interpret):
  return _blocks(_pad_rows(x, _ROWS), w, b, interpret)[: x.shape[0]]


def _matmul_fwd(x, w, b, interpret):
  return _matmul(x, w, b, interpret), (x, w, b)


def _matmul_bwd(interpret, residuals, dy):
  x, w, b = residuals
  n, h = x.shape[0], w.shape[0]
  dx = _blocks(_pad_rows(dy, _ROWS), jnp.swapaxes(w, 1, 2), None, interpret)[:n]
  dw = _weight_grad(_pad_rows(x, _DW_SPAN), _pad_rows(dy.astype(x.dtype), _DW_SPAN), h,
                    interpret)
  db = None if b is None else jnp.sum(dy.astype(jnp.float32), axis=0).reshape(b.shape)
  return dx.astype(x.dtype), dw.astype(w.dtype), None if db is None else db.astype(b.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def block_diagonal_matmul(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *,
                          interpret: bool = False) -> jax.Array:
  """``x: [..., H*I]``, ``w: [H, I, J]``, ``b: [H, J]`` or None -> ``[..., H*J]`` (see the
  module docstring)."""
  h, i, j = w.shape
  if x.shape[-1] != h * i:
    raise ValueError(f"x's last dimension {x.shape[-1]} is not {h} blocks x {i}")
  if b is not None and b.shape != (h, j):
    raise ValueError(f"the bias is {b.shape}, not [H, J] = {(h, j)}")
  if not supported(i, j):
    raise ValueError(f"blocks of {i} x {j}: the kernel needs powers of two of at least 16")
  lead = x.shape[:-1]
  y = _matmul(x.reshape(-1, h * i), w, b, interpret)
  return y.reshape(*lead, h * j)
