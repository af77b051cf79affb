"""Times chunk_gla (forward, forward+backward) beside flash-linear-attention and cuDNN attention.

    python scripts/bench/bench_gla.py --out DIR [--shapes 8,2048,16,64 16,2048,4,128,256 ...]
        [--reps 20] [--check] [--intra fact,fact-pf,xla]

Runs on a GPU. All inputs bfloat16; a shape is B,T,H,D (K = V = D) or B,T,H,K,V (cuDNN
attention, which needs K = V, is then left out). Times are medians: for JAX, of batches of
back-to-back calls divided by the batch size (device time, host dispatch overlapped); for
flash-linear-attention (fla.ops.gla.chunk_gla, if importable), of triton.testing.do_bench's CUDA
events. `--intra` times chunk_gla's GPU path once per listed variant (see set_variant: "fact",
the default, gla.gpu's five kernels; "xla", gla.gpu_xla; options for warps, state tiles and
stages, prefetch, column blocks, chunk size), one column each; `--check` checks every variant
in bfloat16 at Dh 64 (and once in float32 at Dh 48, which takes gla.gpu_xla whatever the
variant). cuDNN is timed first for each shape, whatever `--deadline` says (which stops the
variants and fla). A variant that fails (say, to compile) is reported in the notes and the run
goes on; a misspelt one stops the run before anything is timed. Writes DIR/bench_gla.md (a
markdown table with ratios) and DIR/bench_gla.json.
"""

import argparse
import datetime
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position

from pallas_kernels import dispatch  # pylint: disable=g-import-not-at-top,wrong-import-position
from pallas_kernels.gla import chunk_gla, gla_reference  # pylint: disable=g-import-not-at-top,wrong-import-position
from pallas_kernels.gla import gpu as gla_gpu_fact  # pylint: disable=g-import-not-at-top,wrong-import-position
from timing import time_fn  # pylint: disable=g-import-not-at-top,wrong-import-position

SHAPES = [(8, 2048, 16, 64), (4, 4096, 16, 64), (2, 8192, 16, 64), (1, 16384, 16, 64),
          (8, 2048, 8, 128), (2, 8192, 8, 128)]


def _dims(shape):
  """(B, T, H, K, V) of a B,T,H,D or B,T,H,K,V shape."""
  return tuple(shape) if len(shape) == 5 else (*shape, shape[-1])


def _inputs(shape, seed=0):
  b, t, h, kd, vd = _dims(shape)
  ks = jax.random.split(jax.random.key(seed), 5)
  q, k = (jax.random.normal(kk, (b, t, h, kd), jnp.bfloat16) for kk in ks[:2])
  v, do = (jax.random.normal(kk, (b, t, h, vd), jnp.bfloat16) for kk in ks[2:4])
  log_g = jax.nn.log_sigmoid(jax.random.normal(ks[4], (b, t, h, kd), jnp.float32) + 2.0)
  return q, k, v, log_g.astype(jnp.bfloat16), do


def _time_jax(f, args, reps):
  t0 = time.perf_counter()
  jax.block_until_ready(f(*args))  # compile
  print(f"  first call (compile) {time.perf_counter() - t0:.1f} s", flush=True)
  return time_fn(f, *args, iters=reps, calls=5, warmup=1)


def _gla_fns():
  gla = functools.partial(chunk_gla, chunk_size=CHUNK)
  fwd = jax.jit(lambda q, k, v, g: gla(q, k, v, g)[0])

  @jax.jit
  def fwd_bwd(q, k, v, g, do):
    o, vjp = jax.vjp(lambda *a: gla(*a)[0], q, k, v, g)
    return o, vjp(do)
  return fwd, fwd_bwd


def _cudnn_fns():
  attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn",
                                                      is_causal=True)
  fwd = jax.jit(attn)

  @jax.jit
  def fwd_bwd(q, k, v, do):
    o, vjp = jax.vjp(attn, q, k, v)
    return o, vjp(do)
  return fwd, fwd_bwd


def _time_fla(shape, reps):
  try:
    import torch
    import triton
    from fla.ops.gla import chunk_gla as fla_chunk_gla
  except ImportError as e:
    print(f"flash-linear-attention unavailable: {e}")
    return None
  b, t, h, kd, vd = _dims(shape)
  gen = torch.Generator(device="cuda").manual_seed(0)
  mk = lambda d: torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
  q, k, v, do = mk(kd), mk(kd), mk(vd), mk(vd)
  g = torch.nn.functional.logsigmoid(mk(kd).float() + 2.0).to(torch.bfloat16)
  bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=max(50, 5 * reps),
                                             return_mode="median")
  with torch.no_grad():
    fwd = bench(lambda: fla_chunk_gla(q, k, v, g))
  leaves = [x.requires_grad_() for x in (q, k, v, g)]

  def fwd_bwd():
    o, _ = fla_chunk_gla(*leaves)
    o.backward(do)
  return fwd, bench(fwd_bwd)


# chunk_gla's chunk_size in the timed and checked calls (set_variant's "cN").
CHUNK = 64


def set_variant(variant):
  """A variant of chunk_gla's GPU path: "xla" (gla.gpu_xla) or "fact[-OPTION...]" (gla.gpu, the
  default; no option: the code as it is). Options of "fact":

  - wN: N warps per per-chunk program;
  - sbN: N-wide state tiles; stN: N pipeline stages in the state kernels; pf: the state
    kernels' next tiles prefetched by hand;
  - spN: N-wide column blocks of the per-chunk kernels;
  - cN: chunks of N tokens (chunk_gla's chunk_size, 64 otherwise; for both "fact" and "xla").

  Options timed and dropped (V_ONCE, now the code; STATE_UNROLL, DQK_WARPS, EXACT_APART) are in
  git at 9f561b4 (docs/kernels.md).
  """
  global CHUNK
  name, *opts = variant.split("-")
  if name not in ("fact", "xla"):
    raise ValueError(f"unknown variant {variant!r}: fact or xla")
  dispatch.GLA_GPU_IMPL = name
  fact = gla_gpu_fact
  fact.NUM_WARPS = fact.STATE_BLOCK = fact.SPLIT = None
  fact.STATE_PREFETCH = False
  fact.STATE_STAGES, CHUNK = 3, 64
  numeric = {"w": "NUM_WARPS", "sb": "STATE_BLOCK", "st": "STATE_STAGES", "sp": "SPLIT"}
  flags = {"pf": "STATE_PREFETCH"}
  for opt in opts:
    key = opt.rstrip("0123456789")
    if opt.startswith("c") and opt[1:].isdigit():
      CHUNK = int(opt[1:])
    elif name == "fact" and key in numeric and opt != key:
      setattr(fact, numeric[key], int(opt[len(key):]))
    elif name == "fact" and opt in flags:
      setattr(fact, flags[opt], True)
    else:
      raise ValueError(f"unknown option {opt!r} in {variant!r}")


_REFERENCE = {}  # (dtype, shape) -> the reference's o and gradients, the same for every variant


def check(out_lines, intra="xla", float32=True):
  """Our kernel against the float32 reference on the GPU, values and gradients (float32 at K =
  V = 48, which takes gla.gpu_xla whatever the variant, only if float32)."""
  set_variant(intra)
  cases = ((jnp.float32, (2, 1000, 4, 48)),) if float32 else ()
  for dtype, shape in cases + ((jnp.bfloat16, (2, 4096, 4, 64)),):
    q, k, v, g, do = (x.astype(dtype) for x in _inputs(shape, seed=1))
    g = g.astype(jnp.float32)
    rel = lambda a, r: float(jnp.linalg.norm((a.astype(jnp.float32) - r).ravel())
                             / jnp.linalg.norm(r.ravel()))
    f32 = lambda xs: [x.astype(jnp.float32) for x in xs]

    def grads(fn, *args):
      def loss(*a):
        o = fn(*a)[0]
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o
      (_, o), ds = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*args)
      return o, ds

    ours = grads(lambda *a: chunk_gla(*a, chunk_size=CHUNK), q, k, v, g)
    key = (jnp.dtype(dtype).name, shape)
    if key not in _REFERENCE:
      _REFERENCE[key] = grads(gla_reference, *f32((q, k, v, g)))
    ref = _REFERENCE[key]
    errs = [rel(a, r) for a, r in zip(ours[1], ref[1])]
    line = (f"check intra={intra} {jnp.dtype(dtype).name} {shape}: "
            f"o rel err {rel(ours[0], ref[0]):.2e}; "
            f"dq dk dv dlog_g rel err {' '.join(f'{e:.2e}' for e in errs)}")
    print(line, flush=True)
    out_lines.append(line)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--shapes", nargs="*", default=None, help="B,T,H,D or B,T,H,K,V ...")
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--check", action="store_true", help="compare with the reference first")
  ap.add_argument("--no_fla", action="store_true")
  ap.add_argument("--intra", default="fact",
                  help="comma-separated variants of the GPU path to time, e.g. fact, fact-pf, "
                       "fact-c128-w8, xla (set_variant)")
  ap.add_argument("--deadline", type=float, default=1e9,
                  help="seconds after which no new measurement but cuDNN's starts (the table "
                       "still gets written)")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  shapes = ([tuple(map(int, s.split(","))) for s in args.shapes] if args.shapes else SHAPES)
  intras = args.intra.split(",")
  for intra in intras:  # misspelt variants fail here, before any compilation
    set_variant(intra)
  notes = []
  if args.check:
    for i, intra in enumerate(intras):
      try:
        check(notes, intra, float32=i == 0)
      except Exception as e:  # pylint: disable=broad-except
        notes.append(f"check intra={intra} FAILED: {type(e).__name__}: {str(e)[:2000]}")
        print(notes[-1], flush=True)
  att_fwd, att_fb = _cudnn_fns()
  start = time.perf_counter()
  timed = lambda fn, *a: None if time.perf_counter() - start > args.deadline else fn(*a)
  rows = []
  for shape in shapes:
    q, k, v, g, do = _inputs(shape)
    r = {"shape": shape, "fla_fwd": None, "fla_fb": None, "gla": {}}
    # cuDNN first and whatever the deadline: every row keeps the reference of its ratios.
    same_dims = k.shape[-1] == v.shape[-1]
    r["att_fwd"] = _time_jax(att_fwd, (q, k, v), args.reps) if same_dims else None
    r["att_fb"] = _time_jax(att_fb, (q, k, v, do), args.reps) if same_dims else None
    for intra in intras:
      set_variant(intra)  # read when the jitted functions are traced (first call)
      gla_fwd, gla_fb = _gla_fns()
      print(f"{shape} intra={intra}", flush=True)
      try:
        r["gla"][intra] = (timed(_time_jax, gla_fwd, (q, k, v, g), args.reps),
                           timed(_time_jax, gla_fb, (q, k, v, g, do), args.reps))
      except Exception as e:  # pylint: disable=broad-except
        r["gla"][intra] = (None, None)
        notes.append(f"{shape} intra={intra} FAILED: {type(e).__name__}: {str(e)[:2000]}")
        print(notes[-1], flush=True)
    r["gla_fwd"], r["gla_fb"] = r["gla"][intras[0]]
    rows.append(r)
    print(r, flush=True)
    _write_table(rows, notes, args.out, intras)
  for r in rows:  # last: its autotuning compiles many variants per (H, K)
    fla = None if args.no_fla else timed(_time_fla, r["shape"], args.reps)
    r["fla_fwd"], r["fla_fb"] = fla if fla else (None, None)
    print(r, flush=True)
    _write_table(rows, notes, args.out, intras)

  print(_write_table(rows, notes, args.out, intras))


def _write_table(rows, notes, out, intras=("xla",)):
  """Markdown and JSON of what has been measured so far (one chunk_gla column per variant)."""
  fmt = lambda x: "-" if x is None else f"{x:.3f}"
  ratio = lambda a, b: "-" if a is None or b is None else f"{a / b:.2f}"
  dev = jax.devices()[0]
  head = " / ".join(intras)
  lines = [f"Device: {dev.device_kind}; jax {jax.__version__}; "
           f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "",
           "| B, T, H, Dh (or K, V) | "
           + " | ".join(f"chunk_gla intra={i} fwd / fwd+bwd (ms)" for i in intras)
           + " | fla chunk_gla fwd / fwd+bwd (ms) | cuDNN attention fwd / fwd+bwd (ms) "
           f"| ours/fla fwd+bwd ({head}) | ours/cuDNN fwd+bwd ({head}) |",
           "|---" * (len(intras) + 5) + "|"]
  for r in rows:
    gla = [r["gla"].get(i, (None, None)) for i in intras]
    lines.append(
        f"| {', '.join(map(str, r['shape']))} | "
        + " | ".join(f"{fmt(f)} / {fmt(fb)}" for f, fb in gla)
        + f" | {fmt(r['fla_fwd'])} / {fmt(r['fla_fb'])} "
        f"| {fmt(r['att_fwd'])} / {fmt(r['att_fb'])} "
        f"| {' / '.join(ratio(fb, r['fla_fb']) for _, fb in gla)} "
        f"| {' / '.join(ratio(fb, r['att_fb']) for _, fb in gla)} |")
  lines += [""] + notes
  text = "\n".join(lines)
  with open(os.path.join(out, "bench_gla.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(out, "bench_gla.json"), "w") as f:
    json.dump({"device": dev.device_kind, "rows": rows, "notes": notes}, f, indent=1)
  return text


if __name__ == "__main__":
  main()
