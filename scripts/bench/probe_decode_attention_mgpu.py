"""Probe for issue #18 (a): MQA's decode attention on the tensor cores as a Mosaic GPU kernel.

MQA's decoding step spends most of its time reading the KV cache through JAX's Triton decode
kernel (docs/inference.md). This probe asks how fast a Hopper kernel can read it while doing
the attention's arithmetic: one CTA per row, the row's query heads (16 at 1.3B) padded to
wgmma's 64 rows, one compute warpgroup (q k^T and p v on the tensor cores, an online softmax in
registers) and one memory warpgroup streaming the row's keys and values through a TMA ring.
``mqa_decode`` takes full rows (every row holds T keys); the ragged rows (each row's filled part,
as decoding reads it) go through the model's kernel, ``pallas_kernels.attention.decode`` (one
warpgroup, a TMA ring bounded by the row's length), which began here as session 41's
``mqa_decode_rows``. Checked against a float32 reference in the run; timed
beside the Triton kernel, a bare TMA reader of the same bytes (probe_overlap_mgpu.py) and the
copy ceiling of a jitted ``x + 1``. Results: docs/bench/decode_log.md, sessions 41-42.

    python scripts/bench/probe_decode_attention_mgpu.py
"""
import argparse
import functools
import math
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import probe_overlap_mgpu as po  # scripts/bench/
import timing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from pallas_kernels.attention import decode  # noqa: E402  pylint: disable=g-import-not-at-top

QP = 64  # query rows a CTA: the heads, padded
LOG2E = math.log2(math.e)


def _empty_state(D):
  """The online softmax's state: the output accumulator, the running max (in log2 units) and
  the running sum, for QP query rows."""
  return (jnp.zeros((QP, D), jnp.float32), jnp.full((QP,), -jnp.inf, jnp.float32),
          jnp.zeros((QP,), jnp.float32))


def _attend(q_s, k_s, v_s, state):
  """One key tile into the online softmax: ``q k^T`` and ``p v`` by wgmma."""
  acc, m, l = state
  bk = k_s.shape[0]

  def qk(ref):
    plgpu.wgmma(ref, q_s, plgpu.transpose_ref(k_s, (1, 0)))
    return ref[...]
  s = pl.run_scoped(qk, plgpu.ACC((QP, bk), jnp.float32))
  m_new = jnp.maximum(m, s.max(axis=1) * LOG2E)
  alpha = jnp.exp2(m - m_new)
  p = jnp.exp2(s * LOG2E - lax.broadcast_in_dim(m_new, s.shape, [0]))
  l = l * alpha + p.sum(axis=1)
  acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

  def pv(ref):
    plgpu.wgmma(ref, p.astype(v_s.dtype), v_s)
  return pl.run_state(pv)(plgpu.ACC.init(acc)), m_new, l


def _write_out(acc, l, q_s, o_ref):
  """acc / l through the (now free) query tile to ``o_ref``."""
  q_s[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(q_s.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_s, o_ref)
  plgpu.wait_smem_to_gmem(0)


def _pad_heads(q):
  B, H, D = q.shape
  return jnp.zeros((B, QP, D), q.dtype).at[:, :H].set(q)


def mqa_decode(q, k, v, *, bk=128, stages=2):
  """q [B, H, D] (H <= 64), k, v [B, T, D] -> [B, H, D]; softmax(q k^T) v, no scale."""
  B, H, D = q.shape
  T = k.shape[1]

  def body(q_g, k_g, v_g, o_g, q_s, bar):
    b = lax.axis_index("row")

    def ctx(run):
      plgpu.copy_gmem_to_smem(q_g.at[b], q_s, bar)
      plgpu.barrier_wait(bar)
      acc, _, l = run(_empty_state(D))
      _write_out(acc, l, q_s, o_g.at[b])

    def step(idxs, k_s, v_s, state):
      del idxs
      return _attend(q_s, k_s, v_s, state)

    pipe = plgpu.emit_pipeline_warp_specialized(
        step, grid=(T // bk,), memory_registers=40,
        in_specs=[plgpu.BlockSpec((bk, D), lambda i: (i, 0)),
                  plgpu.BlockSpec((bk, D), lambda i: (i, 0))],
        wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages, compute_context=ctx)
    pipe(k_g.at[b], v_g.at[b])

  out = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((B, QP, D), q.dtype), grid=(B,), grid_names=("row",),
      num_threads=2, thread_name="wg",
      scratch_types=(plgpu.SMEM((QP, D), q.dtype),
                     plgpu.Barrier(num_barriers=1)),
      compiler_params=plgpu.CompilerParams(approx_math=True,
                                           lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(_pad_heads(q), k, v)
  return out[:, :H]


def reference(q, k, v, lengths=None):
  s = jnp.einsum("bhd,btd->bht", q.astype(jnp.float32), k.astype(jnp.float32))
  if lengths is not None:
    s = jnp.where(jnp.arange(k.shape[1]) < lengths[:, None, None], s, -jnp.inf)
  return jnp.einsum("bht,btd->bhd", jax.nn.softmax(s, -1), v.astype(jnp.float32))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rows", type=int, default=1024)
  ap.add_argument("--keys", type=int, default=2048)
  args = ap.parse_args()
  B, T, H, D = args.rows, args.keys, 16, 128
  k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
  q = (jax.random.normal(k0, (B, H, D), jnp.float32) / D**0.5).astype(jnp.bfloat16)
  k = jax.random.normal(k1, (B, T, D), jnp.bfloat16)
  v = jax.random.normal(k2, (B, T, D), jnp.bfloat16)
  want = reference(q, k, v)
  nbytes = 2 * B * T * D * 2
  ceiling = timing.copy_ceiling(1 << 30) / 1e12  # TB/s
  print(f"{jax.devices()[0].device_kind}: copy ceiling (x + 1) {ceiling:.2f} TB/s; "
        f"K+V {nbytes / 1e9:.2f} GB")
  from jax.experimental.pallas.ops.gpu import decode_attention  # pylint: disable=g-import-not-at-top
  full = jnp.full((B,), T, jnp.int32)
  ours = jax.jit(lambda q, k, v, n: decode_attention.mqa(q, k, v, kv_seq_len=n, sm_scale=1.0,
                                                         block_k=128, k_splits=T // 128))
  err = float(jnp.abs(ours(q, k, v, full).astype(jnp.float32) - want).max())
  print(f"Triton (ours) err {err:.3g}")
  t = po.timeit(ours, q, k, v, full)
  print(f"Triton decode_attention: {t:.3f} ms, {nbytes / t / 1e9:.2f} TB/s")
  G = jax.devices()[0].core_count
  R = (nbytes // 512) // (G * po.RT) * G * po.RT
  buf = jnp.zeros((R, 256), jnp.bfloat16)
  t = po.timeit(jax.jit(lambda x: po.fused(None, None, x, G, G)), buf)
  print(f"bare TMA reader of {buf.nbytes / 1e9:.2f} GB on all SMs: {t:.3f} ms, "
        f"{buf.nbytes / t / 1e9:.2f} TB/s")
  for bk, st in [(128, 2), (64, 3), (64, 4)]:
    try:
      f = jax.jit(functools.partial(mqa_decode, bk=bk, stages=st))
      err = float(jnp.abs(f(q, k, v).astype(jnp.float32) - want).max())
      t = po.timeit(f, q, k, v)
      print(f"Mosaic, {bk} keys a step, {st} stages: {t:.3f} ms, {nbytes / t / 1e9:.2f} TB/s, "
            f"err {err:.3g}")
    except Exception as e:  # pylint: disable=broad-except
      print(f"Mosaic {bk}, {st} failed: {type(e).__name__}: {str(e)[:400]}")
  # Each row's filled part: lengths uniform in [1, T] (a decode loop's average), then all full.
  lengths = jax.random.randint(jax.random.key(1), (B,), 1, T + 1)
  want_r = reference(q, k, v, lengths)
  err_o = float(jnp.abs(ours(q, k, v, lengths).astype(jnp.float32) - want_r).max())
  t_ours = po.timeit(ours, q, k, v, lengths)
  print(f"ragged lengths, Triton decode_attention: {t_ours:.3f} ms (err {err_o:.3g})")
  for bk, st in [(64, 2), (64, 3), (128, 2)]:
    f = jax.jit(functools.partial(decode.mqa_decode, scale=1.0, block_k=bk, stages=st))
    err_r = float(jnp.abs(f(q, k, v, lengths).astype(jnp.float32) - want_r).max())
    err_f = float(jnp.abs(f(q, k, v, full).astype(jnp.float32) - want).max())
    t_r = po.timeit(f, q, k, v, lengths)
    t_f = po.timeit(f, q, k, v, full)
    print(f"pallas_kernels.attention.decode, {bk} keys a step, {st} stages: "
          f"ragged {t_r:.3f} ms (err {err_r:.3g}); full rows {t_f:.3f} ms (err {err_f:.3g})")


if __name__ == "__main__":
  main()
