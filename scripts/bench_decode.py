"""Decoding latency and maximum throughput, MQA Transformer vs Hawk vs Griffin (the Griffin
paper's Fig. 1(b) and Fig. 4 protocol), with random weights of a given preset size.

  python scripts/bench_decode.py --out DIR [--size 1.3b] [--families mqa,hawk,griffin]
      [--new_tokens 512,1024,2048,4096] [--latency_batch 16] [--prefill 0,4096]

- Latency: batch ``--latency_batch``, a prompt of 1 token ("empty") or ``--prefill`` tokens,
  time to prefill and sample each ``--new_tokens`` count.
- Maximum throughput: for each ``--new_tokens`` count, the batch is doubled from
  ``--latency_batch`` until the device runs out of memory (or ``--max_batch``); the best
  sampled tokens/s is reported. The MQA baseline decodes through its own KV cache.

Every timing is the median of ``--repeats`` calls after a compiling call. Writes DIR/decode.md
and DIR/decode.json. ``--tiny`` shrinks the models (for a CPU check of the script).
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--tiny", action="store_true", help="tiny models, for a CPU check")
  args = parser.parse_args()

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import presets, sampling  # pylint: disable=g-import-not-at-top

  os.makedirs(args.out, exist_ok=True)
  new_counts = [int(n) for n in args.new_tokens.split(",")]
  prefills = [int(p) for p in args.prefill.split(",")]

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
    sampling.sample(model, prompts, params)  # compile
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      sampling.sample(model, prompts, params)  # returns host arrays: synchronised
      times.append(time.perf_counter() - start)
    return statistics.median(times)

  def out_of_memory(e):
    return "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e)

  results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "command": " ".join(sys.argv), "latency": [], "throughput": []}
  for family in args.families.split(","):
    model = build(family)
    for prefill in prefills:
      for new in new_counts:
        seconds = timed(model, args.latency_batch, prefill, new)
        results["latency"].append(dict(family=family, prefill=prefill, new=new,
                                       batch=args.latency_batch, seconds=seconds))
        print(f"latency {family} prefill={prefill} new={new}: {seconds:.3f} s", flush=True)
    for new in new_counts:
      best, batch = None, args.latency_batch
      while batch <= args.max_batch:
        try:
          seconds = timed(model, batch, 1, new)
        except Exception as e:  # pylint: disable=broad-except  (only running out of memory ends it)
          if not out_of_memory(e):
            raise
          break
        rate = batch * new / seconds
        print(f"throughput {family} new={new} batch={batch}: {rate:,.0f} tokens/s", flush=True)
        if best is None or rate > best[0]:
          best = (rate, batch)
        batch *= 2
      results["throughput"].append(dict(family=family, new=new, tokens_per_sec=best[0],
                                        batch=best[1]))
    del model

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
  text = "\n".join(lines)
  with open(os.path.join(args.out, "decode.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(args.out, "decode.json"), "w") as f:
    json.dump(results, f, indent=1)
  print(text)


if __name__ == "__main__":
  main()
