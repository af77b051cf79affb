"""Where a decoding step's time goes, at a given batch and cache fill, against its roofline.

  python scripts/bench/profile_decode.py --family mqa [--size 1.3b] [--batch 1024]
      [--position 2048] [--steps 32] [--profile DIR] [--hlo FILE] [--tiny]
      [--decode_impl auto|xla|pallas] [--mlp_impl auto|xla|pallas]
      [--xla_option xla_gpu_enable_triton_gemm=false ...]

Decodes ``--steps`` greedy tokens per row (``sampling.decode``, compiled ahead of time) from
caches already holding ``--position`` tokens per row (their contents are zeros: the time does
not depend on them; only the lengths do), and prints the time per step beside the step's floor (``bench_decode.decode_floor``: FLOPs over the
peak or bytes over the copy ceiling measured in the same run, whichever is larger). This is the
steady state that ``bench_decode.py``'s throughput rows average over 4096 positions, at one
position: the MQA baseline's cache read at 4096 new tokens averages about 2048 positions.

``--profile DIR``: one more run under ``jax.profiler``, summarised by
``profile_summary.py`` (time by kind of kernel and the top kernels, per step); ``--hlo FILE``:
the compiled program's optimised HLO.
"""

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def filled_cache(model, batch: int, position: int, max_len: int):
  """``model.init_cache`` with every attention cache holding positions ``0 .. position - 1``
  of one document (a ring buffer the last ``size`` of them), as after a prefill."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import attention, recurrent  # pylint: disable=g-import-not-at-top
  cache = list(model.init_cache(batch, max_len))
  for i, c in enumerate(cache):
    if isinstance(c, attention.AttentionCache):
      size = c.positions.shape[1]
      slots = jnp.arange(size)
      # slot s holds the latest position p < position with p % size == s (none: -1)
      last = position - 1 - (position - 1 - slots) % size
      positions = jnp.where(last >= 0, last, -1).astype(jnp.int32)
      cache[i] = c._replace(positions=jnp.broadcast_to(positions, c.positions.shape))
    elif isinstance(c, recurrent.RecurrentCache):  # the count of tokens it has taken
      cache[i] = c._replace(tokens=jnp.asarray(position, c.tokens.dtype))
  return tuple(cache)


def decoder(model, steps: int):
  """``run(state, cache, logits, pos) -> (tokens [steps, B], cache)``: ``steps`` greedy steps of
  ``sampling.decode``, the loop ``sampling.sample`` runs after its prefill."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import sampling  # pylint: disable=g-import-not-at-top
  graphdef, _ = nnx.split(model)
  params = sampling.SamplingParams(max_new_tokens=steps)

  # The cache is donated and returned, so the loop updates it in place, as in
  # ``sampling.sample`` (which makes it inside its jit). Otherwise XLA copies every cache buffer
  # into the loop at each call (for MQA 1.3B at 1024 rows, 27 GB: about 1.5 ms a step over 16
  # steps on an H100), a cost that sampling does not have.
  @functools.partial(jax.jit, donate_argnums=1)
  def run(state, cache, logits, pos):
    tokens, _, _, cache = sampling.decode(nnx.merge(graphdef, state), cache, logits, pos, params,
                                          return_cache=True)
    return tokens, cache

  return run


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--family", default="mqa")
  parser.add_argument("--size", default="1.3b")
  parser.add_argument("--vocab_size", type=int, default=256_000)
  parser.add_argument("--batch", type=int, default=1024)
  parser.add_argument("--position", type=int, default=2048, help="tokens already cached per row")
  parser.add_argument("--steps", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--profile", default="", help="trace directory")
  parser.add_argument("--hlo", default="", help="write the optimised HLO here")
  parser.add_argument("--tiny", action="store_true", help="tiny models, for a CPU check")
  parser.add_argument("--decode_impl", default="auto", choices=("auto", "xla", "pallas"),
                      help="model.decode_impl: the recurrent blocks' decoding step")
  parser.add_argument("--mlp_impl", default="auto", choices=("auto", "xla", "pallas"),
                      help="model.mlp_impl: the MLP's kernels (decoding: up-projection + gating)")
  parser.add_argument("--xla_option", action="append", default=[], metavar="NAME=VALUE",
                      help="an XLA option for this loop's compile only, e.g. "
                           "xla_gpu_enable_triton_gemm=false (repeatable)")
  args = parser.parse_args()
  options = {}
  for item in args.xla_option:
    name, sep, value = item.partition("=")
    if not sep or not name:
      parser.error(f"--xla_option {item!r}: expected NAME=VALUE")
    options[name] = {"true": True, "false": False}.get(value.lower(), value)
  if args.position < 1 or args.steps < 1 or args.batch < 1:
    parser.error("--position, --steps and --batch must be at least 1")

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import flops, sampling  # pylint: disable=g-import-not-at-top
  import bench_decode  # pylint: disable=g-import-not-at-top
  import profile_summary  # pylint: disable=g-import-not-at-top
  import timing  # pylint: disable=g-import-not-at-top

  model = bench_decode.build_model(args.family, args.size, args.vocab_size, args.tiny,
                                   decode_impl=args.decode_impl, mlp_impl=args.mlp_impl)
  state = nnx.state(model)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  peak = flops.device_peak_flops() or 0.0
  ceiling = timing.copy_ceiling(2**30 if not args.tiny else 2**24)
  floor = bench_decode.decode_floor(model.cfg, n_params, args.batch, args.position, args.steps,
                                    peak, ceiling, prefill=False)
  floor_ms = 1e3 * floor["floor_s"] / args.steps
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {args.family} {args.size}, "
        f"{n_params / 1e9:.2f}B parameters, batch {args.batch}, cache {args.position} tokens, "
        f"{args.steps} steps", flush=True)
  print(f"floor per step {floor_ms:.2f} ms ({floor['bound']}): "
        f"{floor['flops_per_step'] / 1e12:.2f} TFLOP over {peak / 1e12:.0f} TFLOP/s, "
        f"{floor['bytes_per_step'] / 1e9:.2f} GB over {ceiling / 1e12:.2f} TB/s", flush=True)

  tokens = np.random.default_rng(0).integers(3, args.vocab_size, args.batch)
  logits = jax.nn.one_hot(tokens, args.vocab_size, dtype=jnp.float32)  # the first tokens
  pos = jnp.full((args.batch,), args.position, jnp.int32)
  def fresh_cache():  # each run consumes its cache (donated): a buffer of its own per leaf
    cache = filled_cache(model, args.batch, args.position, args.position + args.steps + 1)
    return jax.block_until_ready(jax.tree.map(lambda a: jnp.array(a, copy=True), cache))

  # sampling's own options (GPU: the dot merger off), then --xla_option's
  options = {**sampling.compiler_options(), **options}
  run = decoder(model, args.steps).lower(state, fresh_cache(), logits, pos).compile(
      options or None)
  jax.block_until_ready(run(state, fresh_cache(), logits, pos))
  times = []
  for _ in range(args.repeats):
    cache = fresh_cache()
    start = time.perf_counter()
    jax.block_until_ready(run(state, cache, logits, pos))
    times.append(time.perf_counter() - start)
  ms = 1e3 * statistics.median(times) / args.steps
  print(f"{ms:.2f} ms per step, {args.batch / ms * 1e3:,.0f} tokens/s, "
        f"{100 * floor_ms / ms:.1f}% of the floor", flush=True)
  if args.hlo:
    with open(args.hlo, "w") as f:
      f.write(run.as_text())
  if args.profile:
    cache = fresh_cache()
    with jax.profiler.trace(args.profile, create_perfetto_trace=True):
      jax.block_until_ready(run(state, cache, logits, pos))
    print(profile_summary.summarize(args.profile, steps=args.steps, top=25))


if __name__ == "__main__":
  main()
