"""Every Pallas kernel compiled for this machine's accelerator at model shapes, in bfloat16 and
float32, forward and backward, against its pure-JAX reference evaluated in float64 on the host.

  python scripts/bench/check_gpu_kernels.py [--dtypes bfloat16,float32] [--only rg_lru,...]
      [--tiny]

The tests run the kernels in Pallas' interpreter on a CPU; what only a real compile can show
(a tile that needs more shared memory than the device has, a lowering that exists for one
dtype only) shows here. One line per kernel, shape and dtype: the relative error
(``|got - want| / |want|`` over all elements) of each output and each input gradient for a
random cotangent, or the first line of the compile error. Exit status 1 if any row failed.
``--tiny``: small shapes, for a CPU check of the script (the kernels then run interpreted).
"""

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels  # noqa: E402
from pallas_kernels.attention import decode as decode_attention  # noqa: E402
from pallas_kernels.conv1d import causal  # noqa: E402
from pallas_kernels.gates import block_diagonal  # noqa: E402
from pallas_kernels import loss  # noqa: E402
from pallas_kernels.mlp import gated_up, gating  # noqa: E402
from pallas_kernels.norm import rms  # noqa: E402
from pallas_kernels.rg_lru import decode  # noqa: E402
from pallas_kernels.sampling import greedy  # noqa: E402

# Relative error allowed for each compute dtype: bfloat16 inputs are rounded before both the
# kernel and the reference see them, so what is left is the kernel's own rounding.
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}
# Triton takes float32 dots at their default precision in TF32 (10-bit mantissa), as XLA's
# float32 dots on a GPU do: the H100 measured 2.9e-4 at the gate shape.
TOLERANCE_OVERRIDES = {("block_diagonal", "float32"): 1e-3, ("gates_with_skip", "float32"): 1e-3,
                       ("recurrent_decode_step", "float32"): 1e-3, ("gated_up", "float32"): 1e-3,
                       ("greedy_token", "float32"): 1e-3}
FORWARD_ONLY = {"recurrent_decode_step", "gated_up", "gated_up_mosaic", "greedy_token",
                "greedy_token_mosaic", "decode_attention"}  # decoding: no gradients
# wgmma's 16-bit inputs (the Mosaic GPU kernels)
DTYPES_ONLY = {"decode_attention": ("bfloat16",), "gated_up_mosaic": ("bfloat16",),
               "greedy_token_mosaic": ("bfloat16",)}


def _greedy_maxima(x, table, impl="triton"):
  """Each row's largest logit in each of ``greedy``'s vocabulary tiles (the kernel's partials,
  which also hold the column each came from; the tokens are compared by bench_decode_kernels.py)."""
  return greedy.partials(x, table, impl=impl, interpret=jax.default_backend() == "cpu")[0]


def _block_diagonal_reference(x, w, b):
  h, i, j = w.shape
  y = jnp.einsum("nhi,hij->nhj", x.reshape(-1, h, i), w.astype(x.dtype)) + b.astype(x.dtype)
  return y.reshape(x.shape[0], h * j)


def cases(tiny: bool):
  """(name, kernel, reference, input shapes and kinds) at the shapes the models use."""
  b, t, d = (2, 40, 48) if tiny else (16, 2048, 2048)          # Griffin 400M's RG-LRU layer
  # GLA 340M's heads, 2 rows (the kernels' tiles do not depend on the batch; the float64
  # reference on the host is the slow part)
  gla = (1, 40, 2, 16) if tiny else (2, 2048, 16, 64)
  gla128 = (1, 40, 2, 32) if tiny else (2, 2048, 8, 128)
  bd = (64, 4, 16, 16) if tiny else (32768, 16, 128, 128)      # rows, blocks, in, out
  yield ("rg_lru", pallas_kernels.rg_lru, pallas_kernels.rg_lru_reference,
         [("x", (b, t, d)), ("x", (b, t, d)), ("x", (b, t, d)), ("param", (d,)), ("reset", (b, t))])
  lb, lt = (1, 512) if tiny else (4, 8192)                    # Griffin 400M at T=8192: chunked
  yield ("rg_lru", pallas_kernels.rg_lru, pallas_kernels.rg_lru_reference,
         [("x", (lb, lt, d)), ("x", (lb, lt, d)), ("x", (lb, lt, d)), ("param", (d,)),
          ("reset", (lb, lt))])
  yield ("linear_scan", pallas_kernels.linear_scan, pallas_kernels.linear_scan_reference,
         [("x", (b, t, d)), ("decay", (b, t, d))])
  for q in (gla, gla128):
    yield ("chunk_gla", pallas_kernels.chunk_gla, pallas_kernels.gla_reference,
           [("x", q), ("x", q), ("x", q), ("log_gate", q)])
  n, h, i, j = bd
  interpret = jax.default_backend() == "cpu"  # a Triton kernel: interpreted on a CPU
  bdm = lambda x, w, b: block_diagonal.block_diagonal_matmul(x, w, b, interpret=interpret)
  yield ("block_diagonal", bdm, _block_diagonal_reference,
         [("x", (n, h * i)), ("param", (h, i, j)), ("param", (h, j))])

  def gates(x, w_x, w_a, b_x, b_a):  # the RG-LRU's two gates with the skip, flat outputs
    skip, ys = block_diagonal.block_diagonal_with_skip(x, (w_x, w_a), (b_x, b_a),
                                                       interpret=interpret)
    return (skip, *ys)

  def gates_reference(x, w_x, w_a, b_x, b_a):
    return (x, _block_diagonal_reference(x, w_x, b_x), _block_diagonal_reference(x, w_a, b_a))

  # Griffin 400M's blocks of 128, then 1.3B's of 160 (pieces of 128 + 32), 8 x 2048 rows
  for n, h, i, j in (bd, (64, 2, 48, 48) if tiny else (16384, 16, 160, 160)):
    yield ("gates_with_skip", gates, gates_reference,
           [("x", (n, h * i))] + [("param", (h, i, j))] * 2 + [("param", (h, j))] * 2)
  n, m = (70, 48) if tiny else (32768, 4608)                  # MQA 400M's MLP, 16 x 2048 rows
  mlp = lambda up, bias: gating.gated_gelu(up, bias, interpret=interpret)
  yield ("mlp_gating", mlp, gating.forward,
         [("x", (n, 2, m)), ("x", (2, m))])
  cb, ct, cd = (2, 45, 48) if tiny else (4, 2048, 2048)       # Griffin 400M's Conv1D, 4 rows
  conv = lambda x, w, b, doc: causal.causal_conv1d(x, w, b, doc, interpret=interpret)
  yield ("conv1d", conv, causal.reference,
         [("x", (cb, ct, cd)), ("param", (4, cd)), ("param", (cd,)), ("documents", (cb, ct))])
  # Hawk 1.3B's decoding step at 2048 rows: 16 gate blocks of 160 over 2560 channels
  db, dw, dh = (37, 96, 2) if tiny else (2048, 2560, 16)
  step = lambda *a: decode.gates_update(*a, interpret=interpret)
  yield ("recurrent_decode_step", step, decode.reference,
         [("x", (db, dw)), ("positions", (db,))] + [("gate_weight", (dh, dw // dh, dw // dh))] * 2
         + [("param", (dh, dw // dh))] * 2 + [("param", (dw,)), ("state", (db, dw))])
  gn, gd, gm = (70, 64, 128) if tiny else (2048, 2048, 6144)  # Hawk 1.3B's MLP, 2048 rows
  for name, impl in (("gated_up", "triton"), ("gated_up_mosaic", "mosaic")):
    up = lambda x, w, b, impl=impl: gated_up.gated_up(x, w, b, impl=impl, interpret=interpret)
    yield (name, up, gated_up.reference,
           [("x", (gn, gd)), ("gate_weight", (2, gd, gm)), ("param", (2, gm))])
  # decode attention, 16 heads of 128: MQA 1.3B's global cache of 2048 slots, each row's filled
  # part; Griffin 1.3B's local ring (window 1024 in 1088 slots), rows past the ring's length
  ab, an, ah = (3, 5, 64) if tiny else (256, 16, 128)
  for slots, window in ((192, None), (128, 100)) if tiny else ((2048, None), (1088, 1024)):
    attend = lambda q, k, v, n, w=window: decode_attention.mqa_decode(
        q, k, v, n, scale=ah**-0.5, window=w, interpret=interpret)
    ref = lambda q, k, v, n, w=window: decode_attention.reference(q, k, v, n, scale=ah**-0.5,
                                                                  window=w)
    yield ("decode_attention", attend, ref,
           [("x", (ab, an, ah)), ("x", (ab, slots, ah)), ("x", (ab, slots, ah)),
            ("lengths", (ab, slots if window is None else 3 * slots))])
  # a 1.3B model's output layer, 128 rows (the float64 reference on the host is the slow part)
  gn, gd, gv = (70, 64, 512) if tiny else (128, 2048, 65536)
  for name, impl in (("greedy_token", "triton"), ("greedy_token_mosaic", "mosaic")):
    yield (name, functools.partial(_greedy_maxima, impl=impl),
           lambda x, table: greedy.partials_reference(x, table)[0],
           [("x", (gn, gd)), ("gate_weight", (gv, gd))])
  # the training loss over a 32K vocabulary (Griffin 400M's) and a 256K one, some rows of each
  ce = lambda logits, targets: loss.cross_entropy(logits, targets, interpret=interpret)
  for n, v in ((70, 4352), (5, 512)) if tiny else ((2048, 32768), (131, 256000)):
    yield ("cross_entropy", ce, loss.reference, [("x", (n, v)), ("targets", (n, v))])
  # the residual streams of Griffin 400M (16 x 2048 tokens) and 1.3B (8 x 2048)
  norm = lambda x, scale: rms.rms_norm_with_skip(x, scale, eps=1e-6, interpret=interpret)
  for n, d in ((70, 48),) if tiny else ((32768, 1536), (16384, 2048)):
    yield ("rms_norm", norm, lambda x, scale: (x, rms.forward(x, scale, 1e-6)),
           [("x", (n, d)), ("param", (d,))])


def make_inputs(specs, dtype, key):
  out = []
  for (kind, shape), k in zip(specs, jax.random.split(key, len(specs))):
    if kind == "reset":
      out.append(jax.random.bernoulli(k, 0.002, shape))
    elif kind == "documents":  # document numbers of packed rows, a new one every ~50 tokens
      out.append(jnp.cumsum(jax.random.bernoulli(k, 0.02, shape), axis=-1, dtype=jnp.int32))
    elif kind == "targets":  # a target in [0, V) for each of the N rows of (N, V)
      out.append(jax.random.randint(k, shape[:-1], 0, shape[-1], jnp.int32))
    elif kind == "lengths":  # (B, L): a length in [1, L] per row, both ends included
      lengths = jax.random.randint(k, shape[:1], 1, shape[1] + 1, jnp.int32)
      out.append(lengths.at[0].set(1).at[-1].set(shape[1]))
    elif kind == "positions":  # positions in the document, the first few included
      out.append(jax.random.randint(k, shape, 0, 6, jnp.int32))
    elif kind == "state":
      out.append(jax.random.normal(k, shape, jnp.float32))
    elif kind == "gate_weight":  # block-diagonal gate weights scaled for unit-size logits
      out.append(jax.random.normal(k, shape, jnp.float32) * shape[1] ** -0.5)
    elif kind == "param":
      out.append(jax.random.normal(k, shape, jnp.float32))
    elif kind == "decay":
      out.append(jax.random.uniform(k, shape, jnp.float32, 0.8, 1.0).astype(dtype))
    elif kind == "log_gate":
      out.append(jax.nn.log_sigmoid(4.0 + jax.random.normal(k, shape)).astype(dtype))
    else:
      out.append(jax.random.normal(k, shape).astype(dtype))
  return out


def _as_tuple(out):
  return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def forward_and_grads(fn, inputs, cotangents, grads=True):
  """The outputs and the gradients of the float inputs for the given output cotangents (none
  without ``grads``)."""
  if not grads:
    return list(_as_tuple(fn(*inputs))), []
  diff = [i for i, a in enumerate(inputs) if jnp.issubdtype(a.dtype, jnp.floating)]

  def f(*args):
    full = list(inputs)
    for i, a in zip(diff, args):
      full[i] = a
    return _as_tuple(fn(*full))

  outs, vjp = jax.vjp(f, *[inputs[i] for i in diff])
  return list(outs), list(vjp(tuple(c.astype(o.dtype) for c, o in zip(cotangents, outs))))


def rel_error(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _float64(a):
  return np.asarray(a, np.float64 if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype)


def check(name, fn, ref, specs, dtype, key):
  inputs = make_inputs(specs, dtype, key)
  grads = name not in FORWARD_ONLY
  kernel = jax.jit(lambda a, c: forward_and_grads(fn, a, c, grads))
  try:
    shapes = jax.eval_shape(lambda *a: _as_tuple(fn(*a)), *inputs)
    cts = [jax.random.normal(k, s.shape).astype(s.dtype)
           for s, k in zip(shapes, jax.random.split(jax.random.fold_in(key, 1), len(shapes)))]
    outs, grads = kernel(list(inputs), cts)
    jax.block_until_ready((outs, grads))
  except Exception as e:  # pylint: disable=broad-except  (reported, the run goes on)
    return False, " / ".join(str(e).strip().splitlines())[:300]
  cpu = jax.devices("cpu")[0]
  with jax.enable_x64(True):
    wide = [jax.device_put(_float64(a), cpu) for a in inputs]
    wide_cts = [jax.device_put(_float64(c), cpu) for c in cts]
    # (on the CPU: a jitted function runs where its committed arguments are)
    want_outs, want_grads = jax.jit(lambda a, c: forward_and_grads(ref, a, c, grads))(
        wide, wide_cts)
  errors = [rel_error(g, w) for g, w in zip(outs + grads, list(want_outs) + list(want_grads))]
  ok = max(errors) <= TOLERANCE_OVERRIDES.get((name, dtype), TOLERANCE[dtype])
  return ok, " ".join(f"{e:.1e}" for e in errors)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dtypes", default="bfloat16,float32")
  parser.add_argument("--only", default="", help="kernel names, comma-separated")
  parser.add_argument("--tiny", action="store_true")
  args = parser.parse_args()
  dev = jax.devices()[0]
  print(f"{dev.device_kind}, jax {jax.__version__}")
  print("| kernel | shapes | dtype | result | relative errors (outputs, then gradients) |")
  print("|---|---|---|---|---|")
  failed = 0
  for n, (name, fn, ref, specs) in enumerate(cases(args.tiny)):
    if args.only and name not in args.only.split(","):
      continue
    for dtype in args.dtypes.split(","):
      if dtype not in DTYPES_ONLY.get(name, (dtype,)):
        continue
      ok, detail = check(name, fn, ref, specs, dtype, jax.random.PRNGKey(n))
      failed += not ok
      shapes = " ".join("x".join(map(str, s)) for _, s in specs)
      print(f"| {name} | {shapes} | {dtype} | {'ok' if ok else 'FAILED'} | {detail} |",
            flush=True)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
