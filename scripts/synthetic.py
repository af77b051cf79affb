"""The Griffin paper's synthetic tasks (section 6.2, Fig. 6): trains the MQA baseline, Hawk and
Griffin (5 blocks of width 64) on Selective Copying and Induction Heads, then measures answer
accuracy at the training length and beyond it.

  python scripts/synthetic.py --out DIR [--tasks selective_copying,induction_heads]
      [--models mqa,hawk,griffin] [--steps TASK=N,...] [--parallel N]
      [--lengths TASK=L1,L2,...] [--eval_rows 512] [--time_limit SECONDS] [--every_checkpoint]
      [--tiny]
      [--config.FIELD=VALUE ...]   (passed to every training run, e.g. --config.batch_size=16)

Each run is ``scripts/train.py --config configs/synthetic.py:TASK,MODEL`` (the model and its
recipe) in ``DIR/TASK/MODEL`` (its log in ``train.log`` there); rerunning resumes unfinished runs
and re-evaluates. ``--parallel`` runs that many trainings at once (the models are tiny; on a GPU
they share it); ``--time_limit`` stops the trainings still running after that many seconds
(SIGTERM: each saves its step and exits; rerun to continue); a training stopped by Ctrl-C has
saved its step too, and the script then exits 130. Then each latest checkpoint is evaluated on
``--eval_rows`` held-out rows per length (a run with none yet reads "-"). Writes (rewritten
after each evaluated run) ``DIR/synthetic.md`` (the table), ``DIR/synthetic.json``,
``DIR/learning.png`` (held-out answer accuracy against training step, Fig. 6(a)) and
``DIR/lengths.png`` (accuracy against evaluation length, Fig. 6(b)). ``--every_checkpoint`` also evaluates each kept checkpoint at
every length (how accuracy beyond the training length moves during training). For Induction
Heads the table also breaks the accuracy at the training length down by the distance between
the two markers and by the answer's symbol (which rows a partly learned model gets right).
``--tiny`` (a CPU check of the script): few steps, short rows.

  python scripts/synthetic.py --out DIR --merge DIR1,DIR2,...

draws the learning curves of earlier runs made apart (seeds, variants) in one ``DIR/learning.png``,
their accuracy by evaluation length in ``DIR/lengths.png`` (with, for runs evaluated
``--every_checkpoint``, the accuracy at the longest length by checkpoint), and writes
``DIR/merged.md``: the steps at which each first reached 50%, 90% and 99%.
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from recurrentgemma_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from recurrentgemma_jax.data.synthetic import TASKS  # pylint: disable=g-import-not-at-top,wrong-import-position

MODELS = ("mqa", "hawk", "griffin")  # configs/synthetic.py:TASK,MODEL holds each one
DEFAULT_LENGTHS = {"selective_copying": (1024, 2048, 4096),
                   "induction_heads": (256, 512, 1024, 2048, 4096)}


def _per_task(text, cast):
  """``"task=a,b;task2=c"`` (or ``task=N,task2=M`` for scalars) -> {task: value}."""
  out = {}
  for part in filter(None, text.replace(";", " ").split()):
    task, _, value = part.partition("=")
    if task not in TASKS:
      sys.exit(f"error: {task!r} is not one of {'|'.join(TASKS)}")
    out[task] = cast(value)
  return out


def config_spec(task, model):
  """The ``--config`` of one run: the task and model (with its recipe) in the config's argument."""
  return os.path.join(ROOT, "configs", "synthetic.py") + f":{task},{model}"


def train_overrides(task, args):
  over = []
  if task in args.steps:
    over.append(f"--config.total_steps={args.steps[task]}")
  if args.tiny:
    seq = 64 if task == "selective_copying" else 32
    over += [f"--config.seq_len={seq}", "--config.data.synthetic.num_tokens_to_copy=4",
             "--config.batch_size=8", "--config.eval_every=10", "--config.log_every=10",
             "--config.checkpoint_every=20", "--config.model.attention_window_size=16",
             f"--config.data.eval_tokens={8 * seq}"]
    if task not in args.steps:
      over.append("--config.total_steps=20")
  return over + list(args.config_overrides)  # the caller's --config.* last: they win


def train_all(runs, args):
  """Trains ``runs``, ``args.parallel`` at a time; returns ``(failed, interrupted)``: the
  (task, model) pairs whose training failed, and those stopped by a Ctrl-C (saved)."""
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  if args.parallel > 1:  # several processes on one GPU: share its memory
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  waiting, active, failed, interrupted = list(runs), [], [], []
  deadline = time.time() + args.time_limit if args.time_limit else None
  while waiting or active:
    if deadline and time.time() > deadline:
      for task, model, proc, _ in active:
        print(f"{task} / {model}: time limit, stopping (rerun to continue)", flush=True)
        proc.terminate()
      waiting.clear()
      deadline = None
    while waiting and len(active) < args.parallel:
      task, model, workdir = waiting.pop(0)
      os.makedirs(workdir, exist_ok=True)
      cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
             f"--config={config_spec(task, model)}", f"--workdir={workdir}",
             *train_overrides(task, args)]
      log = open(os.path.join(workdir, "train.log"), "a")
      active.append((task, model, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                   env=env, cwd=ROOT), time.time()))
      print(f"training {task} / {model} -> {workdir}", flush=True)
    time.sleep(2)
    for item in list(active):
      task, model, proc, start = item
      if proc.poll() is not None:
        active.remove(item)
        status = ("done" if proc.returncode == 0 else cli.INTERRUPTED_RUN
                  if proc.returncode == cli.INTERRUPTED else f"FAILED (exit {proc.returncode})")
        print(f"{task} / {model}: {status} in {time.time() - start:.0f} s", flush=True)
        if proc.returncode == cli.INTERRUPTED:  # its step is saved: evaluated as it stands
          interrupted.append((task, model))
        elif proc.returncode:
          failed.append((task, model))
  return failed, interrupted


def accuracy_at_lengths(task, model, workdir, lengths, args):
  """``({length: held-out answer accuracy}, breakdown)`` of the model saved in ``workdir`` (a
  training workdir: its latest checkpoint; or one step's checkpoint directory). ``breakdown``:
  for Induction Heads, ``induction_breakdown`` at the first length (else None)."""
  from recurrentgemma_jax import checkpoint, configlib, data, evaluation  # pylint: disable=g-import-not-at-top
  config = configlib.load(config_spec(task, model))
  configlib.override(config, train_overrides(task, args))
  net, _ = checkpoint.load_model(workdir)
  out, breakdown = {}, None
  for length in lengths:
    # Fewer rows per batch for long rows: global attention's T x T scores (XLA path, float32)
    # of 32 rows at 4096 tokens took 16 GiB and ran out of memory on a shared GPU.
    batch_rows = max(1, min(args.eval_rows, 32, 32 * 1024 // length))
    config.batch_size = batch_rows
    config.data.eval_tokens = args.eval_rows * length
    config.data.synthetic.eval_seq_len = length
    batches = data.make_eval_batches(config)
    if task == "induction_heads" and length == lengths[0]:
      out[length], breakdown = induction_breakdown(net, batches, config.data.synthetic.vocab_size)
    else:
      out[length] = evaluation.masked_accuracy(net, batches)
  return out, breakdown


@functools.lru_cache(maxsize=8)
def _last_token(graphdef):
  """The jitted argmax at each row's last position, of one model structure: one compile for
  all checkpoints of a run (as ``evaluation``'s eval step)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return jax.jit(lambda state, inputs, pos: jnp.argmax(
      nnx.merge(graphdef, state)(inputs, pos)[:, -1], axis=-1))


def induction_breakdown(net, batches, num_symbols, buckets=4):
  """Induction Heads: which held-out rows a partly learned model gets right. Returns the
  accuracy over ``batches`` and ``{"by_distance": [[lo, hi, rows, accuracy], ...],
  "by_answer": [[symbol, rows, accuracy, most often predicted], ...]}``: the accuracy by the
  distance from the first marker to the final one, in ``buckets`` equal ranges, and by the
  answer's symbol (``k`` for ``s{k}``), with the token most often predicted for it (its name in
  the task's vocabulary); None where no row has it."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax.data import synthetic as tasks  # pylint: disable=g-import-not-at-top
  graphdef, state = nnx.split(net)
  last_token = _last_token(graphdef)
  distances, hits, answers, guesses = [], [], [], []
  for batch in batches:
    real = batch["loss_mask"][:, -1] > 0  # the padding rows of the last batch score nothing
    length = batch["inputs"].shape[1]
    distances.append(length - 1 - np.argmax(batch["inputs"][real] == tasks.MARKER, axis=1))
    answers.append(batch["targets"][real, -1] - tasks.FIRST_SYMBOL)
    predicted = last_token(state, jnp.asarray(batch["inputs"]), jnp.asarray(batch["segment_pos"]))
    guesses.append(np.asarray(predicted)[real])
    hits.append(guesses[-1] == batch["targets"][real, -1])
  distances, hits, answers, guesses = map(np.concatenate, (distances, hits, answers, guesses))
  names = tasks.SyntheticVocab(num_symbols)
  most = lambda rows: names.decode([np.bincount(guesses[rows]).argmax()]) if rows.any() else None
  mean = lambda rows: float(hits[rows].mean()) if rows.any() else None  # None: no such row
  edges = np.linspace(1, length - 1, buckets + 1).round().astype(int)
  by_distance = [[int(lo), int(hi), int(((distances >= lo) & (distances <= hi)).sum()),
                  mean((distances >= lo) & (distances <= hi))]
                 for lo, hi in zip(edges[:-1] + 1, edges[1:])]
  by_answer = [[k, int((answers == k).sum()), mean(answers == k), most(answers == k)]
               for k in range(num_symbols)]
  return float(hits.mean()), {"by_distance": by_distance, "by_answer": by_answer}


def learning_curve(workdir):
  """``(last trained step, [(step, held-out answer accuracy), ...])``."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  last = max((r["step"] for r in records), default=0)
  return last, [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]


def write_report(out, results, steps_done, curves, lengths, args, failed, by_step, breakdown):
  """Writes the table (returned), the JSON and both plots; runs not evaluated yet read "-".
  ``by_step``: {(task, model): {step: {length: accuracy}}} of ``--every_checkpoint``;
  ``breakdown``: {(task, model): induction_breakdown(...)}."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  lines = []
  for task in args.tasks:
    lens = lengths[task]
    lines += [f"**{task}** (trained at length {lens[0]})", "",
              "| model | steps | " + " | ".join(f"L={n}" for n in lens) + " |",
              "|---|---|" + "---|" * len(lens)]
    for model in args.models:
      acc = results.get((task, model))
      steps = steps_done.get((task, model), "-")
      cells = ([f"{acc[n]:.3f}" for n in lens] if acc else
               ["failed" if (task, model) in failed else "-"] * len(lens))
      lines.append(f"| {model} | {steps} | " + " | ".join(cells) + " |")
    lines.append("")
  for (task, model), parts in breakdown.items():
    near, symbols = parts["by_distance"], parts["by_answer"]
    lines += [f"**{task} / {model}, accuracy at L={lengths[task][0]} by the distance between "
              "the markers, and by the answer's symbol** (rows in brackets; last line: the "
              "token most often predicted)", "",
              "| " + " | ".join(f"{lo}-{hi}" for lo, hi, _, _ in near) + " |",
              "|" + "---|" * len(near),
              "| " + " | ".join("-" if acc is None else f"{acc:.3f} ({n})"
                                for _, _, n, acc in near) + " |", "",
              "| " + " | ".join(f"s{k}" for k, _, _, _ in symbols) + " |",
              "|" + "---|" * len(symbols),
              "| " + " | ".join("-" if acc is None else f"{acc:.2f} ({n})"
                                for _, n, acc, _ in symbols) + " |",
              "| " + " | ".join("-" if guess is None else guess
                                for _, _, _, guess in symbols) + " |", ""]
  for (task, model), steps in by_step.items():
    lens = lengths[task]
    lines += [f"**{task} / {model}, every kept checkpoint**", "",
              "| step | " + " | ".join(f"L={n}" for n in lens) + " |",
              "|---|" + "---|" * len(lens)]
    lines += [f"| {step} | " + " | ".join(f"{acc[n]:.3f}" for n in lens) + " |"
              for step, acc in steps.items()]
    lines.append("")
  table = "\n".join(lines)
  with open(os.path.join(out, "synthetic.md"), "w") as f:
    f.write(table)
  with open(os.path.join(out, "synthetic.json"), "w") as f:
    json.dump({f"{t}/{m}": {"accuracy": {str(k): v for k, v in acc.items()},
                            "curve": curves.get((t, m), []),
                            **breakdown.get((t, m), {}),
                            **({"by_step": {str(s): {str(k): v for k, v in a.items()}
                                            for s, a in by_step[(t, m)].items()}}
                               if (t, m) in by_step else {})}
               for (t, m), acc in results.items()}, f, indent=1)

  fig, axes = plt.subplots(1, len(args.tasks), figsize=(5 * len(args.tasks), 3.5), squeeze=False)
  for ax, task in zip(axes[0], args.tasks):
    for model in args.models:
      curve = curves.get((task, model))
      if curve:
        ax.plot(*zip(*curve), marker=".", label=model)
    ax.set(title=task, xlabel="training step", ylabel="held-out answer accuracy", ylim=(0, 1.02))
    ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "learning.png"), dpi=120)

  fig, axes = plt.subplots(1, len(args.tasks), figsize=(5 * len(args.tasks), 3.5), squeeze=False)
  for ax, task in zip(axes[0], args.tasks):
    for model in args.models:
      acc = results.get((task, model))
      if acc:
        ax.plot(list(acc), list(acc.values()), marker="o", label=model)
    ax.axvline(lengths[task][0], color="grey", linestyle=":", label="train length")
    ax.set(title=task, xlabel="evaluation length", ylabel="answer accuracy", xscale="log",
           ylim=(0, 1.02))
    ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "lengths.png"), dpi=120)
  plt.close("all")
  return table


def merge_reports(dirs: list[str], out: str) -> str:
  """One learning-curve plot per task and a table of the steps at which each run first reached
  50%, 90% and 99% held-out accuracy, from the ``synthetic.json`` of each directory in
  ``dirs`` (labelled ``DIR: model``). Returns the table."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  runs = []
  for d in dirs:
    path = os.path.join(d, "synthetic.json")
    if not os.path.exists(path):
      sys.exit(f"error: --merge: {path} does not exist (run scripts/synthetic.py --out {d} first)")
    with open(path) as f:
      for key, value in json.load(f).items():
        task, model = key.split("/")
        runs.append((task, f"{os.path.basename(os.path.normpath(d))}: {model}", value))
  lines = ["| task | run | steps | first at 50% / 90% / 99% | accuracy by length |",
           "|---|---|---|---|---|"]
  for task, label, value in runs:
    curve = value["curve"]
    first = [next((s for s, a in curve if a >= t), None) for t in (0.5, 0.9, 0.99)]
    lines.append(f"| {task} | {label} | {curve[-1][0] if curve else '-'} | "
                 + " / ".join("-" if s is None else str(s) for s in first) + " | "
                 + ", ".join(f"{n}: {a:.3f}" for n, a in value["accuracy"].items()) + " |")
  tasks = sorted({t for t, _, _ in runs})
  os.makedirs(out, exist_ok=True)
  fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
  for ax, task in zip(axes[0], tasks):
    for t, label, value in runs:
      if t == task and value["curve"]:
        ax.plot(*zip(*value["curve"]), marker=".", markersize=3, label=label)
    ax.set(title=task, xlabel="training step", ylabel="held-out answer accuracy", ylim=(0, 1.02))
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "learning.png"), dpi=120)
  plt.close(fig)
  # Accuracy against evaluation length (Fig. 6(b)), and where checkpoints were evaluated
  # (--every_checkpoint), accuracy at the longest length against training step.
  tracked = [(t, label, value) for t, label, value in runs if value.get("by_step")]
  panels = len(tasks) + (1 if tracked else 0)
  fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
  for ax, task in zip(axes[0], tasks):
    ticks = set()
    for t, label, value in runs:
      if t == task and value["accuracy"]:
        lens = [int(n) for n in value["accuracy"]]
        ticks.update(lens)
        ax.plot(lens, list(value["accuracy"].values()), marker="o", markersize=3, label=label)
    ax.set(title=task, xlabel="evaluation length", ylabel="answer accuracy", xscale="log",
           ylim=(0, 1.02))
    ax.set_xticks(sorted(ticks), [str(n) for n in sorted(ticks)])
    ax.minorticks_off()
    ax.legend(fontsize=7)
  if tracked:
    ax = axes[0][-1]
    for t, label, value in tracked:
      steps = [int(s) for s in value["by_step"]]
      longest = [acc[max(acc, key=int)] for acc in value["by_step"].values()]
      length = max((int(n) for acc in value["by_step"].values() for n in acc), default=0)
      name = f"{label} (L={length})" if len(tasks) == 1 else f"{t}, {label} (L={length})"
      ax.plot(steps, longest, marker=".", markersize=4, label=name)
    ax.set(title="accuracy at the longest length, by checkpoint", xlabel="training step",
           ylabel="answer accuracy", ylim=(0, 1.02))
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "lengths.png"), dpi=120)
  plt.close(fig)
  table = "\n".join(lines) + "\n"
  with open(os.path.join(out, "merged.md"), "w") as f:
    f.write(table)
  return table


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--tasks", default=",".join(TASKS))
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--steps", default="", help="TASK=N,... (default: the config's)")
  parser.add_argument("--lengths", default="", help="TASK=L1,L2,...;TASK2=... (first: train)")
  parser.add_argument("--parallel", type=int, default=1, help="trainings run at once")
  parser.add_argument("--eval_rows", type=int, default=512)
  parser.add_argument("--time_limit", type=float, default=0,
                      help="seconds after which running trainings are stopped (0: none)")
  parser.add_argument("--skip_training", action="store_true", help="only evaluate and report")
  parser.add_argument("--every_checkpoint", action="store_true",
                      help="also evaluate every kept checkpoint at every length (accuracy "
                           "beyond the training length over training; keep them with "
                           "--config.keep_checkpoints=N)")
  parser.add_argument("--tiny", action="store_true", help="a quick CPU check of the script")
  parser.add_argument("--merge", default="",
                      help="DIR,DIR,...: no training; the learning curves of these earlier "
                           "--out directories (seeds or variants run apart) in one plot and "
                           "table, written to --out")
  args, rest = parser.parse_known_args()
  if args.merge:
    print(merge_reports([d for d in args.merge.split(",") if d], args.out))
    return
  args.config_overrides, unknown = cli.split_config_flags(rest)
  if unknown:
    sys.exit(f"error: unknown argument {unknown[0]!r}; training fields are given as "
             "--config.FIELD=VALUE")
  args.tasks = [t for t in args.tasks.split(",") if t]
  args.models = [m for m in args.models.split(",") if m]
  for name, allowed in (("--tasks", TASKS), ("--models", MODELS)):
    bad = [x for x in getattr(args, name[2:]) if x not in allowed]
    if bad:
      sys.exit(f"error: {name} has {bad[0]!r}; allowed: {'|'.join(allowed)}")
  args.steps = _per_task(args.steps.replace(",", " "), int)
  lengths = {t: DEFAULT_LENGTHS[t] if not args.tiny else
             ((64, 128) if t == "selective_copying" else (32, 64, 128)) for t in TASKS}
  lengths.update(_per_task(args.lengths, lambda v: tuple(int(x) for x in v.split(","))))

  runs = [(t, m, os.path.join(args.out, t, m)) for t in args.tasks for m in args.models]
  from recurrentgemma_jax import checkpoint  # pylint: disable=g-import-not-at-top
  failed, interrupted = ([], []) if args.skip_training else train_all(runs, args)
  results, steps_done, curves, by_step, breakdown = {}, {}, {}, {}, {}
  report = lambda: write_report(args.out, results, steps_done, curves, lengths, args, failed,
                                by_step, breakdown)
  # Rewritten after every evaluated run, so that a run cut short keeps what it has measured.
  table = report()
  for task, model, workdir in runs:
    if (task, model) in failed:
      continue
    if not checkpoint.committed_steps(os.path.join(workdir, "checkpoints")):
      print(f"{task} / {model}: no checkpoint yet in {workdir} (rerun without --skip_training "
            "to train it)" if args.skip_training else
            f"{task} / {model}: stopped before its first checkpoint (rerun to continue)",
            flush=True)
      continue
    steps_done[(task, model)], curves[(task, model)] = learning_curve(workdir)
    results[(task, model)], parts = accuracy_at_lengths(task, model, workdir, lengths[task], args)
    if parts:
      breakdown[(task, model)] = parts
    print(f"{task} / {model}: " + ", ".join(f"L={n} {a:.3f}"
                                             for n, a in results[(task, model)].items()),
          flush=True)
    if args.every_checkpoint:
      table = report()  # the latest checkpoint's figures, before the slower pass over all
      ckpt_dir = os.path.join(workdir, "checkpoints")
      latest = checkpoint.resolve_model_dir(workdir)  # measured above
      by_step[(task, model)] = {
          step: (results[(task, model)] if os.path.join(ckpt_dir, str(step)) == latest else
                 accuracy_at_lengths(task, model, os.path.join(ckpt_dir, str(step)),
                                     lengths[task], args)[0])
          for step in reversed(checkpoint.committed_steps(ckpt_dir))}
    table = report()
  print(table)
  sys.exit(1 if failed else cli.INTERRUPTED if interrupted else 0)


if __name__ == "__main__":
  cli.run_trainings(main)
