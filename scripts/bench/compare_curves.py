"""Whether two runs' loss curves differ by more than a noise reference does (issue #20's
numerics check: a change's 200-step curve against the previous default's, "within bf16 noise").

  python scripts/bench/compare_curves.py --pair now=WORKDIR_A,previous=WORKDIR_B \
      --noise previous=WORKDIR_B,float32=WORKDIR_C

Each WORKDIR is a ``scripts/train.py`` workdir (its ``metrics.jsonl``); the runs share config,
seed and data. Prints the training loss of every run at the steps all of them logged, then for
``--pair`` and for ``--noise`` the mean and largest absolute difference of those losses and the
difference of the last held-out loss. The pair is within noise when its mean difference and
its held-out difference are both at most the noise pair's. ``--noise`` is two runs that differ
only by rounding: the same code in float32 and in bfloat16, or twice in bfloat16 with different
kernels. Exit status 0 within noise, 1 not, 2 bad input.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from recurrentgemma_jax import train  # pylint: disable=g-import-not-at-top,wrong-import-position


def curves(workdir: str) -> tuple[dict[int, float], tuple[int, float] | None]:
  """``({step: training loss}, (step, held-out loss) of the last evaluation or None)``."""
  records = train.read_metrics(workdir)
  losses = {r["step"]: r["loss"] for r in records if "loss" in r}
  evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
  return losses, (max(evals) if evals else None)


def difference(a, b, steps) -> dict:
  """Mean and largest |a - b| over ``steps``, and the held-out difference."""
  gaps = [abs(a[0][s] - b[0][s]) for s in steps]
  held = abs(a[1][1] - b[1][1]) if a[1] and b[1] and a[1][0] == b[1][0] else None
  return {"mean": sum(gaps) / len(gaps), "max": max(gaps), "held_out": held}


def _pair(text: str) -> list[tuple[str, str]]:
  items = [item.split("=", 1) for item in text.split(",")]
  if len(items) != 2 or any(len(i) != 2 or not all(i) for i in items):
    raise argparse.ArgumentTypeError(f"{text!r} is not NAME=WORKDIR,NAME=WORKDIR")
  return [(name, path) for name, path in items]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--pair", type=_pair, required=True, help="NAME=WORKDIR,NAME=WORKDIR")
  parser.add_argument("--noise", type=_pair, required=True, help="NAME=WORKDIR,NAME=WORKDIR")
  args = parser.parse_args(argv)
  runs = dict(args.pair + args.noise)
  clash = [name for name, path in args.pair + args.noise if runs[name] != path]
  if clash:
    print(f"error: --pair/--noise: {clash[0]} names two workdirs", file=sys.stderr)
    return 2
  data = {}
  for name, path in runs.items():
    data[name] = curves(path)
    if not data[name][0]:
      print(f"error: --pair/--noise {name}={path}: no training losses in "
            f"{os.path.join(path, 'metrics.jsonl')}", file=sys.stderr)
      return 2
  steps = sorted(set.intersection(*(set(d[0]) for d in data.values())))
  if not steps:
    print("error: the runs logged no step in common", file=sys.stderr)
    return 2
  names = list(runs)
  print("| step | " + " | ".join(names) + " |")
  print("|---|" + "---|" * len(names))
  for s in steps:
    print(f"| {s} | " + " | ".join(f"{data[n][0][s]:.4f}" for n in names) + " |")
  held = [f"{n} {data[n][1][1]:.4f} (step {data[n][1][0]})" for n in names if data[n][1]]
  if held:
    print("held-out loss: " + ", ".join(held))
  results = {}
  for label, pair in (("pair", args.pair), ("noise", args.noise)):
    (a, _), (b, _) = pair
    results[label] = d = difference(data[a], data[b], steps)
    shown = "-" if d["held_out"] is None else f"{d['held_out']:.4f}"
    print(f"{label} {a} vs {b}: training loss |diff| mean {d['mean']:.4f}, max {d['max']:.4f} "
          f"over {len(steps)} steps; held-out |diff| {shown}")
  pair, noise = results["pair"], results["noise"]
  within = pair["mean"] <= noise["mean"] and (
      pair["held_out"] is None or noise["held_out"] is None
      or pair["held_out"] <= noise["held_out"])
  print(f"within noise: {'yes' if within else 'no'}")
  return 0 if within else 1


if __name__ == "__main__":
  sys.exit(main())
