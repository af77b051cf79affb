"""The decoding-step kernels (``model.decode_impl``: the recurrent block's gates and RG-LRU
update; ``model.mlp_impl``: ``gated_up``) against XLA's step, alone, at one model's shapes,
with their floors and tile variants.

  python scripts/bench/bench_decode_kernels.py [--batch 2048] [--width 2048]
      [--lru_width 2560] [--gate_blocks 16] [--mlp 6144] [--step_tiles 64x4x32,...]
      [--mlp_tiles 128x128x64x8x3,...] [--mlp_mosaic_stages 4,3] [--greedy_mosaic_stages 4,3]
      [--steps 50] [--iters 5]
      [--tiny]

Each row times ``--steps`` steps in one ``fori_loop`` (the median of ``--iters`` loops), the
step's output feeding the next step's input: device time per step, as inside the decoding loop.

Rows (defaults: Hawk 1.3B's recurrent block at 2048 rows, bfloat16):

- the recurrent block's gates and RG-LRU update for one token, from the Conv1D's output: XLA's
  path (``RecurrentBlock.rg_lru``: the Triton gate kernel, as ``gate_impl=auto`` on a GPU, then
  XLA's passes) against ``pallas_kernels.rg_lru.decode.gates_update`` with each ``--step_tiles``
  entry (rows a program x warps x output columns a program, 0 for whole blocks). Bytes floor:
  ``x`` and the float32 state read, ``y`` and the state written (12 bytes a channel a row) over
  the copy ceiling measured in the run.
- the same with the Conv1D (XLA's, which also writes the ring in place) in front and the
  product with the other branch's GeLU behind: XLA's path against
  ``RecurrentBlock.decode_step`` (``decode_impl=pallas``) with the same tiles. Bytes floor:
  also the ring's slots read and one written and the other branch read (22 bytes a channel a
  row).
- the MLP's up-projection and GeLU gating: XLA's (``MLPBlock``'s decoding branch, without the
  down-projection) against ``pallas_kernels.mlp.gated_up``'s Triton kernel with each
  ``--mlp_tiles`` entry (rows x cols x K step x warps x stages) and its Mosaic GPU kernel with
  each ``--mlp_mosaic_stages`` entry (Hopper; the interpreter with ``--tiny``). FLOP floor:
  ``4 B D M`` over the device's peak.
- the greedy token from the tied output layer (``--vocab``): XLA's (the logits in bfloat16, the
  soft cap and the argmax, as ``Model._logits`` and ``sampling.choose``) against
  ``pallas_kernels.sampling.greedy`` with each ``--greedy_tiles`` entry (rows x vocabulary
  columns x K step x warps x stages) and its Mosaic GPU kernel with each
  ``--greedy_mosaic_stages`` entry (Hopper; the interpreter with ``--tiny``), with the fraction
  of rows on which each agrees with XLA. FLOP floor: ``2 B D V`` over the peak.

- decode attention, one token per row against a cache of one key/value head: JAX's Triton
  kernel (the model's path on GPUs before Hopper) and XLA's masked attention over the whole
  cache (the model's path for local attention there) against
  ``pallas_kernels.attention.decode.mqa_decode`` with each ``--attention_tiles`` entry (keys a
  ring slot x slots). MQA 1.3B's global cache (``--attention_rows`` rows of ``--cache`` slots,
  16 heads of 128) with ragged lengths (uniform in [1, cache], a decoding run's average) and
  full; Griffin 1.3B's local ring (``--batch`` rows, ``--window`` 1024: 1025 slots for XLA,
  rounded up to whole 64-key blocks for the kernel), full. Bytes floor: the visible keys and
  values read once over the copy ceiling.
``--only recurrent,mlp,greedy,attention`` picks the groups of rows.

``--tiny``: small shapes, interpreted, for a CPU check of the script.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if "--tiny" in sys.argv and "device_count" not in os.environ.get("XLA_FLAGS", ""):
  # The Mosaic GPU interpreter's three warpgroup threads block on each other's barriers: they
  # need three host computations at once, which a 2-core machine's XLA client runs only with
  # more (host) devices.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from pallas_kernels.mlp import gated_up  # noqa: E402
from pallas_kernels.rg_lru import decode  # noqa: E402
from pallas_kernels.sampling import greedy  # noqa: E402
from recurrentgemma_jax import flops  # noqa: E402
from recurrentgemma_jax import model as model_lib  # noqa: E402
from recurrentgemma_jax import recurrent  # noqa: E402
import timing  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=2048)
  parser.add_argument("--width", type=int, default=2048)
  parser.add_argument("--lru_width", type=int, default=2560)
  parser.add_argument("--gate_blocks", type=int, default=16)
  parser.add_argument("--mlp", type=int, default=6144)
  parser.add_argument("--step_tiles", default="64x4x32,128x8x32,32x2x32,64x4x0",
                      help="rows x warps x output columns a program (0: whole blocks)")
  parser.add_argument("--mlp_tiles",
                      default="128x128x64x8x3,128x128x64x8x4,128x64x64x8x3,64x128x64x4x4")
  parser.add_argument("--mlp_mosaic_stages", default="4,3",
                      help="ring slots of the Mosaic GPU gated_up kernel, one row each")
  parser.add_argument("--vocab", type=int, default=256_000)
  parser.add_argument("--greedy_tiles",
                      default="128x256x64x8x3,128x128x64x8x3,128x256x64x8x4,256x128x64x8x3")
  parser.add_argument("--greedy_mosaic_stages", default="4,3",
                      help="ring slots of the Mosaic GPU greedy kernel, one row each")
  parser.add_argument("--attention_rows", type=int, default=1024)
  parser.add_argument("--cache", type=int, default=2048)
  parser.add_argument("--window", type=int, default=1024)
  parser.add_argument("--attention_tiles", default="64x2,64x3,128x2",
                      help="keys a ring slot x slots")
  parser.add_argument("--only", default="recurrent,mlp,greedy,attention")
  parser.add_argument("--iters", type=int, default=5, help="timed loops (median)")
  parser.add_argument("--steps", type=int, default=50, help="steps a timed loop")
  parser.add_argument("--tiny", action="store_true")
  args = parser.parse_args()
  if args.tiny:
    args.batch, args.width, args.lru_width, args.gate_blocks, args.mlp = 5, 64, 64, 2, 128
    args.step_tiles, args.mlp_tiles, args.iters, args.steps = "32x4x32", "64x64x64x4x2", 1, 2
    args.vocab, args.greedy_tiles, args.mlp_mosaic_stages = 512, "16x256x64x4x2", "2"
    args.greedy_mosaic_stages = "2"
    args.attention_rows, args.cache, args.window, args.attention_tiles = 3, 128, 100, "64x2"
  only = set(args.only.split(","))
  b, d, e, m = args.batch, args.width, args.lru_width, args.mlp
  dt = jnp.bfloat16
  rngs = nnx.Rngs(0)
  # XLA's path as the model takes it on a GPU: the gates through the Triton gate kernel
  # (model.gate_impl auto); until session 30 this script's XLA rows used XLA's batched matmul
  block = recurrent.RecurrentBlock(d, e, args.gate_blocks, rngs=rngs, param_dtype=dt, dtype=dt,
                                   gate_impl="pallas")
  decode.MIN_ROWS = 0  # the kernel rows take the kernel at any batch
  mlp = model_lib.MLPBlock(d, m, rngs=rngs, final_init_scale=1.0, param_dtype=dt, dtype=dt)
  keys = jax.random.split(jax.random.PRNGKey(1), 4)
  x = jax.random.normal(keys[0], (b, 1, e), dt)
  xm = jax.random.normal(keys[1], (b, 1, d), dt)
  seg = jnp.full((b, 1), 100, jnp.int32)
  cache = recurrent.RecurrentCache(jax.random.normal(keys[2], (b, e), jnp.float32),
                                   jax.random.normal(keys[3], (3, b, e), dt),
                                   jnp.asarray(7, jnp.int32))

  gate = jax.random.normal(keys[0], (b, 1, e), dt) + 0.5  # linear_y's output

  def xla_step(block, x, seg, cache):
    y, ring = block.conv_1d(x, seg, cache.conv1d_state, cache.tokens)
    y, h = block.rg_lru(y, seg, cache.rg_lru_state)
    return y * jax.nn.gelu(gate), h, ring

  def kernel_step(block, x, seg, cache):
    return block.decode_step(x, seg, cache, gate)

  def xla_update(block, x, seg, h):  # x: the Conv1D's output
    return block.rg_lru(x, seg, h)

  def kernel_update(block, x, seg, h):
    lru = block.rg_lru
    y, h = decode.gates_update(x[:, 0], seg[:, 0], lru.input_gate.w[...], lru.a_gate.w[...],
                               lru.input_gate.b[...], lru.a_gate.b[...], lru.a_param[...], h,
                               interpret=interpret)
    return y[:, None], h

  def mlp_up(mlp, x):  # the decoding branch without the down-projection
    return gated_up.reference(x[:, 0], mlp.ffw_up.w[...], mlp.ffw_up.b[...].reshape(2, -1))

  interpret = jax.default_backend() == "cpu"

  def per_step(body, module, carry):
    """Device ms per step of ``carry = body(module, carry)``, ``--steps`` of them in one
    ``fori_loop`` (one program: no host time between steps, as in the decoding loop)."""
    graph, state = nnx.split(module)
    loop = jax.jit(lambda state, carry: jax.lax.fori_loop(
        0, args.steps, lambda _, c: body(nnx.merge(graph, state), c), carry))
    return timing.time_fn(loop, state, carry, iters=args.iters, calls=1) / args.steps

  def recurrent_body(step):  # the token's output is the next token's input, as between layers
    def body(block, carry):
      x, cache = carry
      y, h, ring = step(block, x, seg, cache)
      return y, recurrent.RecurrentCache(h, ring, cache.tokens + 1)
    return body

  def mlp_body(up):
    # The output is carried (so written whole by both paths, as in the decoding step) and its
    # first D columns feed the next input (so the loop-invariant up-projection is not hoisted).
    # That slice is read back in both rows, where XLA may fold it into its gating pass.
    def body(mlp, carry):
      x, _ = carry
      out = up(mlp, x)
      return x + out[:, None, :x.shape[-1]] * 1e-3, out
    return body

  ceiling = timing.copy_ceiling(1 << 30 if not args.tiny else 1 << 20)
  peak = flops.device_peak_flops() or 0.0
  step_floor = 22 * b * e / ceiling * 1e3
  mlp_floor = 4 * b * d * m / peak * 1e3 if peak else float("nan")
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; B={b} D={d} E={e} "
        f"({args.gate_blocks} gate blocks) M={m} bfloat16; copy ceiling {ceiling / 1e12:.2f} "
        f"TB/s, peak {peak / 1e12:.0f} TFLOP/s", flush=True)
  print("| work | implementation | ms | floor (ms) | floor reached |\n|---|---|---|---|---|")
  row = lambda work, impl, ms, floor: print(
      f"| {work} | {impl} | {ms:.4f} | {floor:.4f} | {floor / ms:.0%} |", flush=True)

  def update_body(update):
    def body(block, carry):
      x, h = carry
      return update(block, x, seg, h)
    return body

  update_floor = 12 * b * e / ceiling * 1e3
  if "recurrent" in only:
    row("gates + RG-LRU update", "XLA",
        per_step(update_body(xla_update), block, (x, cache.rg_lru_state)), update_floor)
    row("Conv1D + gates + RG-LRU update + GeLU gating", "XLA",
        per_step(recurrent_body(xla_step), block, (x, cache)), step_floor)
    for tile in args.step_tiles.split(","):
      rows, warps, split = map(int, tile.split("x"))
      # pylint: disable=protected-access
      decode._ROWS, decode._WARPS, decode._SPLIT = rows, warps, split
      jax.clear_caches()
      name = (f"kernel, {rows} rows x {warps} warps x "
              + (f"{split} columns a program" if split else "whole blocks"))
      try:
        row("gates + RG-LRU update", name,
            per_step(update_body(kernel_update), block, (x, cache.rg_lru_state)), update_floor)
        row("Conv1D + gates + RG-LRU update + GeLU gating", f"XLA's Conv1D, then the {name}",
            per_step(recurrent_body(kernel_step), block, (x, cache)), step_floor)
      except Exception as err:  # pylint: disable=broad-except  (a tile Triton rejects)
        print(f"| gates + RG-LRU update | kernel, tile {tile} | error: "
              f"{str(err).splitlines()[0][:150]} | | |", flush=True)

  if "mlp" in only:
    mlp_carry = (xm, jnp.zeros((b, m), dt))
    row("MLP up-projection + GeLU gating", "XLA", per_step(mlp_body(mlp_up), mlp, mlp_carry),
        mlp_floor)
    for tile in args.mlp_tiles.split(","):
      r, c, k, warps, stages = map(int, tile.split("x"))
      gated_up._ROWS, gated_up._COLS, gated_up._K = r, c, k  # pylint: disable=protected-access
      gated_up._WARPS, gated_up._STAGES = warps, stages  # pylint: disable=protected-access
      jax.clear_caches()
      try:
        up = lambda mlp, x: gated_up.gated_up(x[:, 0], mlp.ffw_up.w[...],
                                              mlp.ffw_up.b[...].reshape(2, -1), impl="triton",
                                              interpret=interpret)
        ms = per_step(mlp_body(up), mlp, mlp_carry)
        row("MLP up-projection + GeLU gating", f"kernel, tile {r}x{c}, K {k}, {warps} warps, "
            f"{stages} stages", ms, mlp_floor)
      except Exception as err:  # pylint: disable=broad-except
        print(f"| MLP up-projection + GeLU gating | kernel, tile {tile} | error: "
              f"{str(err).splitlines()[0][:150]} | | |", flush=True)
    for stages in map(int, args.mlp_mosaic_stages.split(",")):
      up = lambda mlp, x, stages=stages: gated_up._mosaic(  # pylint: disable=protected-access
          x[:, 0], mlp.ffw_up.w[...].astype(x.dtype), mlp.ffw_up.b[...].reshape(2, -1),
          stages=stages, interpret=interpret)
      row("MLP up-projection + GeLU gating", f"Mosaic GPU kernel, {stages} stages, clusters "
          f"of {1 if interpret else gated_up.MOSAIC_CLUSTER}",
          per_step(mlp_body(up), mlp, mlp_carry), mlp_floor)
  if "greedy" in only:
    greedy_rows(row, per_step, xm[:, 0], args.vocab, peak, args.greedy_tiles,
                args.greedy_mosaic_stages, interpret)
  if "attention" in only:
    attention_rows(row, per_step, args, ceiling, interpret)


def greedy_rows(row, per_step, x, vocab, peak, greedy_tiles, mosaic_stages, interpret):
  b, d = x.shape
  table = (jax.random.normal(jax.random.PRNGKey(5), (vocab, d), jnp.float32)
           / d ** 0.5).astype(x.dtype)
  cap = model_lib.ModelConfig.logits_soft_cap

  def xla_token(table, x):
    logits = jnp.dot(x, table.T).astype(jnp.float32)
    return jnp.argmax(jnp.tanh(logits / cap) * cap, axis=-1).astype(jnp.int32)

  def body(token):  # the token feeds the next input, so the loop-invariant table is not hoisted
    def step(table, x):
      t = token(table, x)
      return x + (t[:, None] % 3).astype(x.dtype) * 1e-2
    return step

  class Table(nnx.Module):  # per_step splits a module
    def __init__(self, table):
      self.table = nnx.Variable(table)

  module = Table(table)
  floor = 2 * b * d * vocab / peak * 1e3 if peak else float("nan")
  wrap = lambda f: (lambda m, x: f(m.table[...], x))
  row("greedy token (output layer + argmax)", "XLA", per_step(body(wrap(xla_token)), module, x),
      floor)
  want = jax.jit(xla_token)(table, x)
  logits = jnp.dot(x, table.T).astype(jnp.float32)
  # (name, error-row name, kernel, whether its row names the largest logit gap) of each Triton
  # tile, then each Mosaic GPU ring depth
  candidates = []
  for tile in greedy_tiles.split(","):
    tile = tuple(map(int, tile.split("x")))
    candidates.append((f"kernel, tile {tile[0]}x{tile[1]}, K {tile[2]}, {tile[3]} warps, "
                       f"{tile[4]} stages", f"kernel, tile {tile}",
                       lambda t, x, tile=tile: greedy.greedy_token(x, t, tile=tile,
                                                                   interpret=interpret), True))
  for stages in map(int, mosaic_stages.split(",") if mosaic_stages else ()):
    candidates.append((
        f"Mosaic GPU kernel, {stages} stages, clusters of "
        f"{greedy.mosaic_cluster(b, interpret=interpret)}", f"Mosaic GPU kernel, {stages} stages",
        lambda t, x, stages=stages: greedy.pick(*greedy._mosaic(  # pylint: disable=protected-access
            x, t, stages=stages, interpret=interpret)), False))
  for name, short, kernel, with_gap in candidates:
    try:
      got = jax.jit(kernel)(table, x)
      agree = float(jnp.mean(got == want))
      chosen = jnp.take_along_axis(logits, got[:, None], 1)[:, 0]
      gap = float(jnp.max(jnp.max(logits, axis=1) - chosen))
      ms = per_step(body(wrap(kernel)), module, x)
      detail = f", largest logit gap {gap:.3g}" if with_gap else ""
      row("greedy token (output layer + argmax)",
          f"{name} (same token on {agree:.2%} of rows{detail})", ms, floor)
    except Exception as err:  # pylint: disable=broad-except
      print(f"| greedy token | {short} | error: {str(err).splitlines()[0][:150]} | | |",
            flush=True)


def attention_rows(row, per_step, args, ceiling, interpret):
  # pylint: disable=g-import-not-at-top
  from pallas_kernels.attention import decode as decode_attention
  from recurrentgemma_jax import attention
  heads, head = (3, 64) if args.tiny else (16, 128)
  scale = head**-0.5

  class Cache(nnx.Module):  # per_step splits a module: the cache is its loop-invariant state
    def __init__(self, keys, values, lengths):
      self.keys, self.values = nnx.Variable(keys), nnx.Variable(values)
      self.lengths = nnx.Variable(lengths)

  def body(attend):  # the output is the next query, so no step is hoisted out of the loop
    return lambda c, q: q + (attend(c.keys[...], c.values[...], c.lengths[...], q)
                             * 1e-3).astype(q.dtype)

  def cache(rows, slots, key):
    k1, k2 = jax.random.split(key)
    return (jax.random.normal(k1, (rows, slots, head), jnp.bfloat16),
            jax.random.normal(k2, (rows, slots, head), jnp.bfloat16))

  def kernels(work, module, q, floor, window):
    for tile in args.attention_tiles.split(","):
      block_k, stages = map(int, tile.split("x"))
      mosaic = lambda k, v, n, q, b=block_k, st=stages: decode_attention.mqa_decode(
          q, k, v, n, scale=scale, window=window, block_k=b, stages=st, interpret=interpret)
      try:
        row(work, f"Mosaic GPU, {block_k} keys a slot, {stages} slots",
            per_step(body(mosaic), module, q), floor)
      except Exception as err:  # pylint: disable=broad-except
        print(f"| {work} | Mosaic GPU, tile {tile} | error: "
              f"{str(err).splitlines()[0][:150]} | | |", flush=True)

  b, t = args.attention_rows, args.cache
  keys, values = cache(b, t, jax.random.PRNGKey(7))
  q = jax.random.normal(jax.random.PRNGKey(8), (b, heads, head), jnp.bfloat16)
  ragged = jax.random.randint(jax.random.PRNGKey(9), (b,), 1, t + 1)
  for name, lengths in (("ragged", ragged), ("full", jnp.full((b,), t, jnp.int32))):
    module = Cache(keys, values, lengths)
    work = f"decode attention, {b} rows x {t} slots, {name}"
    floor = float(jnp.sum(lengths)) * head * 4 / ceiling * 1e3  # keys and values, bfloat16
    tri = lambda k, v, n, q: attention.length_bounded_attention(q, k, v, n, scale, None, "triton")
    row(work, "Triton (JAX's decode_attention)", per_step(body(tri), module, q), floor)
    kernels(work, module, q, floor, None)
  # a local ring, full: XLA's attention over window + 1 slots against the kernel's whole blocks
  b, w = args.batch, args.window
  ring = -(-(w + 1) // decode_attention.BLOCK_K) * decode_attention.BLOCK_K
  keys, values = cache(b, ring, jax.random.PRNGKey(10))
  q = jax.random.normal(jax.random.PRNGKey(11), (b, heads, head), jnp.bfloat16)
  lengths = jnp.full((b,), 4 * ring, jnp.int32)  # wrapped many times
  work = f"local attention, {b} rows, window {w}"
  floor = b * (w + 1) * head * 4 / ceiling * 1e3
  xla = lambda k, v, n, q: attention._masked_attention(  # pylint: disable=protected-access
      q[:, None], k[:, :w + 1], v[:, :w + 1], jnp.ones((1, 1, 1, w + 1), bool), scale)[:, 0]
  module = Cache(keys, values, lengths)
  row(work, f"XLA over the {w + 1}-slot ring", per_step(body(xla), module, q), floor)
  kernels(work, module, q, floor, w)


if __name__ == "__main__":
  main()
