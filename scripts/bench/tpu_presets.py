"""The table of docs/tpu.md: the presets users pick first, compiled for Cloud TPU slices on
this machine by scripts/compile_tpu.py (one process per row), one markdown row each.

  python scripts/bench/tpu_presets.py --out runs/tpu_presets [--rows 0,3,5] [--table]
      [--doc docs/tpu.md]

Each row's --json report goes to OUT/ROW.json with the wall time and exit status beside it
(OUT/ROW.status.json); rows already there are not compiled again, so a long run can be stopped
and restarted, or run in pieces. --table prints the markdown table of what OUT holds.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (name, config, topology, overrides). 256 rows per step (1 per chip on the 256-chip slices,
# 4 per chip on v5p-128's 64 chips); 64 rows at T=8192. ZeRO 1 up to 2B parameters, ZeRO 3
# above (7B and 9B in float32 parameters need more than a 16 or 32 GiB chip replicated); the
# presets' own remat (block). Row 20 is meant not to fit (exit 1).
# Vocabularies: Griffin and RecurrentGemma 256k (the Gemma tokenizer's), GLA 32k (the GLA
# paper's Llama tokenizer).
T2K = ["--config.seq_len=2048", "--config.batch_size=256", "--config.model.vocab_size=256000"]
T8K = ["--config.seq_len=8192", "--config.batch_size=64", "--config.model.vocab_size=256000"]
GLA = ["--config.model.vocab_size=32000"]
ROWS = []
for _topology in ("v5e-256", "v5p-128", "v6e-256"):
  _big_zero = "--config.zero=1" if _topology == "v5p-128" else "--config.zero=3"
  ROWS += [
      ("griffin 400m", "configs/griffin.py:400m", _topology, T2K + ["--config.zero=1"]),
      ("griffin 1.3b", "configs/griffin.py:1.3b", _topology, T2K + ["--config.zero=1"]),
      ("griffin 7b", "configs/griffin.py:7b", _topology, T2K + [_big_zero]),
      ("recurrentgemma 2b", "configs/recurrentgemma.py:2b", _topology, T2K + ["--config.zero=1"]),
      ("recurrentgemma 9b", "configs/recurrentgemma.py:9b", _topology, T2K + ["--config.zero=3"]),
      ("gla 1.3b", "configs/gla.py:1.3b", _topology, T2K + GLA + ["--config.zero=1"]),
  ]
ROWS += [
    ("griffin 1.3b", "configs/griffin.py:1.3b", "v5p-128", T8K + ["--config.zero=1"]),
    ("recurrentgemma 2b", "configs/recurrentgemma.py:2b", "v5p-128", T8K + ["--config.zero=1"]),
    ("griffin 7b", "configs/griffin.py:7b", "v5e-256", T2K + ["--config.zero=1"]),
    # (row 3 did not fit: its parameters, gradients and 256k embedding replicated)
    ("recurrentgemma 2b", "configs/recurrentgemma.py:2b", "v5e-256", T2K + ["--config.zero=3"]),
]


def run_row(index: int, out: str) -> None:
  name, config, topology, overrides = ROWS[index]
  report = os.path.join(out, f"{index}.json")
  command = [sys.executable, os.path.join(ROOT, "scripts", "compile_tpu.py"),
             "--topology", topology, "--config", config, *overrides, "--json", report]
  print(f"[{index}] {name} on {topology}: {' '.join(command[1:])}", flush=True)
  started = time.time()
  proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
  wall = time.time() - started
  print(proc.stdout + proc.stderr, flush=True)
  with open(os.path.join(out, f"{index}.status.json"), "w") as f:
    json.dump({"exit": proc.returncode, "wall_s": wall, "command": command[1:],
               "stderr": proc.stderr.strip().splitlines()[-1:]}, f)


def gib(n) -> str:
  return f"{n / 2**30:.2f}"


def table(out: str) -> str:
  lines = ["| # | preset | slice | T x rows | mesh | ZeRO | remat | micro-batch | GiB per chip "
           "(train / eval) | HBM | fits (exit) | Mosaic kernels | roofline tok/s/chip | MFU "
           "bound | compile wall time |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for index, (name, _, topology, _) in enumerate(ROWS):
    status_file = os.path.join(out, f"{index}.status.json")
    if not os.path.exists(status_file):
      continue
    with open(status_file) as f:
      status = json.load(f)
    # A compile that stopped before its report (a bad config: exit 2; an error: 3) has none.
    report = os.path.join(out, f"{index}.json")
    r = {}
    if os.path.exists(report):
      with open(report) as f:
        r = json.load(f)
    wall = f"{status['wall_s'] / 60:.1f} min"
    if "mesh" not in r:
      verdict = "no" if r else "failed"
      lines.append(f"| {index} | {name} | {topology} | | | | | | | | {verdict} "
                   f"({status['exit']}) | | | | {wall} |")
      continue
    rows = r["tokens_per_step"] // r["seq_len"]
    memory = gib(r["bytes"]["total"]) if r["bytes"]["total"] else "-"
    if r.get("eval_bytes") and r["eval_bytes"]["total"]:
      memory += f" / {gib(r['eval_bytes']['total'])}"
    if not r["fits"] and status["exit"] == 1:
      memory = status["stderr"][0].split("needs ")[-1].split(" per chip")[0] + " needed"
    roof = r.get("roofline") or {}
    lines.append(
        f"| {index} | {name} | {topology} | {r['seq_len']} x {rows} | "
        f"{r['mesh']['data']} x {r['mesh']['model']} | {r['zero']} | {r['remat']} | "
        f"{r['micro_batch']} x {r['grad_accum_steps']} | {memory} | "
        f"{gib(r['hbm_per_chip_bytes'])} | {'yes' if r['fits'] else 'no'} ({status['exit']}) | "
        f"{r['mosaic_kernels'] if r['mosaic_kernels'] is not None else '-'} | "
        + (f"{roof['tokens_per_sec_per_chip']:,.0f} ({roof['bound']}) | {roof['mfu']:.1%} | "
           if roof and r["fits"] else "- | - | ")
        + f"{wall} |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--rows", default="", help="comma-separated row numbers (default: all)")
  parser.add_argument("--table", action="store_true", help="print the table of OUT and stop")
  parser.add_argument("--doc", default="", help="also write the table into this markdown file, "
                      "between its <!-- PRESETS_TABLE --> and <!-- /PRESETS_TABLE --> lines")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  if not args.table:
    rows = [int(i) for i in args.rows.split(",")] if args.rows else range(len(ROWS))
    for index in rows:
      if not os.path.exists(os.path.join(args.out, f"{index}.status.json")):
        run_row(index, args.out)
  text = table(args.out)
  print(text)
  if args.doc:
    with open(args.doc) as f:
      doc = f.read()
    start, end = "<!-- PRESETS_TABLE -->\n", "<!-- /PRESETS_TABLE -->"
    before, rest = doc.split(start)
    with open(args.doc, "w") as f:
      f.write(before + start + text + "\n" + end + rest.split(end, 1)[1])


if __name__ == "__main__":
  main()
