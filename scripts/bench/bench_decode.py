"""Decoding latency and maximum throughput, MQA Transformer vs Hawk vs Griffin (the Griffin
paper's Fig. 1(b) and Fig. 4 protocol), with random weights of a given preset size.

  python scripts/bench/bench_decode.py --out DIR [--size 1.3b] [--families mqa,hawk,griffin]
      [--new_tokens 512,1024,2048,4096] [--latency_batch 16] [--prefill 0,4096 | none]
      [--batches 16,32,...] [--max_batch 4096] [--repeats 3] [--deadline S] [--tiny]

- Latency: batch ``--latency_batch``, a prompt of 1 token ("empty") or ``--prefill`` tokens,
  time to prefill and sample each ``--new_tokens`` count (``--prefill none``: skipped).
- Maximum throughput: for each ``--new_tokens`` count, the batches of ``--batches`` in order
  (default: doubling from ``--latency_batch`` up to ``--max_batch``) until the device runs out
  of memory; the best sampled tokens/s is reported. The MQA baseline decodes through its own KV
  cache.

Each timing is the median of ``--repeats`` runs of the decode loop compiled ahead of time
(``sampling.compiled_sampler``: compilation is not timed and the loop is not run an extra time to
warm up). ``--deadline S`` starts no new measurement after S seconds. Writes DIR/decode.md and
DIR/decode.json after every measurement. ``--tiny`` shrinks the models (for a CPU check of the
script).
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
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--deadline", type=float, default=0, help="seconds; 0: none")
  parser.add_argument("--tiny", action="store_true", help="tiny models, for a CPU check")
  args = parser.parse_args()

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import presets, sampling  # pylint: disable=g-import-not-at-top

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

  def build(family):
    fields = presets.preset(family, args.size)
    if args.tiny:
      fields.update(width=64, lru_width=64, num_layers=3, num_heads=2, num_gate_blocks=2,
                    mlp_expanded_width=128, attention_window_size=16)
    cfg = model_lib.ModelConfig(vocab_size=args.vocab_size, dtype="bfloat16",
                                param_dtype="bfloat16", **fields)
    return model_lib.init_model(cfg, seed=0)

  def timed(model, batch, prompt_len, new):
    prompts = np.random.default_rng(0).integers(3, args.vocab_size,
                                                (batch, max(prompt_len, 1))).tolist()
    params = sampling.SamplingParams(max_new_tokens=new)
    run, run_args = sampling.compiled_sampler(model, prompts, params)
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      jax.block_until_ready(run(*run_args))
      times.append(time.perf_counter() - start)
    return statistics.median(times)

  def out_of_memory(e):
    return "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e)

  results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "command": " ".join(sys.argv), "out": args.out, "latency": [], "throughput": [],
             "runs": []}
  for family in args.families.split(","):
    model = build(family)
    for prefill in prefills:
      for new in new_counts:
        if out_of_time():
          break
        seconds = timed(model, args.latency_batch, prefill, new)
        results["latency"].append(dict(family=family, prefill=prefill, new=new,
                                       batch=args.latency_batch, seconds=seconds))
        print(f"latency {family} prefill={prefill} new={new}: {seconds:.3f} s", flush=True)
        write(results)
    for new in new_counts:
      best = None
      for batch in batches:
        if out_of_time():
          break
        try:
          seconds = timed(model, batch, 1, new)
        except Exception as e:  # pylint: disable=broad-except  (only running out of memory ends it)
          if not out_of_memory(e):
            raise
          print(f"throughput {family} new={new} batch={batch}: out of memory", flush=True)
          results["runs"].append(dict(family=family, new=new, batch=batch, tokens_per_sec=None))
          write(results)
          break
        rate = batch * new / seconds
        print(f"throughput {family} new={new} batch={batch}: {rate:,.0f} tokens/s", flush=True)
        results["runs"].append(dict(family=family, new=new, batch=batch, tokens_per_sec=rate))
        write(results)
        if best is None or rate > best[0]:
          best = (rate, batch)
      if best is not None:
        results["throughput"].append(dict(family=family, new=new, tokens_per_sec=best[0],
                                          batch=best[1]))
        write(results)
    del model
  print(write(results))


def write(results):
  """Writes DIR/decode.md and DIR/decode.json; returns the markdown."""
  lines = [f"Device {results['device']}, jax {results['jax']}, {results['date']}; "
           f"command `{results['command']}`.", "",
           "| family | prefill | new tokens | batch | latency (s) |", "|---|---|---|---|---|"]
  lines += [f"| {r['family']} | {r['prefill']} | {r['new']} | {r['batch']} | {r['seconds']:.3f} |"
            for r in results["latency"]]
  lines += ["", "| family | new tokens | best batch | max throughput (tokens/s) | vs mqa |",
            "|---|---|---|---|---|"]
  base = {r["new"]: r["tokens_per_sec"] for r in results["throughput"] if r["family"] == "mqa"}
  for r in results["throughput"]:
    ratio = f"{r['tokens_per_sec'] / base[r['new']]:.2f}x" if r["new"] in base else ""
    lines.append(f"| {r['family']} | {r['new']} | {r['batch']} | {r['tokens_per_sec']:,.0f} | "
                 f"{ratio} |")
  lines += ["", "Every throughput run:", "", "| family | new tokens | batch | tokens/s |",
            "|---|---|---|---|"]
  lines += [f"| {r['family']} | {r['new']} | {r['batch']} | "
            + ("out of memory" if r["tokens_per_sec"] is None else f"{r['tokens_per_sec']:,.0f}")
            + " |" for r in results["runs"]]
  text = "\n".join(lines)
  with open(os.path.join(results["out"], "decode.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(results["out"], "decode.json"), "w") as f:
    json.dump(results, f, indent=1)
  return text


if __name__ == "__main__":
  main()
