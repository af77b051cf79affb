"""Multi-query attention within a row through JAX's TPU splash attention kernel.

``jax.experimental.pallas.ops.tpu.splash_attention`` is a flash-attention kernel for TPUs
(Mosaic) that skips the blocks of the score matrix its mask leaves empty, so local attention
costs ``O(T * window)``. It works on one row, ``q [N, T, H]`` against one key/value head
``[T, H]``; ``splash_mqa`` vmaps it over the rows of a batch and states our attention in its
terms:

- causal, and a local window where token ``t`` sees keys ``t - window .. t`` (``window + 1``
  keys, the official RecurrentGemma convention, as ``recurrentgemma_jax.attention.attention_mask``):
  ``LocalMask(window_size=(window, 0))``, or ``CausalMask`` for global attention. Both are
  computed inside the kernel from block indices, never stored as ``T x T``.
- documents packed in a row kept apart: the document ids ``cumsum(segment_pos == 0)`` are its
  ``SegmentIds`` (queries and keys alike).
- the scale multiplies ``q`` before the kernel, which does not scale the scores itself.

Limits (``problem`` states them for the model config):

- Sequence blocks are multiples of 128 (the kernel's key blocks must be whole lanes), so a row
  is padded at its end to a multiple of 128. The padding is its own document after every real
  token: causality keeps it out of every real query, and its queries' outputs are dropped (no
  gradient flows from them). Blocks are the largest of 512, 256 and 128 dividing the padded
  length.
- Any head dimension compiles (Mosaic pads the lanes of its tiles to 128): heads smaller than
  128, as in tiny test models, cost what heads of 128 do.
- float32 or bfloat16 (the kernel keeps its softmax statistics in float32); TPUs, or the Pallas
  interpreter on a CPU target (``dispatch.interpret_on``); not GPUs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from pallas_kernels import dispatch

LANES = 128  # the kernel's key blocks are multiples of this
BLOCKS = (512, 256, 128)  # tried in order: the first that divides the padded length
DTYPES = ("float32", "bfloat16")
_PAD_DOCUMENT = -1  # document id of the padding (real ids are >= 0)


def problem(dtype: str, platform: str) -> str | None:
  """Why ``splash_mqa`` cannot run for activations of ``dtype`` on ``platform`` ("tpu", "gpu",
  "cpu"; None: it can). The one statement of these limits."""
  if platform not in ("tpu", "cpu"):
    return (f"runs on TPUs (and in the Pallas interpreter on a CPU); this run's devices are "
            f"{platform}")
  if str(dtype) not in DTYPES:
    return f"needs model.dtype float32 or bfloat16 (got {dtype!r})"
  return None


def padded_length(t: int) -> int:
  """The row length the kernel runs at: ``t`` rounded up to a multiple of 128."""
  return -(-t // LANES) * LANES


def block_size(t: int) -> int:
  """Queries (and keys) per kernel block for rows of ``t`` tokens."""
  padded = padded_length(t)
  return next(b for b in BLOCKS if padded % b == 0)


def _kernel(num_heads: int, t: int, window: int | None, block: int, interpret: bool):
  """The splash kernel of one row: ``num_heads`` query heads, ``t`` tokens (a multiple of
  ``block``). Built in each trace: it holds its block tables as arrays of that trace (the
  host-side evaluation of the mask, block by block, is cached by JAX)."""
  if window is None:
    mask = splash.CausalMask((t, t))
  else:
    mask = splash.LocalMask((t, t), window_size=(window, 0), offset=0)
  sizes = splash.BlockSizes(
      block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
      block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  return splash.make_splash_mqa_single_device(
      splash.MultiHeadMask([mask] * num_heads), block_sizes=sizes, interpret=interpret)


def splash_mqa(q, k, v, segment_pos, *, window: int | None, scale: float,
               block: int | None = None, interpret: bool = False):
  """Causal multi-query attention within each row, documents kept apart.

  Args:
    q: [B, T, N, H] queries.
    k, v: [B, T, H], the one key/value head (cast to q's dtype).
    segment_pos: [B, T] int, each token's position in its document (0 starts a document).
    window: token t sees keys t - window .. t of its document; None: all earlier ones.
    scale: multiplies the scores (applied to q).
    block: queries (and keys) per kernel block, a multiple of 128 that divides T padded to a
      multiple of 128; None: ``block_size(T)``.
    interpret: run the kernel in the Pallas interpreter (always so on a CPU target).
  Returns:
    [B, T, N, H] in q's dtype. Differentiable in q, k and v (the kernel's own backward
    kernels).
  """
  b, t, n, h = q.shape
  if k.shape != (b, t, h) or v.shape != (b, t, h) or segment_pos.shape != (b, t):
    raise ValueError(f"splash_mqa: q must be [B, T, N, H], k and v [B, T, H], segment_pos "
                     f"[B, T]; got q {q.shape}, k {k.shape}, v {v.shape}, segment_pos "
                     f"{segment_pos.shape}")
  if window is not None and window < 0:
    raise ValueError(f"splash_mqa: window={window} must be >= 0 (or None)")
  platform = dispatch.target_platform()
  interpret = dispatch.interpret_on(platform, interpret)
  why = problem(jnp.dtype(q.dtype).name, "cpu" if interpret else platform)
  if why:
    raise ValueError(f"splash_mqa: {why}")
  padded = padded_length(t)
  block = block or block_size(t)
  if block % LANES or padded % block:
    raise ValueError(f"splash_mqa: block={block} must be a multiple of {LANES} dividing the "
                     f"padded length {padded} (T={t})")
  documents = jnp.cumsum(segment_pos == 0, axis=-1, dtype=jnp.int32)
  pad = padded - t
  q = jnp.pad((q * scale).astype(q.dtype), ((0, 0), (0, pad), (0, 0), (0, 0)))
  k, v = (jnp.pad(x.astype(q.dtype), ((0, 0), (0, pad), (0, 0))) for x in (k, v))
  documents = jnp.pad(documents, ((0, 0), (0, pad)), constant_values=_PAD_DOCUMENT)
  kernel = _kernel(n, padded, window, block, interpret)
  row = lambda q, k, v, ids: kernel(q, k, v, splash.SegmentIds(q=ids, kv=ids))
  out = jax.vmap(row)(q.transpose(0, 2, 1, 3), k, v, documents)  # [B, N, T_pad, H]
  return out.transpose(0, 2, 1, 3)[:, :t]
