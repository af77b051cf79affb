"""A recurrent block's decoding step in one kernel: Conv1D, the block-diagonal gates and the
RG-LRU update for one token per row.

``decode_step(x, ring, count, segment_pos, conv_w, conv_b, w_x, w_a, b_x, b_a, a_param, h0, *,
interpret=False) -> (y, h)`` with

- ``x``: ``[B, E]``, the token's ``linear_x`` output (the compute dtype);
- ``ring``: ``[S, B, E]``, the Conv1D's last ``S = W - 1`` inputs, the ``c``-th token a cache
  took in slot ``c % S`` (``layers.Conv1D``); ``count``: int32 scalar, the tokens taken so far
  (the same for every row); ``segment_pos``: int32 ``[B]``, the token's position in its
  document (a tap ``s`` tokens back is used only where ``segment_pos >= s``);
- ``conv_w``: ``[W, E]``, ``conv_b``: ``[E]``; ``w_x``, ``w_a``: ``[H, E/H, E/H]`` and ``b_x``,
  ``b_a``: ``[H, E/H]``, the input gate's and the decay gate's blocks; ``a_param``: ``[E]``;
  ``h0``: ``[B, E]`` float32;
- ``y``: ``[B, E]`` (``x``'s dtype) and ``h``: ``[B, E]`` float32, the new state.

The ring itself is not written here: the caller writes ``x`` into slot ``count % S`` (an
in-place dynamic-update-slice).

Why: in XLA's decoding step these are five passes over ``[B, E]`` activations and the
float32 state, about 102 us a block for Hawk 1.3B at 2048 rows on an H100 (the Conv1D 0.47,
the gate kernel 0.67, the gate arithmetic 0.23, the update 0.86 and the ring's write 0.22 ms
a step; docs/bench/decode_log.md, session 28), where one pass reads about 95 MB a block:
about 32 us at the copy ceiling.

Each program takes ``_ROWS`` rows and one gate block (grid ``(B / _ROWS, H)``): it computes the
Conv1D of its block's channels, both gates from them (``E/H``-square dots in float32), the
decay and the normalised input, and ``h = a * h0 + x_in`` (written over ``h0``). Arithmetic in
float32, rounded to the compute dtype where the XLA step stores values in it (the Conv1D output,
the gate logits, the normalised input); the float32 sums in between (the bias added before the
rounding, the Conv1D's taps) may differ from XLA's by an ulp of the compute dtype. Blocks whose
size is not a power of two go in pieces (``gates.block_diagonal.pieces``: 160 = 128 + 32).

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

# Rows per program and warps. Each program reads its gate block's two weights (102 KB at blocks
# of 160) from L2; 8 warps keep the float32 tiles (the Conv1D's pieces, two gate accumulators) in
# registers. On an H100 at Hawk 1.3B's shapes (bench_decode_kernels.py, session 29): 0.163 ms a
# block; 16 x 2 0.159, 32 x 4, 64 x 4 and 128 x 8 0.22-0.33 (XLA's passes: 0.100).
_ROWS = 64
_WARPS = 8


def supported(width: int, num_blocks: int, temporal_width: int) -> bool:
  """Whether the kernel takes ``num_blocks`` gate blocks over ``width`` channels and a Conv1D of
  ``temporal_width`` taps (its weights are read a row at a time: any width from 2)."""
  return (width % num_blocks == 0 and bd.supported(width // num_blocks, width // num_blocks)
          and temporal_width >= 2)


def _piece(ref, start, size):
  """Columns ``start:start + size`` of a ``[R, n]`` or ``[n]`` ref (all of it where that is
  all)."""
  if size == ref.shape[-1]:
    return ref[...]
  return ref[pl.ds(start, size)] if len(ref.shape) == 1 else ref[:, pl.ds(start, size)]


def _row(ref, k, start, size):
  """Row ``k``, columns ``start:start + size`` of a 2-D ref."""
  return ref[k, :] if size == ref.shape[-1] else ref[k, pl.ds(start, size)]


def _kernel(shift_ref, seg_ref, x_ref, *refs, slots):
  ring_refs = refs[:slots]
  cw_ref, cb_ref, wx_ref, wa_ref, bx_ref, ba_ref, la_ref, h0_ref, y_ref, h_ref = refs[slots:]
  f32, dtype = jnp.float32, x_ref.dtype
  block = x_ref.shape[1]
  seg = seg_ref[...][:, None]                    # [R, 1]
  reset = seg == 0
  shifts = [shift_ref[k] for k in range(slots)]  # how many tokens back each slot lies
  convs = []
  for a, n in bd.pieces(block):
    # the Conv1D's weight rows: 0..S-1 the slots', S the token's
    w = lambda k: _row(cw_ref, k, a, n).astype(f32)[None]  # pylint: disable=cell-var-from-loop
    conv = _piece(x_ref, a, n).astype(f32) * w(slots) + _piece(cb_ref, a, n).astype(f32)[None]
    for k in range(slots):
      tap = jnp.where(seg >= shifts[k], _piece(ring_refs[k], a, n).astype(f32), 0.0)
      conv += tap * w(k)
    convs.append((a, conv.astype(dtype)))
  for (c, m), (_, x_in) in zip(bd.pieces(block), convs):
    def logits(w_ref, b_ref):
      acc = sum(jnp.dot(x, bd._weight(w_ref, a, x.shape[1], c, m),  # pylint: disable=protected-access
                        preferred_element_type=f32) for a, x in convs)
      return (acc + b_ref[0, pl.ds(c, m)].astype(f32)[None]).astype(dtype).astype(f32)
    gate_x = jax.nn.sigmoid(logits(wx_ref, bx_ref))
    gate_a = jax.nn.sigmoid(logits(wa_ref, ba_ref))
    log_a = gate_a * _piece(la_ref, c, m)[None]  # la: -RG_LRU_C * softplus(a_param)
    multiplier = jnp.where(reset, 1.0, jnp.sqrt(1.0 - jnp.exp(2.0 * log_a)))
    normalized = (x_in.astype(f32) * gate_x * multiplier).astype(dtype).astype(f32)
    h = jnp.where(reset, 0.0, jnp.exp(log_a)) * _piece(h0_ref, c, m) + normalized
    bd._set_cols(h_ref, c, h)  # pylint: disable=protected-access
    bd._set_cols(y_ref, c, h.astype(dtype))  # pylint: disable=protected-access


def decode_step_reference(x, ring, count, segment_pos, conv_w, conv_b, w_x, w_a, b_x, b_a, a_param,
                          h0):
  """The same step in plain JAX, in the inputs' precision (float64 under ``jax.enable_x64``):
  ``(y, h)``, ``y`` in ``x``'s dtype."""
  slots = ring.shape[0]
  seg = segment_pos[:, None]
  conv = x * conv_w[slots] + conv_b
  for shift in range(1, slots + 1):
    tap = jax.lax.dynamic_index_in_dim(ring, (count - shift) % slots, keepdims=False)
    conv = conv + jnp.where(seg >= shift, tap, 0) * conv_w[slots - shift]
  blocks = conv.reshape(conv.shape[0], w_x.shape[0], -1)
  gate = lambda w, b: jax.nn.sigmoid(jnp.einsum("bhi,hij->bhj", blocks, w) + b).reshape(conv.shape)
  log_a = -RG_LRU_C * gate(w_a, b_a) * jax.nn.softplus(a_param)
  reset = seg == 0
  multiplier = jnp.where(reset, 1.0, jnp.sqrt(1 - jnp.exp(2 * log_a)))
  h = jnp.where(reset, 0.0, jnp.exp(log_a)) * h0 + conv * gate(w_x, b_x) * multiplier
  return h.astype(x.dtype), h


def tap_shifts(count, slots: int):
  """``[W]`` int32 (``W = slots + 1``): how many tokens back ring slot ``k`` lies when the cache
  has taken ``count`` tokens (slot ``k`` holds token ``c`` with ``c % slots == k``, the latest
  before ``count``), and 0 for the token itself (last)."""
  back = (count - jnp.arange(slots)) % slots
  return jnp.concatenate([jnp.where(back == 0, slots, back), jnp.zeros((1,), back.dtype)]
                         ).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("interpret",))
def decode_step(x, ring, count, segment_pos, conv_w, conv_b, w_x, w_a, b_x, b_a, a_param, h0, *,
                interpret: bool = False):
  """See the module docstring."""
  slots, batch, width = ring.shape
  blocks, block = w_x.shape[:2]
  if conv_w.shape != (slots + 1, width) or w_x.shape != (blocks, block, block) or (
      block * blocks != width or w_a.shape != w_x.shape):
    raise ValueError(f"decode_step: conv_w {conv_w.shape} and the gates {w_x.shape} do not fit "
                     f"a ring of {slots} slots over {width} channels")
  # Conv1D weight rows in slot order: slot k lies shifts[k] tokens back, so it takes row
  # W - 1 - shifts[k] (``layers.Conv1D``: y = b + sum_s w[W-1-s] x[t-s]); the token's row last.
  shifts = tap_shifts(count, slots)
  w_slots = jnp.take(conv_w, slots - shifts, axis=0).astype(x.dtype)
  # rows a program: _ROWS, or the batch rounded up to a power of two (16 at least: Triton's
  # smallest dot) where that is fewer, so that a small batch is not padded to _ROWS
  tile_rows = min(_ROWS, max(16, 1 << (batch - 1).bit_length()))
  rows = -(-batch // tile_rows) * tile_rows
  pad = lambda a, axis=0, value=0: jnp.pad(
      a, [(0, rows - batch) if d == axis else (0, 0) for d in range(a.ndim)],
      constant_values=value)
  seg = pad(segment_pos.astype(jnp.int32), value=1)
  tile = pl.BlockSpec((tile_rows, block), lambda r, k: (r, k))
  slot_specs = [pl.BlockSpec((None, tile_rows, block), functools.partial(
      lambda s, r, k: (s, r, k), s)) for s in range(slots)]
  weight = pl.BlockSpec((1, block, block), lambda r, k: (k, 0, 0))
  bias = pl.BlockSpec((1, block), lambda r, k: (k, 0))
  y, h = pl.pallas_call(
      functools.partial(_kernel, slots=slots),
      name="pallas_recurrent_decode_step",
      out_shape=(jax.ShapeDtypeStruct((rows, width), x.dtype),
                 jax.ShapeDtypeStruct((rows, width), jnp.float32)),
      grid=(rows // tile_rows, blocks),
      in_specs=[pl.BlockSpec((slots + 1,), lambda r, k: (0,)),
                pl.BlockSpec((tile_rows,), lambda r, k: (r,)),
                tile, *slot_specs,
                pl.BlockSpec((slots + 1, block), lambda r, k: (0, k)),
                pl.BlockSpec((block,), lambda r, k: (k,)),
                weight, weight, bias, bias,
                pl.BlockSpec((block,), lambda r, k: (k,)),
                tile],
      out_specs=(tile, tile),
      input_output_aliases={10 + slots: 1},  # h over h0: the state updated in place
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=_WARPS),
      interpret=interpret,
  )(shifts, seg, pad(x), *([pad(ring, axis=1)] * slots), w_slots, conv_b.astype(x.dtype),
    w_x.astype(x.dtype), w_a.astype(x.dtype), b_x, b_a,
    -RG_LRU_C * jax.nn.softplus(a_param.astype(jnp.float32)), pad(h0.astype(jnp.float32)))
  return y[:batch], h[:batch]
