"""Multi-query decode attention on Hopper's tensor cores (Pallas Mosaic GPU).

One new query token per row, its ``N`` heads against the cached keys and values of the one
key/value head: a global cache's first ``lengths[b]`` slots, or a local-attention ring masked to
the window. One CTA a row; one warpgroup runs a ring of ``stages`` TMA loads of ``block_k`` keys
and values and stops at the row's last filled tile, so a row reads only its filled part. The
heads take the first of wgmma's 64 rows (loaded by TMA, no padded copy in HBM); ``q k^T`` and
``p v`` run on the tensor cores with an online softmax in registers (float32), the tiles masked
past the length and outside the window.

On an H200 at MQA 1.3B's shape (1024 rows, 2048 slots, 16 heads of 128) it takes 0.163-0.177 ms
over ragged lengths against 0.206-0.212 for JAX's Triton decode kernel, 0.275 against 0.336-0.353
over full rows (docs/kernels.md); ``dispatch.decode_attention_path`` picks it on Hopper GPUs.

In Pallas' Mosaic GPU interpreter (the CPU tests) the keys go in transposed, ``[B, H, S]``,
since the interpreter's wgmma takes no transposed operand; ``p`` goes through shared memory and
the iota has no layout. The ring, the length bound, the masks and the softmax are the same code.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import dispatch

QUERY_ROWS = 64  # wgmma's rows: the heads, padded
BLOCK_K = 64  # keys a ring slot
STAGES = 2  # ring slots
HEAD_DIMS = (64, 128)  # head sizes it runs: the accumulator is 64 x H float32 in one warpgroup
DTYPES = ("bfloat16", "float16")


def problem(q_shape, cache_shape, dtype) -> str | None:
  """Why ``mqa_decode`` cannot take ``q [B, N, H]`` against a ``[B, S, H]`` cache of ``dtype``,
  or None."""
  _, n, h = q_shape
  if jnp.dtype(dtype).name not in DTYPES:
    return f"dtype {jnp.dtype(dtype).name} (allowed: {', '.join(DTYPES)})"
  if n > QUERY_ROWS:
    return f"{n} query heads (at most {QUERY_ROWS})"
  if h not in HEAD_DIMS:
    return f"head size {h} (allowed: {HEAD_DIMS})"
  if cache_shape[1] % BLOCK_K:
    return f"{cache_shape[1]} cache slots (a multiple of {BLOCK_K} needed)"
  return None


def mqa_decode(q, keys, values, lengths, *, scale: float, window: int | None = None,
               block_k: int = BLOCK_K, stages: int = STAGES, interpret: bool = False):
  """``softmax(scale q k^T) v`` over each row's cached keys of the current document.

  ``lengths[b]`` (at least 1) is the document's tokens so far, the new one included; token p
  sits at slot ``p % S``, the last S tokens kept. Global attention (``window=None``,
  ``S >= lengths``): slots ``0 .. lengths[b] - 1``. Local attention over a ring of S slots:
  the filled slots whose token is at most ``window`` before the new one (all of them when
  ``S <= window``, a cache shorter than the window).

  q: [B, N, H]; keys, values: [B, S, H], S a multiple of ``block_k``; lengths: [B] int.
  Returns [B, N, H] in q's dtype."""
  b_, n, h = q.shape
  size = keys.shape[1]
  why = problem(q.shape, keys.shape, q.dtype)
  if not why and size % block_k:
    why = f"{size} cache slots for block_k={block_k}"
  if why:
    raise ValueError(f"mqa_decode: unsupported {why}")
  c = scale * math.log2(math.e)  # the softmax runs in base 2
  heads = -(-n // 8) * 8  # rows of whole 8-row tiles in shared memory (padded in XLA if need be)
  rows = QUERY_ROWS

  def body(len_g, q_g, k_g, v_g, o_g, q_s, k_s, v_s, p_s, loaded, q_bar):
    b = lax.axis_index("row")
    length = len_g[b]
    filled = jnp.minimum(length, size)  # slots holding this document's tokens
    newest = lax.rem(length - 1, size)  # the new token's slot
    tiles = (filled + block_k - 1) // block_k

    def fetch(t, slot):
      keys_at = (k_g.at[b, :, pl.ds(t * block_k, block_k)] if interpret
                 else k_g.at[b, pl.ds(t * block_k, block_k)])
      plgpu.copy_gmem_to_smem(keys_at, k_s.at[slot], loaded.at[slot])
      plgpu.copy_gmem_to_smem(v_g.at[b, pl.ds(t * block_k, block_k)], v_s.at[slot],
                              loaded.at[slot])

    # The heads fill the first of the 64 query rows; the rest hold whatever shared memory
    # held: every step is row by row (scores, softmax, p v), so they reach no real head.
    plgpu.copy_gmem_to_smem(q_g.at[b], q_s.at[pl.ds(0, heads)], q_bar)
    lax.fori_loop(0, jnp.minimum(stages, tiles), lambda t, _: fetch(t, t), None)
    plgpu.barrier_wait(q_bar)
    if interpret:  # the interpreter has no layouts
      key_iota = lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
    else:
      key_iota = plgpu.broadcasted_iota(jnp.int32, (rows, block_k), 1,
                                        layout=plgpu.Layout.WGMMA)

    def step(t, state):
      acc, m, l = state
      slot = lax.rem(t, stages)
      plgpu.barrier_wait(loaded.at[slot])

      def scores(ref):
        k_t = k_s.at[slot] if interpret else plgpu.transpose_ref(k_s.at[slot], (1, 0))
        plgpu.wgmma(ref, q_s, k_t)
        return ref[...]
      s = pl.run_scoped(scores, plgpu.ACC((rows, block_k), jnp.float32))
      slot_of = key_iota + lax.broadcast_in_dim(t * block_k, s.shape, ())
      visible = slot_of < lax.broadcast_in_dim(filled, s.shape, ())
      if window is not None:  # tokens back from the new one: (newest - slot) mod size
        back = lax.broadcast_in_dim(newest, s.shape, ()) - slot_of
        back = jnp.where(back < 0, back + lax.broadcast_in_dim(size, s.shape, ()), back)
        visible &= back <= lax.broadcast_in_dim(window, s.shape, ())
      s = jnp.where(visible, s * c, lax.broadcast_in_dim(jnp.float32(-jnp.inf), s.shape, ()))
      m_new = jnp.maximum(m, s.max(axis=1))
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
      l = l * alpha + p.sum(axis=1)

      def mix(ref):
        if interpret:  # the interpreter's wgmma reads its left operand from shared memory
          p_s[...] = p.astype(p_s.dtype)
          plgpu.wgmma(ref, p_s, v_s.at[slot])
        else:
          plgpu.wgmma(ref, p.astype(v_s.dtype), v_s.at[slot])
        return ref[...]
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pl.run_scoped(
          mix, plgpu.ACC((rows, h), jnp.float32))
      plgpu.commit_smem()  # every thread is done with this slot before it is refilled

      @pl.when(t + stages < tiles)
      def _():
        fetch(t + stages, slot)
      return acc, m_new, l

    acc, _, l = lax.fori_loop(
        0, tiles, step, (jnp.zeros((rows, h), jnp.float32),
                         jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32)))
    q_s[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(q_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s.at[pl.ds(0, heads)], o_g.at[b])
    plgpu.wait_smem_to_gmem(0)

  key_tile = (h, block_k) if interpret else (block_k, h)
  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((b_, heads, h), q.dtype), grid=(b_,),
      grid_names=("row",),
      scratch_types=(plgpu.SMEM((rows, h), q.dtype), plgpu.SMEM((stages, *key_tile), q.dtype),
                     plgpu.SMEM((stages, block_k, h), q.dtype),
                     plgpu.SMEM((rows, block_k), q.dtype),
                     plgpu.Barrier(num_arrivals=2, num_barriers=stages), plgpu.Barrier()),
      compiler_params=plgpu.CompilerParams(approx_math=True,
                                           lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=dispatch.mosaic_gpu_interpreter(interpret))
  keys = keys.astype(q.dtype)
  q = jnp.pad(q, ((0, 0), (0, heads - n), (0, 0)))
  out = kernel(lengths.astype(jnp.int32), q, keys.swapaxes(1, 2) if interpret else keys,
               values.astype(q.dtype))
  return out[:, :n]


def visible_slots(lengths, size: int, window: int | None):
  """[B, S]: the slots ``mqa_decode`` attends to."""
  slot = jnp.arange(size)[None]
  visible = slot < jnp.minimum(lengths, size)[:, None]
  if window is not None:
    visible &= (lengths[:, None] - 1 - slot) % size <= window
  return visible


def reference(q, keys, values, lengths, *, scale: float, window: int | None = None):
  """The same attention in XLA, in float32 (float64 for float64 inputs)."""
  wide = lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32))
  s = jnp.einsum("bnh,bsh->bns", wide(q), wide(keys)) * scale
  s = jnp.where(visible_slots(lengths, keys.shape[1], window)[:, None], s, -jnp.inf)
  return jnp.einsum("bns,bsh->bnh", jax.nn.softmax(s, -1), wide(values))
