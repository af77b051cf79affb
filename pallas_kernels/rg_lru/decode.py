"""A recurrent block's decoding step after its Conv1D, in one kernel: both block-diagonal gates
and the RG-LRU update for one token per row.

``gates_update(x, segment_pos, w_x, w_a, b_x, b_a, a_param, h0, *, interpret=False) -> (y, h)``
with

- ``x``: ``[B, E]``, the token's Conv1D output (the compute dtype);
- ``segment_pos``: int32 ``[B]``, the token's position in its document (0 restarts the state);
- ``w_x``, ``w_a``: ``[H, E/H, E/H]`` and ``b_x``, ``b_a``: ``[H, E/H]``, the input gate's and
  the decay gate's blocks; ``a_param``: ``[E]``; ``h0``: ``[B, E]`` float32;
- ``y``: ``[B, E]`` (``x``'s dtype) and ``h``: ``[B, E]`` float32, the new state (written
  over ``h0``'s buffer).

Why: XLA's step runs the gate kernel (``pallas_kernels.gates``, which writes both gates'
logits), then the gate arithmetic and the update as passes of their own; this kernel reads
``x`` and the state once and writes ``y`` and the state once (12 bytes a channel a row).
The Conv1D stays XLA's (one pass at its bytes floor, which also writes the token into the
ring in place). On an H100 at Hawk 1.3B's shapes and 2048 rows: 0.062 ms a block against 0.073
for XLA's passes with XLA's batched-matmul gates (``gate_impl=xla``), and Hawk's decoding step
14.31-14.33 ms against 14.67 with the default XLA path (Triton gate kernel, then XLA's passes;
docs/bench/decode_log.md, session 30). An earlier kernel that also did the Conv1D (written in
session 28, timed in session 29) held the Conv1D's pieces, both gates' accumulators and the
state at once: 249 registers a thread, one program an SM, 0.16 ms a block.

Each program takes ``_ROWS`` rows and one gate block (grid ``(B / _ROWS, H)``): it loads the
block's ``x`` tile once, then walks the block's output columns ``_COLS`` at a time in a loop
(a ``[rows, E/H] x [E/H, _COLS]`` dot per gate, the decay, the normalised input, the update),
so that only one piece's accumulators are live (127 registers a thread at 64 rows and 4 warps;
unrolled over the whole block: 255 and spills). Blocks whose size is not a multiple of
``_COLS`` go in ``gates.block_diagonal.pieces``, unrolled. Arithmetic in float32, rounded to
the compute dtype where the XLA step stores values in it (the gate logits, the normalised
input).

Triton lowering (``interpret=True``: Pallas' generic interpreter, used by the tests on the
CPU). ``E/H`` must be a multiple of 16 (``supported``); ``B`` is padded inside.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gates import block_diagonal as bd
from pallas_kernels.rg_lru.reference import RG_LRU_C

# Rows a program, warps, output columns a loop step and Triton's pipeline stages. On an H100 at
# Hawk 1.3B's shapes (bench_decode_kernels.py, session 30), ms a block: 64 x 4 warps x 32
# columns, 1 stage 0.0618 (3 stages 0.0649, 2 0.0706); 128 x 8, 1-2 stages 0.0612-0.0616; 64 x
# 8 0.0878; 32 x 4 0.1025; 64 x 2 0.0691; the block's pieces unrolled 0.0923; XLA's passes with
# its batched-matmul gates 0.0733.
_ROWS = 64
_WARPS = 4
_COLS = 32  # 0: the block's pieces, unrolled (as for a block that is no multiple of it)
_STAGES = 1
# Fewer rows than this (a device's share) take XLA's step, which is faster there: on an H100,
# Hawk 1.3B's decoding step at 16 / 128 / 512 rows 2.40 / 3.26 / 5.22 ms with the kernel
# against 2.30 / 2.99 / 5.03 with XLA's, at 2048 rows 14.31-14.33 against 14.67 (session 30).
# A grid of B / 64 x H programs leaves most SMs idle under 1024 rows.
MIN_ROWS = 2048


def supported(width: int, num_blocks: int) -> bool:
  """Whether the kernel takes ``num_blocks`` gate blocks over ``width`` channels."""
  return width % num_blocks == 0 and bd.supported(width // num_blocks, width // num_blocks)


def worthwhile(rows: int, width: int, num_blocks: int) -> bool:
  """Whether ``RecurrentBlock`` takes the kernel: shapes it takes, ``MIN_ROWS`` rows or more."""
  return rows >= MIN_ROWS and supported(width, num_blocks)


def _kernel(seg_ref, x_ref, wx_ref, wa_ref, bx_ref, ba_ref, la_ref, h0_ref, y_ref, h_ref, *,
            cols):
  f32, dtype = jnp.float32, y_ref.dtype
  block = x_ref.shape[1]
  reset = seg_ref[...][:, None] == 0                                   # [R, 1]
  xs = [(a, x_ref[:, pl.ds(a, n)]) for a, n in bd.pieces(block)]     # the x tile, read once

  def piece(c, m):  # output columns c:c+m
    def logits(w_ref, b_ref):
      acc = sum(jnp.dot(x, w_ref[0, pl.ds(a, x.shape[1]), pl.ds(c, m)],
                        preferred_element_type=f32) for a, x in xs)
      return (acc + b_ref[0, pl.ds(c, m)].astype(f32)[None]).astype(dtype).astype(f32)
    gate_x = jax.nn.sigmoid(logits(wx_ref, bx_ref))
    gate_a = jax.nn.sigmoid(logits(wa_ref, ba_ref))
    log_a = gate_a * la_ref[pl.ds(c, m)][None]  # la: -RG_LRU_C * softplus(a_param)
    multiplier = jnp.where(reset, 1.0, jnp.sqrt(1.0 - jnp.exp(2.0 * log_a)))
    x_in = x_ref[:, pl.ds(c, m)].astype(f32)
    normalized = (x_in * gate_x * multiplier).astype(dtype).astype(f32)
    h = jnp.where(reset, 0.0, jnp.exp(log_a)) * h0_ref[:, pl.ds(c, m)] + normalized
    h_ref[:, pl.ds(c, m)] = h
    y_ref[:, pl.ds(c, m)] = h.astype(dtype)

  if not cols or block % cols:
    for c, m in bd.pieces(block):
      piece(c, m)
  else:
    def body(i, carry):
      piece(pl.multiple_of(i * cols, cols), cols)
      return carry
    jax.lax.fori_loop(0, block // cols, body, 0)


def reference(x, segment_pos, w_x, w_a, b_x, b_a, a_param, h0):
  """The same step in plain JAX, in the inputs' precision (float64 under ``jax.enable_x64``):
  ``(y, h)``, ``y`` in ``x``'s dtype."""
  blocks = x.reshape(x.shape[0], w_x.shape[0], -1)
  gate = lambda w, b: jax.nn.sigmoid(jnp.einsum("bhi,hij->bhj", blocks, w) + b).reshape(x.shape)
  log_a = -RG_LRU_C * gate(w_a, b_a) * jax.nn.softplus(a_param)
  reset = segment_pos[:, None] == 0
  multiplier = jnp.where(reset, 1.0, jnp.sqrt(1 - jnp.exp(2 * log_a)))
  h = jnp.where(reset, 0.0, jnp.exp(log_a)) * h0 + x * gate(w_x, b_x) * multiplier
  return h.astype(x.dtype), h


@functools.partial(jax.jit, static_argnames=("interpret",))
def gates_update(x, segment_pos, w_x, w_a, b_x, b_a, a_param, h0, *, interpret: bool = False):
  """See the module docstring."""
  batch, width = x.shape
  blocks, block = w_x.shape[:2]
  if w_x.shape != (blocks, block, block) or block * blocks != width or w_a.shape != w_x.shape:
    raise ValueError(f"gates_update: the gate blocks {w_x.shape} and {w_a.shape} do not fit "
                     f"{width} channels")
  # rows a program: _ROWS, or the batch rounded up to a power of two (16 at least: Triton's
  # smallest dot) where that is fewer, so that a small batch is not padded to _ROWS
  tile_rows = min(_ROWS, max(16, 1 << (batch - 1).bit_length()))
  rows = -(-batch // tile_rows) * tile_rows
  pad = lambda a, value=0: jnp.pad(a, [(0, rows - batch)] + [(0, 0)] * (a.ndim - 1),
                                   constant_values=value)
  tile = pl.BlockSpec((tile_rows, block), lambda r, k: (r, k))
  weight = pl.BlockSpec((1, block, block), lambda r, k: (k, 0, 0))
  bias = pl.BlockSpec((1, block), lambda r, k: (k, 0))
  y, h = pl.pallas_call(
      functools.partial(_kernel, cols=_COLS),
      name="pallas_recurrent_gates_update",
      out_shape=(jax.ShapeDtypeStruct((rows, width), x.dtype),
                 jax.ShapeDtypeStruct((rows, width), jnp.float32)),
      grid=(rows // tile_rows, blocks),
      in_specs=[pl.BlockSpec((tile_rows,), lambda r, k: (r,)), tile, weight, weight, bias, bias,
                pl.BlockSpec((block,), lambda r, k: (k,)), tile],
      out_specs=(tile, tile),
      input_output_aliases={7: 1},  # h over h0: the state updated in place
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=_WARPS,
                                                                  num_stages=_STAGES),
      interpret=interpret,
  )(pad(segment_pos.astype(jnp.int32), value=1), pad(x), w_x.astype(x.dtype),
    w_a.astype(x.dtype), b_x, b_a, -RG_LRU_C * jax.nn.softplus(a_param.astype(jnp.float32)),
    pad(h0.astype(jnp.float32)))
  return y[:batch], h[:batch]
