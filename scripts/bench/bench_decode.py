"""Decoding latency and maximum throughput, MQA Transformer vs Hawk vs Griffin (the Griffin
paper's Fig. 1(b) and Fig. 4 protocol), with random weights of a given preset size.

  python scripts/bench/bench_decode.py --out DIR [--size 1.3b] [--families mqa,hawk,griffin]
      [--new_tokens 512,1024,2048,4096] [--latency_batch 16] [--prefill 0,4096 | none]
      [--batches 16,32,...] [--max_batch 4096] [--hbm_budget_gb G] [--repeats 3]
      [--deadline S] [--tiny] [--decode_impl auto|xla|pallas] [--mlp_impl auto|xla|pallas]

- Latency: batch ``--latency_batch``, a prompt of 1 token ("empty") or ``--prefill`` tokens,
  time to prefill and sample each ``--new_tokens`` count (``--prefill none``: skipped).
- Maximum throughput: for each ``--new_tokens`` count, the batches of ``--batches`` in order
  (default: doubling from ``--latency_batch`` up to ``--max_batch``) until the device runs out
  of memory; the best sampled tokens/s is reported. The MQA baseline decodes through its own KV
  cache.

- ``--hbm_budget_gb G``: in the throughput search, a batch whose compiled program (weights,
  caches, logits, temporaries: ``aot.Memory``) needs more than G GiB counts as out of memory, as
  on a device of that size (the Griffin paper's TPU v5e has 16 GB); it is compiled, not run.
- Every row has its roofline: per decoding step, the FLOPs (``flops.forward_flops_per_token`` at
  each position's number of keys, times the batch) over the device's peak, and the bytes (every
  weight once, plus each row's KV cache as far as it is filled (attention layers; a local
  window reads at most its window) or its recurrent and Conv1D state, read and written) over
  the copy ceiling measured in the same run (a jitted ``x + 1`` over 1 GiB: bytes read plus
  written). The larger of the two, summed over the steps (and the prefill), is the floor; the
  row shows which bound it is ("memory" or "compute") and the fraction of it reached. Logits
  and sampling are not in the floor. Beside it, the throughput rows give the fraction of the
  same floor with the FLOPs over the matmul ceiling measured in the run instead of the rated
  peak (``timing.matmul_ceiling``: a bfloat16 8192-cubed matmul back to back for 1.5 s, so
  that a power cap sets the clock as it does through a decoding run).

Each timing is the median of ``--repeats`` runs of the decode loop compiled ahead of time
(``sampling.compiled_sampler``: compilation is not timed and the loop is not run an extra time to
warm up); each throughput run also gives the GPU's median SM clock and mean power through its
timed runs (``timing.GpuClocks``). ``--deadline S`` starts no new measurement after S seconds.
Writes DIR/decode.md and DIR/decode.json after every measurement. ``--tiny`` shrinks the models
(for a CPU check of the script).
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--size", default="1.3b")
  parser.add_argument("--families", default="mqa,hawk,griffin")
  parser.add_argument("--vocab_size", type=int, default=256_000)
  parser.add_argument("--new_tokens", default="512,1024,2048,4096")
  parser.add_argument("--prefill", default="0,4096")
  parser.add_argument("--latency_batch", type=int, default=16)
  parser.add_argument("--max_batch", type=int, default=4096)
  parser.add_argument("--batches", default="", help="throughput batch sizes (default: doubling)")
  parser.add_argument("--hbm_budget_gb", type=float, default=0,
                      help="treat a batch needing more than this many GiB as out of memory")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--deadline", type=float, default=0, help="seconds; 0: none")
  parser.add_argument("--tiny", action="store_true", help="tiny models, for a CPU check")
  parser.add_argument("--decode_impl", default="auto", choices=("auto", "xla", "pallas"),
                      help="model.decode_impl: the recurrent blocks' decoding step")
  parser.add_argument("--mlp_impl", default="auto", choices=("auto", "xla", "pallas"),
                      help="model.mlp_impl: the MLP's kernels (decoding: up-projection + gating)")
  args = parser.parse_args()

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import aot, flops, sampling  # pylint: disable=g-import-not-at-top
  import timing  # pylint: disable=g-import-not-at-top  (scripts/bench/, beside this file)

  os.makedirs(args.out, exist_ok=True)
  new_counts = [int(n) for n in args.new_tokens.split(",")]
  prefills = [] if args.prefill == "none" else [int(p) for p in args.prefill.split(",")]
  if args.batches:
    batches = [int(b) for b in args.batches.split(",")]
  else:
    batches = [args.latency_batch << i for i in range(32)
               if args.latency_batch << i <= args.max_batch]
  start_time = time.time()

  def out_of_time():
    return args.deadline and time.time() - start_time > args.deadline

  def timed(model, batch, prompt_len, new, budget=0.0):
    prompts = np.random.default_rng(0).integers(3, args.vocab_size,
                                                (batch, max(prompt_len, 1))).tolist()
    params = sampling.SamplingParams(max_new_tokens=new)
    run, run_args = sampling.compiled_sampler(model, prompts, params)
    if budget:
      need = aot.Memory.of(run).total / 2**30
      if need > budget:
        raise OverBudget(f"needs {need:.3g} GiB, over the {budget:g} GiB budget")
    times = []
    with timing.GpuClocks() as clocks:  # the SM clock and power through the timed runs
      for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(*run_args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), clocks.summary()

  def out_of_memory(e):
    return isinstance(e, OverBudget) or "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e)

  peak = flops.device_peak_flops() or 0.0
  ceiling = timing.copy_ceiling(2**30 if not args.tiny else 2**24)
  sustained = (timing.matmul_ceiling() if not args.tiny
               else timing.matmul_ceiling(256, seconds=0.05))
  results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "command": " ".join(sys.argv), "out": args.out, "peak_flops": peak,
             "copy_ceiling_bytes_per_s": ceiling, "matmul_ceiling_flops": sustained,
             "hbm_budget_gb": args.hbm_budget_gb,
             "latency": [], "throughput": [], "runs": []}
  print(f"peak {peak / 1e12:.0f} TFLOP/s (matmul ceiling {sustained / 1e12:.0f} measured), "
        f"copy ceiling {ceiling / 1e12:.2f} TB/s", flush=True)
  for family in args.families.split(","):
    model = build_model(family, args.size, args.vocab_size, args.tiny,
                        decode_impl=args.decode_impl, mlp_impl=args.mlp_impl)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))

    def floor(batch, prompt_len, new, model=model, n_params=n_params):
      rated = decode_floor(model.cfg, n_params, batch, max(prompt_len, 1), new, peak, ceiling)
      measured = decode_floor(model.cfg, n_params, batch, max(prompt_len, 1), new, sustained,
                              ceiling)
      return dict(rated, floor_measured_s=measured["floor_s"])

    for prefill in prefills:
      for new in new_counts:
        if out_of_time():
          break
        seconds, _ = timed(model, args.latency_batch, prefill, new)
        results["latency"].append(dict(family=family, prefill=prefill, new=new,
                                       batch=args.latency_batch, seconds=seconds,
                                       **floor(args.latency_batch, prefill, new)))
        print(f"latency {family} prefill={prefill} new={new}: {seconds:.3f} s", flush=True)
        write(results)
    for new in new_counts:
      best = None
      for batch in batches:
        if out_of_time():
          break
        try:
          seconds, clocks = timed(model, batch, 1, new, budget=args.hbm_budget_gb)
        except Exception as e:  # pylint: disable=broad-except  (only running out of memory ends it)
          if not out_of_memory(e):
            raise
          why = str(e) if isinstance(e, OverBudget) else "out of memory"
          print(f"throughput {family} new={new} batch={batch}: {why}", flush=True)
          results["runs"].append(dict(family=family, new=new, batch=batch, tokens_per_sec=None,
                                      status=why))
          write(results)
          break
        rate = batch * new / seconds
        print(f"throughput {family} new={new} batch={batch}: {rate:,.0f} tokens/s", flush=True)
        results["runs"].append(dict(family=family, new=new, batch=batch, tokens_per_sec=rate,
                                    seconds=seconds, clocks=clocks, **floor(batch, 1, new)))
        write(results)
        if best is None or rate > best["tokens_per_sec"]:
          best = results["runs"][-1]
      if best is not None:
        results["throughput"].append(dict(best))
        write(results)
    del model
  print(write(results))


def model_config(family: str, size: str, vocab_size: int, tiny: bool = False, **overrides):
  """A preset's ModelConfig with bfloat16 weights and compute; ``tiny``: a few thousand
  parameters of the same family, for a CPU check; ``overrides``: ModelConfig fields
  (``decode_impl``, ``mlp_impl``)."""
  from recurrentgemma_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import presets  # pylint: disable=g-import-not-at-top
  fields = presets.preset(family, size)
  if tiny:
    fields.update(width=64, lru_width=64, num_layers=3, num_heads=2, num_gate_blocks=2,
                  mlp_expanded_width=128, attention_window_size=16)
  return model_lib.ModelConfig(vocab_size=vocab_size, dtype="bfloat16", param_dtype="bfloat16",
                               **fields, **overrides)


def build_model(family: str, size: str, vocab_size: int, tiny: bool = False, **overrides):
  """A randomly initialised :func:`model_config` model."""
  from recurrentgemma_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  return model_lib.init_model(model_config(family, size, vocab_size, tiny, **overrides), seed=0)


class OverBudget(Exception):
  """A batch whose compiled program does not fit ``--hbm_budget_gb``."""


def decode_floor(cfg, n_params: int, batch: int, prompt_len: int, new: int, peak: float,
                 ceiling: float, prefill: bool = True) -> dict:
  """The roofline of prefilling ``prompt_len`` tokens (``prefill=False``: already cached) and
  decoding ``new`` more, ``batch`` rows (bfloat16 weights): per step the larger of its FLOPs
  over ``peak`` and its bytes over ``ceiling``, summed. See the module docstring for what is
  counted."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import flops  # pylint: disable=g-import-not-at-top
  d, lru = cfg.width, cfg.resolved_lru_width
  pos = np.arange(prompt_len, prompt_len + new, dtype=np.float64)  # each step's position
  types = cfg.resolved_block_types
  attention = [cfg.attention_window_size if t == "attention" else None
               for t in types if t in ("attention", "global_attention")]
  keys = [np.minimum(pos + 1, w + 1) if w is not None else pos + 1 for w in attention]
  keys_total = sum(keys) + np.zeros_like(pos)  # (an array also without attention layers)
  # FLOPs per row: every weight, plus 2 * 2 * d per key (forward_flops_per_token at length 1
  # counts one key per attention layer).
  flops_row = flops.forward_flops_per_token(cfg, 1) + 4 * d * (keys_total - len(keys))
  state_bytes = 0.0  # per row, read and written each step
  for t in types:
    if t == "recurrent":
      state_bytes += 2 * (4 * lru + 2 * (cfg.conv1d_temporal_width - 1) * lru)
    elif t == "gla":
      heads = cfg.gla_num_heads or cfg.num_heads
      state_bytes += 2 * 4 * int(d * cfg.gla_expand_k) * int(d * cfg.gla_expand_v) / heads
  bytes_row = state_bytes + 2 * 2 * cfg.head_dim * keys_total  # K and V, one head, bfloat16
  weight_bytes = 2.0 * n_params
  compute_s = batch * flops_row / peak if peak else np.zeros_like(pos)
  memory_s = (weight_bytes + batch * bytes_row) / ceiling
  floor_s = float(np.maximum(compute_s, memory_s).sum())
  if prefill and prompt_len > 1:  # the prefill: one pass over the prompt
    prefill_flops = batch * prompt_len * flops.forward_flops_per_token(cfg, prompt_len)
    floor_s += max(prefill_flops / peak if peak else 0.0, weight_bytes / ceiling)
  return {"floor_s": floor_s,
          "bound": "memory" if float(memory_s.sum()) >= float(np.sum(compute_s)) else "compute",
          "flops_per_step": float(batch * flops_row.mean()),
          "bytes_per_step": float(weight_bytes + batch * bytes_row.mean())}


def _fraction(r, key: str = "floor_s") -> str:
  """The share of ``r``'s floor (``key``: ``floor_measured_s`` for the one at the measured
  matmul ceiling) that its time reached."""
  seconds = r.get("seconds")
  if not seconds or key not in r:
    return "-"
  return (f"{100 * r[key] / seconds:.0f}% of {r['bound']}" if key == "floor_s"
          else f"{100 * r[key] / seconds:.0f}%")


def plot(results) -> None:
  """DIR/decode.png: Fig. 1(b) (maximum throughput against tokens decoded) and Fig. 4 (latency
  against tokens decoded at the latency batch, empty and long prefill)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  families = list(dict.fromkeys(r["family"] for r in results["runs"] + results["latency"]))
  for family in families:
    rows = sorted((r["new"], r["tokens_per_sec"]) for r in results["throughput"]
                  if r["family"] == family)
    if rows:
      left.plot(*zip(*rows), marker="o", label=family)
    for prefill in sorted({r["prefill"] for r in results["latency"]}):
      rows = sorted((r["new"], r["seconds"]) for r in results["latency"]
                    if r["family"] == family and r["prefill"] == prefill)
      if rows:
        right.plot(*zip(*rows), marker="o", linestyle="-" if prefill <= 1 else "--",
                   label=f"{family}, prefill {prefill}")
  budget = f", {results['hbm_budget_gb']:g} GiB budget" if results.get("hbm_budget_gb") else ""
  left.set(xlabel="tokens decoded", ylabel="max tokens/s", title=f"Maximum throughput{budget}")
  right.set(xlabel="tokens decoded", ylabel="seconds",
            title=f"Latency, batch {results['latency'][0]['batch'] if results['latency'] else '-'}")
  for ax in (left, right):
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    if ax.lines:
      ax.legend(fontsize=8)
  fig.suptitle(f"{results['device']}, {results['date']}")
  fig.tight_layout()
  fig.savefig(os.path.join(results["out"], "decode.png"), dpi=100)
  plt.close(fig)


def write(results):
  """Writes DIR/decode.md and DIR/decode.json; returns the markdown."""
  import timing  # pylint: disable=g-import-not-at-top  (scripts/bench/, beside this file)
  budget = (f"; batches needing over {results['hbm_budget_gb']:g} GiB count as out of memory"
            if results.get("hbm_budget_gb") else "")
  lines = [f"Device {results['device']}, jax {results['jax']}, {results['date']}; "
           f"command `{results['command']}`.", "",
           f"Roofline: peak {results['peak_flops'] / 1e12:.0f} TFLOP/s (rated), copy ceiling "
           f"{results['copy_ceiling_bytes_per_s'] / 1e12:.2f} TB/s measured in the run{budget}. "
           f"'At the matmul ceiling': the same floor with the FLOPs over "
           f"{results.get('matmul_ceiling_flops', 0) / 1e12:.0f} TFLOP/s, a bfloat16 matmul's "
           "rate measured in the run.",
           "", "| family | prefill | new tokens | batch | latency (s) | floor (s) | reached |",
           "|---|---|---|---|---|---|---|"]
  lines += [f"| {r['family']} | {r['prefill']} | {r['new']} | {r['batch']} | {r['seconds']:.3f} "
            f"| {r['floor_s']:.3f} | {_fraction(r)} |" for r in results["latency"]]
  lines += ["", "| family | new tokens | best batch | max throughput (tokens/s) | vs mqa "
            "| roofline (tokens/s) | reached | at the matmul ceiling |",
            "|---|---|---|---|---|---|---|---|"]
  base = {r["new"]: r["tokens_per_sec"] for r in results["throughput"] if r["family"] == "mqa"}
  for r in results["throughput"]:
    ratio = f"{r['tokens_per_sec'] / base[r['new']]:.2f}x" if r["new"] in base else ""
    lines.append(f"| {r['family']} | {r['new']} | {r['batch']} | {r['tokens_per_sec']:,.0f} | "
                 f"{ratio} | {r['batch'] * r['new'] / r['floor_s']:,.0f} | {_fraction(r)} | "
                 f"{_fraction(r, 'floor_measured_s')} |")
  lines += ["", "Every throughput run (GFLOP and GB per decoding step, averaged over the steps; "
            "the GPU's median SM clock and mean power through the timed runs, '(cap)' where "
            "the power cap throttled it):",
            "", "| family | new tokens | batch | tokens/s | GFLOP/step | GB/step | reached "
            "| SM clock, power |", "|---|---|---|---|---|---|---|---|"]
  for r in results["runs"]:
    if r["tokens_per_sec"] is None:
      lines.append(f"| {r['family']} | {r['new']} | {r['batch']} | {r.get('status', 'out of memory')}"
                   " | - | - | - | - |")
    else:
      lines.append(f"| {r['family']} | {r['new']} | {r['batch']} | {r['tokens_per_sec']:,.0f} | "
                   f"{r['flops_per_step'] / 1e9:,.0f} | {r['bytes_per_step'] / 1e9:.2f} | "
                   f"{_fraction(r)} | {timing.clock_cell(r.get('clocks'))} |")
  text = "\n".join(lines)
  with open(os.path.join(results["out"], "decode.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(results["out"], "decode.json"), "w") as f:
    json.dump(results, f, indent=1)
  plot(results)
  return text


if __name__ == "__main__":
  main()
