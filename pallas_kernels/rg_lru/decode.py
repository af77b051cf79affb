"""A recurrent block's decoding step after its Conv1D, in one kernel: both block-diagonal gates
and the RG-LRU update for one token per row.

``gates_update(x, segment_pos, w_x, w_a, b_x, b_a, a_param, h0, *, gate=None, interpret=False)
-> (y, h)`` with

- ``x``: ``[B, E]``, the token's Conv1D output (the compute dtype);
- ``segment_pos``: int32 ``[B]``, the token's position in its document (0 restarts the state);
- ``w_x``, ``w_a``: ``[H, E/H, E/H]`` and ``b_x``, ``b_a``: ``[H, E/H]``, the input gate's and
  the decay gate's blocks; ``a_param``: ``[E]``; ``h0``: ``[B, E]`` float32;
- ``gate``: ``[B, E]`` (``x``'s dtype) or None, the block's other branch before its GeLU
  (``linear_y``'s output);
- ``y``: ``[B, E]`` (``x``'s dtype): the RG-LRU's output, times ``gelu(gate)`` where a gate is
  given (the product ``linear_out`` takes: XLA's step otherwise multiplies in a pass of its
  own, 0.24 of Hawk 1.3B's 13.3 ms at 2048 rows on an H200, session 43); ``h``: ``[B, E]``
  float32, the new state (written over ``h0``'s buffer).

Why: XLA's step runs the gate kernel (``pallas_kernels.gates``, which writes both gates'
logits), then the gate arithmetic and the update as passes of their own; this kernel reads ``x``
and the state once and writes ``y`` and the state once (12 bytes a channel a row). The Conv1D
stays XLA's (one pass at its bytes floor, which also writes the token into the ring in place).
On an H100 at Hawk 1.3B's shapes and 2048 rows: 0.0544-0.0576 ms a block against 0.0776-0.0860
for XLA's passes with XLA's batched-matmul gates (``gate_impl=xla``), and Hawk's decoding step
14.02-14.19 ms (session 32) against 14.67 with the default XLA path (Triton gate kernel, then
XLA's passes; session 30; docs/bench/decode_log.md). An earlier kernel that also did the Conv1D
(written in session 28, timed in session 29) held the Conv1D's pieces, both gates' accumulators
and the state at once: 249 registers a thread, one program an SM, 0.16 ms a block.

Each program takes ``_ROWS`` rows and ``_SPLIT`` output columns of one gate block (grid
``(E/H/_SPLIT, H, B/_ROWS)``, the first axis fastest): a ``[rows, E/H] x [E/H, _SPLIT]`` dot per
gate over the block's ``x`` tile, then the decay, the normalised input and the update for its
columns. Only one split's accumulators are live, and the grid has ``E/H / _SPLIT`` times as many
programs as one of whole blocks: at Hawk 1.3B's shapes and 2048 rows, 0.0605 ms a block (with
the row tiles first in the grid) against 0.079-0.082 for programs of whole blocks walking 32
columns at a time in a loop (the kernel until session 32: 127 registers a thread, 320 programs),
and Hawk's decoding step 14.17-14.19 ms against 14.55-14.59 (session 32,
docs/bench/decode_log.md). Blocks whose size is no multiple of ``_SPLIT`` (or is ``_SPLIT`` or
less) are one program a block, their columns in ``gates.block_diagonal.pieces``, unrolled.
Arithmetic in float32, rounded to the compute dtype where the XLA step stores values in it (the
gate logits, the normalised input).

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

# Rows a program, warps and output columns a program (0: whole blocks). On an H100 at Hawk 1.3B's
# shapes, 2048 rows (bench_decode_kernels.py, session 32, with the row tiles first in the grid),
# ms a block: 64 x 4 x 32 0.0605; 128 x 8 0.0624-0.0629; 128 x 4 0.0649; 64 x 2 or 64 x 8 0.0720;
# 32 x 2 0.0674; 256 x 8 0.0753; whole blocks in a loop of 32 columns (64 x 4) 0.079-0.082;
# XLA's passes with its batched-matmul gates 0.0776. The columns first: 64 x 4 x 32 0.0544-0.0576.
_ROWS = 64
_WARPS = 4
_SPLIT = 32
# Fewer rows than this (a device's share) take XLA's step; 16 is the fewest timed. On an H100
# (session 32, alternated, ms a step), Hawk 1.3B at 16 rows: 1.99 / 2.01 with the kernel against
# 2.21 / 2.20 with XLA's; at 128: 2.63 / 2.67 against 2.80 / 2.82; at 512: 4.81 / 4.83 against
# 4.90 / 4.84; at 1024: 7.63 / 7.58 against 7.68 / 7.63; Griffin 1.3B at 128 rows 2.90 / 2.90
# against 3.00 / 3.02, at 1024 9.24 / 9.23 against 9.22 / 9.27. The programs of whole blocks
# (until session 32) were slower than XLA's step under 2048 rows.
MIN_ROWS = 16


def supported(width: int, num_blocks: int) -> bool:
  """Whether the kernel takes ``num_blocks`` gate blocks over ``width`` channels."""
  return width % num_blocks == 0 and bd.supported(width // num_blocks, width // num_blocks)


def worthwhile(rows: int, width: int, num_blocks: int) -> bool:
  """Whether ``RecurrentBlock`` takes the kernel: shapes it takes, ``MIN_ROWS`` rows or more."""
  return rows >= MIN_ROWS and supported(width, num_blocks)


def _kernel(seg_ref, x_ref, xc_ref, wx_ref, wa_ref, bx_ref, ba_ref, la_ref, h0_ref, *refs):
  """``x_ref``: the row tile's whole block (the dots' input); ``xc_ref`` and the refs after it:
  the program's output columns (``_SPLIT`` of them, or the whole block). ``refs``: the gate's
  (if any), then ``y`` and ``h``."""
  g_ref, y_ref, h_ref = refs if len(refs) == 3 else (None, *refs)
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
    x_in = xc_ref[:, pl.ds(c, m)].astype(f32)
    normalized = (x_in * gate_x * multiplier).astype(dtype).astype(f32)
    h = jnp.where(reset, 0.0, jnp.exp(log_a)) * h0_ref[:, pl.ds(c, m)] + normalized
    h_ref[:, pl.ds(c, m)] = h
    y = h.astype(dtype)
    if g_ref is not None:
      gelu = jax.nn.gelu(g_ref[:, pl.ds(c, m)].astype(f32)).astype(dtype)
      y = (y.astype(f32) * gelu.astype(f32)).astype(dtype)
    y_ref[:, pl.ds(c, m)] = y

  for c, m in bd.pieces(h_ref.shape[1]):  # the program's columns (a split is one piece)
    piece(c, m)


def reference(x, segment_pos, w_x, w_a, b_x, b_a, a_param, h0, gate_in=None):
  """The same step in plain JAX, in the inputs' precision (float64 under ``jax.enable_x64``):
  ``(y, h)``, ``y`` in ``x``'s dtype."""
  blocks = x.reshape(x.shape[0], w_x.shape[0], -1)
  gate = lambda w, b: jax.nn.sigmoid(jnp.einsum("bhi,hij->bhj", blocks, w) + b).reshape(x.shape)
  log_a = -RG_LRU_C * gate(w_a, b_a) * jax.nn.softplus(a_param)
  reset = segment_pos[:, None] == 0
  multiplier = jnp.where(reset, 1.0, jnp.sqrt(1 - jnp.exp(2 * log_a)))
  h = jnp.where(reset, 0.0, jnp.exp(log_a)) * h0 + x * gate(w_x, b_x) * multiplier
  y = h.astype(x.dtype)
  return (y if gate_in is None else y * jax.nn.gelu(gate_in)), h


@functools.partial(jax.jit, static_argnames=("interpret",))
def gates_update(x, segment_pos, w_x, w_a, b_x, b_a, a_param, h0, *, gate=None,
                 interpret: bool = False):
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
  xp = pad(x)
  split = _SPLIT if _SPLIT and block % _SPLIT == 0 and _SPLIT < block else block
  parts = block // split  # programs a block and row tile
  # The grid's first axis is CUDA's fastest: programs launched together take one row tile's
  # neighbouring columns, so that their state reads and writes fill whole rows of memory. On an
  # H100 at Hawk 1.3B's shapes: 0.0544-0.0558 ms a block against 0.0601-0.0709 with the row
  # tiles fastest (a probe of the grid orders); in the decoding step no difference measured
  # (session 32).
  tile = pl.BlockSpec((tile_rows, block), lambda c, k, r: (r, k))
  out = pl.BlockSpec((tile_rows, split), lambda c, k, r: (r, k * parts + c))
  weight = pl.BlockSpec((1, block, split), lambda c, k, r: (k, 0, c))
  bias = pl.BlockSpec((1, split), lambda c, k, r: (k, c))
  gated = [] if gate is None else [pad(gate.astype(x.dtype))]
  y, h = pl.pallas_call(
      _kernel,
      name="pallas_recurrent_gates_update",
      out_shape=(jax.ShapeDtypeStruct((rows, width), x.dtype),
                 jax.ShapeDtypeStruct((rows, width), jnp.float32)),
      grid=(parts, blocks, rows // tile_rows),
      in_specs=[pl.BlockSpec((tile_rows,), lambda c, k, r: (r,)), tile, out, weight, weight,
                bias, bias, pl.BlockSpec((split,), lambda c, k, r: (k * parts + c,)), out]
               + [out] * len(gated),
      out_specs=(out, out),
      input_output_aliases={8: 1},  # h over h0: the state updated in place
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=_WARPS,
                                                                  num_stages=1),
      interpret=interpret,
  )(pad(segment_pos.astype(jnp.int32), value=1), xp, xp, w_x.astype(x.dtype),
    w_a.astype(x.dtype), b_x, b_a, -RG_LRU_C * jax.nn.softplus(a_param.astype(jnp.float32)),
    pad(h0.astype(jnp.float32)), *gated)
  return y[:batch], h[:batch]
