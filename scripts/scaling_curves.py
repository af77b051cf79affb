"""The Griffin paper's scaling curves (Fig. 1(a); issue #18's "Fig. 2"), scaled down to one GPU:
held-out loss against training FLOPs for the MQA Transformer, Hawk, Griffin and GLA at a few
compute budgets, trained on the Python source of the packages installed where it runs.

  python scripts/scaling_curves.py --out DIR [--budgets 1e15,3e15,1e16]
      [--families mqa,hawk,griffin,gla] [--seeds 0] [--learning_rates 3e-3]
      [--time_limit SECONDS] [--parallel N] [--skip_training]
      [--source_dirs DIR,...] [--held_out 0.02] [--max_file_kb 1024] [--corpus_max_mb 0]
      [--piece_chars 2048]
      [--config.FIELD=VALUE ...]   (passed to every training run, after the script's own)

1. The corpus, ``DIR/corpus``: every ``*.py`` file under ``--source_dirs`` (default: this
   Python's site-packages folders; a file reached twice, by its real path or by its path in an
   earlier folder, counts once) that is not empty, at most ``--max_file_kb``, valid UTF-8 and
   not byte for byte a file taken before it (vendored copies: one of them could be held out).
   Whole files are held out by a hash of their relative path, and taken in the order of
   another hash of it until ``--corpus_max_mb`` (0: all). Each file is cut at line ends into
   documents of at most ``--piece_chars`` characters (a batch then draws on dozens of files,
   not one or two).
   Written: ``train.jsonl`` and ``heldout.jsonl`` (records ``text``, ``path``), ``files.tsv``
   (path, bytes, sha256, split; sorted by path) and ``manifest.json`` (its sha256, the files
   and bytes of each split, the options, Python and the installed distributions). A corpus
   already there is kept when a rebuild gives the same ``manifest["corpus"]`` and refused
   (exit 1) when not: the runs in DIR were trained on it.
2. The runs: one model table for every family (depth 6, head size 64, RNN width 4/3 of the
   width, MLP expansion 3); each budget takes the width whose Chinchilla-optimal compute (20
   training tokens per Griffin parameter) is nearest, and each family trains for the budget
   divided by its training FLOPs per token (``recurrentgemma_jax/flops.py``). Each run is
   ``scripts/train.py`` in ``DIR/runs/FAMILY_BUDGET`` (``_lrRATE`` added for each of
   ``--learning_rates`` but the recipe's, ``_sSEED`` for each of ``--seeds`` but 0; the seed
   sets the initialisation and the data order; log: ``train.log`` there); a finished run is
   skipped, an unfinished one resumes from its checkpoint; ``--parallel N`` trains N at once.
   ``--time_limit``: no run starts after that many seconds and those running get SIGTERM (each
   saves its step; rerun to continue).
3. The report: ``DIR/scaling_curves.md`` (the table), ``DIR/scaling_curves.json`` and
   ``DIR/scaling_curves.png`` (held-out loss against training FLOPs); the table, the order of
   the families at each budget and whether each family's loss falls with compute are printed.
   With several seeds these compare each family's mean over its seeds, and give the range;
   with several learning rates, each family at each budget is compared at its best rate (the
   lowest mean), after a table of every rate's mean.
   Then each family's held-out loss at a quarter, half and three quarters of its runs and at
   their end (where Griffin's gap to MQA opens and closes).

docs/scaling_curves.md gives the recipe and how it was scaled down from the paper's.
"""

import argparse
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import shutil
import site
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# This process only counts parameters and FLOPs from shapes; the accelerator is the runs'.
CHILD_ENV = dict(os.environ, PYTHONUNBUFFERED="1")
os.environ["JAX_PLATFORMS"] = "cpu"

# pylint: disable=g-import-not-at-top,wrong-import-position
from recurrentgemma_jax import checkpoint, cli, configlib, data, flops
from recurrentgemma_jax import model as model_lib
from recurrentgemma_jax import train as train_lib
# pylint: enable=g-import-not-at-top,wrong-import-position

BASE_CONFIG = os.path.join(ROOT, "configs", "default.py")
FAMILIES = ("mqa", "hawk", "griffin", "gla")
BUDGETS = (1e15, 3e15, 1e16)
FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # of a run, where the report gives its held-out loss
# The model table (Table 2 of the paper, scaled down): the paper's 100M-400M models keep depth 12
# and grow the width, with heads of 128, D_RNN about 4/3 D and 16 gate blocks.
DEPTH = 6  # a multiple of 3: Griffin's blocks are (R, R, A) twice
HEAD_DIM = 64
WIDTHS = tuple(range(128, 1025, 64))
TOKENS_PER_PARAM = 20  # Chinchilla, as the paper's Table 2 (1.9B tokens at 100M, 300B at 14B)
# The recipe, the same for every family and budget (but the rates of --learning_rates);
# docs/scaling_curves.md says what changed from the paper's.
RECIPE = {
    "seq_len": 512,
    "batch_size": 64,
    # --learning_rates tries others; 3e-3 beat 1e-3 for every family at every budget tried
    # on an H200 (2026-11-29, docs/scaling_curves.md); 1e-3 was the rate until then.
    "optimizer.learning_rate": 3e-3,
    "optimizer.schedule": "cosine",
    "optimizer.final_lr_fraction": 0.1,
    "optimizer.b2": 0.95,
    "optimizer.weight_decay": 0.1,
    "optimizer.grad_clip_norm": 1.0,
    "model.dtype": "bfloat16",
    "model.param_dtype": "float32",
    "model.remat": "none",
    "model.num_gate_blocks": 16,
    "model.attention_window_size": 256,  # the paper's 1024 at 2048 tokens, scaled with seq_len
    "model.embeddings_scale_by_sqrt_dim": False,
    "model.logits_soft_cap": 0.0,
    "data.source": "jsonl",
    "data.tokenizer": "byte",
    "data.eval_tokens": 2**20,
    "keep_checkpoints": 2,
}
WARMUP_FRACTION = 0.05
# Stable: after warm-up, the mean of SMOOTH consecutive logged training losses never exceeds
# SPIKE_LIMIT x the lowest such mean before it. (One step's loss depends on the few files its
# rows come from; the mean of 5 does much less: docs/scaling_curves.md.)
SPIKE_LIMIT = 1.5
SMOOTH = 5
SPLITS = ("train", "heldout")


# --- the corpus ----------------------------------------------------------------------------------


def default_source_dirs() -> list[str]:
  dirs = site.getsitepackages() + [site.getusersitepackages()]
  return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _sha256(data_bytes: bytes) -> str:
  return hashlib.sha256(data_bytes).hexdigest()


def path_hash(purpose: str, path: str) -> float:
  """A number in [0, 1) from the sha256 of ``purpose:path``: one for the held-out split, one
  for the order files are taken in (independent of each other)."""
  return int(_sha256(f"{purpose}:{path}".encode())[:16], 16) / 2**64


def list_sources(source_dirs: list[str]) -> list[tuple[str, str]]:
  """``(relative path, path)`` of every ``*.py`` file under ``source_dirs``, each real path and
  each relative path once (the first folder that has it, as Python's import would)."""
  seen, files = set(), []
  for root in source_dirs:
    for folder, subfolders, names in os.walk(root):
      subfolders[:] = sorted(s for s in subfolders if s != "__pycache__")
      for name in sorted(n for n in names if n.endswith(".py")):
        path = os.path.join(folder, name)
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        real = os.path.realpath(path)
        if real not in seen and rel not in seen and os.path.isfile(real):
          seen.update((real, rel))
          files.append((rel, path))
  return files


def pieces(text: str, size: int) -> list[str]:
  """``text`` cut at line ends into pieces of at most ``size`` characters (a longer line is cut
  where it reaches ``size``; 0: one piece)."""
  out, start = [], 0
  while start < len(text):
    end = start + size if size else len(text)
    if end < len(text):
      newline = text.rfind("\n", start, end)
      end = newline + 1 if newline >= start else end
    out.append(text[start:end])
    start = end
  return out


def build_corpus(out: str, args) -> dict:
  """Writes the corpus into ``out/corpus`` (see the module docstring); returns its manifest."""
  final, tmp = os.path.join(out, "corpus"), os.path.join(out, "corpus.tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  max_bytes = args.corpus_max_mb * 2**20 if args.corpus_max_mb else math.inf
  splits = {s: {"files": 0, "bytes": 0} for s in SPLITS}
  skipped = {"larger than max_file_kb": 0, "empty": 0, "not UTF-8": 0, "unreadable": 0,
             "identical to an earlier file": 0}
  listing, total, contents = [], 0, set()
  sources = sorted(list_sources(args.source_dirs), key=lambda f: path_hash("order", f[0]))
  writers = {s: open(os.path.join(tmp, f"{s}.jsonl"), "w", encoding="utf-8") for s in SPLITS}
  with writers["train"], writers["heldout"]:
    for rel, path in sources:
      try:
        if os.path.getsize(path) > args.max_file_kb * 1024:
          skipped["larger than max_file_kb"] += 1
          continue
        with open(path, "rb") as f:
          raw = f.read()
      except OSError:
        skipped["unreadable"] += 1
        continue
      try:
        text = raw.decode("utf-8")
      except UnicodeDecodeError:
        skipped["not UTF-8"] += 1
        continue
      if not text.strip():
        skipped["empty"] += 1
        continue
      digest = _sha256(raw)
      if digest in contents:  # a vendored or copied file: once, or a copy may be held out
        skipped["identical to an earlier file"] += 1
        continue
      if total + len(raw) > max_bytes:
        break
      contents.add(digest)
      total += len(raw)
      split = "heldout" if path_hash("held-out", rel) < args.held_out else "train"
      for piece in pieces(text, args.piece_chars):
        writers[split].write(json.dumps({"text": piece, "path": rel}, ensure_ascii=False) + "\n")
      splits[split]["files"] += 1
      splits[split]["bytes"] += len(raw)
      listing.append(f"{rel}\t{len(raw)}\t{digest}\t{split}\n")
  empty = [s for s in SPLITS if not splits[s]["files"]]
  if empty:
    shutil.rmtree(tmp)
    sys.exit(f"error: the corpus would have no {empty[0]} file; add files or change --held_out")
  table = "".join(sorted(listing)).encode()
  with open(os.path.join(tmp, "files.tsv"), "wb") as f:
    f.write(table)
  manifest = {
      "corpus": {"files_tsv_sha256": _sha256(table), "splits": splits, "skipped": skipped,
                 "held_out": args.held_out, "max_file_kb": args.max_file_kb,
                 "corpus_max_mb": args.corpus_max_mb, "piece_chars": args.piece_chars},
      "python": sys.version, "platform": platform.platform(), "source_dirs": args.source_dirs,
      "distributions": sorted(
          f"{d.metadata['Name']}=={d.version}"
          for d in importlib.metadata.distributions(path=args.source_dirs) if d.metadata["Name"]),
  }
  with open(os.path.join(tmp, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1)
  return _keep_or_replace(final, tmp, manifest)


def _keep_or_replace(final: str, tmp: str, manifest: dict) -> dict:
  path = os.path.join(final, "manifest.json")
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    shutil.rmtree(tmp)
    new, old_corpus = manifest["corpus"], old.get("corpus", {})
    differ = [k for k in sorted(set(new) | set(old_corpus)) if new.get(k) != old_corpus.get(k)]
    if differ:
      sys.exit(f"error: the corpus built now differs from the one in {final} in "
               f"{', '.join(differ)} (see its manifest.json); the runs there were trained on "
               "it. Use another --out, or remove that folder to train on the new corpus")
    return old
  shutil.rmtree(final, ignore_errors=True)
  os.replace(tmp, final)
  return manifest


# --- the runs ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
  family: str
  budget: float
  workdir: str
  flags: list[str]  # --config.FIELD=VALUE for scripts/train.py
  config: object  # the ConfigDict those flags give
  params: int
  flops_per_token: float

  @property
  def name(self) -> str:
    return run_name(self.family, self.budget, self.config.seed,
                    self.config.optimizer.learning_rate)

  @property
  def tokens_per_step(self) -> int:
    return self.config.batch_size * self.config.seq_len

  @property
  def flops(self) -> float:
    return self.flops_per_token * self.tokens_per_step * self.config.total_steps


def budget_label(budget: float) -> str:
  return f"{budget:g}".replace("+", "")


def run_name(family: str, budget: float, seed: int, learning_rate: float) -> str:
  """``FAMILY_BUDGET``, with ``_lrRATE`` for rates other than the recipe's and ``_sSEED`` for
  seeds other than 0 (a sweep of one seed and rate keeps the names it had before either was
  an option)."""
  lr = "" if learning_rate == RECIPE["optimizer.learning_rate"] else f"_lr{learning_rate:g}"
  return f"{family}_{budget_label(budget)}{lr}" + (f"_s{seed}" if seed else "")


def _flags(fields: dict, args) -> list[str]:
  return [f"--config.{k}={v}" for k, v in fields.items()] + args.config_overrides


def _config(flags: list[str]):
  config = configlib.load(BASE_CONFIG)
  configlib.override(config, flags)
  return config


def _model(config) -> model_lib.ModelConfig:
  return configlib.model_config(config, data.make_tokenizer(config).vocab_size)


def model_fields(family: str, width: int, args) -> dict:
  corpus = os.path.join(os.path.abspath(args.out), "corpus")
  return {**RECIPE, "data.paths": os.path.join(corpus, "train.jsonl"),
          "data.eval_paths": os.path.join(corpus, "heldout.jsonl"),
          "model.family": family, "model.width": width, "model.num_layers": DEPTH,
          "model.num_heads": max(1, width // HEAD_DIM),
          "model.lru_width": round(4 * width / 3 / 64) * 64,
          "model.mlp_expanded_width": 3 * width}


@functools.lru_cache(maxsize=None)
def _optimal_compute(width: int, overrides: tuple[str, ...]) -> float:
  """Training FLOPs of Griffin at ``width`` on 20 tokens per parameter."""
  args = argparse.Namespace(out="", config_overrides=list(overrides))
  config = _config(_flags(model_fields("griffin", width, args), args))
  cfg = _model(config)
  return TOKENS_PER_PARAM * model_lib.count_params(cfg) * flops.train_flops_per_token(
      cfg, config.seq_len)


def plan(family: str, budget: float, args, seed: int = 0,
         learning_rate: float = RECIPE["optimizer.learning_rate"]) -> Run:
  """The run of ``family`` at ``budget`` training FLOPs with ``seed`` and a peak
  ``learning_rate`` (overrides given to the script win)."""
  width = min(WIDTHS, key=lambda w: abs(math.log(
      _optimal_compute(w, tuple(args.config_overrides)) / budget)))
  fields = model_fields(family, width, args)
  config = _config(_flags(fields, args))
  cfg = _model(config)
  per_token = flops.train_flops_per_token(cfg, config.seq_len)
  steps = max(1, round(budget / per_token / (config.batch_size * config.seq_len)))
  fields.update({"seed": seed, "optimizer.learning_rate": learning_rate, "total_steps": steps,
                 "optimizer.warmup_steps": max(1, round(WARMUP_FRACTION * steps)),
                 "log_every": max(1, min(10, steps // 100)),
                 "eval_every": max(1, steps // 8), "checkpoint_every": max(1, steps // 4)})
  flags = _flags(fields, args)
  config = _config(flags)
  name = run_name(family, budget, config.seed, config.optimizer.learning_rate)
  return Run(family, budget, os.path.join(args.out, "runs", name), flags, config,
             model_lib.count_params(cfg), per_token)


def _identity_file(run: Run) -> str:
  return os.path.join(run.workdir, "run.json")


def _identity(run: Run) -> dict:
  """What a run's folder name stands for, beyond the family and budget."""
  return {"seed": run.config.seed, "learning_rate": run.config.optimizer.learning_rate}


def _logged_rate_differs(run: Run) -> tuple[int, float, float] | None:
  """The first ``(step, logged, planned)`` where the learning rate a run's ``metrics.jsonl``
  logged is not its planned schedule's (a record at step s logs the rate step s trained with,
  the schedule at s - 1); None when every logged rate agrees, or none was logged."""
  logged = [(r["step"], r["lr"]) for r in train_lib.read_metrics(run.workdir) if "lr" in r]
  if not logged:
    return None
  _, schedule = train_lib.make_optimizer(run.config.optimizer, run.config.total_steps)
  planned = np.asarray(schedule(np.array([step - 1 for step, _ in logged])), np.float64)
  for (step, rate), want in zip(logged, planned):
    if abs(rate - want) > 1e-4 * abs(want) + 1e-12:  # float32 rounding is about 1e-7
      return step, rate, float(want)
  return None


def check_identities(runs: list[Run]) -> None:
  """Stops (exit 1) when a planned run's folder holds a run of another seed or learning rate
  (``run.json``, written at its first start). A folder from before ``run.json`` was written is
  checked by its learning rate alone: the rates its metrics logged must be the planned
  schedule's (the recipe's rate was 1e-3 until 2026-11-29: such a folder named without ``_lr``
  holds a 1e-3 run)."""
  for run in runs:
    if os.path.exists(_identity_file(run)):
      with open(_identity_file(run)) as f:
        saved = json.load(f)
      if saved != _identity(run):
        sys.exit(f"error: {run.workdir} holds a run with {saved} (its run.json), not the "
                 f"planned {_identity(run)}; use another --out")
    elif (differs := _logged_rate_differs(run)) is not None:
      step, rate, want = differs
      sys.exit(f"error: {run.workdir} holds a run of another learning rate: its metrics.jsonl "
               f"logged {rate:.4g} at step {step}, where the planned peak "
               f"{run.config.optimizer.learning_rate:g} gives {want:.4g}; use another --out")


def finished(run: Run) -> bool:
  return any(r.get("step") == run.config.total_steps and "eval_loss" in r
             for r in train_lib.read_metrics(run.workdir))


def _wall_time_file(run: Run) -> str:
  return os.path.join(run.workdir, "wall_time_s.json")


def _wall_time(run: Run) -> dict:
  """``{"seconds": wall time of the run's processes, "launches": how many}``."""
  if not os.path.exists(_wall_time_file(run)):
    return {"seconds": None, "launches": 0}
  with open(_wall_time_file(run)) as f:
    return json.load(f)


def _add_wall_time(run: Run, seconds: float) -> None:
  before = _wall_time(run)
  with open(_wall_time_file(run), "w") as f:
    json.dump({"seconds": (before["seconds"] or 0.0) + seconds,
               "launches": before["launches"] + 1}, f)


def train_all(runs: list[Run], args) -> list[str]:
  """Trains the unfinished runs, ``args.parallel`` at a time (then the largest budgets first);
  returns the names of those that failed. At the time limit no run starts and the running ones
  get SIGTERM (each saves its step)."""
  deadline = time.time() + args.time_limit if args.time_limit else math.inf
  failed, running, stopped = [], [], False
  env = dict(CHILD_ENV)
  if args.parallel > 1:  # several processes on one accelerator: none may take it all up front
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  todo = []
  for run in runs:
    if finished(run):
      print(f"{run.name}: finished", flush=True)
    else:
      todo.append(run)
  if args.parallel > 1:  # the longest first: the last to finish then starts early
    todo.sort(key=lambda r: -r.flops)

  def start(run: Run):
    os.makedirs(run.workdir, exist_ok=True)
    with open(_identity_file(run), "w") as f:
      json.dump(_identity(run), f)
    steps = checkpoint.committed_steps(os.path.join(run.workdir, "checkpoints"))
    begin = f"resuming at step {max(steps)}" if steps else "starting"
    print(f"{run.name}: {begin} of {run.config.total_steps} ({run.params / 1e6:.2f}M "
          f"parameters, {run.flops:.2e} FLOPs) -> {run.workdir}", flush=True)
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), f"--config={BASE_CONFIG}",
           f"--workdir={run.workdir}", *run.flags]
    with open(os.path.join(run.workdir, "train.log"), "a") as log:
      proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    running.append((run, proc, time.time()))

  def finish(run: Run, proc, began: float):
    _add_wall_time(run, time.time() - began)
    if proc.returncode == 0 and finished(run):
      print(f"{run.name}: done in {time.time() - began:.0f} s", flush=True)
    elif proc.returncode == 0 and stopped:
      print(f"time limit: {run.name} stopped (rerun to continue)", flush=True)
    elif proc.returncode == cli.INTERRUPTED:
      print(f"{run.name}: {cli.INTERRUPTED_RUN}", flush=True)
      failed.append(run.name)
    else:
      print(f"{run.name}: FAILED (exit {proc.returncode}; see {run.workdir}/train.log)")
      failed.append(run.name)

  try:
    while todo or running:
      while todo and len(running) < args.parallel and not stopped:
        start(todo.pop(0))
      time.sleep(0.2)
      for item in [item for item in running if item[1].poll() is not None]:
        running.remove(item)
        finish(*item)
      if not stopped and time.time() >= deadline:
        stopped = True
        for _, proc, _ in running:
          proc.terminate()  # train.py saves the step it is at and exits
        if todo:
          print(f"time limit: {', '.join(r.name for r in todo)} not started (rerun to continue)")
        todo = []
  finally:
    for _, proc, _ in running:
      proc.terminate()
      proc.wait()
  return failed


# --- the report ----------------------------------------------------------------------------------


def spike_ratio(losses: list[float], skip: int, window: int = SMOOTH) -> float:
  """The largest ratio of the mean of ``window`` consecutive losses to the lowest such mean
  before it, over the means that end after the first ``skip`` losses (1: no rise at all)."""
  lowest, worst = math.inf, 1.0
  for end in range(window, len(losses) + 1):
    mean = sum(losses[end - window:end]) / window
    lowest = min(lowest, mean)
    if end > skip:
      worst = max(worst, mean / lowest)
  return worst


def summarize(run: Run, train_bytes: int) -> dict:
  records = train_lib.read_metrics(run.workdir)
  train = [(r["step"], r["loss"]) for r in records if "loss" in r]
  evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
  final = [loss for step, loss in evals if step == run.config.total_steps]
  warm = sum(1 for step, _ in train if step <= run.config.optimizer.warmup_steps)
  spike = spike_ratio([loss for _, loss in train], warm) if train else None
  return {
      "family": run.family, "budget": run.budget, "seed": run.config.seed,
      "learning_rate": run.config.optimizer.learning_rate, "flops": run.flops,
      "width": run.config.model.width, "depth": run.config.model.num_layers,
      "params": run.params, "tokens": run.tokens_per_step * run.config.total_steps,
      "epochs": run.tokens_per_step * run.config.total_steps / train_bytes,
      "steps": run.config.total_steps, "steps_done": max((s for s, _ in train), default=0),
      "held_out_loss": final[0] if final else None, "spike_ratio": spike,
      "stable": None if spike is None else spike <= SPIKE_LIMIT,
      "wall_time_s": _wall_time(run)["seconds"],
      "eval_curve": [(step * run.tokens_per_step * run.flops_per_token, loss)
                     for step, loss in evals],
  }


def _count(n: int) -> str:
  return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


def _cell(value, fmt: str, unit: str = "") -> str:
  return "-" if value is None else format(value, fmt) + unit


def table(rows: list[dict]) -> str:
  lines = ["| family | budget | learning rate | seed | width x depth | params | tokens | "
           "tokens/param | epochs | steps | FLOPs | held-out loss | spike ratio | stable | "
           "wall time |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    steps = (str(r["steps"]) if r["steps_done"] >= r["steps"]
             else f"{r['steps_done']} of {r['steps']}")
    stable = {None: "-", True: "yes", False: "**no**"}[r["stable"]]
    lines.append(
        f"| {r['family']} | {budget_label(r['budget'])} | {_rate(r):g} | {r.get('seed', 0)} | "
        f"{r['width']} x {r['depth']} | "
        f"{_count(r['params'])} | {_count(r['tokens'])} | {r['tokens'] / r['params']:.1f} | "
        f"{r['epochs']:.2f} | {steps} | {r['flops']:.2e} | {_cell(r['held_out_loss'], '.4f')} | "
        f"{_cell(r['spike_ratio'], '.3f')} | {stable} | {_cell(r['wall_time_s'], '.0f', ' s')} |")
  return "\n".join(lines)


def _rate(row: dict) -> float:
  return row.get("learning_rate", 1e-3)  # rows written before rates were recorded: all 1e-3


def mean_losses(rows: list[dict], key=lambda r: (r["family"], r["budget"])) -> dict:
  """``{key(row): (mean, lowest, highest)}`` of the final held-out losses over the rows of
  each key (the seeds), for the keys whose every run finished (others are absent)."""
  groups = {}
  for r in rows:
    groups.setdefault(key(r), []).append(r["held_out_loss"])
  return {k: (sum(v) / len(v), min(v), max(v)) for k, v in groups.items() if None not in v}


def _by_rate(r: dict) -> tuple:
  return r["family"], r["budget"], _rate(r)


def at_best_rate(rows: list[dict]) -> list[dict]:
  """The rows of each family and budget at its learning rate with the lowest mean held-out
  loss over the seeds (among the rates whose every run finished; the lowest rate if none)."""
  means = mean_losses(rows, _by_rate)
  best = {}
  for r in rows:
    pair, rate = (r["family"], r["budget"]), _rate(r)
    mine = means.get((*pair, rate), (math.inf,))[0]
    if pair not in best or (mine, rate) < best[pair]:
      best[pair] = (mine, rate)
  return [r for r in rows if _rate(r) == best[(r["family"], r["budget"])][1]]


def findings(rows: list[dict], families: list[str], budgets: list[float]) -> str:
  """The order of the families at each budget (the paper's beside it) and whether each
  family's held-out loss falls with compute; over several seeds, of each family's mean; over
  several learning rates, at each family's best for each budget (after a table of them)."""
  lines = []
  rates = sorted({_rate(r) for r in rows})
  if len(rates) > 1:
    means = mean_losses(rows, _by_rate)
    rows = at_best_rate(rows)
    chosen = {_by_rate(r) for r in rows}
    lines += ["Learning rates (mean held-out loss over the seeds; * the rate each family and "
              "budget is compared at below):"]
    for budget in budgets:
      cells = [f"{f} " + ", ".join(
          f"{rate:g} {_cell(means.get((f, budget, rate), (None,))[0], '.4f')}"
          + ("*" if (f, budget, rate) in chosen else "") for rate in rates) for f in families]
      lines.append(f"- {budget_label(budget)}: " + "; ".join(cells))
    lines.append("")
  seeds = sorted({r.get("seed", 0) for r in rows})
  loss = mean_losses(rows)
  per_seed = {(r["family"], r["budget"], r.get("seed", 0)): r["held_out_loss"] for r in rows}

  def value(pair) -> str:
    mean, low, high = loss[pair]
    return f"{mean:.4f}" + (f" ({low:.4f}-{high:.4f})" if len(seeds) > 1 else "")

  what = "lowest mean held-out loss first" if len(seeds) > 1 else "lowest held-out loss first"
  lines += [f"Order at each budget ({what}"
           + (f"; over seeds {', '.join(map(str, seeds))}, their range in brackets"
              if len(seeds) > 1 else "")
           + "); the paper's Fig. 1(a): Griffin below MQA at every budget, Hawk above it (GLA "
           "is not in the paper)."]
  for budget in budgets:
    done = sorted((loss[(f, budget)][0], f) for f in families if (f, budget) in loss)
    order = " < ".join(f"{f} {value((f, budget))}" for _, f in done) or "-"
    check = ""
    if ("griffin", budget) in loss and ("mqa", budget) in loss:
      check = ("; Griffin at or below MQA: "
               + ("yes" if loss[("griffin", budget)][0] <= loss[("mqa", budget)][0] else "no"))
      if len(seeds) > 1:
        below = sum(per_seed[("griffin", budget, s)] <= per_seed[("mqa", budget, s)]
                    for s in seeds)
        check += f" (with the same seed: {below} of {len(seeds)})"
    lines.append(f"- {budget_label(budget)}: {order}{check}")
  lines.append("")
  lines.append("Held-out loss falls with compute" + (" (means):" if len(seeds) > 1 else ":"))
  for family in families:
    values = [loss.get((family, b), (None,))[0] for b in budgets]
    if len(values) < 2:
      verdict = "- (one budget)"
    elif None in values:
      verdict = "- (not every run finished)"
    else:
      verdict = "yes" if all(a > b for a, b in zip(values, values[1:])) else "no"
    lines.append(f"- {family}: {verdict} (" + ", ".join(_cell(v, ".4f") for v in values) + ")")
  lines.append("")
  lines.append("Held-out loss during training, at " + ", ".join(f"{f:g}" for f in FRACTIONS)
               + " of each run" + (" (means over the seeds)" if len(seeds) > 1 else "") + ":")
  for budget in budgets:
    cells = []
    for family in families:
      mine = [r for r in rows if r["family"] == family and r["budget"] == budget]
      values = [_mean([loss_at(r, f) for r in mine]) for f in FRACTIONS]
      cells.append(f"{family} " + ", ".join(_cell(v, ".3f") for v in values))
    lines.append(f"- {budget_label(budget)}: " + "; ".join(cells))
  return "\n".join(lines)


def loss_at(row: dict, fraction: float) -> float | None:
  """The run's last held-out evaluation within the first ``fraction`` of its steps (None if it
  has none there, or has not reached that point)."""
  if row["steps_done"] < fraction * row["steps"]:
    return None
  if fraction >= 1:  # the end: the final evaluation (none if the run stopped before it)
    return row["held_out_loss"]
  # eval_curve's FLOPs are the steps' share of the run's FLOPs (1e-9: rounding).
  within = [loss for flops, loss in sorted(row["eval_curve"])
            if flops <= fraction * row["flops"] * (1 + 1e-9)]
  return within[-1] if within else None


def _mean(values: list) -> float | None:
  return None if not values or None in values else sum(values) / len(values)


def write_report(out: str, rows: list[dict], families: list[str], budgets: list[float]) -> str:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import matplotlib.ticker  # pylint: disable=g-import-not-at-top

  text = table(rows) + "\n\n" + findings(rows, families, budgets) + "\n"
  shown = at_best_rate(rows)  # all of them with one learning rate
  loss = mean_losses(shown)
  with open(os.path.join(out, "scaling_curves.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out, "scaling_curves.json"), "w") as f:
    json.dump(rows, f, indent=1)
  fig, ax = plt.subplots(figsize=(6, 4.5))
  for i, family in enumerate(families):
    color = f"C{i}"
    mine = [r for r in shown if r["family"] == family]
    for r in mine:  # each run's held-out loss during training, faint
      if r["eval_curve"]:
        ax.plot(*zip(*r["eval_curve"]), color=color, alpha=0.3, linewidth=1)
    # One point a budget (its seeds share the config, so the FLOPs): the mean, the range a bar.
    done = sorted({(r["flops"], r["budget"]) for r in mine if (family, r["budget"]) in loss})
    if done:
      stats = [loss[(family, budget)] for _, budget in done]
      x = [flops for flops, _ in done]
      y = [mean for mean, _, _ in stats]
      ax.errorbar(x, y, yerr=[[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]],
                  color=color, marker="o", capsize=3, label=family)
  ax.set(xscale="log", yscale="log", xlabel="training FLOPs", ylabel="held-out loss (nats/byte)",
         title="Scaling curves (Griffin paper Fig. 1(a), scaled down)")
  ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.2g"))
  ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.2g"))
  if ax.get_legend_handles_labels()[0]:
    ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "scaling_curves.png"), dpi=120)
  plt.close(fig)
  return text


def _families(text: str) -> list[str]:
  families = [f for f in text.split(",") if f]
  bad = [f for f in families if f not in FAMILIES]
  if bad or not families:
    raise argparse.ArgumentTypeError(f"{bad[0] if bad else text!r} is not one of "
                                     f"{'|'.join(FAMILIES)}")
  return families


def _budgets(text: str) -> list[float]:
  try:
    return sorted(float(b) for b in text.split(",") if b)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a list of numbers") from None


def _rates(text: str) -> list[float]:
  try:
    rates = sorted({float(r) for r in text.split(",") if r})
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a list of numbers") from None
  if not rates or min(rates) <= 0:
    raise argparse.ArgumentTypeError(f"{text!r}: learning rates are numbers above 0")
  return rates


def _seeds(text: str) -> list[int]:
  try:
    seeds = sorted({int(s) for s in text.split(",") if s})
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a list of whole numbers") from None
  if not seeds or min(seeds) < 0:
    raise argparse.ArgumentTypeError(f"{text!r}: seeds are whole numbers from 0")
  return seeds


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--budgets", type=_budgets, default=list(BUDGETS),
                      help="training FLOPs of each run, comma-separated")
  parser.add_argument("--families", type=_families, default=list(FAMILIES))
  parser.add_argument("--seeds", type=_seeds, default=[0],
                      help="seeds of each family and budget, comma-separated (0: no suffix)")
  parser.add_argument("--learning_rates", type=_rates,
                      default=[RECIPE["optimizer.learning_rate"]],
                      help="peak learning rates tried for each family and budget, comma-separated")
  parser.add_argument("--time_limit", type=float, default=0,
                      help="seconds after which no run starts and the running one stops (0: none)")
  parser.add_argument("--parallel", type=int, default=1,
                      help="runs trained at once (on one accelerator: small models leave it idle)")
  parser.add_argument("--skip_training", action="store_true", help="only build and report")
  parser.add_argument("--source_dirs", default="",
                      help="folders of the corpus, comma-separated (default: site-packages)")
  parser.add_argument("--held_out", type=float, default=0.02, help="share of files held out")
  parser.add_argument("--max_file_kb", type=int, default=1024, help="larger files are skipped")
  parser.add_argument("--corpus_max_mb", type=float, default=0, help="corpus size cap (0: none)")
  parser.add_argument("--piece_chars", type=int, default=2048,
                      help="documents are pieces of files of at most this many characters")
  args, rest = parser.parse_known_args()
  args.config_overrides, unknown = cli.split_config_flags(rest)
  if unknown:
    parser.error(f"unknown argument {unknown[0]!r} (training fields: --config.FIELD=VALUE)")
  for field, option in (("seed", "--seeds"), ("optimizer.learning_rate", "--learning_rates")):
    if any(o.startswith(f"--config.{field}=") for o in args.config_overrides):
      parser.error(f"--config.{field} would name runs by another value than they train with: "
                   f"use {option}")
  if args.parallel < 1:
    parser.error(f"--parallel={args.parallel} must be at least 1")
  if not 0 < args.held_out < 1:
    parser.error(f"--held_out={args.held_out} must be between 0 and 1")
  args.source_dirs = ([os.path.abspath(d) for d in args.source_dirs.split(",") if d]
                      or default_source_dirs())

  with cli.user_errors():
    runs = [plan(f, b, args, seed, rate) for b in args.budgets for f in args.families
            for rate in args.learning_rates for seed in args.seeds]
  names = [r.name for r in runs]
  if len(set(names)) < len(names):
    parser.error(f"two planned runs would share the folder {max(names, key=names.count)}: "
                 "give --learning_rates that differ in their first 6 significant digits")
  os.makedirs(args.out, exist_ok=True)
  corpus = build_corpus(args.out, args)["corpus"]
  splits = corpus["splits"]
  print("corpus: " + ", ".join(f"{s} {v['files']} files, {v['bytes'] / 1e6:.1f} MB"
                               for s, v in splits.items())
        + f"; files.tsv sha256 {corpus['files_tsv_sha256']}", flush=True)
  check_identities(runs)
  failed = [] if args.skip_training else train_all(runs, args)
  rows = [summarize(r, splits["train"]["bytes"]) for r in runs]
  text = write_report(args.out, rows, args.families, args.budgets)
  print(text)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  cli.run_trainings(main)
