"""Block-diagonal matmuls on the GPU without moving activations between layouts (custom VJP).

``block_diagonal_matmul(x, w, b) -> y`` with ``x: [N, H*I]``, ``w: [H, I, J]``, ``b: [H, J]``
or None, ``y: [N, H*J]``: ``y[:, h*J:(h+1)*J] = x[:, h*I:(h+1)*I] @ w[h] + b[h]``, float32
accumulation with the bias added before the one rounding to ``x``'s dtype (a bias added
outside was one more pass over ``y``: 1.5 ms of an H100 Griffin-400M step, session 18).
These are the RG-LRU gates. XLA computes them as a batched matmul over ``h``, so it
moves the ``[N, H, I]`` activations to ``[H, N, I]`` and back, forward and backward. On an H100
those transposes, plus the matmuls, took 4.8% of a Griffin-1.3B training step
(docs/performance.md).

``block_diagonal_with_skip(x, ws, bs) -> (x, ys)`` is the RG-LRU's form: both gates read the
same ``x``, which the layer also uses itself. One forward program reads its ``x`` tile once for
every ``(w, b)`` of ``ws, bs``; ``x`` comes back as it is (the skip), so the backward receives
its gradient and one ``dx`` program sums ``ds + sum_g dy_g @ w_g^T`` before one rounding. Apart,
the two gates read ``x`` twice, wrote two ``dx`` and XLA summed them with the skip's gradient in
one more pass: eight ``[N, H*I]`` passes a layer where this makes four (session 19).

Each program reads its ``[rows, I]`` tile straight out of ``x``'s rows (a strided tile, each
row piece contiguous) and multiplies it by ``w[h]``:

- forward and ``dx``: grid ``(N / rows, H)``, ``y_tile = x_tile @ w[h]`` (``dx`` uses
  ``w[h]^T``);
- ``dw`` and ``db``: grid ``(N / 1024, H)``, one call per weight. Each program accumulates
  ``x_tile^T dy_tile`` and the column sums of ``dy_tile`` over its 1024 rows (8 tiles of 128
  rows; 16 of 64 for float32) in float32 and writes one partial ``[I, J]`` and ``[J]``. The
  partials are summed outside, over ``N / 1024`` (the bias gradient was a pass of its own).

Blocks whose size is not a power of two (Griffin 1.3B's 160, 7B's 352) are cut into pieces of
powers of two up to 128, largest first (160 = 128 + 32; ``pieces``): a program still reads its
``[rows, I]`` tile once and writes its ``[rows, J]`` tile once, as a sum of the pieces'
products (Triton's loads and dots take powers of two only). ``dw`` then runs one program per
input piece, grid ``(N / 1024, H, pieces)``.

Triton lowering (``interpret=True``: Pallas' generic interpreter, used by the tests on the CPU).
``I`` and ``J`` must be multiples of 16 (``supported``); ``N`` is padded inside.
"""

from __future__ import annotations

import functools
import operator
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_ROWS = 128        # rows per tile
_DW_SPAN = 1024    # rows per dw program
# Warps per program. H100, session 19, 16 blocks of 128 x 128 over 32768 rows: the forward
# (two gates) 0.210 ms and dx 0.238 ms with 8, 0.218 and 0.253 with 4.
_WARPS = 8


def _dw_rows(dtype) -> int:
  """Rows per step of the dw loop: 128 for 2-byte inputs, 64 for float32. Triton pipelines the
  loop's loads through shared memory; float32 tiles of 128 rows asked an H100 for 320 KiB, more
  than its 227 KiB (a float32 Griffin-400M training step did not compile)."""
  return _ROWS * 2 // max(jnp.dtype(dtype).itemsize, 2)


def pieces(n: int) -> list[tuple[int, int]]:
  """``(start, size)`` tiles along a block dimension of size ``n``: the whole of it where ``n``
  is a power of two, else the largest powers of two up to 128 that fill it, largest first (160:
  128 + 32). Triton's loads and dots take powers of two only."""
  if n & (n - 1) == 0:
    return [(0, n)]
  out, start = [], 0
  while start < n:
    size = 128
    while size > n - start:
      size //= 2
    out.append((start, size))
    start += size
  return out


def supported(in_block: int, out_block: int) -> bool:
  """Whether the kernels take blocks of this size: multiples of 16 (Triton's smallest dot)."""
  return all(n >= 16 and n % 16 == 0 for n in (in_block, out_block))


def _cols(ref, start, size):
  """``ref[..., start:start + size]`` of a 2-D ref; the whole ref where that is all of it."""
  return ref[...] if size == ref.shape[-1] else ref[:, pl.ds(start, size)]


def _weight(ref, a, n, c, m):
  """Rows ``a:a+n`` and columns ``c:c+m`` of a ``[1, I, J]`` weight ref; the whole where that
  is all of it."""
  return ref[0] if (n, m) == ref.shape[1:] else ref[0, pl.ds(a, n), pl.ds(c, m)]


def _set_cols(ref, start, value):
  if value.shape[-1] == ref.shape[-1]:
    ref[...] = value
  else:
    ref[:, pl.ds(start, value.shape[-1])] = value


def _matmul_kernel(x_ref, *refs, groups):
  # refs: groups weights [1, I, J], groups biases [1, J], then groups outputs [rows, J].
  i, j = refs[0].shape[1:]
  xs = [(a, _cols(x_ref, a, n)) for a, n in pieces(i)]  # the x tile, read once
  for w_ref, b_ref, y_ref in zip(refs[:groups], refs[groups:2 * groups], refs[2 * groups:]):
    for c, m in pieces(j):
      y = functools.reduce(operator.add, (
          jnp.dot(x, _weight(w_ref, a, x.shape[1], c, m), preferred_element_type=jnp.float32)
          for a, x in xs))
      y += b_ref[0, pl.ds(c, m)].astype(jnp.float32)[None, :]
      _set_cols(y_ref, c, y.astype(y_ref.dtype))


def _blocks(x, ws, bs, interpret):
  """``ys`` for ``x: [N, H*I]`` with ``N`` a multiple of ``_ROWS``, one per ``(w, b)``."""
  n = x.shape[0]
  h, i, j = ws[0].shape
  groups = len(ws)
  w_spec = pl.BlockSpec((1, i, j), lambda r, k: (k, 0, 0))
  b_spec = pl.BlockSpec((1, j), lambda r, k: (k, 0))
  y_spec = pl.BlockSpec((_ROWS, j), lambda r, k: (r, k))
  return pl.pallas_call(
      functools.partial(_matmul_kernel, groups=groups),
      name="pallas_gates_fwd",
      out_shape=[jax.ShapeDtypeStruct((n, h * j), x.dtype)] * groups,
      grid=(n // _ROWS, h),
      in_specs=[pl.BlockSpec((_ROWS, i), lambda r, k: (r, k))] + [w_spec] * groups
      + [b_spec] * groups,
      out_specs=[y_spec] * groups,
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=_WARPS),
      interpret=interpret,
  )(x, *(w.astype(x.dtype) for w in ws), *bs)


def _dx_kernel(*refs, groups, skip):
  # refs: groups dy tiles [rows, J], groups transposed weights [1, J, I], the skip's gradient
  # [rows, I] (with skip), then dx [rows, I].
  dys, wts = refs[:groups], refs[groups:2 * groups]
  dx_ref = refs[-1]
  j, i = wts[0].shape[1:]
  dy_tiles = [[(c, _cols(dy_ref, c, m)) for c, m in pieces(j)] for dy_ref in dys]
  for a, n in pieces(i):
    acc = jnp.zeros((dx_ref.shape[0], n), jnp.float32)
    for tiles, wt_ref in zip(dy_tiles, wts):
      for c, dy in tiles:
        acc += jnp.dot(dy, _weight(wt_ref, c, dy.shape[1], a, n),
                       preferred_element_type=jnp.float32)
    if skip:
      acc += _cols(refs[2 * groups], a, n).astype(jnp.float32)
    _set_cols(dx_ref, a, acc.astype(dx_ref.dtype))


def _input_grad(dys, ws, ds, interpret):
  """``ds + sum_g dy_g @ w_g^T`` per block (``ds`` None: no skip), rows a multiple of
  ``_ROWS``."""
  n = dys[0].shape[0]
  h, i, j = ws[0].shape
  groups = len(ws)
  dtype = dys[0].dtype
  tile = lambda width: pl.BlockSpec((_ROWS, width), lambda r, k: (r, k))
  wt_spec = pl.BlockSpec((1, j, i), lambda r, k: (k, 0, 0))
  extra = [] if ds is None else [ds]
  return pl.pallas_call(
      functools.partial(_dx_kernel, groups=groups, skip=ds is not None),
      name="pallas_gates_dx",
      out_shape=jax.ShapeDtypeStruct((n, h * i), dtype),
      grid=(n // _ROWS, h),
      in_specs=[tile(j)] * groups + [wt_spec] * groups + [tile(i)] * len(extra),
      out_specs=tile(i),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=_WARPS),
      interpret=interpret,
  )(*dys, *(jnp.swapaxes(w, 1, 2).astype(dtype) for w in ws), *extra)


def _dw_kernel(x_ref, dy_ref, dw_ref, db_ref, *, rows_per_step):
  # x_ref: [span, I], dy_ref: [span, J], dw_ref: [1, 1, I, J], db_ref: [1, 1, J]. Program k of
  # the grid's last axis writes the rows of dw of the block's k-th input piece; the first also
  # writes db.
  i, j = dw_ref.shape[-2:]
  out_pieces = pieces(j)

  def piece(a, n, with_db):
    def body(s, carry):
      accs, cols = carry
      rows = pl.ds(s * rows_per_step, rows_per_step)
      x = x_ref[rows, :] if n == i else x_ref[rows, pl.ds(a, n)]
      accs, cols = list(accs), list(cols)
      for t, (c, m) in enumerate(out_pieces):
        dy = dy_ref[rows, :] if m == j else dy_ref[rows, pl.ds(c, m)]
        # x_rows^T dy_rows (``pl.dot`` is gone from JAX 0.12; dot_general works in both)
        accs[t] += jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)
        if with_db:
          cols[t] += jnp.sum(dy.astype(jnp.float32), axis=0)
      return tuple(accs), tuple(cols)

    zeros = (tuple(jnp.zeros((n, m), jnp.float32) for _, m in out_pieces),
             tuple(jnp.zeros((m,), jnp.float32) for _, m in out_pieces))
    accs, cols = jax.lax.fori_loop(0, _DW_SPAN // rows_per_step, body, zeros)
    for (c, m), acc in zip(out_pieces, accs):
      if n == i and m == j:
        dw_ref[0, 0] = acc
      else:
        dw_ref[0, 0, pl.ds(a, n), pl.ds(c, m)] = acc
    if with_db:
      for (c, m), col in zip(out_pieces, cols):
        db_ref[0, 0, pl.ds(c, m)] = col

  in_pieces = pieces(i)
  if len(in_pieces) == 1:
    piece(*in_pieces[0], True)
    return
  for k, (a, n) in enumerate(in_pieces):
    pl.when(pl.program_id(2) == k)(functools.partial(piece, a, n, k == 0))


def _weight_grads(x, dy, h, interpret):
  """``(sum_n x_h^T dy_h, sum_n dy_h)`` per block, float32, for ``N`` a multiple of
  ``_DW_SPAN``."""
  n = x.shape[0]
  i, j = x.shape[1] // h, dy.shape[1] // h
  dw, db = pl.pallas_call(
      functools.partial(_dw_kernel, rows_per_step=_dw_rows(x.dtype)),
      name="pallas_gates_dw",
      out_shape=(jax.ShapeDtypeStruct((n // _DW_SPAN, h, i, j), jnp.float32),
                 jax.ShapeDtypeStruct((n // _DW_SPAN, h, j), jnp.float32)),
      grid=(n // _DW_SPAN, h, len(pieces(i))),
      in_specs=[pl.BlockSpec((_DW_SPAN, i), lambda r, b, k: (r, b)),
                pl.BlockSpec((_DW_SPAN, j), lambda r, b, k: (r, b))],
      out_specs=(pl.BlockSpec((1, 1, i, j), lambda r, b, k: (r, b, 0, 0)),
                 pl.BlockSpec((1, 1, j), lambda r, b, k: (r, b, 0))),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=_WARPS),
      interpret=interpret,
  )(x, dy)
  return dw.sum(axis=0), db.sum(axis=0)


def _pad_rows(a, multiple):
  extra = -a.shape[0] % multiple
  return jnp.pad(a, ((0, extra), (0, 0))) if extra else a


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _matmuls(x, ws, bs, skip, interpret):
  ys = tuple(y[: x.shape[0]] for y in _blocks(_pad_rows(x, _ROWS), ws, bs, interpret))
  return (x, ys) if skip else ys


def _matmuls_fwd(x, ws, bs, skip, interpret):
  return _matmuls(x, ws, bs, skip, interpret), (x, ws, bs)


def _matmuls_bwd(skip, interpret, residuals, cotangents):
  x, ws, bs = residuals
  n, h = x.shape[0], ws[0].shape[0]
  ds, dys = cotangents if skip else (None, cotangents)
  dys = [dy.astype(x.dtype) for dy in dys]
  ds = None if ds is None else _pad_rows(ds.astype(x.dtype), _ROWS)
  dx = _input_grad([_pad_rows(dy, _ROWS) for dy in dys], ws, ds, interpret)[:n]
  x_span = _pad_rows(x, _DW_SPAN)
  grads = [_weight_grads(x_span, _pad_rows(dy, _DW_SPAN), h, interpret) for dy in dys]
  dws = tuple(dw.astype(w.dtype) for (dw, _), w in zip(grads, ws))
  dbs = tuple(db.astype(b.dtype) for (_, db), b in zip(grads, bs))
  return dx, dws, dbs


_matmuls.defvjp(_matmuls_fwd, _matmuls_bwd)


def _check(x, w, b):
  h, i, j = w.shape
  if x.shape[-1] != h * i:
    raise ValueError(f"x's last dimension {x.shape[-1]} is not {h} blocks x {i}")
  if b is not None and b.shape != (h, j):
    raise ValueError(f"the bias is {b.shape}, not [H, J] = {(h, j)}")
  if not supported(i, j):
    raise ValueError(f"blocks of {i} x {j}: the kernel needs multiples of 16")


def block_diagonal_matmul(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *,
                          interpret: bool = False) -> jax.Array:
  """``x: [..., H*I]``, ``w: [H, I, J]``, ``b: [H, J]`` or None -> ``[..., H*J]`` (see the
  module docstring)."""
  _check(x, w, b)
  h, _, j = w.shape
  b = jnp.zeros((h, j), jnp.float32) if b is None else b
  lead = x.shape[:-1]
  (y,) = _matmuls(x.reshape(-1, x.shape[-1]), (w,), (b,), False, interpret)
  return y.reshape(*lead, h * j)


def block_diagonal_with_skip(x: jax.Array, ws: Sequence[jax.Array], bs: Sequence[jax.Array], *,
                             interpret: bool = False) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """``x: [..., H*I]``, ``ws``: weights ``[H, I, J]`` of one shape, ``bs``: their biases
  ``[H, J]`` -> ``(x, ys)``, ``ys[g] = block_diagonal_matmul(x, ws[g], bs[g])``; ``x`` comes
  back as it is so that its other uses take their gradient through this call (the module
  docstring)."""
  if not ws or len(ws) != len(bs) or any(w.shape != ws[0].shape for w in ws):
    raise ValueError(f"block_diagonal_with_skip takes as many biases as weights, all weights "
                     f"of one shape; got {[w.shape for w in ws]} and {[b.shape for b in bs]}")
  for w, b in zip(ws, bs):
    _check(x, w, b)
  lead = x.shape[:-1]
  h, _, j = ws[0].shape
  skip, ys = _matmuls(x.reshape(-1, x.shape[-1]), tuple(ws), tuple(bs), True, interpret)
  return skip.reshape(x.shape), tuple(y.reshape(*lead, h * j) for y in ys)
