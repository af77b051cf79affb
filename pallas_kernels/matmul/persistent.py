"""The skeleton of this package's Mosaic GPU matmul kernels: ``x [R, D]`` against one or more
right-hand operands, over output tiles walked by persistent CTAs, with an epilogue of the
caller's.

``tiles(x_g, operands, first, stop, step, *, tile, epilogue, prologue=None, scratch=(),
transposed=False, stages, cluster=1)`` runs inside a ``plgpu.kernel`` of three warpgroups
(axis ``"wg"``; one memory, two compute) and walks output tiles ``first, first + step, ... <
stop``, the rows fastest, so the CTAs running at once share each right-hand tile through L2.
With ``cluster`` > 1 (a kernel launched with ``cluster_launch(cluster)``) a tile index stands for
``cluster`` neighbouring row tiles, one a CTA of the cluster, which load each right-hand tile
once between them (TMA multicast). ``schedule`` gives the padded rows, the tile count, the
grid and the cluster size (none in the interpreter).
A memory warpgroup streams ``x``'s tile and each operand's through a ring of ``stages`` TMA
slots (K steps of ``tile[2]``); each compute warpgroup runs wgmma over its 64 rows into one
``[64, tile[1]]`` float32 accumulator an operand, then calls
``epilogue(accs, tm=, tn=, wg=, mine=, **scratch)`` (``tm``, ``tn``: the tile's rows and
columns as slices; ``wg``: the warpgroup; ``mine``: its rows of the tile), after
``prologue(tm=, tn=, wg=, mine=, **scratch)`` where given (issued before the main loop, to
overlap it: a bias load). ``operands(cols)`` gives each operand's ``[D, cols]`` slice (or
``[cols, D]`` with ``transposed``, read as ``x op^T``; Pallas' Mosaic GPU interpreter takes no
transposed operand, so there the caller passes ``[D, cols]`` slices and ``transposed=False``).

Used by ``pallas_kernels.mlp.gated_up`` (two operands: the MLP's branches) and
``pallas_kernels.sampling.greedy`` (one, the embedding table, transposed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


DTYPES = ("bfloat16", "float16")  # wgmma's 16-bit operands


def problem(dtype, width: int, columns: int, *, tile, what: str) -> str | None:
  """Why ``tiles`` cannot take ``x [N, width]`` of ``dtype`` against operands of ``columns``
  columns (named ``what`` in the message) at ``tile``, or None."""
  if jnp.dtype(dtype).name not in DTYPES:
    return f"dtype {jnp.dtype(dtype).name} (allowed: {', '.join(DTYPES)})"
  _, cols, k_step = tile
  if width % k_step or columns % cols:
    return f"width {width} and {what} {columns} (multiples of {k_step} and {cols} needed)"
  return None


def schedule(n: int, columns: int, *, tile, cluster: int, interpret: bool):
  """``(rows, tiles, grid, cluster)`` for ``x [n, D]`` against ``columns`` operand columns: the
  rows padded to whole tiles of every CTA of a cluster, the number of cluster tiles (``tiles``'
  ``stop``), the grid (one cluster for every ``cluster`` SMs, no more than there are tiles), and
  the CTAs a cluster. Pallas' Mosaic GPU interpreter has no cluster barriers: there, three CTAs
  and no clusters."""
  cluster = 1 if interpret else cluster
  rows = -(-n // (tile[0] * cluster)) * tile[0] * cluster
  tiles = rows // (tile[0] * cluster) * (columns // tile[1])
  sms = 3 if interpret else getattr(jax.devices()[0], "core_count", 132)
  return rows, tiles, min(sms // cluster, tiles), cluster


def cluster_launch(cluster: int) -> dict:
  """``plgpu.kernel``'s keyword arguments for clusters of ``cluster`` CTAs (axis
  ``"cluster"``)."""
  return dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}


def tiles(x_g, operands, first, stop, step, *, tile, epilogue, prologue=None, scratch=(),
          transposed: bool = False, stages: int, cluster: int = 1):
  """See the module docstring. ``scratch``: ``(name, type)`` pairs of the epilogue's shared
  memory and barriers, passed to it (and the prologue) by name."""
  d = x_g.shape[1]
  tile_m, tile_n, tile_k = tile
  half = tile_m // 2  # rows of a compute warpgroup
  m_tiles = x_g.shape[0] // (tile_m * cluster)  # row tiles of a cluster
  swizzle = plgpu.find_swizzle(tile_k * 16)
  in_tr = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
  first_cols = operands(pl.ds(0, tile_n))

  def pipeline(body, context):
    spec = lambda shape, at, shared=(): plgpu.BlockSpec(
        shape, at, transforms=in_tr, memory_space=plgpu.SMEM, collective_axes=shared)
    shared = ("cluster",) if cluster > 1 else ()  # the cluster's CTAs share operand tiles
    op_spec = (spec((tile_n, tile_k), lambda k: (0, k), shared) if transposed
               else spec((tile_k, tile_n), lambda k: (k, 0), shared))
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(d // tile_k,), memory_registers=40,
        in_specs=[spec((tile_m, tile_k), lambda k: (0, k))] + [op_spec] * len(first_cols),
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=stages, compute_context=context)

  wg = lax.axis_index("wg")
  ignore = lambda *_, **__: None
  allocs = pipeline(ignore, ignore).get_allocations(x_g.at[pl.ds(0, tile_m)], *first_cols)

  @functools.partial(pl.run_scoped, allocs=allocs, **dict(scratch), collective_axes="wg")
  def _(allocs, **scratch_refs):
    @pl.loop(first, stop, step=step)
    def _(t):
      row = t % m_tiles * cluster + (lax.axis_index("cluster") if cluster > 1 else 0)
      tm, tn = pl.ds(row * tile_m, tile_m), pl.ds(t // m_tiles * tile_n, tile_n)
      at = dict(tm=tm, tn=tn, wg=wg, mine=pl.ds(wg * half, half))  # mine: the warpgroup's rows

      def context(run):
        if prologue is not None:
          prologue(**at, **scratch_refs)

        def accumulate(*accs):
          run(accs)
          epilogue(accs, **at, **scratch_refs)
        pl.run_scoped(accumulate,
                      *[plgpu.ACC((half, tile_n), jnp.float32) for _ in first_cols])

      def step_k(_, x_s, *refs):
        op_s, accs = refs[:-1], refs[-1]
        for acc, o_s in zip(accs, op_s):
          plgpu.wgmma(acc, x_s.at[at["mine"]],
                      plgpu.transpose_ref(o_s, (1, 0)) if transposed else o_s)
        plgpu.wgmma_wait(0)
        return accs

      pipeline(step_k, context)(x_g.at[tm], *operands(tn), allocations=allocs)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
