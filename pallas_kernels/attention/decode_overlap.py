"""One half-batch's decode attention beside the other half's MLP up-projection, in one launch.

Issue #18 (a): MQA's decoding step reads its KV cache (memory-bound) and runs its matmuls
(compute-bound) one after the other, because XLA runs one kernel at a time and each fills the
GPU (docs/inference.md). With the batch decoded as two half-batches a layer apart, one half's
attention and the other half's MLP depend on nothing of each other. This kernel runs both:

``attention_and_gated_up(q, keys, values, lengths, x, w, b, *, scale, row_offset=0,
window=None) -> (o, h)``, with ``o`` what ``attention.decode.mqa_decode`` gives for ``q``
against the cache rows ``row_offset .. row_offset + len(q) - 1`` (``keys``, ``values``,
``lengths`` are the whole batch's: no copy of a half), and ``h`` what ``mlp.gated_up`` gives for
``x``. Work items, one CTA each: the attention's rows (``decode.row_attention``, one warpgroup
of the CTA's three) spread evenly among the up-projection's output tiles
(``gated_up.mosaic_tiles``, all three), in launch order, so that the hardware hands each SM the
next item as it frees and both kinds end together, whatever their speeds (session 41's probe:
9-15% faster than the two in sequence, scripts/bench/probe_overlap_mgpu.py).

Hopper only (wgmma, TMA); ``interpret=True`` runs it in Pallas' Mosaic GPU interpreter, whose
three warpgroup threads block in turn on each other's barriers: it needs the host's XLA client
to run three computations at once (the tests' 8 host devices give that; a 2-core machine's
default deadlocks, as it does for ``gated_up``'s Mosaic kernel). Not yet
on the model's path: the two-half-batch decoding step that would call it is still to build,
and its speed on a GPU is measured by ``scripts/bench/bench_decode_kernels.py --only overlap``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import dispatch
from pallas_kernels.attention import decode
from pallas_kernels.mlp import gated_up


@functools.partial(jax.jit, static_argnames=("scale", "row_offset", "window", "interpret"))
def attention_and_gated_up(q, keys, values, lengths, x, w, b, *, scale: float,
                           row_offset: int = 0, window: int | None = None,
                           interpret: bool = False):
  """See the module docstring. q: [A, N, H]; keys, values: [B, S, H] with ``row_offset + A <=
  B``; lengths: [B]; x: [R, D]; w: [2, D, M]; b: [2, M]."""
  rows, n, head = q.shape
  size = keys.shape[1]
  why = decode.problem(q.shape, keys.shape, q.dtype) or gated_up.mosaic_problem(
      x.shape[1], w.shape[-1], x.dtype)
  if not why and row_offset + rows > keys.shape[0]:
    why = f"rows {row_offset}..{row_offset + rows - 1} of a {keys.shape[0]}-row cache"
  if why:
    raise ValueError(f"attention_and_gated_up: unsupported {why}")
  heads = -(-n // 8) * 8
  scratch, attend = decode.row_attention(
      size=size, heads=heads, head_dim=head, dtype=q.dtype, scale=scale, window=window,
      block_k=decode.BLOCK_K, stages=decode.STAGES, interpret=interpret)
  tile_m, tile_n, _ = gated_up.MOSAIC_TILE
  x_rows = -(-x.shape[0] // tile_m) * tile_m
  tiles = x_rows // tile_m * (w.shape[-1] // tile_n)
  items = rows + tiles

  def kernel(len_g, q_g, k_g, v_g, x_g, w_g, b_g, o_g, h_g):
    i, wg = lax.axis_index("item"), lax.axis_index("wg")
    # item i is a row of attention when the running count of rows, (i + 1) A / items, steps up
    before, upto = i * rows // items, (i + 1) * rows // items

    @pl.when(upto > before)
    def _():
      mine = pl.ds(row_offset, rows)

      def row(*scratch_refs):
        @pl.when(wg == 0)  # one warpgroup a row, as in mqa_decode
        def _():
          attend(before, len_g.at[mine], q_g, k_g.at[mine], v_g.at[mine], o_g, *scratch_refs)
      pl.run_scoped(row, *scratch, collective_axes="wg")

    @pl.when(upto == before)
    def _():
      t = i - upto
      gated_up.mosaic_tiles(x_g, w_g, b_g, h_g, t, t + 1, 1, interpret=interpret)

  call = plgpu.kernel(
      kernel, out_type=(jax.ShapeDtypeStruct((rows, heads, head), q.dtype),
                        jax.ShapeDtypeStruct((x_rows, w.shape[-1]), x.dtype)),
      grid=(items,), grid_names=("item",), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=dispatch.mosaic_gpu_interpreter(interpret))
  q, keys, values = decode.kernel_operands(q, keys, values, heads, interpret)
  o, h = call(lengths.astype(jnp.int32), q, keys, values,
              jnp.pad(x, ((0, x_rows - x.shape[0]), (0, 0))), w.astype(x.dtype),
              b.astype(jnp.float32))
  return o[:, :n], h[:x.shape[0]]
