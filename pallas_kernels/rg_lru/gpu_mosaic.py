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

_WARPGROUP = 128
# The defaults: 16 rows x 256 channels x 8 stages, the fastest configuration measured on an H100
# (docs/kernels.md); float32 inputs shrink the stages to fit shared memory.
ROWS, BLOCK_D, STAGES = 16, 256, 8


def _interpret_params():
  # Pallas' Mosaic GPU interpreter (simulates TMA, barriers and the warpgroup on the CPU);
  # `interpret=True` would pick the generic interpreter, which has no rules for async copies.
  from jax._src.pallas.mosaic_gpu.interpret import params  # pylint: disable=g-import-not-at-top
  return params.InterpretGPUParams()


# Shared memory a block may use on an H100 is 227 KiB; leave room for barriers and Pallas' own
# scratch.
_SMEM_BUDGET = 220 * 1024


def _fit_smem(rows, block_d, stages, y_stages, x_bytes, a_bytes):
  """``(rows, stages)``, shrunk (stages first, down to 2; then rows) until the rings fit."""
  def smem(rows, stages):
    return rows * block_d * (stages * (x_bytes + a_bytes) + y_stages * x_bytes) + block_d * 4
  while smem(rows, stages) > _SMEM_BUDGET and stages > 2:
    stages -= 1
  while smem(rows, stages) > _SMEM_BUDGET and rows > 1:
    rows //= 2
  return rows, stages


def tma_capable(compute_capability: str) -> bool:
  """Whether a CUDA device of this compute capability (``"9.0"``) has TMA (Hopper and newer)."""
  return int(str(compute_capability).split(".")[0]) >= 9


def supports(x, a, block_d: int = BLOCK_D) -> bool:
  """Whether ``linear_scan_mgpu`` can run these ``[B, T, D]`` inputs (TMA stride alignment)."""
  if x.ndim != 3 or a.shape != x.shape or block_d % _WARPGROUP:
    return False
  d = x.shape[2]
  return all(d * jnp.dtype(v.dtype).itemsize % 16 == 0 for v in (x, a))


@functools.partial(jax.jit, static_argnames=("reverse", "rows", "block_d", "stages",
                                             "y_stages", "auto_barriers", "interpret"))
def linear_scan_mgpu(x, a, h0=None, *, reverse=False, rows=ROWS, block_d=BLOCK_D, stages=STAGES,
                     y_stages=2, auto_barriers=False, interpret=False):
  """``(y, h_last)`` of ``h_t = a_t * h_{t-1} + x_t`` (``h_{t+1}`` when ``reverse``).

  Args:
    x, a: ``[B, T, D]`` (float32 or bfloat16; they may differ); see ``supports``.
    h0: ``[B, D]`` float32 or None (zeros).
    reverse: scan from ``t = T-1`` down to 0.
    rows: time rows per pipeline stage (tile height).
    block_d: channels per CUDA block, a multiple of 128 (``block_d / 128`` per CUDA thread).
    stages: shared-memory slots for x and for a; ``stages - 1`` tiles are in flight while one
      is scanned. Stages, then rows, shrink where the rings would not fit in shared memory
      (float32 inputs take twice the bytes).
    y_stages: shared-memory slots for y (TMA stores in flight).
    auto_barriers: let Pallas put a warpgroup barrier around every shared-memory store (not
      needed here: each thread reads back only what it wrote, and the pipeline synchronises
      before every TMA copy).
    interpret: run Pallas' Mosaic GPU interpreter (CPU).

  Returns:
    ``y: [B, T, D]`` in ``x``'s dtype, ``h_last: [B, D]`` float32.
  """
  B, T, D = x.shape
  if not supports(x, a, block_d):
    raise ValueError(f"unsupported shape/dtypes for the Mosaic GPU scan: {x.shape} "
                     f"{x.dtype} {a.dtype}, block_d={block_d}")
  f32 = jnp.float32
  n_d = pl.cdiv(D, block_d)
  d_pad = n_d * block_d
  h0 = jnp.zeros((B, D), f32) if h0 is None else h0.astype(f32)
  if d_pad != D:
    h0 = jnp.pad(h0, ((0, 0), (0, d_pad - D)))
  rows, stages = _fit_smem(rows, block_d, stages, y_stages,
                           jnp.dtype(x.dtype).itemsize, jnp.dtype(a.dtype).itemsize)
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

  def kernel(x_gmem, a_gmem, h0_gmem, y_gmem, hl_gmem, x_smem, a_smem, y_smem, vec_smem,
             loaded, vec_loaded):
    b = lax.axis_index("b")
    j = lax.axis_index("d")
    channels = pl.ds(j * block_d, block_d)

    def tile(s):  # the [rows, block_d] window of a [B, T, D] stream at pipeline step s
      return (b, pl.ds(time_tile(s) * rows, rows), channels)

    def fetch(s, slot):
      plgpu.copy_gmem_to_smem(x_gmem.at[tile(s)], x_smem.at[slot], loaded.at[slot])
      plgpu.copy_gmem_to_smem(a_gmem.at[tile(s)], a_smem.at[slot], loaded.at[slot])

    # Prologue: the first `stages` tiles in flight. A traced loop index, not Python ints: a
    # static window past T (the short first tile of a reverse scan) fails Pallas' bounds check,
    # while TMA itself zero-fills the rows past T.
    lax.fori_loop(0, stages, lambda s, _: fetch(s, s), None)
    plgpu.copy_gmem_to_smem(h0_gmem.at[b, channels], vec_smem, vec_loaded)
    plgpu.barrier_wait(vec_loaded)
    h = load(vec_smem)

    def scan_tile(n, slot, y_slot, h):
      x_tile, a_tile, y_tile = x_smem.at[slot], a_smem.at[slot], y_smem.at[y_slot]
      for r in (range(n - 1, -1, -1) if reverse else range(n)):
        h = load(a_tile.at[r]) * h + load(x_tile.at[r])
        y_tile[r] = h.astype(y_tile.dtype)
      return h

    def step(s, h):
      slot = lax.rem(s, stages)
      y_slot = lax.rem(s, y_stages)
      plgpu.barrier_wait(loaded.at[slot])
      # The y store issued y_stages steps ago has finished reading its slot (and all threads
      # wait for that: the wait ends in a warpgroup barrier).
      plgpu.wait_smem_to_gmem(y_stages - 1, wait_read_only=True)
      full = functools.partial(scan_tile, rows, slot, y_slot)
      if tail == rows:
        h = full(h)
      else:
        short = functools.partial(scan_tile, tail, slot, y_slot)
        h = lax.cond(time_tile(s) == n_t - 1, short, full, h)
      # Fence + warpgroup barrier: the y rows are visible to TMA, and every thread is done
      # reading this x / a slot before it is refilled.
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(y_smem.at[y_slot], y_gmem.at[tile(s)])

      @pl.when(s + stages < n_t)
      def _():
        fetch(s + stages, slot)

      return h

    h = lax.fori_loop(0, n_t, step, h)
    vec_smem[...] = h
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(vec_smem, hl_gmem.at[b, channels])
    plgpu.wait_smem_to_gmem(0)

  T_out = T
  if interpret:  # the interpreter rejects the out-of-bounds TMA windows that hardware clips
    x, a = (jnp.pad(v, ((0, 0), (0, n_t * rows - T), (0, d_pad - D))) for v in (x, a))
    T_out, D_out = n_t * rows, d_pad
  else:
    D_out = D
  y, h_last = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((B, T_out, D_out), x.dtype),
                jax.ShapeDtypeStruct((B, d_pad), f32)),
      scratch_types=[
          plgpu.SMEM((stages, rows, block_d), x.dtype),
          plgpu.SMEM((stages, rows, block_d), a.dtype),
          plgpu.SMEM((y_stages, rows, block_d), x.dtype),
          plgpu.SMEM((block_d,), f32),
          plgpu.Barrier(num_arrivals=2, num_barriers=stages),
          plgpu.Barrier(),
      ],
      compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=not auto_barriers),
      grid=(B, n_d),
      grid_names=("b", "d"),
      interpret=_interpret_params() if interpret else None,
  )(x, a, h0)
  return y[:, :T, :D], h_last[:, :D]
