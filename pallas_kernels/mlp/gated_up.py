"""The gated MLP's up-projection and gating in one kernel, for decoding (no backward).

``gated_up(x, w, b, *, interpret=False) -> h`` with ``x: [N, D]``, ``w: [2, D, M]`` (both
branches), ``b: [2, M]``, ``h = gelu(x w_0 + b_0) * (x w_1 + b_1)``: ``[N, M]`` in ``x``'s
dtype (tanh GeLU, as ``jax.nn.gelu``). Each program computes a ``[rows, cols]`` tile of both
branches' matmuls (two float32 accumulators over ``D`` in steps of ``_K``) and writes only ``h``:
XLA writes both ``[N, M]`` branches and reads them again in a pass of its own (Hawk 1.3B at
2048 rows on an H100: the matmul 4.04 ms a step at 613 TFLOP/s, the gating pass 0.67 ms;
docs/bench/decode_log.md, session 28).

Rounded to the compute dtype where the XLA path stores values in it: each branch after its bias
(here the float32 bias is added before that rounding), the GeLU before the product. Triton
lowering (``interpret=True``: Pallas' interpreter, the CPU tests). ``D`` a multiple of ``_K``,
``M`` of 64 (``supported``); ``N`` is padded inside.

Two implementations of the same tile arithmetic, picked by ``dispatch.gated_up_path``:

- Triton (``_triton``): every GPU; float32 too.
- Mosaic GPU (``_mosaic``, on ``matmul.persistent``'s skeleton), on Hopper for bfloat16 and
  float16 with ``M`` a multiple of 128: one persistent CTA per SM walks the output tiles (rows
  fastest, so the CTAs running at once share each weight tile through L2; clusters of two CTAs
  on neighbouring row tiles load each weight tile once between them, TMA multicast). A memory
  warpgroup streams ``x`` and both branches' weights through a ring of ``MOSAIC_STAGES`` TMA
  slots; two compute warpgroups each take 64 of the tile's 128 rows of both branches on wgmma
  (two ``64 x 128`` float32 accumulators), and the bias, GeLU and product run in registers
  before a TMA store. On an H200 at Hawk 1.3B's shape
  (2048 rows, ``D`` 2048, ``M`` 6144) it takes 0.153-0.154 ms (668-675 TFLOP/s) against
  0.183-0.193 for the Triton kernel; at 1024 rows 0.084-0.088 against 0.101-0.107
  (docs/bench/decode_log.md, session 43); with the clusters (session 45) 0.159 against 0.166
  without, on a slower H200. Pallas' Mosaic GPU interpreter has no cluster barriers:
  interpreted, the kernel runs without clusters.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import dispatch
from pallas_kernels.matmul import persistent

# The tile: 128 rows by 128 columns of each branch, a 128 x 256 output tile's worth of
# accumulators, as XLA's and cuBLAS's large tiles. On an H100 at Hawk 1.3B's shapes
# (bench_decode_kernels.py, session 29): 0.191-0.196 ms a call with K 64 or 32 and 3 or 4
# stages; 64 x 256 0.222, 128 x 64 (4 warps) 0.233; 5 stages exceed shared memory.
_ROWS, _COLS, _K = 128, 128, 64
_WARPS, _STAGES = 8, 3
# float32 operands: half the K step and 2 stages (3 stages of 64 would ask for 288 KiB of shared
# memory, more than an H100's 227 KiB). Triton then multiplies in full float32, not tensor cores.
_K32, _STAGES32 = 32, 2

# The Mosaic GPU tile: 128 rows (64 a compute warpgroup) by 128 columns of each branch, K steps
# of 64, 4 ring slots (192 KiB; 3 slots: 0.156 against 0.153 ms at 2048 rows, session 43). One
# persistent CTA per SM with the rows fastest beat a CTA a tile (0.163) and the columns fastest
# (0.179).
# Clusters of two CTAs on neighbouring row tiles share each weight tile through TMA multicast:
# 0.159 against 0.166 ms without at 2048 rows (H200, session 45).
MOSAIC_TILE = (128, 128, 64)
MOSAIC_STAGES = 4
MOSAIC_CLUSTER = 2

# The fewest rows (per device) for which ``model.MLPBlock`` takes the kernel. Fewer rows leave the
# matmul bound by reading the weights, where XLA's gemm (split over more SMs) is faster: Hawk
# 1.3B's decoding step on an H100 (session 29, means of two runs) was 3.2% slower with the kernel
# at 16 rows, 5.3% at 128, 0.7% at 512, and faster at 1024 rows (MQA, 1.4%) and 2048 (Hawk, 1.5%).
MIN_ROWS = 1024


def _cols(expanded: int) -> int:
  """Columns of a tile: ``_COLS``, or 64 where ``expanded`` is not a multiple of it."""
  return _COLS if expanded % _COLS == 0 else 64


def _k_and_stages(dtype) -> tuple[int, int]:
  return (_K, _STAGES) if jnp.dtype(dtype).itemsize <= 2 else (_K32, _STAGES32)


def supported(width: int, expanded: int) -> bool:
  return width % _K == 0 and expanded % 64 == 0


def mosaic_problem(width: int, expanded: int, dtype) -> str | None:
  """Why the Mosaic GPU kernel cannot take ``x [N, width]`` of ``dtype`` against a
  ``[2, width, expanded]`` weight, or None."""
  return persistent.problem(dtype, width, expanded, tile=MOSAIC_TILE, what="expanded width")


def worthwhile(rows: int, width: int, expanded: int) -> bool:
  """Whether ``model.MLPBlock`` takes the kernel: shapes it takes, ``MIN_ROWS`` rows or more."""
  return rows >= MIN_ROWS and supported(width, expanded)


def reference(x, w, b):
  """The same in jnp: ``model.MLPBlock``'s decoding path where the kernel is not used. The
  branch axis is a batch axis of both operands, so the ``[2, D, M]`` weight is read as it lies
  (with ``"nd,cdm->ncm"`` XLA transposed the whole weight at every step: 0.89 ms of Hawk 1.3B's
  17 ms step at 2048 rows on an H100)."""
  up = jnp.einsum("cnd,cdm->cnm", jnp.broadcast_to(x, (2, *x.shape)), w.astype(x.dtype))
  up = up + b.astype(x.dtype)[:, None]
  return jax.nn.gelu(up[0]) * up[1]


def _kernel(x_ref, w0_ref, w1_ref, b_ref, h_ref, *, k_step):
  f32, dtype = jnp.float32, h_ref.dtype
  rows, cols = h_ref.shape

  def step(k, accs):
    a0, a1 = accs
    xs = x_ref[:, pl.ds(k * k_step, k_step)]
    a0 += jnp.dot(xs, w0_ref[pl.ds(k * k_step, k_step), :], preferred_element_type=f32)
    a1 += jnp.dot(xs, w1_ref[pl.ds(k * k_step, k_step), :], preferred_element_type=f32)
    return a0, a1

  zeros = jnp.zeros((rows, cols), f32)
  a0, a1 = jax.lax.fori_loop(0, x_ref.shape[1] // k_step, step, (zeros, zeros))
  u0 = (a0 + b_ref[0, :].astype(f32)[None]).astype(dtype).astype(f32)
  u1 = (a1 + b_ref[1, :].astype(f32)[None]).astype(dtype).astype(f32)
  h_ref[...] = (jax.nn.gelu(u0).astype(dtype).astype(f32) * u1).astype(dtype)


@functools.partial(jax.jit, static_argnames=("impl", "interpret"))
def gated_up(x, w, b, *, impl: str | None = None, interpret: bool = False):
  """See the module docstring. ``impl``: "triton" or "mosaic"; None asks
  ``dispatch.gated_up_path``."""
  n, d = x.shape
  m = w.shape[-1]
  if w.shape != (2, d, m) or b.shape != (2, m) or not supported(d, m):
    raise ValueError(f"gated_up: x {x.shape}, w {w.shape}, b {b.shape}: need w [2, D, M], "
                     f"b [2, M], D a multiple of {_K}, M of 64")
  impl = impl or dispatch.gated_up_path(d, m, x.dtype)
  if impl == "mosaic":
    why = mosaic_problem(d, m, x.dtype)
    if why:
      raise ValueError(f"gated_up: the Mosaic GPU kernel does not take {why}")
    return _mosaic(x, w.astype(x.dtype), b, interpret=interpret)
  return _triton(x, w, b, interpret=interpret)


def _triton(x, w, b, *, interpret: bool):
  n, d = x.shape
  m = w.shape[-1]
  # rows a program: _ROWS, or fewer for a small batch (a power of two, 16 at least)
  tile_rows = min(_ROWS, max(16, 1 << (n - 1).bit_length()))
  rows, cols = -(-n // tile_rows) * tile_rows, _cols(m)
  k_step, stages = _k_and_stages(x.dtype)
  h = pl.pallas_call(
      functools.partial(_kernel, k_step=k_step),
      name="pallas_gated_up",
      out_shape=jax.ShapeDtypeStruct((rows, m), x.dtype),
      grid=(rows // tile_rows, m // cols),
      in_specs=[pl.BlockSpec((tile_rows, d), lambda r, c: (r, 0)),
                pl.BlockSpec((None, d, cols), lambda r, c: (0, 0, c)),
                pl.BlockSpec((None, d, cols), lambda r, c: (1, 0, c)),
                pl.BlockSpec((2, cols), lambda r, c: (0, c))],
      out_specs=pl.BlockSpec((tile_rows, cols), lambda r, c: (r, c)),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=_WARPS,
                                                                  num_stages=stages),
      interpret=interpret,
  )(jnp.pad(x, ((0, rows - n), (0, 0))), w.astype(x.dtype), w.astype(x.dtype), b)
  return h[:n]


def _mosaic(x, w, b, *, stages: int = MOSAIC_STAGES, interpret: bool = False,
            cluster: int = MOSAIC_CLUSTER):
  """The Mosaic GPU kernel (module docstring) on ``persistent.tiles``; ``interpret``: Pallas'
  Mosaic GPU interpreter, three CTAs and no clusters."""
  n, m = x.shape[0], w.shape[-1]
  dtype, f32 = x.dtype, jnp.float32
  tile_m, tile_n, _ = MOSAIC_TILE
  half = tile_m // 2  # rows of a compute warpgroup
  rows, tiles, grid, cluster = persistent.schedule(n, m, tile=MOSAIC_TILE, cluster=cluster,
                                          interpret=interpret)
  swizzle = plmgpu.find_swizzle(tile_n * 16)
  out_tr = (plmgpu.TilingTransform((8, swizzle // 2)), plmgpu.SwizzleTransform(swizzle))
  c = math.sqrt(2 / math.pi)

  def kernel(x_g, w_g, b_g, h_g):
    def prologue(tm, tn, wg, mine, out_s, b_s, b_bar):
      del tm, mine, out_s
      plmgpu.copy_gmem_to_smem(b_g.at[:, tn], b_s.at[wg], b_bar.at[wg])

    def epilogue(accs, tm, tn, wg, mine, out_s, b_s, b_bar):
      a0, a1 = accs
      plmgpu.barrier_wait(b_bar.at[wg])
      if interpret:  # the interpreter has no layouts
        b0, b1 = b_s[wg, 0], b_s[wg, 1]
      else:
        column = plmgpu.Layout.WGMMA.reduce(0)
        b0 = plmgpu.load(b_s.at[wg, 0], (), layout=column)
        b1 = plmgpu.load(b_s.at[wg, 1], (), layout=column)
      bias = lambda v: lax.broadcast_in_dim(v, (half, tile_n), [1])
      u0 = (a0[...] + bias(b0)).astype(dtype).astype(f32)
      u1 = (a1[...] + bias(b1)).astype(dtype).astype(f32)
      gelu = 0.5 * u0 * (1 + jnp.tanh(c * (u0 + 0.044715 * u0 * u0 * u0)))
      h = (gelu.astype(dtype).astype(f32) * u1).astype(dtype)
      plmgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store has read
      out_s[wg] = h
      plmgpu.commit_smem()
      plmgpu.copy_smem_to_gmem(out_s.at[wg], h_g.at[tm].at[mine].at[:, tn])

    persistent.tiles(
        x_g, lambda cols: (w_g.at[0, :, cols], w_g.at[1, :, cols]), lax.axis_index("sm"),
        tiles, grid, tile=MOSAIC_TILE, prologue=prologue, epilogue=epilogue, stages=stages,
        cluster=cluster,
        scratch=(("out_s", plmgpu.SMEM((2, half, tile_n), dtype, transforms=out_tr)),
                 ("b_s", plmgpu.SMEM((2, 2, tile_n), f32)),
                 ("b_bar", plmgpu.Barrier(num_barriers=2))))

  call = plmgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((rows, m), dtype), grid=(grid,), grid_names=("sm",),
      **persistent.cluster_launch(cluster), num_threads=3, thread_name="wg",
      compiler_params=plmgpu.CompilerParams(
          lowering_semantics=plmgpu.LoweringSemantics.Warpgroup),
      interpret=dispatch.mosaic_gpu_interpreter(interpret))
  return call(jnp.pad(x, ((0, rows - n), (0, 0))), w, b.astype(f32))[:n]
