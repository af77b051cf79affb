"""Probe for issue #18 (a): cache reads and a matmul overlapped in one Mosaic GPU kernel.

MQA's decoding step runs its cache reads (memory-bound) and its matmuls (compute-bound) one
after the other, because XLA runs one kernel at a time and each fills the GPU
(docs/inference.md). This probe asks whether one warp-specialised kernel can run both at once on
disjoint SMs. Reader work items stream a bfloat16 buffer through a TMA ring and sum it (a
stand-in for the decode attention's reads, without its arithmetic); matmul work items are
128 x 256 tiles of wgmma (two compute warpgroups of 128 x 128, one memory warpgroup issuing TMA
loads). Both outputs are checked against XLA's in the run. Two ways to split the SMs:

- static (``--Ps``): one persistent CTA per SM, CTAs [0, P) read 1/P of the buffer each, the
  others walk the matmul tiles;
- dynamic (``--chunks C``): one CTA per work item, reader items of C tiles spread evenly among
  the matmul tiles in launch order, so the hardware hands each SM the next item as it frees and
  both kinds of work end at about the same time, whatever their speeds.

It prints each one alone, fused, and in sequence (cuBLAS, then the reader on every SM: the best
sequence). Results: docs/bench/decode_log.md, session 41.

    python scripts/bench/probe_overlap_mgpu.py --chunks 32,64 --Ps 28,32 --stages 3x4
    python scripts/bench/probe_overlap_mgpu.py --chunks 32,64 --Ps 40,48 --stages 3x4 --buf_gib 2
    JAX_PLATFORMS=cpu python scripts/bench/probe_overlap_mgpu.py --interpret  # tiny, on the CPU

``--stages AxB``: A stages in the matmul's TMA ring, B in the reader's.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import timing  # scripts/bench/

TM, TN, TK = 128, 256, 64  # CTA tile; each of the two compute warpgroups takes 128 x 128
RT, RC = 64, 256  # reader tile: rows x columns (TMA boxes stop at 256)


def fused(a, b, buf, G, P, *, mm_stages=3, rd_stages=4, chunk=None, interpret=False):
  """``chunk=None``: G persistent CTAs, P of them readers (a static split). ``chunk=C``: one
  CTA per work item, reader chunks of C tiles spread evenly among the matmul tiles in launch
  order, so that the hardware hands each SM the next item as it frees (a dynamic split)."""
  do_mm, do_rd = a is not None, buf is not None
  n_m = n_r = 0
  if do_mm:
    M, K = a.shape
    N = b.shape[1]
    m_iters, n_iters, k_iters = M // TM, N // TN, K // TK
    n_m = m_iters * n_iters
  if do_rd:
    R = buf.shape[0]
    per = R // (P * RT) if chunk is None else chunk  # reader tiles a reader CTA walks
    n_r = P if chunk is None else R // (chunk * RT)
  if chunk is not None:
    G = n_r + n_m
  swz = plgpu.find_swizzle(TK * 16)
  tr = (plgpu.TilingTransform((8, swz // 2)), plgpu.SwizzleTransform(swz))
  out_swz = plgpu.find_swizzle(TN // 2 * 16)
  out_tr = (plgpu.TilingTransform((8, out_swz // 2)), plgpu.SwizzleTransform(out_swz))

  def body(*refs):
    refs = list(refs)
    a_g = refs.pop(0) if do_mm else None
    b_g = refs.pop(0) if do_mm else None
    buf_g = refs.pop(0) if do_rd else None
    out_g = refs.pop(0) if do_mm else None
    sums_g = refs.pop(0) if do_rd else None
    cta = lax.axis_index("sm")
    wg = lax.axis_index("wg")
    if chunk is None:
      is_reader, slot = cta < P, cta
      first, stop, step = cta - P, n_m, G - P
    else:  # item i is a reader when the running count of readers, (i + 1) n_r / G, steps up
      readers_to = (cta + 1) * n_r // G
      slot = cta * n_r // G
      is_reader = readers_to > slot
      first, stop, step = cta - readers_to, cta - readers_to + 1, 1

    if do_rd:
      def rd_pipe(bd, ctx):
        return plgpu.emit_pipeline_warp_specialized(
            bd, grid=(per,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((RT, RC), lambda i: (i, 0), memory_space=plgpu.SMEM)],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=rd_stages,
            compute_context=ctx)
      ignore = lambda *_, **__: None

      @pl.when(is_reader)
      def _reader():
        mine = buf_g.at[pl.ds(slot * (per * RT), per * RT)]

        @functools.partial(pl.run_scoped,
                           allocs=rd_pipe(ignore, ignore).get_allocations(mine),
                           res=plgpu.SMEM((2, RC // 2), jnp.float32), collective_axes="wg")
        def _scope(allocs, res):
          def rd_body(idxs, tile, acc):
            del idxs
            for r in range(RT):
              acc = acc + tile[r, pl.ds(wg * (RC // 2), RC // 2)].astype(jnp.float32)
            return acc

          def ctx(run):
            acc = run(jnp.zeros((RC // 2,), jnp.float32))
            res[wg] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(res.at[wg], sums_g.at[slot, wg])
            plgpu.wait_smem_to_gmem(0)

          rd_pipe(rd_body, ctx)(mine, allocations=allocs)

    if do_mm:
      def mm_pipe(bd, ctx):
        return plgpu.emit_pipeline_warp_specialized(
            bd, grid=(k_iters,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((TM, TK), lambda k: (0, k), transforms=tr,
                                      memory_space=plgpu.SMEM),
                      plgpu.BlockSpec((TK, TN), lambda k: (k, 0), transforms=tr,
                                      memory_space=plgpu.SMEM)],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=mm_stages,
            compute_context=ctx)
      ignore = lambda *_, **__: None

      @pl.when(jnp.logical_not(is_reader))
      def _matmul():
        @functools.partial(
            pl.run_scoped,
            allocs=mm_pipe(ignore, ignore).get_allocations(a_g.at[pl.ds(0, TM)],
                                                           b_g.at[:, pl.ds(0, TN)]),
            out_s=plgpu.SMEM((2, TM, TN // 2), out_g.dtype, transforms=out_tr),
            collective_axes="wg")
        def _scope(allocs, out_s):
          @pl.loop(first, stop, step=step)
          def _tile(t):
            mi, ni = t % m_iters, t // m_iters
            ms, ns = pl.ds(mi * TM, TM), pl.ds(ni * TN, TN)
            wn = pl.ds(wg * (TN // 2), TN // 2)

            def ctx(run):
              @functools.partial(pl.run_scoped, acc=plgpu.ACC((TM, TN // 2), jnp.float32))
              def _acc(acc):
                run(acc)
                y = acc[...].astype(out_g.dtype)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                out_s[wg] = y
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_s.at[wg], out_g.at[ms, :].at[:, ns].at[:, wn])

            def mma(idxs, a_s, b_s, acc):
              del idxs
              plgpu.wgmma(acc, a_s, b_s.at[:, wn])
              plgpu.wgmma_wait(0)
              return acc

            mm_pipe(mma, ctx)(a_g.at[ms, :], b_g.at[:, ns], allocations=allocs)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  outs = []
  if do_mm:
    outs.append(jax.ShapeDtypeStruct((M, N), a.dtype))
  if do_rd:
    outs.append(jax.ShapeDtypeStruct((n_r, 2, RC // 2), jnp.float32))
  kw = {}
  if interpret:
    from jax._src.pallas.mosaic_gpu.interpret import params  # pylint: disable=g-import-not-at-top
    kw["interpret"] = params.InterpretGPUParams()
  f = plgpu.kernel(
      body, out_type=tuple(outs), grid=(G,), grid_names=("sm",), num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **kw)
  args = [x for x in (a, b, buf) if x is not None]
  return f(*args)


def reference_sums(buf, P):
  R = buf.shape[0]
  x = buf.astype(jnp.float32).reshape(P, R // P, 2, RC // 2)
  return x.sum(1)


def measure(fz, rd, a, b, bb, mm_out):
  """The reader alone (its sums against XLA's) and the fused kernel (both outputs against the
  parts'): ``(t_reader, sums_err, t_fused, outputs_ok)``."""
  sums = rd(bb)[0]
  serr = float(jnp.abs(sums - reference_sums(bb, sums.shape[0])).max())
  t_rd = timeit(rd, bb)
  o2, s2 = fz(a, b, bb)
  ok = bool(jnp.array_equal(o2, mm_out)) and bool(jnp.allclose(s2, sums))
  return t_rd, serr, timeit(fz, a, b, bb), ok


def timeit(f, *args):
  """ms a call: the median of seven windows of ten back-to-back calls."""
  return timing.time_fn(f, *args, iters=7, calls=10)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--interpret", action="store_true")
  p.add_argument("--Ps", default="16,24,32,48,66")
  p.add_argument("--stages", default="3x4,3x6,2x2")
  p.add_argument("--buf_gib", type=float, default=1.0)
  p.add_argument("--chunks", default="", help="reader tiles a work item: the dynamic split")
  args = p.parse_args()
  k = jax.random.split(jax.random.key(0), 3)
  if args.interpret:
    M, K, N, G, P, R = 128, 128, 512, 3, 1, 4 * RT
  else:
    M, K, N, R = 1024, 2048, 65536, int(args.buf_gib * (1 << 30)) // (RC * 2)
    G = jax.devices()[0].core_count
  a = jax.random.normal(k[0], (M, K), jnp.bfloat16)
  b = (jax.random.normal(k[1], (K, N), jnp.float32) / K**0.5).astype(jnp.bfloat16)
  buf = jax.random.normal(k[2], (R, RC), jnp.bfloat16)
  want = jnp.dot(a, b, preferred_element_type=jnp.float32)
  if args.interpret:
    for chunk in (None, 1):
      out, sums = fused(a, b, buf, G, P, mm_stages=2, rd_stages=2, chunk=chunk, interpret=True)
      print(f"chunk={chunk}: matmul err", float(jnp.abs(out.astype(jnp.float32) - want).max()),
            "sums err", float(jnp.abs(sums - reference_sums(buf, sums.shape[0])).max()))
    return
  print(jax.devices()[0].device_kind, "SMs", G, "buffer GiB", buf.nbytes / 2**30)
  gemm = jax.jit(lambda a, b: jnp.dot(a, b))
  t_cublas = timeit(gemm, a, b)
  print(f"cuBLAS alone {t_cublas:.3f} ms ({2*M*N*K/t_cublas/1e9:.0f} TFLOP/s)")
  try:
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    for wgd in (hm.MatmulDimension.N, hm.MatmulDimension.M):
      cfg = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                            grid_minor_dim=hm.MatmulDimension.M, grid_tile_width=4,
                            wg_dimension=wgd)
      lib = jax.jit(lambda a, b, cfg=cfg: hm.matmul(a, b, None, cfg))
      t_lib = timeit(lib, a, b)
      print(f"jax's hopper_matmul_mgpu ({wgd}) {t_lib:.3f} ms ({2*M*N*K/t_lib/1e9:.0f} TFLOP/s)")
  except Exception as e:  # pylint: disable=broad-except
    print(f"hopper_matmul_mgpu failed: {type(e).__name__}: {str(e)[:300]}")
  rsum = jax.jit(lambda x: x.astype(jnp.float32).reshape(-1, 8, RC).sum(0))
  t_xred = timeit(rsum, buf)
  print(f"XLA reduction of the buffer {t_xred:.3f} ms ({buf.nbytes/t_xred/1e9:.2f} TB/s)")
  rd_all = jax.jit(lambda x: fused(None, None, x[: (R // (G * RT)) * G * RT], G, G))
  seq_all = jax.jit(lambda a, b, x: (jnp.dot(a, b), rd_all(x)))  # the best sequence
  mm_ref = jax.jit(lambda a, b: fused(a, b, None, G, 0))(a, b)[0]
  for c in [int(c) for c in args.chunks.split(",") if c]:
    bb = buf[: (R // (c * RT)) * c * RT]
    try:
      rd = jax.jit(lambda x, c=c: fused(None, None, x, G, 0, chunk=c))
      fz = jax.jit(lambda a, b, x, c=c: fused(a, b, x, G, 0, chunk=c))
      t_rd, serr, t_fz, ok = measure(fz, rd, a, b, bb, mm_ref)
      t_mm = timeit(jax.jit(lambda a, b, c=c: fused(a, b, None, G, 0, chunk=c)), a, b)
      t_seq_all = timeit(seq_all, a, b, buf)
      print(f"[dynamic, {c} tiles a reader item] reader alone {t_rd:.3f} ms "
            f"({bb.nbytes/t_rd/1e9:.2f} TB/s, err {serr:.2g}); matmul alone (a CTA a tile) "
            f"{t_mm:.3f}; fused {t_fz:.3f} ms (outputs ok: {ok}); cuBLAS + reader on all "
            f"SMs {t_seq_all:.3f}")
    except Exception as e:  # pylint: disable=broad-except
      print(f"[dynamic, {c}] failed: {type(e).__name__}: {str(e)[:300]}")
  for st in args.stages.split(","):
    ms_, rs_ = map(int, st.split("x"))
    try:
      mm = jax.jit(lambda a, b: fused(a, b, None, G, 0, mm_stages=ms_))
      out = mm(a, b)[0]
      err = float(jnp.abs(out.astype(jnp.float32) - want).max())
      t_mm = timeit(mm, a, b)
      print(f"[{st}] Mosaic matmul alone on {G} SMs {t_mm:.3f} ms "
            f"({2*M*N*K/t_mm/1e9:.0f} TFLOP/s), max err {err:.3g}")
    except Exception as e:  # pylint: disable=broad-except
      print(f"[{st}] matmul failed: {type(e).__name__}: {str(e)[:300]}")
      continue
    for P in map(int, args.Ps.split(",")):
      R_ = (R // (P * RT)) * P * RT
      bb = buf[:R_]
      try:
        rd = jax.jit(lambda x, P=P: fused(None, None, x, P, P, rd_stages=rs_))
        fz = jax.jit(lambda a, b, x, P=P: fused(a, b, x, G, P, mm_stages=ms_, rd_stages=rs_))
        t_rd, serr, t_fz, ok = measure(fz, rd, a, b, bb, out)
        t_seq = timeit(jax.jit(lambda a, b, x, rd=rd: (jnp.dot(a, b), rd(x))), a, b, bb)
        t_seq_all = timeit(seq_all, a, b, buf)
        print(f"[{st}] P={P}: reader alone on P SMs {t_rd:.3f} ms "
              f"({bb.nbytes/t_rd/1e9:.2f} TB/s, err {serr:.2g}); fused {t_fz:.3f} ms "
              f"(outputs ok: {ok}); cuBLAS + reader {t_seq:.3f}; sum of parts "
              f"{t_cublas + t_rd:.3f}; cuBLAS + reader on all SMs {t_seq_all:.3f}")
      except Exception as e:  # pylint: disable=broad-except
        print(f"[{st}] P={P} failed: {type(e).__name__}: {str(e)[:300]}")
  t = timeit(rd_all, buf)
  print(f"reader on all {G} SMs {t:.3f} ms ({(R // (G * RT)) * G * RT * RC * 2/t/1e9:.2f} TB/s)")


if __name__ == "__main__":
  main()
