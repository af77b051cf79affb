"""cuDNN flash attention at the training shapes: how the same-document mask is passed.

    python scripts/bench/bench_attention.py [--batch 16 --seq_len 2048 --heads 12 --head_dim 128]
        [--windows none,1024] [--segments 2,4,8] [--docs 3] [--iters 20]

Times the forward and the forward + backward (gradients of q, k and v) of MQA attention (one
key/value head, bfloat16) through cuDNN, per variant:

- ``mask``: the dense ``[B, 1, T, T]`` same-document mask (``attention.document_mask_attention``).
  jax turns it into a bias, and its cuDNN backward also writes a bias gradient.
- ``causal``: causality and the window only, no mask (exact only for rows of one document).
- ``fused M``: ``attention.fused_attention`` with ``segment_bounds=(M,)``, the model's path:
  causal for rows of one document, cuDNN's packed segments for at most ``M`` a row, else the
  mask. ``fused (model default)``: the same with ``attention.SEGMENT_BOUNDS``.

Before timing, the ``mask`` and ``fused`` outputs and gradients are compared with the XLA
reference on rows of ``--docs`` documents (row 0: one), which the last column also times.
TFLOP/s count the multiply-adds of the unmasked (query, key) pairs of a single-document row:
4 per pair and head dim forward, 10 backward.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

from recurrentgemma_jax import attention
from timing import time_fn  # pylint: disable=g-import-not-at-top  (scripts/bench/)


def random_documents(rng, batch, seq_len, docs):
  """segment_pos of rows cut into ``docs`` documents at random points (row 0: one document)."""
  pos = np.zeros((batch, seq_len), np.int32)
  for b in range(batch):
    n = 1 if b == 0 else docs
    cuts = np.sort(rng.choice(np.arange(1, seq_len), n - 1, replace=False))
    for start, end in zip(np.r_[0, cuts], np.r_[cuts, seq_len]):
      pos[b, start:end] = np.arange(end - start)
  return jnp.asarray(pos)


def variants(window, segments):
  out = {"mask": functools.partial(attention.document_mask_attention, window=window,
                                   implementation="cudnn"),
         "causal": lambda q, k, v, pos, scale: jax.nn.dot_product_attention(
             q, k[:, :, None], v[:, :, None], scale=scale, is_causal=True,
             local_window_size=None if window is None else (window, 0),
             implementation="cudnn")}
  for m in segments:
    out[f"fused {m}"] = functools.partial(attention.fused_attention, window=window,
                                          implementation="cudnn", segment_bounds=(m,))
  out["fused (model default)"] = functools.partial(
      attention.fused_attention, window=window, implementation="cudnn",
      segment_bounds=attention.SEGMENT_BOUNDS)
  return out


def loss_fn(attend, cot):
  def f(q, k, v, pos, scale):
    return jnp.sum(attend(q, k, v, pos, scale=scale).astype(jnp.float32) * cot)
  return f


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--seq_len", type=int, default=2048)
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--head_dim", type=int, default=128)
  parser.add_argument("--windows", default="none,1024")
  parser.add_argument("--segments", default="2,4,8")
  parser.add_argument("--docs", type=int, default=3, help="documents per row in the check")
  parser.add_argument("--iters", type=int, default=20)
  args = parser.parse_args()
  segments = [int(m) for m in args.segments.split(",") if m]
  b, t, n, h = args.batch, args.seq_len, args.heads, args.head_dim
  scale = h**-0.5
  dev = jax.devices()[0]
  print(f"{dev.device_kind}, jax {jax.__version__}; B={b} T={t} heads={n} head_dim={h}, "
        "one key/value head, bfloat16", flush=True)
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, t, h), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, t, h), jnp.bfloat16)
  cot = jax.random.normal(keys[3], (b, t, n, h), jnp.float32)
  one_doc = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  several = random_documents(np.random.default_rng(0), b, t, args.docs)
  rows = ["| window | variant | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | "
          f"fwd+bwd ms, {args.docs} documents a row |", "|---|---|---|---|---|---|---|"]
  for window in [None if w == "none" else int(w) for w in args.windows.split(",")]:
    mask = np.asarray(attention.attention_mask(one_doc[:1], window))
    pairs = b * int(mask.sum())
    fwd_flop, bwd_flop = 4 * pairs * n * h, 10 * pairs * n * h

    def reference(q, k, v, pos, scale):
      return attention.document_mask_attention(q, k, v, pos, window, scale, implementation="xla")

    ref_grad = jax.jit(jax.value_and_grad(loss_fn(reference, cot), argnums=(0, 1, 2)),
                       static_argnames="scale")
    _, want = ref_grad(q, k, v, several, scale=scale)
    for name, attend in variants(window, segments).items():
      fwd = jax.jit(functools.partial(attend, scale=scale))
      grad = jax.jit(functools.partial(
          jax.value_and_grad(loss_fn(attend, cot), argnums=(0, 1, 2)), scale=scale))
      try:
        if name != "causal":  # exact only for one document a row
          _, got = grad(q, k, v, several)
          errs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))
                        / (float(jnp.max(jnp.abs(w.astype(jnp.float32)))) + 1e-9))
                  for g, w in zip(got, want)]
          status = "ok" if max(errs) < 2e-2 else "WRONG"
          print(f"  check {window} {name}: relative max error dq dk dv "
                f"{', '.join(f'{e:.1e}' for e in errs)}: {status}", flush=True)
        f_ms = time_fn(fwd, q, k, v, one_doc, iters=args.iters)
        g_ms = time_fn(grad, q, k, v, one_doc, iters=args.iters)
        g_docs = (time_fn(grad, q, k, v, several, iters=args.iters) if name != "causal"
                  else float("nan"))
      except Exception as e:  # pylint: disable=broad-except
        print(f"  {window} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        continue
      row = (f"| {window} | {name} | {f_ms:.3f} | {fwd_flop / f_ms / 1e9:.0f} | {g_ms:.3f} | "
             f"{(fwd_flop + bwd_flop) / g_ms / 1e9:.0f} | {g_docs:.3f} |")
      print(row, flush=True)
      rows.append(row)
  print("\n".join(rows))


if __name__ == "__main__":
  main()
