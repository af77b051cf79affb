"""Forward linear scan ``h_t = a_t * h_{t-1} + x_t`` as a Pallas Mosaic GPU (Hopper) kernel.

The Triton kernel (``gpu.py``) prefetches one chunk of rows into registers, which keeps too
few bytes in flight to reach the copy ceiling with only ``B * D / 256`` programs. This kernel
moves the rows with TMA instead: each CUDA block (one Pallas thread = one warpgroup of 128 CUDA
threads) owns one batch row and ``block_d`` channels and walks the whole time axis over tiles of
``[rows, block_d]``. ``x`` and ``a`` tiles arrive by TMA (``copy_gmem_to_smem``) in a
``stages``-slot shared-memory ring, one mbarrier per slot; a slot is refilled with the tile
``stages`` steps ahead as soon as it has been scanned, so ``stages - 1`` tiles are in flight
while one is scanned. ``y`` tiles go back by TMA (``copy_smem_to_gmem``) from their own, smaller
ring of ``y_stages`` slots. (The pipeline is written out rather than taken from
``plgpu.emit_pipeline``: a separate, smaller y ring leaves shared memory for more input stages,
and Pallas' Mosaic GPU interpreter, which the CPU tests use, does not run emit_pipeline's
predicated output copies.)

Inside a tile the recurrence runs row by row from shared memory: row ``r`` of a tile is loaded
as a ``[block_d]`` array in the strided layout (each CUDA thread owns ``block_d / 128``
consecutive channels), combined with the float32 carry in registers and stored to the ``y``
tile; the rows of a tile are unrolled. The carry is the step loop's carry (registers), so it
never round-trips through memory between tiles. ``h0`` comes in and ``h_last`` goes out through
a ``[block_d]`` float32 shared-memory buffer with one TMA copy each.

Ragged shapes: rows past ``T`` in the last tile are zero-filled by TMA on the way in and
clipped on the way out; the tile that holds the end of T (the last in scan order, the first
when reversed) runs a shorter, separately traced loop (``lax.cond``) so the carry never sees
them. Channels past ``D`` in the last ``block_d`` tile are
likewise zero-filled / clipped; ``h0`` and ``h_last`` travel padded to a multiple of ``block_d``.
TMA needs 16-byte aligned row strides, so ``D * itemsize`` must be a multiple of 16 for every
stream; ``supports`` says whether a shape can run here (callers fall back to Triton otherwise).

Forward only (no custom VJP of its own): ``linear_scan`` uses it as the forward of
``linear_scan`` when ``ScanConfig.gpu_forward == "mosaic"`` (the backward stays Triton);
``reverse=True`` walks the tiles and the rows of each tile backwards. Measured on an H100 in
docs/kernels.md ("Mosaic GPU forward").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import dispatch

_WARPGROUP = 128
# The defaults: 16 rows x 256 channels x 8 stages, the fastest configuration measured on an H100
# (docs/kernels.md); float32 inputs shrink the stages to fit shared memory.
ROWS, BLOCK_D, STAGES = 16, 256, 8


# Shared memory a block may use on an H100 is 227 KiB; leave room for barriers and Pallas' own
# scratch.
_SMEM_BUDGET = 220 * 1024


def _fit_smem(rows, block_d, stages, y_stages, in_bytes, out_bytes, row_bytes, vec_bytes):
  """``(rows, stages)``, shrunk (stages first, down to 2; then rows) until the rings fit.

  ``in_bytes`` / ``out_bytes``: bytes per (row, channel) of all streams / outputs together;
  ``row_bytes``: bytes per row of the per-token scalars; ``vec_bytes``: bytes per channel of the
  carry and parameter vectors."""
  def smem(rows, stages):
    return (rows * (block_d * (stages * in_bytes + y_stages * out_bytes) + stages * row_bytes)
            + block_d * vec_bytes)
  while smem(rows, stages) > _SMEM_BUDGET and stages > 2:
    stages -= 1
  while smem(rows, stages) > _SMEM_BUDGET and rows > 1:
    rows //= 2
  return rows, stages


def tma_capable(compute_capability: str) -> bool:
  """Whether a CUDA device of this compute capability (``"9.0"``) has TMA (Hopper and newer)."""
  return int(str(compute_capability).split(".")[0]) >= 9


def supports(*streams, token_rows=(), block_d: int = BLOCK_D) -> bool:
  """Whether ``mosaic_scan`` can run these ``[B, T, D]`` streams and ``[B, T]`` per-token rows
  (TMA needs 16-byte aligned row strides)."""
  shape = streams[0].shape
  if len(shape) != 3 or block_d % _WARPGROUP or any(v.shape != shape for v in streams):
    return False
  if any(r.shape != shape[:2] or shape[1] * 4 % 16 for r in token_rows):  # rows go as float32
    return False
  return all(shape[2] * jnp.dtype(v.dtype).itemsize % 16 == 0 for v in streams)


def linear_scan_mgpu(x, a, h0=None, *, reverse=False, rows=ROWS, block_d=BLOCK_D, stages=STAGES,
                     y_stages=2, interpret=False):
  """``(y, h_last)`` of ``h_t = a_t * h_{t-1} + x_t`` (``h_{t+1}`` when ``reverse``).

  Args:
    x, a: ``[B, T, D]`` (float32 or bfloat16; they may differ); see ``supports``.
    h0: ``[B, D]`` float32 or None (zeros).
    reverse, rows, block_d, stages, y_stages, interpret: as in ``mosaic_scan``.

  Returns:
    ``y: [B, T, D]`` in ``x``'s dtype, ``h_last: [B, D]`` float32.
  """
  if h0 is None:
    h0 = jnp.zeros((x.shape[0], x.shape[2]), jnp.float32)
  (y,), (h_last,) = mosaic_scan(linear_step, (x, a), (h0,), out_dtypes=(x.dtype,),
                                reverse=reverse, rows=rows, block_d=block_d, stages=stages,
                                y_stages=y_stages, interpret=interpret)
  return y, h_last


def linear_step(carries, ins):
  """The linear scan's forward step, ``h = a h + x`` (``scan.py`` runs it through either
  driver)."""
  (h,), (x, a) = carries, ins
  h = a * h + x
  return (h,), (h,)


@functools.partial(jax.jit, static_argnames=("step", "out_dtypes", "reverse", "rows", "block_d",
                                             "stages", "y_stages", "row_unroll", "interpret"))
def mosaic_scan(step, streams, carries0, *, out_dtypes, reverse=False, token_rows=(), params=(),
                rows=ROWS, block_d=BLOCK_D, stages=STAGES, y_stages=2, row_unroll=0,
                interpret=False):
  """A forward ``blocked.blocked_scan`` (no lookahead stream) as a Mosaic GPU kernel.

  Args:
    step: the per-step function of ``blocked.blocked_scan``: ``(carries, ins) -> (carries,
      outs)``, ``ins`` = one ``[block_d]`` float32 row of each stream, one scalar of each
      ``token_rows`` array, each ``params`` vector.
    streams: ``[B, T, D]`` arrays (float32 or bfloat16); see ``supports``.
    carries0: ``[B, D]`` float32 initial carries.
    out_dtypes: one dtype per ``[B, T, D]`` output of ``step``.
    reverse: scan from ``t = T-1`` down to 0.
    token_rows: ``[B, T]`` float32 per-token scalars (``T`` a multiple of 4: TMA strides; a
      tile of them must be a multiple of 128 bytes, so ``rows`` a multiple of 32).
    params: ``[D]`` float32 per-channel vectors.
    rows: time rows per pipeline stage (tile height).
    block_d: channels per CUDA block, a multiple of 128 (``block_d / 128`` per CUDA thread).
    stages: shared-memory slots per input; ``stages - 1`` tiles are in flight while one is
      scanned. Stages, then rows, shrink where the rings would not fit in shared memory.
    y_stages: shared-memory slots per output (TMA stores in flight).
    row_unroll: 0: every row of a tile traced (unrolled); N: a loop over the rows, N per
      iteration (shorter compiles for heavy steps).
    interpret: run Pallas' Mosaic GPU interpreter (CPU).

  Returns:
    ``(outputs, carries)``: the ``[B, T, D]`` outputs and the final ``[B, D]`` float32 carries.
  """
  B, T, D = streams[0].shape
  if not supports(*streams, token_rows=token_rows, block_d=block_d):
    raise ValueError(f"unsupported shapes/dtypes for the Mosaic GPU scan: "
                     f"{[(v.shape, v.dtype) for v in streams]}, per-token rows "
                     f"{[r.shape for r in token_rows]}, block_d={block_d}")
  f32 = jnp.float32
  n_in, n_rows, n_par, n_car, n_out = (len(streams), len(token_rows), len(params),
                                       len(carries0), len(out_dtypes))
  n_d = pl.cdiv(D, block_d)
  d_pad = n_d * block_d
  pad_d = lambda v: jnp.pad(v.astype(f32), [(0, 0)] * (v.ndim - 1) + [(0, d_pad - D)])
  vectors = [pad_d(c) for c in carries0] + [pad_d(p) for p in params]
  in_bytes = sum(jnp.dtype(v.dtype).itemsize for v in streams)
  out_bytes = sum(jnp.dtype(dt).itemsize for dt in out_dtypes)
  rows, stages = _fit_smem(rows, block_d, stages, y_stages, in_bytes, out_bytes, 4 * n_rows,
                           4 * (n_car + n_par))
  if token_rows and rows % 32:
    raise ValueError(f"rows={rows} (after fitting shared memory): per-token rows need tiles "
                     "of a multiple of 32 rows")
  n_t = pl.cdiv(T, rows)
  tail = T - (n_t - 1) * rows  # rows of the last time tile, 1..rows
  stages = min(stages, n_t)
  y_stages = min(y_stages, n_t)
  layout = plgpu.Layout.WG_STRIDED((block_d,), vec_size=block_d // _WARPGROUP)

  def load(ref):
    # ref[...] then layout_cast: the lowering takes the cast as the load's layout (jax 0.10-0.11;
    # the interpreter has no layouts and no rule for the cast).
    value = ref[...] if interpret else plgpu.layout_cast(ref[...], layout)
    return value.astype(f32)

  def time_tile(s):  # pipeline step -> time tile
    return n_t - 1 - s if reverse else s

  def kernel(*refs):
    refs = list(refs)

    def take(n):
      taken, refs[:n] = refs[:n], []
      return taken

    in_gmem, row_gmem, vec_gmem = take(n_in), take(n_rows), take(n_car + n_par)
    out_gmem, carry_out_gmem = take(n_out), take(n_car)
    in_smem, row_smem, out_smem = take(n_in), take(n_rows), take(n_out)
    vec_smem, loaded, vec_loaded = take(1)[0], take(1)[0], take(1)[0]
    b = lax.axis_index("b")
    j = lax.axis_index("d")
    channels = pl.ds(j * block_d, block_d)

    def tile(s):  # the [rows, block_d] window of a [B, T, D] stream at pipeline step s
      return (b, pl.ds(time_tile(s) * rows, rows), channels)

    def fetch(s, slot):
      for g, m in zip(in_gmem, in_smem):
        plgpu.copy_gmem_to_smem(g.at[tile(s)], m.at[slot], loaded.at[slot])
      for g, m in zip(row_gmem, row_smem):
        plgpu.copy_gmem_to_smem(g.at[b, pl.ds(time_tile(s) * rows, rows)], m.at[slot],
                                loaded.at[slot])

    # Prologue: the first `stages` tiles in flight. A traced loop index, not Python ints: a
    # static window past T (the short first tile of a reverse scan) fails Pallas' bounds check,
    # while TMA itself zero-fills the rows past T.
    lax.fori_loop(0, stages, lambda s, _: fetch(s, s), None)
    for i, g in enumerate(vec_gmem):  # [B, D] carries, then [D] parameters
      window = (b, channels) if i < n_car else (channels,)
      plgpu.copy_gmem_to_smem(g.at[window], vec_smem.at[i], vec_loaded)
    plgpu.barrier_wait(vec_loaded)
    vectors = [load(vec_smem.at[i]) for i in range(n_car + n_par)]
    carries, param_vals = tuple(vectors[:n_car]), tuple(vectors[n_car:])

    def scan_row(r, slot, y_slot, carries):
      ins = tuple(load(m.at[slot, r]) for m in in_smem)
      ins += tuple(m[slot, r] for m in row_smem)
      carries, outs = step(carries, ins + param_vals)
      for m, value in zip(out_smem, outs):
        m[y_slot, r] = value.astype(m.dtype)
      return carries

    def scan_tile(n, slot, y_slot, carries):
      if not row_unroll:  # every row traced: the fastest code, the longest compile
        for r in (range(n - 1, -1, -1) if reverse else range(n)):
          carries = scan_row(r, slot, y_slot, carries)
        return carries
      row = (lambda i: n - 1 - i) if reverse else (lambda i: i)
      return lax.fori_loop(0, n, lambda i, c: scan_row(row(i), slot, y_slot, c), carries,
                           unroll=min(row_unroll, n))

    def body(s, carries):
      slot = lax.rem(s, stages)
      y_slot = lax.rem(s, y_stages)
      plgpu.barrier_wait(loaded.at[slot])
      # The stores issued y_stages steps ago have finished reading their slot (and all threads
      # wait for that: the wait ends in a warpgroup barrier).
      plgpu.wait_smem_to_gmem(n_out * (y_stages - 1), wait_read_only=True)
      full = functools.partial(scan_tile, rows, slot, y_slot)
      if tail == rows:
        carries = full(carries)
      else:
        short = functools.partial(scan_tile, tail, slot, y_slot)
        carries = lax.cond(time_tile(s) == n_t - 1, short, full, carries)
      # Fence + warpgroup barrier: the output rows are visible to TMA, and every thread is
      # done reading this input slot before it is refilled.
      plgpu.commit_smem()
      for m, g in zip(out_smem, out_gmem):
        plgpu.copy_smem_to_gmem(m.at[y_slot], g.at[tile(s)])

      @pl.when(s + stages < n_t)
      def _():
        fetch(s + stages, slot)

      return carries

    carries = lax.fori_loop(0, n_t, body, carries)
    for i, c in enumerate(carries):
      vec_smem[i] = c
    plgpu.commit_smem()
    for i, g in enumerate(carry_out_gmem):
      plgpu.copy_smem_to_gmem(vec_smem.at[i], g.at[b, channels])
    plgpu.wait_smem_to_gmem(0)

  T_out = T
  token_rows = [r.astype(f32) for r in token_rows]
  if interpret:  # the interpreter rejects the out-of-bounds TMA windows that hardware clips
    pad_t = n_t * rows - T
    streams = [jnp.pad(v, ((0, 0), (0, pad_t), (0, d_pad - D))) for v in streams]
    token_rows = [jnp.pad(r, ((0, 0), (0, pad_t))) for r in token_rows]
    T_out, D_out = n_t * rows, d_pad
  else:
    D_out = D
  results = plgpu.kernel(
      kernel,
      out_type=tuple(jax.ShapeDtypeStruct((B, T_out, D_out), dt) for dt in out_dtypes)
      + (jax.ShapeDtypeStruct((B, d_pad), f32),) * n_car,
      scratch_types=[plgpu.SMEM((stages, rows, block_d), v.dtype) for v in streams]
      + [plgpu.SMEM((stages, rows), f32)] * n_rows
      + [plgpu.SMEM((y_stages, rows, block_d), dt) for dt in out_dtypes]
      + [plgpu.SMEM((n_car + n_par, block_d), f32),
         plgpu.Barrier(num_arrivals=n_in + n_rows, num_barriers=stages),
         plgpu.Barrier(num_arrivals=n_car + n_par)],
      compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
      grid=(B, n_d),
      grid_names=("b", "d"),
      interpret=dispatch.mosaic_gpu_interpreter(interpret),
  )(*streams, *token_rows, *vectors)
  outs = tuple(y[:, :T, :D] for y in results[:n_out])
  return outs, tuple(c[:, :D] for c in results[n_out:])
