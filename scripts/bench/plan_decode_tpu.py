"""Decoding on one TPU chip, planned without a TPU: the largest batch whose sampling program fits
the chip, per family, and the throughput its roofline allows (the Griffin paper's Fig. 1(b)
setting: one TPU v5e, 16 GB).

  python scripts/bench/plan_decode_tpu.py --topology v5e-1 [--size 1.3b]
      [--families mqa,hawk,griffin] [--vocab_size 256000] [--new_tokens 4096]
      [--min_batch 16] [--max_batch 8192] [--hbm_gib X] [--json OUT.json] [--tiny]

For each family, ``sampling.sample`` (the prefill of a one-token prompt per row and the greedy
decoding loop, as ``bench_decode.py``'s throughput rows) is compiled for the chip through
libtpu's compile-only devices (``aot.compile_sampling``: abstract bfloat16 weights, nothing
allocated, no TPU needed) at batches doubling from ``--min_batch``, until one does not fit the
chip's HBM (the compiled program's arguments, outputs and temporaries, XLA's memory analysis;
or the compiler refuses it) or ``--max_batch``. The largest batch that fits gets its roofline,
``bench_decode.decode_floor`` at the chip's peak FLOP/s and published HBM bandwidth (per step,
every weight once and each row's filled KV cache or recurrent state, or the step's FLOPs,
whichever takes longer): an upper bound on its tokens/s, since nothing here ran on a TPU.
``--hbm_gib`` judges against less HBM than the chip's. ``--tiny``: small models of each family,
for a CPU check of the script.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--topology", default="v5e-1", help="a one-chip slice: v5e-1 or v6e-1")
  parser.add_argument("--size", default="1.3b")
  parser.add_argument("--families", default="mqa,hawk,griffin")
  parser.add_argument("--vocab_size", type=int, default=256_000)
  parser.add_argument("--new_tokens", type=int, default=4096)
  parser.add_argument("--min_batch", type=int, default=16)
  parser.add_argument("--max_batch", type=int, default=8192)
  parser.add_argument("--hbm_gib", type=float, default=0,
                      help="judge against this many GiB instead of the chip's HBM")
  parser.add_argument("--json", default="", help="write the rows here")
  parser.add_argument("--tiny", action="store_true", help="tiny models, for a CPU check")
  args = parser.parse_args()
  if args.new_tokens < 1 or args.min_batch < 1 or args.max_batch < args.min_batch:
    parser.error("--new_tokens and --min_batch must be at least 1, --max_batch at least "
                 "--min_batch")

  from recurrentgemma_jax import aot  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  import bench_decode  # pylint: disable=g-import-not-at-top

  try:
    tpu = aot.parse_slice(args.topology)
    families = args.families.split(",")
    configs = {f: bench_decode.model_config(f, args.size, args.vocab_size, args.tiny)
               for f in families}
  except (ConfigError, KeyError) as e:
    parser.error(str(e).strip("'\""))
  if tpu.chips != 1:
    parser.error(f"--topology {args.topology}: one chip (v5e-1 or v6e-1); a larger slice "
                 "serves one model copy per chip, each with this plan")
  try:
    device = tpu.devices()[0]
  except aot.CompileError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(3)
  chip = tpu.chip
  limit = int(args.hbm_gib * aot.GIB) if args.hbm_gib else chip.hbm_bytes
  print(f"{tpu.name} ({device.device_kind}): {aot.human_bytes(limit)} HBM, "
        f"{chip.peak_flops / 1e12:.0f} TFLOP/s, {chip.hbm_bandwidth / 1e9:.0f} GB/s; "
        f"{args.size}, {args.new_tokens} new tokens a row", flush=True)

  rows = []
  for family in families:
    cfg = configs[family]
    best, over, batch = None, None, args.min_batch
    while batch <= args.max_batch:
      program = aot.compile_sampling(cfg, device, batch, args.new_tokens)
      if program.compiled is None and not program.out_of_memory:
        print(f"error: {family} at batch {batch} did not compile: {program.error}",
              file=sys.stderr)
        sys.exit(3)
      need = aot.human_bytes(program.memory.total) if program.memory.total else "more"
      print(f"{family} batch {batch}: {need} ({program.compile_s:.0f} s to compile)", flush=True)
      if not program.fits(limit):
        over = dict(batch=batch, hbm_bytes=program.memory.total or None)
        break
      best, batch = (batch, program), 2 * batch
    row = dict(family=family, parameters=None, batch=None, hbm_bytes=None, next=over)
    if best is not None:
      rows_fitting, program = best
      parameters = model_lib.count_params(cfg)
      floor = bench_decode.decode_floor(cfg, parameters, rows_fitting, 1, args.new_tokens,
                                        chip.peak_flops, chip.hbm_bandwidth)
      row.update(parameters=parameters, batch=rows_fitting, hbm_bytes=program.memory.total,
                 memory=program.memory.as_dict(),
                 tokens_per_s=rows_fitting * args.new_tokens / floor["floor_s"],
                 bound=floor["bound"], flops_per_step=floor["flops_per_step"],
                 bytes_per_step=floor["bytes_per_step"])
    rows.append(row)

  base = next((r for r in rows if r["family"] == "mqa" and r["batch"]), None)
  lines = [f"{tpu.name}, {aot.human_bytes(limit)}: {args.size}, {args.new_tokens} new tokens",
           "| family | largest batch | its HBM: weights, temporaries, total | next batch | "
           "roofline tokens/s (bound) | x MQA |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    nxt = r["next"]
    nxt_text = ("-" if nxt is None else f"{nxt['batch']}: "
                + (aot.human_bytes(nxt["hbm_bytes"]) if nxt["hbm_bytes"] else "refused"))
    if r["batch"] is None:
      lines.append(f"| {r['family']} | none fits | | {nxt_text} | | |")
      continue
    m = r["memory"]
    ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
    lines.append(
        f"| {r['family']} | {r['batch']} | {aot.human_bytes(m['arguments'])}, "
        f"{aot.human_bytes(m['temporaries'])}, {aot.human_bytes(r['hbm_bytes'])} | {nxt_text} | "
        f"{r['tokens_per_s']:,.0f} ({r['bound']}) | {ratio} |")
  print("\n".join(lines))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"topology": tpu.name, "device_kind": device.device_kind, "hbm_limit": limit,
                 "size": args.size, "new_tokens": args.new_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
