"""The greedy token from the tied output layer in one kernel, for decoding (no backward).

``greedy_token(x, table, *, interpret=False) -> tokens`` with ``x: [N, D]`` (the final norm's
output), ``table: [V, D]`` (the embedding table, tied): ``argmax_v (x table^T)[n, v]``, int32
``[N]``. XLA writes the ``[N, V]`` logits and reads them again for the argmax (Hawk 1.3B at 2048
rows and V = 256K on an H100: 1 GB a step, a 0.50 ms pass; docs/bench/decode_log.md). Here each
program computes a ``[rows, cols]`` tile of the logits in float32 over ``D`` in steps of ``_K``,
rounds it to ``x``'s dtype (as XLA stores the logits), and writes only each row's largest value
in the tile and its first column; ``pick`` reduces those ``[N, V / cols]`` partials to the token.

The model's logit soft cap (``cap * tanh(l / cap)``) is increasing, so it is left out: it picks
the same token unless two different logits round to the same capped float32 value, which takes
large logits (bfloat16 ones from about 6.8 x the cap: 204 and 205 at a cap of 30) or float32
logits an ulp or so apart near the cap. Ties go to the lower index, as ``jnp.argmax``. The
tile's matmul sums in another order than XLA's gemm, so a row whose two best logits differ by
about a rounding may pick the other one. A row with NaN logits gets some token of the
vocabulary (``jnp.argmax`` would give the first NaN's).

Triton lowering (``interpret=True``: Pallas' interpreter, the CPU tests). ``D`` a multiple of
``_K`` and ``V`` of 128 (``supported``); ``N`` is padded inside.

A Mosaic GPU version of the same tile arithmetic (``_mosaic``, Hopper, bfloat16 and float16, ``V``
a multiple of 256) runs on ``matmul.persistent``'s skeleton: persistent CTAs over ``[128, 256]``
tiles, the rows fastest, in clusters of two CTAs on neighbouring row tiles that share each table
tile through TMA multicast; a 3-slot TMA ring of ``x`` and table tiles; wgmma over 64 rows a
compute warpgroup against the table read as it lies (``x table^T``); each row's largest rounded
logit and first column found in registers and stored by TMA. Its partials equal the Triton
kernel's bit for bit (an H200 at Hawk 1.3B's shape: 2048 rows, ``D`` 2048, ``V`` 256,000), and
it is the faster there: 3.10 ms against 3.36 (docs/bench/decode_log.md, session 45), so
``dispatch.greedy_path`` takes it on Hopper (``GREEDY_IMPL=triton`` overrides). Pallas' Mosaic
GPU interpreter has no cluster barriers: interpreted, the kernel runs without clusters.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import dispatch
from pallas_kernels.matmul import persistent

# The tile: 128 rows by 256 vocabulary columns, K steps of 64, 8 warps, 3 stages (as
# ``mlp.gated_up``'s 128 x 2 x 128). Programs run rows fastest, so the rows of the batch that share
# a slice of the table run together and the table is read from memory about once.
_ROWS, _COLS, _K = 128, 256, 64
_WARPS, _STAGES = 8, 3
# float32 operands: half the K step and 2 stages (shared memory), as ``gated_up``.
_K32, _STAGES32 = 32, 2

# The Mosaic GPU tile (rows, vocabulary columns, K step), TMA ring slots and CTAs a cluster: 128
# rows as two compute warpgroups of 64, each with one 64 x 256 float32 accumulator. On an H200 at
# Hawk 1.3B's shape (session 45): 3.10 ms with clusters of two and 3 slots, 3.20 with 4; 3.26
# without clusters (3 or 4 slots); 3.20 with K steps of 128 and 2 slots. Clusters from
# MOSAIC_CLUSTER_ROWS rows: at 512 rows 0.779 ms against 0.845 without, at 256 0.436 against
# 0.428, at 128 (padded to 256) 0.410 against 0.292.
MOSAIC_TILE = (128, 256, 64)
MOSAIC_STAGES = 3
MOSAIC_CLUSTER = 2
MOSAIC_CLUSTER_ROWS = 512

# The fewest rows (per device) for which the model takes the kernel (``model.decode_impl``). On
# an H100 at a 1.3B model's output layer (V = 256K, D = 2048; bench_decode_kernels.py, session
# 31), ms a call, XLA / kernel: 2048 rows 3.80 / 3.30, 1024 rows 1.93 / 1.66, 512 rows 1.04 /
# 0.92, 128 rows 0.46 / 0.39, 16 rows 0.369 / 0.380 (reading the table bounds both there).
MIN_ROWS = 128


def tile_cols(vocab: int) -> int:
  """Vocabulary columns of a tile: ``_COLS``, 128, or (``partials_reference`` only, for a share of
  the vocabulary that is no multiple of 128) the whole vocabulary."""
  return next((c for c in (_COLS, 128) if vocab % c == 0), vocab)


def supported(vocab: int, width: int) -> bool:
  return width % _K == 0 and vocab % 128 == 0


def worthwhile(rows: int, vocab: int, width: int) -> bool:
  """Whether the model takes the kernel: shapes it takes, ``MIN_ROWS`` rows or more."""
  return rows >= MIN_ROWS and supported(vocab, width)


def reference(x, table):
  """The same in jnp: the logits in ``x``'s dtype, then the argmax."""
  logits = jnp.dot(x, table.astype(x.dtype).T)
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def partials_reference(x, table):
  """``partials``' outputs (less ``cols``) in jnp, from the logits in ``x``'s dtype (float32 at
  least): the path of a device with fewer rows than ``MIN_ROWS`` under a mesh, and the float64
  reference of ``check_gpu_kernels.py``."""
  n, vocab = x.shape[0], table.shape[0]
  cols = tile_cols(vocab)
  logits = jnp.dot(x, table.astype(x.dtype).T).astype(jnp.promote_types(x.dtype, jnp.float32))
  logits = logits.reshape(n, vocab // cols, cols)
  return jnp.max(logits, axis=2), jnp.argmax(logits, axis=2).astype(jnp.int32)


def _kernel(x_ref, t_ref, max_ref, arg_ref, *, k_step):
  f32 = jnp.float32
  rows, cols = x_ref.shape[0], t_ref.shape[0]

  def step(k, acc):
    xs = x_ref[:, pl.ds(k * k_step, k_step)]
    ts = t_ref[:, pl.ds(k * k_step, k_step)]
    return acc + jax.lax.dot_general(xs, ts, (((1,), (1,)), ((), ())),
                                     preferred_element_type=f32)

  acc = jax.lax.fori_loop(0, x_ref.shape[1] // k_step, step, jnp.zeros((rows, cols), f32))
  logits = acc.astype(x_ref.dtype).astype(f32)
  best = jnp.max(logits, axis=1)
  column = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
  # (clamped: a NaN maximum equals no column; the token stays in the vocabulary)
  first = jnp.minimum(jnp.min(jnp.where(logits == best[:, None], column, cols), axis=1), cols - 1)
  max_ref[...] = best[:, None]
  arg_ref[...] = first[:, None]


def mosaic_problem(vocab: int, width: int, dtype) -> str | None:
  """Why the Mosaic GPU kernel cannot take ``x [N, width]`` of ``dtype`` against a ``[vocab,
  width]`` table, or None."""
  return persistent.problem(dtype, width, vocab, tile=MOSAIC_TILE, what="vocabulary")


def partials(x, table, *, tile=None, impl: str | None = None, interpret: bool = False):
  """``(best [N, V / cols] float32, column [N, V / cols] int32, cols)``: each row's largest logit
  in each vocabulary tile and its first column in the tile. ``tile``: ``(rows, cols, K step,
  warps, stages)`` of the Triton kernel, for benchmarks. ``impl``: "triton" or "mosaic"; None
  asks ``dispatch.greedy_path``."""
  n, d = x.shape
  vocab = table.shape[0]
  if table.shape != (vocab, d) or not supported(vocab, d):
    raise ValueError(f"greedy_token: x {x.shape}, table {table.shape}: need table [V, D], D a "
                     f"multiple of {_K}, V of 128")
  impl = impl or dispatch.greedy_path(vocab, d, x.dtype)
  if impl == "mosaic":
    why = mosaic_problem(vocab, d, x.dtype)
    if why:
      raise ValueError(f"greedy_token: the Mosaic GPU kernel does not take {why}")
    return _mosaic(x, table.astype(x.dtype), interpret=interpret)
  wide = jnp.dtype(x.dtype).itemsize > 2
  tile_rows, cols, k_step, warps, stages = tile or (
      _ROWS, tile_cols(vocab), _K32 if wide else _K, _WARPS, _STAGES32 if wide else _STAGES)
  tile_rows = min(tile_rows, max(16, 1 << (n - 1).bit_length()))
  rows = -(-n // tile_rows) * tile_rows
  tiles = vocab // cols
  best, column = pl.pallas_call(
      functools.partial(_kernel, k_step=k_step),
      name="pallas_greedy_token",
      out_shape=(jax.ShapeDtypeStruct((rows, tiles), jnp.float32),
                 jax.ShapeDtypeStruct((rows, tiles), jnp.int32)),
      grid=(rows // tile_rows, tiles),
      in_specs=[pl.BlockSpec((tile_rows, d), lambda r, c: (r, 0)),
                pl.BlockSpec((cols, d), lambda r, c: (c, 0))],
      out_specs=(pl.BlockSpec((tile_rows, 1), lambda r, c: (r, c)),
                 pl.BlockSpec((tile_rows, 1), lambda r, c: (r, c))),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=warps,
                                                                  num_stages=stages),
      interpret=interpret,
  )(jnp.pad(x, ((0, rows - n), (0, 0))), table.astype(x.dtype))
  return best[:n], column[:n], cols


def mosaic_cluster(rows: int, *, cluster: int = MOSAIC_CLUSTER, interpret: bool = False) -> int:
  """The CTAs a cluster of the Mosaic kernel at ``rows`` rows, at most ``cluster``: none below
  ``MOSAIC_CLUSTER_ROWS`` rows (a cluster's second row tile would be mostly padding) nor in the
  interpreter (no cluster barriers)."""
  return 1 if interpret or rows < MOSAIC_CLUSTER_ROWS else cluster


def _mosaic(x, table, *, stages: int = MOSAIC_STAGES, interpret: bool = False,
            cluster: int = MOSAIC_CLUSTER):
  """The Mosaic GPU kernel (module docstring); ``interpret``: Pallas' Mosaic GPU interpreter,
  three CTAs and no clusters, the table transposed for it (its wgmma takes no transposed
  operand). Clusters of at most ``cluster`` CTAs (``mosaic_cluster``)."""
  n = x.shape[0]
  vocab = table.shape[0]
  tile_m, cols, _ = MOSAIC_TILE
  half = tile_m // 2
  rows, tiles, grid, cluster = persistent.schedule(
      n, vocab, tile=MOSAIC_TILE, cluster=mosaic_cluster(n, cluster=cluster),
      interpret=interpret)
  dtype, f32 = x.dtype, jnp.float32

  def epilogue(accs, tm, tn, wg, mine, out_s, out_g):
    logits = accs[0][...].astype(dtype).astype(f32)  # rounded as XLA stores the logits
    best = logits.max(axis=1)
    if interpret:  # the interpreter has no layouts
      column = lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    else:
      column = plmgpu.broadcasted_iota(jnp.int32, logits.shape, 1, layout=plmgpu.Layout.WGMMA)
    # the first column holding the maximum, as the largest (cols - column) among them
    back = jnp.where(logits == lax.broadcast_in_dim(best, logits.shape, [0]),
                     float(cols) - column.astype(f32), 0.0).max(axis=1)
    plmgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store has read
    out_s[wg, 0] = best
    # (clamped: a NaN maximum equals no column; the token stays in the vocabulary)
    out_s[wg, 1] = jnp.minimum(float(cols) - back, float(cols - 1))
    plmgpu.commit_smem()
    plmgpu.copy_smem_to_gmem(out_s.at[wg],
                             out_g.at[:, tn.start // cols, pl.ds(tm.start + mine.start, half)])

  def kernel(x_g, t_g, out_g):
    operands = (lambda c: (t_g.at[:, c],)) if interpret else (lambda c: (t_g.at[c],))
    persistent.tiles(
        x_g, operands, lax.axis_index("sm"), tiles, grid, tile=MOSAIC_TILE,
        epilogue=functools.partial(epilogue, out_g=out_g), stages=stages, cluster=cluster,
        transposed=not interpret, scratch=(("out_s", plmgpu.SMEM((2, 2, half), f32)),))

  call = plmgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((2, vocab // cols, rows), f32), grid=(grid,),
      grid_names=("sm",), num_threads=3, thread_name="wg",
      **persistent.cluster_launch(cluster),
      compiler_params=plmgpu.CompilerParams(
          lowering_semantics=plmgpu.LoweringSemantics.Warpgroup),
      interpret=dispatch.mosaic_gpu_interpreter(interpret))
  out = call(jnp.pad(x, ((0, rows - n), (0, 0))), table.T if interpret else table)
  return out[0, :, :n].T, out[1, :, :n].T.astype(jnp.int32), cols


def pick(best, column, cols: int):
  """The token of each row from ``partials``' per-tile maxima (the first tile holding the row's
  maximum, as ``jnp.argmax``)."""
  tile = jnp.argmax(best, axis=1)
  return (tile * cols + jnp.take_along_axis(column, tile[:, None], axis=1)[:, 0]).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("tile", "impl", "interpret"))
def greedy_token(x, table, *, tile=None, impl: str | None = None, interpret: bool = False):
  """See the module docstring."""
  best, column, cols = partials(x, table, tile=tile, impl=impl, interpret=interpret)
  return pick(best, column, cols)
