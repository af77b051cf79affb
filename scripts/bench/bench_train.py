"""Training throughput (step time, tokens/s, MFU) of griffin, hawk, mqa and gla at 400M and 1B
over sequence lengths at fixed tokens per step (the Griffin paper's Fig. 3 protocol), and the
official recurrentgemma Griffin side by side with ours.

  python scripts/bench/bench_train.py --out DIR [--families griffin,hawk,mqa,gla] [--sizes 400m,1b]
      [--seq_lens 2048,4096,8192] [--tokens_per_step 32768] [--steps 10] [--warmup 2]
      [--remat none|block|dots] [--rows_per_microbatch N] [--vocab_size 32768]
      [--anchor] [--anchor_only] [--anchor_rows 32] [--anchor_scan auto] [--deadline S]
      [--profile] [--tiny] [--config.FIELD=VALUE ...]

Sweep: for each family and size (``400m`` is the Griffin paper's 400M for griffin/hawk/mqa and
the GLA paper's 340M for gla; ``1b`` is 1.3B; any other preset name is used as is), the
family's run config (``configs/FAMILY.py:SIZE``: bfloat16 compute, float32 parameters and AdamW
state, its own remat, unless ``--remat``) with ``--vocab_size``, and each sequence length T with
``tokens_per_step / T`` rows (16 x 2048 = 8 x 4096 = 4 x 8192 by default). ``--config.F=V``
overrides apply to every row of ours.

Each row: the train state and a random-token batch are made on the device (no data pipeline),
``train.setup(config).jit_train_step`` is compiled once (its time reported), ``--warmup`` steps
run, then ``--steps`` steps are dispatched back to back and timed together up to
``jax.block_until_ready`` of the last state, three times; the step time is the median of the
three means. This is how ``train.py`` runs (it waits for the device only every ``log_every``
steps); the median of ``--steps`` steps each timed to ``block_until_ready`` is reported beside
it (``step_blocked_s``: it adds the host's dispatch and wait to every step). MFU =
``flops.train_flops_per_token`` (6 x matmul parameters + causal attention within the window,
per token) x tokens/s / ``flops.device_peak_flops`` ("-" where the
peak is unknown, e.g. CPU). A row that runs out of device memory reads "OOM"; the sweep goes on.
The parameters of a family and size are made once and carried across its sequence lengths.

``--anchor`` first times the official recurrentgemma (``recurrentgemma.jax.Griffin``, pip
package 1.0.1) training step and ours on the same architecture: width 1536, RG-LRU width 2048,
12 blocks (recurrent, recurrent, local attention) x 4, 16 heads (= gate blocks), MLP width
3 x 1536, vocabulary 32768, window 1024, no embedding scaling or logit cap; T = 2048 and
``--anchor_rows`` (32) rows per step. The official side: bfloat16 compute, float32 parameters,
its per-block remat (``gradient_checkpointing``), its default scan (AUTO: a ``lax.scan``
unrolled 128 steps off TPU; ``--anchor_scan``), this package's AdamW
(``train.make_optimizer``, the same as ours) and the same micro-batch accumulation. If either
side runs out of memory it is retried with half the rows per micro-batch (same tokens per step).
The ratio of tokens/s (ours / official) is printed (issue #7 asks for at least 1.5x).

``--rows_per_microbatch N`` accumulates gradients over micro-batches of N rows
(``optimizer.grad_accum_steps = rows / N``) in every row. ``--deadline S`` starts no new row
after S seconds (the rest read "skipped"). Writes DIR/train.md, DIR/train.json and
DIR/train.png (tokens/s against T), rewritten after every row. ``--profile`` also traces one
more timed window (``--steps`` steps back to back) of every row with ``jax.profiler`` and
writes DIR/profile_<row>.md (device time by kind of kernel, the device's idle time between
kernels and the top kernels, ``scripts/bench/profile_summary.py``), the Perfetto trace
DIR/trace_<row>.json.gz and the compiled HLO DIR/hlo_<row>.txt (to look up what a fusion
holds). ``--tiny`` shrinks the models, T to 64 and 128 and the steps, for a CPU check of the
script. Sets XLA_PYTHON_CLIENT_MEM_FRACTION to 0.92 unless it is set. Each row also reports the
GPU's SM clock and board power through its timed windows (``timing.GpuClocks``): an H100 at its
700 W cap clocks well below the rate its peak assumes (docs/performance.md).
"""

import argparse
import gc
import glob
import json
import os
import shutil
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from recurrentgemma_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from recurrentgemma_jax import model as model_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from recurrentgemma_jax.errors import first_line  # pylint: disable=g-import-not-at-top,wrong-import-position

FAMILIES = ("griffin", "hawk", "mqa", "gla")
# Size label -> the preset name each family has for it (presets.PAPER_SIZES / GLA_SIZES).
SIZE_ALIASES = {"400m": {"gla": "340m"}, "1b": {"griffin": "1.3b", "hawk": "1.3b",
                                                 "mqa": "1.3b", "gla": "1.3b"}}
# The anchor architecture (Griffin-400M class, 16 heads); model fields of our config.
ANCHOR_MODEL = dict(family="griffin", width=1536, lru_width=2048, num_layers=12, num_heads=16,
                    num_gate_blocks=16, mlp_expanded_width=3 * 1536, vocab_size=32768,
                    attention_window_size=1024, embeddings_scale_by_sqrt_dim=False,
                    logits_soft_cap=0.0, block_types="")
TINY_MODEL = dict(width=64, lru_width=64, num_layers=3, num_heads=2, num_gate_blocks=2,
                  gla_num_heads=2, mlp_expanded_width=192, attention_window_size=32)
TINY_ANCHOR = dict(ANCHOR_MODEL, width=64, lru_width=64, num_layers=3, num_heads=2,
                   num_gate_blocks=2, mlp_expanded_width=192, vocab_size=512,
                   attention_window_size=32)


def _version(package: str) -> str:
  try:
    from importlib import metadata  # pylint: disable=g-import-not-at-top
    return metadata.version(package)
  except Exception:  # pylint: disable=broad-except
    return "?"


def out_of_memory(e: BaseException) -> bool:
  text = str(e)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--families", default=",".join(FAMILIES))
  parser.add_argument("--sizes", default="400m,1b")
  parser.add_argument("--seq_lens", default="2048,4096,8192")
  parser.add_argument("--tokens_per_step", type=int, default=32768)
  parser.add_argument("--steps", type=int, default=10, help="timed steps per row")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
  parser.add_argument("--remat", choices=model_lib.REMAT_POLICIES, default=None,
                      help="override the config's model.remat (default: the config's own)")
  parser.add_argument("--rows_per_microbatch", type=int, default=0,
                      help="gradient accumulation over micro-batches of this many rows (0: none)")
  parser.add_argument("--vocab_size", type=int, default=32768)
  parser.add_argument("--anchor", action="store_true",
                      help="also time the official recurrentgemma Griffin against ours")
  parser.add_argument("--anchor_only", action="store_true", help="only the anchor comparison")
  parser.add_argument("--anchor_rows", type=int, default=32, help="rows of 2048 per anchor step")
  parser.add_argument("--anchor_scan", default="auto",
                      choices=("auto", "linear_native", "associative_native"),
                      help="the official RG-LRU scan (auto: its default, linear_native off TPU)")
  parser.add_argument("--deadline", type=float, default=0,
                      help="seconds after which no new row starts (0: none)")
  parser.add_argument("--tiny", action="store_true", help="tiny models, for a CPU check")
  parser.add_argument("--profile", action="store_true",
                      help="also trace one more window of --steps steps of each row with "
                           "jax.profiler and write OUT/profile_<row>.md "
                           "(scripts/bench/profile_summary.py)")
  args, rest = parser.parse_known_args()
  overrides, bad = cli.split_config_flags(rest)
  if bad:
    parser.error(f"unknown argument {bad[0]!r}")
  args.overrides = overrides
  if args.steps < 1 or args.warmup < 0:
    parser.error("--steps must be >= 1 and --warmup >= 0")
  args.anchor = args.anchor or args.anchor_only
  families = [f for f in args.families.split(",") if f] if not args.anchor_only else []
  for f in families:
    if f not in FAMILIES:
      parser.error(f"--families: {f!r} is not one of {'|'.join(FAMILIES)}")
  sizes = [s for s in args.sizes.split(",") if s]
  seq_lens = [int(t) for t in args.seq_lens.split(",") if t]
  anchor_seq = 2048
  if args.tiny:
    if "--seq_lens" not in sys.argv:
      seq_lens = [64, 128]
    if "--tokens_per_step" not in sys.argv:
      args.tokens_per_step = 256
    if "--steps" not in sys.argv:
      args.steps = 2
    if "--warmup" not in sys.argv:
      args.warmup = 1
    if "--vocab_size" not in sys.argv:
      args.vocab_size = 512
    if "--anchor_rows" not in sys.argv:
      args.anchor_rows = 4
    anchor_seq = 64
  for t in seq_lens:
    if args.tokens_per_step % t:
      parser.error(f"--tokens_per_step={args.tokens_per_step} is not a multiple of T={t}")

  os.makedirs(args.out, exist_ok=True)
  # Let a row use the whole device (jax preallocates 75% by default); before jax starts.
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
  Bench(args, families, sizes, seq_lens, anchor_seq).run()


class Bench:

  def __init__(self, args, families, sizes, seq_lens, anchor_seq):
    import jax  # pylint: disable=g-import-not-at-top
    from recurrentgemma_jax import flops  # pylint: disable=g-import-not-at-top
    self.jax = jax
    self.args = args
    self.families, self.sizes, self.seq_lens, self.anchor_seq = (families, sizes, seq_lens,
                                                                 anchor_seq)
    self.start = time.perf_counter()
    self.device = jax.devices()[0]
    self.peak = flops.device_peak_flops(self.device)
    self.results = {
        "device": self.device.device_kind, "platform": self.device.platform,
        "peak_flops": self.peak, "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python"] + sys.argv),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "anchor": [], "rows": []}

  # ------------------------------------------------------------------ driver

  def run(self):
    args = self.args
    print(f"{self.device.device_kind} ({self.device.platform}), jax {self.jax.__version__}, "
          f"peak {self.peak / 1e12 if self.peak else '-'} TFLOP/s", flush=True)
    if args.anchor:
      self.run_anchor()
    for size in self.sizes:
      for family in self.families:
        self.run_group(family, size)
    self.write()
    print()
    print(self.markdown())

  def past_deadline(self) -> bool:
    return bool(self.args.deadline) and time.perf_counter() - self.start > self.args.deadline

  def accum_steps(self, rows: int, rows_per_micro: int | None = None) -> int:
    per = self.args.rows_per_microbatch if rows_per_micro is None else rows_per_micro
    if not per or per >= rows:
      return 1
    if rows % per:
      raise ValueError(f"--rows_per_microbatch={per} does not divide the {rows} rows")
    return rows // per

  def free(self):
    gc.collect()
    self.jax.clear_caches()

  def record(self, section: str, row: dict):
    self.results[section].append(row)
    status = row["status"]
    if status == "ok":
      mfu = f", MFU {100 * row['mfu']:.1f}%" if row.get("mfu") is not None else ""
      print(f"  {row['model']} {row['size']} T={row['seq_len']} rows={row['rows']}"
            f"x{row['micro_batches']}: compile {row['compile_s']:.1f} s (trace "
            f"{row['trace_s']:.1f} s), step "
            f"{1e3 * row['step_s']:.1f} ms, {row['tokens_per_s']:,.0f} tokens/s{mfu}, "
            f"loss {row['loss']:.3f}  [{time.perf_counter() - self.start:.0f} s]", flush=True)
    else:
      print(f"  {row['model']} {row['size']} T={row['seq_len']} rows={row['rows']}: {status}"
            f"  [{time.perf_counter() - self.start:.0f} s]", flush=True)
    self.write()

  # ------------------------------------------------------------------ ours

  def our_config(self, family, preset, seq_len, rows, accum, model_fields=None):
    from recurrentgemma_jax import configlib  # pylint: disable=g-import-not-at-top
    args = self.args
    config = configlib.load(os.path.join(ROOT, "configs", f"{family}.py") + f":{preset}")
    config.model.vocab_size = args.vocab_size
    if args.tiny:
      config.model.update(TINY_MODEL)
    if model_fields:
      config.model.update(model_fields)
    config.model.dtype = "bfloat16"
    config.model.param_dtype = "float32"
    if args.remat:
      config.model.remat = args.remat
    config.seq_len = seq_len
    config.batch_size = rows
    config.optimizer.grad_accum_steps = accum
    config.zero = 0
    config.mesh.data, config.mesh.model, config.mesh.slices = 1, 1, 1
    configlib.override(config, args.overrides)
    configlib.validate(config, process_count=1, device_count=1)
    return config

  def random_batch(self, rows, seq_len, vocab, sharding=None, seed=1):
    jax, jnp = self.jax, self.jax.numpy

    def make(key):
      tokens = jax.random.randint(key, (rows, seq_len + 1), 0, vocab, jnp.int32)
      return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
              "segment_pos": jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32),
                                              (rows, seq_len)),
              "loss_mask": jnp.ones((rows, seq_len), jnp.float32)}

    fn = jax.jit(make, out_shardings=sharding) if sharding is not None else jax.jit(make)
    return fn(jax.random.key(seed))

  def time_compiled(self, jitted, state, batch, name="step"):
    """Compiles, warms up and times; returns (state, stats). ``state`` is donated."""
    jax = self.jax
    t0 = time.perf_counter()
    lowered = jitted.lower(state, batch)
    trace_s = time.perf_counter() - t0
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    del lowered
    memory = None
    try:
      m = compiled.memory_analysis()
      memory = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes) / 2**30
    except Exception:  # pylint: disable=broad-except  (not every backend reports it)
      pass
    metrics = None
    for _ in range(self.args.warmup):
      state, metrics = compiled(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(self.args.steps):
      t = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready(state)
      times.append(time.perf_counter() - t)
    window_means = []
    import timing  # pylint: disable=g-import-not-at-top  (scripts/bench/; imports jax)
    with timing.GpuClocks() as clocks:  # the SM clock and power through the timed windows
      for _ in range(3):  # as train.py runs: steps dispatched back to back, one wait at the end
        t = time.perf_counter()
        for _ in range(self.args.steps):
          state, metrics = compiled(state, batch)
        jax.block_until_ready(state)
        window_means.append((time.perf_counter() - t) / self.args.steps)
    loss = float(metrics["loss"])
    if self.args.profile:
      state = self.profile(compiled, state, batch, name)
    del compiled
    return state, {"compile_s": compile_s, "trace_s": trace_s,
                   "step_s": statistics.median(window_means),
                   "step_blocked_s": statistics.median(times),
                   "step_times_s": times, "window_means_s": window_means, "loss": loss,
                   "memory_gib": memory, "clocks": clocks.summary()}

  def profile(self, compiled, state, batch, name):
    """Traces one more timed window (``--steps`` steps dispatched back to back, one wait);
    writes OUT/profile_<name>.md and prints its first lines."""
    import re  # pylint: disable=g-import-not-at-top
    import profile_summary  # pylint: disable=g-import-not-at-top  (scripts/bench/, beside this file)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")
    trace_dir = os.path.join(self.args.out, "traces", name)
    steps = self.args.steps
    with self.jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(steps):
        state, _ = compiled(state, batch)
      self.jax.block_until_ready(state)
    with open(os.path.join(self.args.out, f"hlo_{name}.txt"), "w") as f:
      f.write(compiled.as_text())  # to look up what a fusion in the profile holds
    for path in glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                          recursive=True):
      shutil.copy(path, os.path.join(self.args.out, f"trace_{name}.json.gz"))
    try:
      text = profile_summary.summarize(trace_dir, steps)
    except Exception as e:  # pylint: disable=broad-except  (a profile is extra, never fatal)
      text = f"no summary: {first_line(e)}"
    with open(os.path.join(self.args.out, f"profile_{name}.md"), "w") as f:
      f.write(f"# {name}\n\n{text}\n")
    print("\n".join(text.splitlines()[:24]), flush=True)
    return state

  def our_row(self, label, size_label, config, state=None):
    """Times one config; returns (row, state or None). A given state (same model) is reused."""
    from recurrentgemma_jax import flops, train  # pylint: disable=g-import-not-at-top
    plan = train.setup(config, devices=self.jax.devices()[:1])
    cfg = plan.model_cfg
    params = sum(int(x.size) for x in self.jax.tree.leaves(plan.params_abstract))
    rows, seq_len = config.batch_size, config.seq_len
    row = {"model": label, "size": size_label, "impl": "ours", "params": params,
           "seq_len": seq_len, "rows": rows, "micro_batches": config.optimizer.grad_accum_steps,
           "tokens_per_step": rows * seq_len, "remat": cfg.remat,
           "flops_per_token": flops.train_flops_per_token(cfg, seq_len)}
    try:
      if state is None:
        state = plan.initial_state(config)
      batch = self.random_batch(rows, seq_len, cfg.vocab_size, plan.batch_sharding)
      state, stats = self.time_compiled(plan.jit_train_step(config.optimizer.grad_accum_steps),
                                        state, batch, f"{label}_{size_label}_T{seq_len}")
      del batch
    except Exception as e:  # pylint: disable=broad-except  (a row fails, the sweep goes on)
      state = None
      row["status"] = "OOM" if out_of_memory(e) else f"error: {first_line(e)}"
      if not out_of_memory(e):
        traceback.print_exc()
      return row, None  # (the caller frees the device memory, once the exception is gone)
    row.update(stats, status="ok")
    self.finish(row)
    return row, state

  def finish(self, row):
    row["tokens_per_s"] = row["tokens_per_step"] / row["step_s"]
    row["mfu"] = (row["flops_per_token"] * row["tokens_per_s"] / self.peak
                  if self.peak else None)

  def run_group(self, family, size):
    from recurrentgemma_jax import presets  # pylint: disable=g-import-not-at-top
    preset = SIZE_ALIASES.get(size, {}).get(family, size)
    known = presets.GLA_SIZES if family == "gla" else presets.PAPER_SIZES
    label = size if preset == size else f"{size} ({preset})"
    if preset not in known:
      print(f"{family} {size}: no preset {preset!r} (one of {'|'.join(known)}); skipped")
      return
    print(f"{family} {label}", flush=True)
    state = None
    for seq_len in self.seq_lens:
      rows = self.args.tokens_per_step // seq_len
      base = {"model": family, "size": label, "impl": "ours", "seq_len": seq_len, "rows": rows,
              "tokens_per_step": rows * seq_len}
      if self.past_deadline():
        self.record("rows", dict(base, status="skipped (deadline)"))
        continue
      try:
        config = self.our_config(family, preset, seq_len, rows, self.accum_steps(rows))
      except Exception as e:  # pylint: disable=broad-except  (a bad row is reported, not fatal)
        self.record("rows", dict(base, status=f"error: {first_line(e)}"))
        continue
      row, state = self.our_row(family, label, config, state)
      if state is None:
        self.free()
      self.record("rows", row)
    del state
    self.free()

  # ------------------------------------------------------------------ anchor

  def run_anchor(self):
    args = self.args
    rows, seq_len = args.anchor_rows, self.anchor_seq
    fields = TINY_ANCHOR if args.tiny else ANCHOR_MODEL
    print(f"anchor: official recurrentgemma vs ours, T={seq_len}, {rows} rows", flush=True)
    for impl in ("official", "ours"):
      per_micro = args.rows_per_microbatch or rows
      while True:
        base = {"model": f"griffin ({impl})", "size": "400m-class anchor", "impl": impl,
                "seq_len": seq_len, "rows": rows, "tokens_per_step": rows * seq_len}
        if self.past_deadline():
          self.record("anchor", dict(base, status="skipped (deadline)"))
          break
        accum = self.accum_steps(rows, per_micro)
        try:
          config = self.our_config("griffin", "400m", seq_len, rows, accum,
                                   fields)
          if impl == "ours":
            row, state = self.our_row(base["model"], base["size"], config)
            del state
          else:
            row = self.official_row(base, config)
        except Exception as e:  # pylint: disable=broad-except
          traceback.print_exc()
          row = dict(base, status=f"error: {first_line(e)}")
        self.free()
        if row["status"] == "OOM" and per_micro > 1 and per_micro % 2 == 0:
          print(f"  {base['model']}: OOM at {per_micro} rows per micro-batch; retrying with "
                f"{per_micro // 2}", flush=True)
          per_micro //= 2
          continue
        self.record("anchor", row)
        break

  def official_row(self, base, config):
    """The official Griffin's training step on the anchor architecture (``config`` is ours,
    for the optimizer, the accumulation and the model FLOPs)."""
    import itertools  # pylint: disable=g-import-not-at-top
    import recurrentgemma.jax as rg  # pylint: disable=g-import-not-at-top
    from recurrentgemma_jax import configlib, flops, train  # pylint: disable=g-import-not-at-top
    jax, jnp = self.jax, self.jax.numpy
    m = config.model
    ours_cfg = configlib.model_config(config, m.vocab_size)
    pattern = itertools.cycle([rg.TemporalBlockType.RECURRENT, rg.TemporalBlockType.RECURRENT,
                               rg.TemporalBlockType.ATTENTION])
    rg_cfg = rg.GriffinConfig(
        vocab_size=m.vocab_size, width=m.width, mlp_expanded_width=m.mlp_expanded_width,
        num_heads=m.num_heads, block_types=tuple(itertools.islice(pattern, m.num_layers)),
        embeddings_scale_by_sqrt_dim=m.embeddings_scale_by_sqrt_dim,
        attention_window_size=m.attention_window_size, logits_soft_cap=m.logits_soft_cap,
        lru_width=m.lru_width, scan_type=getattr(rg.ScanType, self.args.anchor_scan.upper()))
    model = rg.Griffin(rg_cfg, gradient_checkpointing=True, dtype=jnp.bfloat16,
                       param_dtype=jnp.float32)
    rows, seq_len, accum = config.batch_size, config.seq_len, config.optimizer.grad_accum_steps
    tx, schedule = train.make_optimizer(config.optimizer, config.total_steps)
    row = dict(base, micro_batches=accum, remat="block (gradient_checkpointing)",
               version=_version("recurrentgemma"),
               scan=rg_cfg.scan_type.name.lower(),
               flops_per_token=flops.train_flops_per_token(ours_cfg, seq_len))

    def loss_sum(params, micro):
      logits, _ = model.apply({"params": params}, micro["inputs"], micro["segment_pos"],
                              return_cache=False)
      return train.masked_cross_entropy(logits, micro["targets"], micro["loss_mask"])

    step = train.train_step_from_loss(loss_sum, tx, schedule, accum)  # ours, official loss

    try:
      init_len = min(seq_len, 16)  # parameters do not depend on T
      params = jax.jit(lambda key: model.init(
          key, jnp.zeros((1, init_len), jnp.int32), jnp.arange(init_len)[None],
          return_cache=False)["params"])(jax.random.key(0))
      row["params"] = sum(int(x.size) for x in jax.tree.leaves(params))
      state = {"step": jnp.zeros((), jnp.int32), "params": params,
               "opt_state": jax.jit(tx.init)(params)}
      batch = self.random_batch(rows, seq_len, m.vocab_size)
      state, stats = self.time_compiled(jax.jit(step, donate_argnums=0), state, batch,
                                        f"official_T{seq_len}")
      del state, batch
    except Exception as e:  # pylint: disable=broad-except
      row["status"] = "OOM" if out_of_memory(e) else f"error: {first_line(e)}"
      if not out_of_memory(e):
        traceback.print_exc()
      return row
    row.update(stats, status="ok")
    self.finish(row)
    return row

  # ------------------------------------------------------------------ output

  def fmt_row(self, r):
    ok = r["status"] == "ok"
    params = f"{r['params'] / 1e6:,.1f}M" if r.get("params") else "-"
    micro = f"{r['rows'] // r['micro_batches']} x {r['micro_batches']}" if r.get(
        "micro_batches") else "-"
    mem = f"{r['memory_gib']:.2f}" if ok and r.get("memory_gib") is not None else "-"
    if ok:
      mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
      blocked = f"{1e3 * r['step_blocked_s']:.1f}" if r.get("step_blocked_s") else "-"
      import timing  # pylint: disable=g-import-not-at-top  (scripts/bench/)
      cells = [f"{r['compile_s']:.1f}", f"{1e3 * r['step_s']:.1f}", blocked,
               f"{r['tokens_per_s']:,.0f}", mfu, timing.clock_cell(r.get("clocks"))]
    else:
      cells = ["-", r["status"], "-", "-", "-", "-"]
    return (f"| {r['model']} | {r['size']} | {params} | {r['seq_len']} | {r['rows']} | {micro} "
            f"| {r['tokens_per_step']:,} | {r.get('remat', '-')} | {mem} | "
            + " | ".join(cells) + " |")

  def markdown(self) -> str:
    res, args = self.results, self.args
    peak = f"{res['peak_flops'] / 1e12:.0f} TFLOP/s bf16 peak" if res["peak_flops"] else \
        "peak FLOP/s unknown: no MFU"
    head = ("| model | size | params | T | rows | micro-batch rows x count | tokens/step | remat "
            "| compiled GiB | compile (s) | step (ms) | blocked (ms) | tokens/s | MFU "
            "| SM clock, power |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"Device {res['device']} ({peak}), jax {res['jax']}, {res['date']}; command "
             f"`{res['command']}`.", "",
             f"bfloat16 compute, float32 parameters and AdamW state, random tokens made on the "
             f"device; after {args.warmup} warm-up steps, the median of three means of "
             f"{args.steps} steps dispatched back to back (as train.py runs; 'blocked': the "
             f"median of {args.steps} steps each timed to `block_until_ready`). MFU = "
             f"flops.train_flops_per_token (6 x matmul parameters + causal attention) x tokens/s "
             f"/ peak. compiled GiB: arguments + outputs + temporaries of the compiled step. "
             f"SM clock, power: the median SM clock and the mean board power through the timed "
             f"windows (nvidia-smi every 100 ms; '(cap)': throttled by the power cap in most "
             f"samples; '-': not sampled). The peak assumes the tensor cores at their rated "
             f"clock (1830 MHz on an H100 SXM)."]
    if res["anchor"]:
      official = next((r for r in res["anchor"] if r["impl"] == "official"), {})
      arch = ("tiny stand-in (--tiny)" if args.tiny else
              "width 1536, RG-LRU 2048, 12 blocks R,R,A, 16 heads, MLP 4608, vocabulary 32768, "
              "window 1024")
      lines += ["", f"Anchor: the official recurrentgemma {_version('recurrentgemma')} Griffin "
                f"(scan {official.get('scan', args.anchor_scan)}) and ours, one architecture "
                f"({arch}), the same tokens per step:", "", head]
      lines += [self.fmt_row(r) for r in res["anchor"]]
      ratio = self.anchor_ratio()
      if ratio is not None:
        lines += ["", f"**ours / official tokens/s: {ratio:.2f}x** (issue #7 goal: >= 1.5x)"]
    if res["rows"]:
      lines += ["", f"Sweep: vocabulary {args.vocab_size}, {args.tokens_per_step:,} tokens "
                f"per step:", "", head]
      lines += [self.fmt_row(r) for r in res["rows"]]
    return "\n".join(lines)

  def anchor_ratio(self):
    rate = {r["impl"]: r["tokens_per_s"] for r in self.results["anchor"] if r["status"] == "ok"}
    if "ours" in rate and "official" in rate:
      return rate["ours"] / rate["official"]
    return None

  def write(self):
    out = self.args.out
    self.results["anchor_ratio"] = self.anchor_ratio()
    self.results["elapsed_s"] = time.perf_counter() - self.start
    with open(os.path.join(out, "train.md"), "w") as f:
      f.write(self.markdown() + "\n")
    with open(os.path.join(out, "train.json"), "w") as f:
      json.dump(self.results, f, indent=1, default=str)
    try:
      self.plot(os.path.join(out, "train.png"))
    except Exception as e:  # pylint: disable=broad-except  (the plot is optional)
      print(f"  (no plot: {first_line(e)})")

  def plot(self, path):
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    series = {}
    for r in self.results["rows"]:
      if r["status"] == "ok":
        series.setdefault((r["model"], r["size"]), []).append((r["seq_len"], r["tokens_per_s"]))
    sizes = list(dict.fromkeys(size for _, size in series))
    colors = {f: f"C{i}" for i, f in enumerate(FAMILIES)}
    anchors = [r for r in self.results["anchor"] if r["status"] == "ok"]
    if not series and not anchors:
      return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (family, size), points in series.items():  # colour: family; line style: size
      points.sort()
      ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
              color=colors.get(family), linestyle=("-", "--", ":", "-.")[sizes.index(size) % 4],
              label=f"{family} {size}")
    for r in anchors:
      ax.scatter([r["seq_len"]], [r["tokens_per_s"]], marker="*" if r["impl"] == "ours" else "x",
                 color="C4" if r["impl"] == "ours" else "k", s=90, zorder=3,
                 label=f"anchor: {r['model']}, {r['rows']} rows")
    ax.set_xscale("log", base=2)
    seqs = sorted({r["seq_len"] for r in self.results["rows"] + anchors})
    ax.set_xticks(seqs)
    ax.set_xticklabels([str(t) for t in seqs])
    ax.set_xlabel("sequence length T (tokens per step fixed)")
    ax.set_ylabel("training tokens / s")
    ax.set_title(f"Training throughput, {self.results['device']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
  main()
