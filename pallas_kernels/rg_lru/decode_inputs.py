"""A recurrent block's decoding inputs in one Mosaic GPU kernel (Hopper): both projections
(``linear_x``, ``linear_y``), the Conv1D over the ring of the last inputs, and the ring's slot
write, for one token per row. Work in progress (not yet timed; no default path takes it).

``decode_inputs(x, w_x, b_x, w_y, b_y, conv_w, conv_b, ring, count, segment_pos, *,
interpret=False) -> (xc, y, ring)`` with ``x [N, D]`` (the temporal block's normed input, the
compute dtype), ``w_x``, ``w_y`` ``[D, E]``, ``b_x``, ``b_y``, ``conv_b`` ``[E]``, ``conv_w``
``[4, E]``, ``ring [3, N, E]`` (``layers.Conv1D``'s decoding state: the input of the ``c``-th
token in slot ``c % 3``), ``count`` the tokens the ring has taken, ``segment_pos [N]``:

- ``y = x w_y + b_y`` (``linear_y``'s output);
- ``x_lin = x w_x + b_x``; ``xc = conv_b + x_lin conv_w[3] + sum_s tap_s conv_w[3 - s]`` over
  the taps ``s = 1, 2, 3`` in the token's document (``segment_pos >= s``), tap ``s`` the ring's
  slot ``(count - s) % 3``; the ring with ``x_lin`` in slot ``count % 3``.

Each value is rounded to the compute dtype where ``layers.Dense`` and ``layers.Conv1D`` store
it. XLA runs this as two gemms, a Conv1D pass and a dynamic-update-slice (Hawk 1.3B at 2048
rows on an H200: 2 x 0.033 + 0.016 + 0.008 ms a layer, docs/bench/decode_log.md, session 44).

On ``matmul.persistent``'s skeleton: the output columns are ``[x_lin | y]`` in ``[128, 128]``
tiles, one operand a tile; each CTA walks its ``x`` tiles, then its ``y`` tiles (one progression
over both, so the CTAs stay balanced). An ``x`` tile's prologue loads its three ring tiles
(TMA, under the main loop); its epilogue computes ``xc`` in registers and stores it and
``x_lin`` (into the ring, in place). 3 ring slots of K steps: the ring tiles take the shared
memory a fourth would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu

from pallas_kernels import dispatch
from pallas_kernels.matmul import persistent

TILE = (128, 128, 64)
STAGES = 2  # with the ring's tiles, three slots of K steps would not fit in shared memory
CLUSTER = 2  # CTAs a cluster (neighbouring row tiles sharing each weight tile), as gated_up's
TAPS = 3  # a Conv1D of temporal width 4: the token and three earlier inputs


def problem(n: int, width: int, expanded: int, dtype) -> str | None:
  """Why the kernel cannot take ``x [n, width]`` of ``dtype`` against ``[width, expanded]``
  projections, or None."""
  why = persistent.problem(dtype, width, expanded, tile=TILE, what="RNN width")
  if why:
    return why
  if n % TILE[0]:
    return f"{n} rows (a multiple of {TILE[0]} needed: the ring is written in place)"
  return None


def reference(x, w_x, b_x, w_y, b_y, conv_w, conv_b, ring, count, segment_pos):
  """The same in jnp, as ``layers.Dense`` and ``layers.Conv1D``'s decoding step compute it."""
  dtype = x.dtype
  y = jnp.dot(x, w_y.astype(dtype)) + b_y.astype(dtype)
  x_lin = jnp.dot(x, w_x.astype(dtype)) + b_x.astype(dtype)
  w, b = conv_w.astype(dtype), conv_b.astype(dtype)
  xc = x_lin * w[TAPS] + b
  for s in range(1, TAPS + 1):
    tap = lax.dynamic_index_in_dim(ring, (count - s) % TAPS, keepdims=False).astype(dtype)
    xc = xc + jnp.where((segment_pos >= s)[:, None], tap, 0) * w[TAPS - s]
  return xc, y, lax.dynamic_update_index_in_dim(ring, x_lin.astype(ring.dtype), count % TAPS, 0)


def decode_inputs(x, w_x, b_x, w_y, b_y, conv_w, conv_b, ring, count, segment_pos, *,
                  interpret: bool = False):
  """See the module docstring."""
  n, d = x.shape
  e = w_x.shape[1]
  why = problem(n, d, e, x.dtype)
  if why:
    raise ValueError(f"decode_inputs: the Mosaic GPU kernel does not take {why}")
  if ring.shape != (TAPS, n, e) or ring.dtype != x.dtype or conv_w.shape != (TAPS + 1, e):
    raise ValueError(f"decode_inputs: ring {ring.shape} {ring.dtype}, conv_w {conv_w.shape}: "
                     f"need [{TAPS}, {n}, {e}] {x.dtype} and [{TAPS + 1}, {e}]")
  return _mosaic(x, w_x.astype(x.dtype), b_x, w_y.astype(x.dtype), b_y, conv_w, conv_b, ring,
                 count, segment_pos, interpret=interpret)


def _mosaic(x, w_x, b_x, w_y, b_y, conv_w, conv_b, ring, count, segment_pos, *,
            interpret: bool, stages: int = STAGES, cluster: int = CLUSTER, tile=TILE):
  n, _ = x.shape
  e = w_x.shape[1]
  dtype, f32 = x.dtype, jnp.float32
  tile_m, tile_n, _ = tile
  half = tile_m // 2
  # (rows not in whole cluster tiles take none: the ring is written in place, so not padded)
  _, tiles, grid, cluster = persistent.schedule(
      n, e, tile=tile, cluster=1 if n % (tile_m * cluster) else cluster, interpret=interpret)
  # The vectors, float32, one row each: b_x, conv_w[0..3], conv_b, b_y.
  params = jnp.concatenate([b_x[None], conv_w, conv_b[None], b_y[None]]).astype(f32)
  slots = ((count - jnp.arange(1, TAPS + 1)) % TAPS).astype(jnp.int32)  # tap s's ring slot
  valid = (segment_pos[None, :] >= jnp.arange(1, TAPS + 1)[:, None]).astype(f32)  # [3, N]
  swizzle = plmgpu.find_swizzle(tile_n * 16)
  tr = (plmgpu.TilingTransform((8, swizzle // 2)), plmgpu.SwizzleTransform(swizzle))
  rounded = lambda v: v.astype(dtype).astype(f32)

  def kernel(x_g, wx_g, wy_g, par_g, slots_g, valid_g, ring_g, xc_g, y_g):
    def column(par_s, wg, i):
      if interpret:  # the interpreter has no layouts
        v = par_s[wg, i]
      else:
        v = plmgpu.load(par_s.at[wg, i], (), layout=plmgpu.Layout.WGMMA.reduce(0))
      return lax.broadcast_in_dim(rounded(v), (half, tile_n), [1])

    def row(valid_s, wg, s):
      if interpret:
        v = valid_s[wg, s]
      else:
        v = plmgpu.load(valid_s.at[wg, s], (), layout=plmgpu.Layout.WGMMA.reduce(1))
      return lax.broadcast_in_dim(v, (half, tile_n), [0]) > 0.5

    def prologue(tm, tn, wg, mine, taps_s, par_s, valid_s, bar):
      plmgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores have read
      plmgpu.copy_gmem_to_smem(par_g.at[:, tn], par_s.at[wg], bar.at[wg])
      plmgpu.copy_gmem_to_smem(valid_g.at[:, pl.ds(tm.start + mine.start, half)],
                               valid_s.at[wg], bar.at[wg])
      for s in range(TAPS):
        plmgpu.copy_gmem_to_smem(ring_g.at[slots_g[s]].at[tm].at[mine].at[:, tn],
                                 taps_s.at[wg, s], bar.at[wg])

    def epilogue(accs, tm, tn, wg, mine, taps_s, par_s, valid_s, bar):
      plmgpu.barrier_wait(bar.at[wg])
      x_lin = rounded(rounded(accs[0][...]) + column(par_s, wg, 0))
      xc = rounded(rounded(x_lin * column(par_s, wg, 1 + TAPS)) + column(par_s, wg, 2 + TAPS))
      for s in range(1, TAPS + 1):
        tap = taps_s[wg, s - 1].astype(f32)
        term = rounded(jnp.where(row(valid_s, wg, s - 1), tap, 0.0)
                       * column(par_s, wg, 1 + TAPS - s))
        xc = rounded(xc + term)
      y = rounded(rounded(accs[1][...]) + column(par_s, wg, 3 + TAPS))
      # (the taps are in registers now: their slots take the outputs)
      for s, v in enumerate((xc, y, x_lin)):
        taps_s[wg, s] = v.astype(dtype)
      plmgpu.commit_smem()
      plmgpu.copy_smem_to_gmem(taps_s.at[wg, 0], xc_g.at[tm].at[mine].at[:, tn])
      plmgpu.copy_smem_to_gmem(taps_s.at[wg, 1], y_g.at[tm].at[mine].at[:, tn])
      plmgpu.copy_smem_to_gmem(taps_s.at[wg, TAPS - 1],
                               ring_g.at[slots_g[TAPS - 1]].at[tm].at[mine].at[:, tn])

    persistent.tiles(
        x_g, lambda cols: (wx_g.at[:, cols], wy_g.at[:, cols]), lax.axis_index("sm"), tiles,
        grid, tile=tile, prologue=prologue, epilogue=epilogue, stages=stages, cluster=cluster,
        scratch=(("taps_s", plmgpu.SMEM((2, TAPS, half, tile_n), dtype, transforms=tr)),
                 ("par_s", plmgpu.SMEM((2, TAPS + 4, tile_n), f32)),
                 ("valid_s", plmgpu.SMEM((2, TAPS, half), f32)),
                 ("bar", plmgpu.Barrier(num_arrivals=2 + TAPS, num_barriers=2))))

  ring_ref = jax.new_ref(ring, memory_space=plmgpu.GMEM)
  # pl.kernel (plgpu.kernel's batching wrapper takes no Ref operands): the ring, a Ref, is
  # written in place
  call = pl.kernel(
      kernel, out_type=(jax.ShapeDtypeStruct((n, e), dtype), jax.ShapeDtypeStruct((n, e), dtype)),
      mesh=plmgpu.Mesh(grid=(grid,), grid_names=("sm",), num_threads=3, thread_name="wg",
                       **persistent.cluster_launch(cluster)),
      compiler_params=plmgpu.CompilerParams(
          lowering_semantics=plmgpu.LoweringSemantics.Warpgroup),
      interpret=dispatch.mosaic_gpu_interpreter(interpret), name="decode_inputs")
  xc, y = call(x, w_x, w_y, params, slots, valid, ring_ref)
  return xc, y, ring_ref[...]
