"""Multi-query attention (one shared key/value head) with RoPE, global or over a local window.

Local attention lets token ``t`` see tokens ``t - window .. t`` of its own document (the
official RecurrentGemma convention: ``window + 1`` keys including itself); global attention
sees every earlier token of its document. RoPE rotates the first half of each head with the
position inside the document, so packed documents get the positions they would have alone.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import dispatch
from pallas_kernels.attention import decode as decode_kernel
from pallas_kernels.attention import splash_mqa
from recurrentgemma_jax import layers
from sharding import partitioning

_MASKED = -2.3819763e38  # finite, so rows that see nothing give no NaN
_MAX_WAVELENGTH = 10_000


def apply_rope(x: Float[Array, "b t n h"], positions: Int[Array, "b t"]) -> Float[Array, "b t n h"]:
  """Rotates the first half of the head dimension by ``position * frequency``."""
  x_rope, x_pass = jnp.split(x, 2, axis=-1)
  half = x_rope.shape[-1] // 2
  inv_frequencies = 1.0 / _MAX_WAVELENGTH ** (2 * jnp.arange(half) / x_rope.shape[-1])
  angles = positions[:, :, None, None] * inv_frequencies
  sin, cos = jnp.sin(angles).astype(x.dtype), jnp.cos(angles).astype(x.dtype)
  first, second = jnp.split(x_rope, 2, axis=-1)
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin, x_pass],
                         axis=-1)


def attention_mask(segment_pos: Int[Array, "b t"], window: int | None) -> Bool[Array, "b t t"]:
  """``mask[b, q, k]``: causal, same document, and within ``window`` when it is set."""
  doc = layers.document_ids(segment_pos)
  pos = jnp.arange(segment_pos.shape[1])
  mask = (pos[:, None] >= pos[None, :])[None] & (doc[:, :, None] == doc[:, None, :])
  if window is not None:
    mask = mask & (pos[:, None] <= pos[None, :] + window)[None]
  return mask


def _masked_attention(q, keys, values, mask, scale):
  """``softmax(q k^T * scale)`` over the unmasked keys (float32 softmax), times the values.
  q: [B, T, N, H]; keys, values: [B, S, H]; mask: broadcastable to [B, N, T, S]."""
  logits = jnp.einsum("btnh,bsh->bnts", q, keys) * scale
  logits = jnp.where(mask, logits, _MASKED).astype(layers.accumulation_dtype(q.dtype))
  probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
  return jnp.einsum("bnts,bsh->btnh", probs, values)


def document_mask_attention(q, k, v, segment_pos, window, scale, implementation=None):
  """Within-row attention through ``jax.nn.dot_product_attention``, the same-document mask of
  packed rows passed as a dense ``[B, 1, T, T]`` mask; causality and the window are the
  kernel's own masks. q: [B, T, N, H]; k, v: [B, T, H]."""
  doc = layers.document_ids(segment_pos)
  same_doc = (doc[:, :, None] == doc[:, None, :])[:, None]  # [B, 1, T, T]
  return jax.nn.dot_product_attention(
      q, k[:, :, None], v[:, :, None], mask=same_doc, scale=scale, is_causal=True,
      local_window_size=None if window is None else (window, 0), implementation=implementation)


def _row_documents(segment_pos: Int[Array, "b t"]) -> Int[Array, "b t"]:
  """``layers.document_ids`` counted from 0 at each row's first token (which may continue a
  document: then it has no ``segment_pos == 0``)."""
  doc = layers.document_ids(segment_pos)
  return doc - doc[:, :1]


def document_segments(segment_pos: Int[Array, "b t"], max_segments: int):
  """The documents of each row as cuDNN's packed segments: ``(lengths, offsets, count)``,
  int32 ``[B, M]``, ``[B, M + 1]`` (``M = max_segments``; -1 past a row's last document) and
  ``[B]`` (documents in each row; the segments cover the row only where ``count <= M``)."""
  doc = _row_documents(segment_pos)
  count = doc[:, -1] + 1
  used = jnp.arange(max_segments)[None] < count[:, None]
  lengths = jnp.sum(doc[:, :, None] == jnp.arange(max_segments)[None, None], axis=1,
                    dtype=jnp.int32)
  offsets = jnp.cumsum(lengths, axis=-1, dtype=jnp.int32) - lengths
  lengths, offsets = jnp.where(used, lengths, -1), jnp.where(used, offsets, -1)
  offsets = jnp.pad(offsets, ((0, 0), (0, 1)), constant_values=-1)
  return lengths, offsets, count


# The bounds on documents a row of cuDNN's packed segments are compiled for: a batch whose
# rows have at most 4 documents takes the first, at most 16 the second, more the dense mask.
# The packed form's cost grows with its bound (docs/bench/performance_log.md, "attention without a
# dense mask"): 2.4 ms forward + backward at 4 and 3.0 at 16, against 3.6 for the mask, at
# MQA-400M's layer shape.
SEGMENT_BOUNDS = (4, 16)


def packed_segments_supported() -> bool:
  """Whether cuDNN's packed segments run here: jax allows them on Hopper (9.0) and newer."""
  capability = dispatch.gpu_capability()
  return capability is not None and capability >= 9.0


def fused_attention(q, k, v, segment_pos, window, scale, implementation=None,
                    segment_bounds=None):
  """Within-row attention as one fused kernel: cuDNN's flash attention for
  ``implementation="cudnn"`` (bfloat16/float16 on NVIDIA GPUs; the T x T scores are never
  stored), ``document_mask_attention`` otherwise. q: [B, T, N, H]; k, v: [B, T, H].

  A dense mask costs cuDNN a ``[B, 1, T, T]`` bias read in the forward and a bias gradient
  written in the backward (jax always asks for it), 1.8x the time of causal attention alone.
  So the documents are given as the kernel's own masks wherever they can be, chosen at run
  time (``lax.switch``) from the rows at hand: causal only where every row is one document,
  cuDNN's packed segments for the first of ``segment_bounds`` (default ``SEGMENT_BOUNDS``
  where ``packed_segments_supported``, else none) that every row's documents fit, the dense
  mask otherwise. The packed form goes through jax's cuDNN module (``jax._src``), as
  ``jax.nn.dot_product_attention`` does not take segments. The switch is
  ``switch_keeping_operands``: differentiated, ``lax.switch`` copied the queries, keys and
  values out of its forward (1.2 ms of an MQA-400M step on an H100, docs/performance.md)."""
  if implementation != "cudnn":
    return document_mask_attention(q, k, v, segment_pos, window, scale, implementation)
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # pylint: disable=g-import-not-at-top
  if segment_bounds is None:
    segment_bounds = SEGMENT_BOUNDS if packed_segments_supported() else ()
  segment_bounds = sorted(m for m in segment_bounds if m >= 2)
  sliding = None if window is None else window + 1  # cuDNN counts the query itself

  # Keys and values as cuDNN takes them ([B, T, 1, H]) before the switch, so each branch's
  # residuals hold the switch's operands themselves (see ``switch_keeping_operands``).
  k, v = k[:, :, None], v[:, :, None]

  def causal(q, k, v, segment_pos, *segments):
    del segment_pos, segments
    return cudnn.dot_product_attention(q, k, v, scale=scale, mask_type=cudnn.MaskType.CAUSAL,
                                       sliding_window_length=sliding)

  def packed(index):
    def attend(q, k, v, segment_pos, *segments):
      del segment_pos
      lengths, offsets = segments[2 * index:2 * index + 2]
      return cudnn.dot_product_attention(
          q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
          scale=scale, mask_type=cudnn.MaskType.PADDING_CAUSAL, sliding_window_length=sliding)
    return attend

  @jax.checkpoint  # its [B, 1, T, T] bias would be a residual of every branch, zeros if unused
  def masked(q, k, v, segment_pos, *segments):
    del segments
    return document_mask_attention(q, k[:, :, 0], v[:, :, 0], segment_pos, window, scale,
                                   implementation)

  segments = [a for m in segment_bounds for a in document_segments(segment_pos, m)[:2]]
  most = jnp.max(_row_documents(segment_pos)[:, -1]) + 1  # documents in the fullest row
  # 0: causal; 1 + (bounds below ``most``): the first packed bound that fits, or the mask.
  branch = jnp.where(most <= 1, 0, 1 + sum((most > m).astype(jnp.int32) for m in segment_bounds))
  branches = (causal, *map(packed, range(len(segment_bounds))), masked)
  return switch_keeping_operands(branch, branches, q, k, v, segment_pos, *segments)


def switch_keeping_operands(index, branches, *operands):
  """``lax.switch(index, branches, *operands)`` for a single array output, differentiable in
  its floating operands, with a backward that copies less.

  Differentiated, ``lax.switch`` returns every branch's residuals from its forward switch:
  the operands and the output the branch keeps come out as new arrays (XLA copies them:
  for MQA-400M's attention, 100 MB of queries a layer), and the other branches' residuals as
  zeros. Here each branch runs under ``jax.vjp`` in the forward switch, which returns only
  the residuals that are neither an operand nor the output; the backward switch rebuilds that
  branch's VJP from them and the operands and output, kept once outside the switch."""
  n = len(branches)
  layouts = [None] * n  # per branch, set while tracing: (VJP tree, where each leaf comes from)

  def split(i, ops):
    out, vjp = jax.vjp(branches[i], *ops)
    leaves, tree = jax.tree.flatten(vjp)
    sources, own = [], []
    for leaf in leaves:
      j = next((j for j, o in enumerate(ops) if leaf is o), None)
      if j is not None:
        sources.append(("operand", j))
      elif leaf is out:
        sources.append(("output", 0))
      else:
        sources.append(("own", len(own)))
        own.append(leaf)
    layouts[i] = (tree, sources)
    return out, own

  floating = [jnp.issubdtype(o.dtype, jnp.floating) for o in operands]

  @jax.custom_vjp
  def run(index, *ops):
    return jax.lax.switch(index, branches, *ops)

  def fwd(index, *ops):
    own_shapes = [jax.eval_shape(lambda *o, i=i: split(i, o)[1], *ops) for i in range(n)]

    def forward(i):
      def go(*ops):
        out, own = split(i, ops)
        return out, [own if j == i else [jnp.zeros(a.shape, a.dtype) for a in own_shapes[j]]
                     for j in range(n)]
      return go
    out, own = jax.lax.switch(index, [forward(i) for i in range(n)], *ops)
    return out, (index, ops, out, own)

  def bwd(residuals, g):
    index, ops, out, own = residuals

    def backward(i):
      def go(ops, out, own, g):
        tree, sources = layouts[i]
        pick = {"operand": lambda j: ops[j], "output": lambda j: out, "own": lambda j: own[i][j]}
        vjp = jax.tree.unflatten(tree, [pick[kind](j) for kind, j in sources])
        return [ct for ct, f in zip(vjp(g), floating) if f]
      return go
    grads = iter(jax.lax.switch(index, [backward(i) for i in range(n)], ops, out, own, g))
    return (None, *(next(grads) if f else None for f in floating))

  run.defvjp(fwd, bwd)
  return run(index, *operands)


class AttentionCache(NamedTuple):
  """Keys and values of the last tokens (a ring buffer), with each slot's position in its
  document (-1: empty). Bounded by the window for local attention."""

  keys: Float[Array, "b s h"]
  values: Float[Array, "b s h"]
  positions: Int[Array, "b s"]


BAND_BLOCK = 256  # queries per block of banded local attention
DECODE_BLOCK = 128  # cached keys per program of the GPU decode kernel


def length_bounded_attention(q, keys, values, lengths, scale, window, kernel):
  """One query token per row over its cached keys, reading only the filled blocks of the
  cache, through ``kernel`` (``dispatch.decode_attention_path``): ``"mosaic"``, our Mosaic GPU
  kernel for Hopper (``pallas_kernels.attention.decode``: global attention over the first
  ``lengths[b]`` slots, or local attention over a ring), or ``"triton"``, JAX's Pallas GPU
  decode-attention kernel (``jax.experimental.pallas.ops.gpu.decode_attention``, global
  only); their interpreters on a CPU. q: [B, N, H]; keys, values: [B, S, H]; lengths: [B], the
  document's tokens so far."""
  interpret = dispatch.target_platform() == "cpu"
  if kernel == "mosaic":
    return decode_kernel.mqa_decode(q, keys, values, lengths, scale=scale, window=window,
                                    interpret=interpret)
  assert window is None and keys.shape[1] % DECODE_BLOCK == 0, (window, keys.shape)
  from jax.experimental.pallas.ops.gpu import decode_attention  # pylint: disable=g-import-not-at-top
  return decode_attention.mqa(q, keys, values, kv_seq_len=lengths, sm_scale=scale,
                              block_k=DECODE_BLOCK, k_splits=keys.shape[1] // DECODE_BLOCK,
                              interpret=interpret)


class MQAttention(nnx.Module):
  """``num_heads`` query heads of ``width // num_heads`` dims, one key/value head."""

  def __init__(self, width: int, num_heads: int, window: int | None, *, rngs: nnx.Rngs,
               final_init_scale: float = 1.0, param_dtype=jnp.float32, dtype=jnp.float32,
               impl: str = "xla"):
    self.num_heads = num_heads
    self.impl = impl
    # Local attention longer than the band's keys runs banded (``_banded``).
    self.band_block = min(window, BAND_BLOCK) if window else None
    self.head_dim = width // num_heads
    self.window = window
    self.dtype = dtype
    kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype, use_bias=False)
    self.proj_q = layers.Dense(width, width, axes=("embed", "heads"), **kw)
    self.proj_k = layers.Dense(width, self.head_dim, axes=("embed", "kv"), **kw)
    self.proj_v = layers.Dense(width, self.head_dim, axes=("embed", "kv"), **kw)
    kw["use_bias"] = True
    self.proj_final = layers.Dense(width, width, axes=("heads", "embed"),
                                   init_scale=final_init_scale, **kw)

  def __call__(
      self,
      x: Float[Array, "b t d"],
      segment_pos: Int[Array, "b t"],
      cache: AttentionCache | None = None,
  ) -> tuple[Float[Array, "b t d"], AttentionCache | None]:
    """Without a cache: attention within the row (training, evaluation). With one: the new
    tokens also see the cached keys of their document, and the cache is updated."""
    b, t, _ = x.shape
    q = apply_rope(self.proj_q(x).reshape(b, t, self.num_heads, self.head_dim), segment_pos)
    k = apply_rope(self.proj_k(x).reshape(b, t, 1, self.head_dim), segment_pos)[:, :, 0]
    v = self.proj_v(x).reshape(b, t, self.head_dim)
    # Kernels, per device under a mesh (query heads over ``model``, rows over ``data``, the one
    # key/value head on every device: cuDNN's own partitioning rule wants q, k and v split
    # alike, and a Pallas call has none). cuDNN takes the same-document mask only for an even
    # length: odd rows use the XLA path.
    if cache is None and (self.impl == "splash" or self.impl == "cudnn" and t % 2 == 0):
      scale = self.head_dim**-0.5
      if self.impl == "cudnn":
        attend = lambda q, k, v, pos: fused_attention(q, k, v, pos, self.window, scale,
                                                      implementation="cudnn")
      else:  # TPU splash attention (the Pallas interpreter on a CPU)
        attend = lambda q, k, v, pos: splash_mqa(q, k, v, pos, window=self.window, scale=scale)
      bthd, bth = ("batch", None, "heads", None), ("batch", None, None)
      encoded = partitioning.shard_local(attend, (bthd, bth, bth, ("batch", None)), bthd)(
          q, k, v, segment_pos)
      return self.proj_final(encoded.reshape(b, t, -1)), None
    if cache is None and self.window is not None and t > self._band_keys:
      encoded = self._banded(q, k, v, segment_pos)
      return self.proj_final(encoded.reshape(b, t, -1)), None
    if cache is not None and t == 1:
      encoded, new_cache = self._decode_step(q, k, v, segment_pos, cache)
      return self.proj_final(encoded.reshape(b, t, -1)), new_cache
    if cache is None:
      keys, values, mask, new_cache = k, v, attention_mask(segment_pos, self.window), None
    else:
      keys, values, mask, new_cache = self._with_cache(k, v, segment_pos, cache)
    encoded = _masked_attention(q, keys, values, mask[:, None], self.head_dim**-0.5)
    return self.proj_final(encoded.reshape(b, t, -1)), new_cache

  @property
  def _band_keys(self) -> int:
    """Keys each query block of ``_banded`` sees."""
    return (-(-self.window // self.band_block) + 1) * self.band_block

  def _banded(self, q, k, v, segment_pos):
    """Local attention in blocks of ``band_block`` queries, each seeing its own key block and
    the ``ceil(window / band_block)`` before it: ``O(T * (window + band_block))`` scores instead
    of ``O(T^2)``, the same result."""
    b, t, n, h = q.shape
    w, bq = self.window, self.band_block
    n_prev = -(-w // bq)
    nb = -(-t // bq)
    pad = nb * bq - t
    doc = jnp.pad(layers.document_ids(segment_pos), ((0, 0), (0, pad)), constant_values=-1)
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nb, bq, n, h)

    def with_previous(x, fill):  # [b, nb * bq, ...] -> [b, nb, (n_prev + 1) * bq, ...]
      blocks = x.reshape(x.shape[0], nb, bq, *x.shape[2:])
      parts = []
      for j in range(n_prev, 0, -1):  # the block j before, filled before the row starts
        if j >= nb:
          parts.append(jnp.full_like(blocks, fill))
        else:
          front = jnp.full_like(blocks[:, :j], fill)
          parts.append(jnp.concatenate([front, blocks[:, :-j]], axis=1))
      return jnp.concatenate(parts + [blocks], axis=2)

    keys = with_previous(jnp.pad(k, ((0, 0), (0, pad), (0, 0))), 0)
    values = with_previous(jnp.pad(v, ((0, 0), (0, pad), (0, 0))), 0)
    key_doc = with_previous(doc, -1)
    pos = jnp.arange(nb * bq)
    q_pos = pos.reshape(nb, bq)
    k_pos = with_previous(pos[None], -1)[0]  # [nb, (n_prev + 1) * bq]
    mask = ((k_pos[:, None, :] <= q_pos[:, :, None]) & (q_pos[:, :, None] <= k_pos[:, None, :] + w)
            & (k_pos[:, None, :] >= 0))[None]
    mask = mask & (doc.reshape(b, nb, bq)[..., None] == key_doc[:, :, None, :]) & (
        key_doc[:, :, None, :] >= 0)
    logits = jnp.einsum("bcqnh,bckh->bcnqk", q, keys) * self.head_dim**-0.5
    logits = jnp.where(mask[:, :, None], logits, _MASKED).astype(
        layers.accumulation_dtype(q.dtype))
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    encoded = jnp.einsum("bcnqk,bckh->bcqnh", probs, values)
    return encoded.reshape(b, nb * bq, n, h)[:, :t]

  def _decode_step(self, q, k, v, segment_pos, cache: AttentionCache):
    """One new token per row: written into the cache first, then attention over the cache
    alone. No copy of the cache is made: reading the old cache after updating it in place (or
    concatenating the new token to it, as ``_with_cache`` does) makes XLA copy the whole cache
    every step. The ring buffer of local attention has at least ``window + 1`` slots, so the
    slot the new token takes is one that has already left the window.

    A cache holds position p of the current document at slot ``p % size``, so on GPUs
    (``impl == "cudnn"``) a decode kernel reads only the ``min(position + 1, size)`` filled
    slots: global attention through either kernel, local attention through the Mosaic one."""
    new_cache = self._updated_cache(k, v, segment_pos, cache)
    keys, values = new_cache.keys.astype(q.dtype), new_cache.values.astype(q.dtype)
    scale = self.head_dim**-0.5
    kernel = self._decode_kernel(q.shape[0], keys.shape[1])
    if kernel:
      attend = lambda q, keys, values, lengths: length_bounded_attention(
          q, keys, values, lengths, scale, self.window, kernel)
      bnh, bsh = ("batch", "heads", None), ("batch", None, None)
      encoded = partitioning.shard_local(attend, (bnh, bsh, bsh, ("batch",)), bnh)(
          q[:, 0], keys, values, segment_pos[:, 0] + 1)
      return encoded[:, None], new_cache
    visible = new_cache.positions >= 0  # [B, S]: this document's tokens (the new one included)
    if self.window is not None:
      visible &= segment_pos <= new_cache.positions + self.window
    return _masked_attention(q, keys, values, visible[:, None, None, :], scale), new_cache

  def _updated_cache(self, k, v, segment_pos, cache: AttentionCache) -> AttentionCache:
    """The ring buffer after the new tokens: the last ``size`` tokens of the last document,
    each at slot ``position % size``."""
    size = cache.keys.shape[1]
    doc = layers.document_ids(segment_pos)  # 0: continues the cached document
    cached_pos = jnp.where((doc[:, -1:] == 0), cache.positions, -1)  # a new document drops it
    last = segment_pos[:, -1:]
    keep = (doc == doc[:, -1:]) & (segment_pos > last - size)
    slot = jnp.where(keep, segment_pos % size, size)  # size: out of range, dropped
    rows = jnp.arange(k.shape[0])[:, None]
    return AttentionCache(
        keys=cache.keys.at[rows, slot].set(k.astype(cache.keys.dtype), mode="drop"),
        values=cache.values.at[rows, slot].set(v.astype(cache.values.dtype), mode="drop"),
        positions=cached_pos.at[rows, slot].set(segment_pos, mode="drop"))

  def _with_cache(self, k, v, segment_pos, cache: AttentionCache):
    """Keys, values and mask over ``cache + new tokens``, and the updated ring buffer."""
    size = cache.keys.shape[1]
    doc = layers.document_ids(segment_pos)  # 0: continues the cached document
    keys = jnp.concatenate([cache.keys.astype(k.dtype), k], axis=1)
    values = jnp.concatenate([cache.values.astype(v.dtype), v], axis=1)
    key_pos = jnp.concatenate([cache.positions, segment_pos], axis=1)
    key_doc = jnp.concatenate([jnp.where(cache.positions >= 0, 0, -1), doc], axis=1)
    order = jnp.arange(keys.shape[1])
    new_order = order[size:]
    mask = ((key_doc[:, None, :] == doc[:, :, None]) & (key_pos[:, None, :] >= 0)
            & (order[None, None, :] <= new_order[None, :, None]))
    if self.window is not None:
      mask &= segment_pos[:, :, None] <= key_pos[:, None, :] + self.window
    return keys, values, mask, self._updated_cache(k, v, segment_pos, cache)

  def _decode_kernel(self, batch: int, size: int) -> str | None:
    """The decode kernel that reads a cache of ``size`` slots in ``_decode_step`` (``"mosaic"``
    or ``"triton"``), or None for XLA's attention over the whole cache."""
    if self.impl != "cudnn":
      return None
    path = dispatch.decode_attention_path((batch, self.num_heads, self.head_dim),
                                          (batch, size, self.head_dim), self.dtype)
    if path == "mosaic" or self.window is None and size % DECODE_BLOCK == 0:
      return path
    return None

  def init_cache(self, batch_size: int, max_len: int, dtype) -> AttentionCache:
    """An empty cache: the window (and the new token) for local attention, ``max_len`` tokens
    for global; on GPUs, whole blocks of the decode kernels (``_decode_kernel``)."""
    size = max_len if self.window is None else min(self.window + 1, max_len)
    if self.window is None and self.impl == "cudnn":  # whole blocks for the GPU decode kernels
      size = -(-max_len // DECODE_BLOCK) * DECODE_BLOCK
    elif self.impl == "cudnn":  # a ring of whole blocks, if the Mosaic kernel is to read it
      blocks = -(-size // decode_kernel.BLOCK_K) * decode_kernel.BLOCK_K
      size = blocks if self._decode_kernel(batch_size, blocks) == "mosaic" else size
    zeros = jnp.zeros((batch_size, size, self.head_dim), dtype)
    return AttentionCache(zeros, zeros, jnp.full((batch_size, size), -1, jnp.int32))
