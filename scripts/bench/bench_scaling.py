"""Weak scaling of training over the GPUs of one host, through the real launcher.

  python scripts/bench/bench_scaling.py --out DIR [--config configs/griffin.py:400m] [--steps 20]
      [--rows_per_gpu 8] [--gpus 1,2]

For each setup it runs ``scripts/launch_gpus.sh`` (one process per GPU, jax.distributed),
reads the run's ``metrics.jsonl`` and reports the median tokens/s of the logged intervals after
the first (compilation); weak scaling keeps the rows per data-parallel GPU fixed, so the
efficiency is ``tokens/s(n) / (n * tokens/s(1))``. Setups: data parallel with ZeRO-1 on every
GPU count, and tensor parallel (``mesh.model = 2``) on 2 GPUs. Writes ``DIR/scaling.md``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(out, name, gpus, args, steps):
  workdir = os.path.join(out, name)
  env = dict(os.environ, GPUS_PER_NODE=str(gpus), PYTHONUNBUFFERED="1")
  cmd = ["bash", os.path.join(ROOT, "scripts", "launch_gpus.sh"), f"--workdir={workdir}",
         f"--config.total_steps={steps}", "--config.log_every=5", "--config.eval_every=0",
         f"--config.checkpoint_every={steps}", "--config.data.eval_tokens=1", *args]
  start = time.time()
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
  print(f"{name}: exit {proc.returncode} in {time.time() - start:.0f} s", flush=True)
  if proc.returncode:
    print(proc.stdout[-4000:], proc.stderr[-4000:], flush=True)
    return None
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f if '"tokens_per_sec"' in line]
  rates = [m["tokens_per_sec"] for m in lines[1:]]  # the first interval holds compilation
  return {"tokens_per_sec": statistics.median(rates), "mfu": lines[-1]["mfu"],
          "loss": lines[-1]["loss"]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--config", default=os.path.join(ROOT, "configs", "griffin.py") + ":400m")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--rows_per_gpu", type=int, default=8)
  parser.add_argument("--gpus", default="1,2", help="GPU counts of the data-parallel runs")
  parser.add_argument("--tp_gpus", type=int, default=2, help="tensor-parallel run (0: none)")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  counts = [int(n) for n in args.gpus.split(",")]
  rows = []
  base = None
  for n in counts:
    setup_args = ["--config", args.config, f"--config.batch_size={args.rows_per_gpu * n}",
                  f"--config.zero={1 if n > 1 else 0}"]
    result = run(args.out, f"dp{n}", n, setup_args, args.steps)
    if result is None:
      continue
    if n == 1:
      base = result["tokens_per_sec"]
    eff = result["tokens_per_sec"] / (n * base) if base else None
    rows.append((f"data parallel{' + ZeRO-1' if n > 1 else ''}", n, f"{n}x1",
                 args.rows_per_gpu * n, result, eff))
  if args.tp_gpus:
    n = args.tp_gpus
    result = run(args.out, f"tp{n}", n, ["--config", args.config,
                                         f"--config.batch_size={args.rows_per_gpu}",
                                         "--config.mesh.data=1", f"--config.mesh.model={n}"],
                 args.steps)
    if result is not None:
      rows.append((f"tensor parallel (model={n})", n, f"1x{n}", args.rows_per_gpu, result,
                   None))
  table = ["| setup | GPUs | mesh (data x model) | global batch (rows) | tokens/s | "
           "tokens/s per GPU | MFU | weak-scaling efficiency |", "|---|---|---|---|---|---|---|---|"]
  for name, n, mesh, batch, r, eff in rows:
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a"
    table.append(f"| {name} | {n} | {mesh} | {batch} | {r['tokens_per_sec']:,.0f} | "
                 f"{r['tokens_per_sec'] / n:,.0f} | {mfu} | "
                 f"{'' if eff is None else f'{100 * eff:.1f}%'} |")
  text = "\n".join(table)
  with open(os.path.join(args.out, "scaling.md"), "w") as f:
    f.write(text + "\n")
  print(text)
  sys.exit(0 if rows else 1)


if __name__ == "__main__":
  main()
