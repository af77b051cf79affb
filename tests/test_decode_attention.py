"""MQA's decode attention on the tensor cores (``pallas_kernels.attention.decode``, in Pallas'
Mosaic GPU interpreter) against float64 NumPy, its limits, and which decode kernel runs where."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.attention import decode


def reference64(q, keys, values, visible, scale):
  """softmax(scale q k^T) v over the ``visible [B, S]`` keys of each row, in float64."""
  q, keys, values = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q, keys, values))
  s = np.einsum("bnh,bsh->bns", q, keys) * scale
  s = np.where(visible[:, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bns,bsh->bnh", p / p.sum(-1, keepdims=True), values)


def ring_visible(lengths, size, window):
  """[B, S], from each slot's token: token p at slot p % S, the last S tokens kept; visible
  if at most ``window`` tokens before the newest (any, for global attention)."""
  visible = np.zeros((len(lengths), size), bool)
  for b, n in enumerate(lengths):
    for p in range(max(0, n - size), n):
      visible[b, p % size] = window is None or n - 1 - p <= window
  return visible


@pytest.mark.parametrize("batch,slots,heads,head_dim,dtype,block_k,stages,window", [
    (4, 192, 5, 64, jnp.bfloat16, 64, 2, None),    # odd heads, padded to 64 query rows
    (3, 320, 16, 128, jnp.float16, 64, 3, None),   # MQA 1.3B's heads, a 3-slot ring
    (2, 256, 64, 64, jnp.bfloat16, 128, 2, None),  # no padding, 128 keys a slot
    (3, 128, 1, 64, jnp.bfloat16, 64, 3, None),    # more ring slots than tiles
    (6, 192, 5, 64, jnp.bfloat16, 64, 2, 130),     # local: a ring of 192 slots, window 130
    (4, 128, 3, 128, jnp.float16, 64, 3, 127),     # local: the smallest ring, window + 1 slots
    (3, 64, 2, 64, jnp.bfloat16, 64, 2, 500),      # local, a cache shorter than the window
])
def test_mqa_decode_matches_float64(batch, slots, heads, head_dim, dtype, block_k, stages, window):
  rng = np.random.default_rng(batch * slots + heads)
  lengths = rng.integers(1, slots + 1 if window is None else 3 * slots, batch)
  edge = [1, slots, block_k + 1] if window is None else [1, window + 2, slots + 5, 2 * slots]
  lengths[:len(edge)] = edge[:batch]  # one key; every slot; one past a tile; rings wrapped
  visible = ring_visible(lengths, slots, window)
  q = jnp.asarray(rng.normal(size=(batch, heads, head_dim)), dtype)
  keys = rng.normal(size=(batch, slots, head_dim))
  values = rng.normal(size=(batch, slots, head_dim))
  hidden = ~visible[:, :, None]  # stale or out-of-window slots: loud if attended to
  keys = jnp.asarray(np.where(hidden, 30.0, keys), dtype)
  values = jnp.asarray(np.where(hidden, 1e3, values), dtype)
  scale = head_dim**-0.5
  np.testing.assert_array_equal(decode.visible_slots(jnp.asarray(lengths), slots, window),
                                visible)
  out = decode.mqa_decode(q, keys, values, jnp.asarray(lengths), scale=scale, window=window,
                          block_k=block_k, stages=stages, interpret=True)
  assert out.shape == q.shape and out.dtype == q.dtype
  want = reference64(q, keys, values, visible, scale)
  # the kernel's own rounding: p in the inputs' dtype before p v, the output rounded once
  eps = float(jnp.finfo(dtype).eps)
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=4 * eps, rtol=4 * eps)


def test_problem_names_what_it_cannot_take():
  assert decode.problem((2, 16, 128), (2, 256, 128), jnp.bfloat16) is None
  assert "dtype float32" in decode.problem((2, 16, 128), (2, 256, 128), jnp.float32)
  assert "65 query heads" in decode.problem((2, 65, 128), (2, 256, 128), jnp.bfloat16)
  assert "head size 96" in decode.problem((2, 16, 96), (2, 256, 96), jnp.bfloat16)
  assert "200 cache slots" in decode.problem((2, 16, 64), (2, 200, 64), jnp.bfloat16)
  x = jnp.zeros((2, 4, 64), jnp.float32)
  with pytest.raises(ValueError, match="dtype float32"):
    decode.mqa_decode(x, jnp.zeros((2, 64, 64)), jnp.zeros((2, 64, 64)), jnp.ones(2, jnp.int32),
                      scale=1.0, interpret=True)
  x, ring = x.astype(jnp.bfloat16), jnp.zeros((2, 192, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="192 cache slots for block_k=128"):
    decode.mqa_decode(x, ring, ring, jnp.ones(2, jnp.int32), scale=1.0, block_k=128,
                      interpret=True)


def test_decode_attention_path(monkeypatch):
  """auto: Triton's interpreter on a CPU (Mosaic only on Hopper GPUs); a shape or dtype the
  Mosaic kernel cannot take goes to Triton even when asked for; a bad setting is named."""
  ok, bad = ((2, 16, 128), (2, 256, 128), "bfloat16"), ((2, 16, 128), (2, 256, 128), "float32")
  assert jax.default_backend() == "cpu"
  assert dispatch.decode_attention_path(*ok) == "triton"
  monkeypatch.setattr(dispatch, "DECODE_ATTENTION_IMPL", "mosaic")
  assert dispatch.decode_attention_path(*ok) == "mosaic"
  assert dispatch.decode_attention_path(*bad) == "triton"
  monkeypatch.setattr(dispatch, "DECODE_ATTENTION_IMPL", "cudnn")
  with pytest.raises(ValueError, match="DECODE_ATTENTION_IMPL='cudnn': allowed auto"):
    dispatch.decode_attention_path(*ok)
