"""Compiles, on a machine without a TPU, the training step train.py would run on a TPU slice.

  python scripts/compile_tpu.py --topology=v5p-128 [--num_slices=N] [--config=FILE[:ARG]]
      [--config.FIELD=VALUE ...] [--json=OUT.json] [--hlo=OUT.txt] [--search] [--hbm_gib=X]

--topology is a Cloud TPU slice name: v4-8 ... v4-4096 and v5p-8 ... v5p-12288 (TensorCores,
two per chip), v5e-1 ... v5e-256 (or v5litepod-N) and v6e-1 ... v6e-256 (chips). The config and
its overrides are read as train.py reads them; the mesh (mesh.data, mesh.model, mesh.slices =
--num_slices), ZeRO stage, remat, gradient accumulation and kernels are the run's. The run's
data and init_from checkpoint are not read (only their shapes matter; a SentencePiece tokenizer
that is not a local file needs --config.model.vocab_size).

Prints per chip: HBM of the training and evaluation steps against the chip's, the compiled
FLOPs and bytes per step (every loop iteration counted), the Mosaic kernels in the step, and a
roofline bound (the larger of FLOPs at peak and bytes at full HBM bandwidth) with its tokens/s
per chip and MFU. --search compiles candidates to find the cheapest model.remat (none, dots,
block) and with it the largest micro-batch (fewest optimizer.grad_accum_steps) that fit, and
prints them as flags. --hbm_gib judges against less HBM than the chip's (headroom).

The flags are absl flags (the config through ml_collections.config_flags), as train.py's:
a train.py command line compiles as it is (its --workdir is ignored).

Exit status: 0 it compiles and fits; 1 it does not fit (one line: needed vs available per chip);
2 bad input (one line per problem, nothing compiled); 3 it did not compile for another reason.
"""

import json
import os
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from recurrentgemma_jax import cli  # pylint: disable=g-import-not-at-top


def _fail(code: int, message: str):
  print(f"error: {message}", file=sys.stderr)
  sys.exit(code)


def _size(n) -> str:
  from recurrentgemma_jax import aot  # pylint: disable=g-import-not-at-top
  return aot.human_bytes(n)


def _si(n: float, unit: str) -> str:
  for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(n) >= scale:
      return f"{n / scale:.2f} {prefix}{unit}"
  return f"{n:.0f} {unit}"


def _memory_line(label: str, program, limit) -> str:
  m = program.memory
  if program.compiled is None:
    return f"HBM per chip, {label}: not compiled ({program.error})"
  share = f" ({m.total / limit:.1%})" if limit else ""
  verdict = "fits" if limit is None or m.total <= limit else "DOES NOT FIT"
  return (f"HBM per chip, {label}: arguments {_size(m.arguments)}, outputs {_size(m.outputs)} "
          f"({_size(m.aliased)} donated), temporaries {_size(m.temporaries)}, code "
          f"{_size(m.code)}; total {_size(m.total)} of {_size(limit)}{share}: {verdict}")


def _print_report(tpu, report) -> None:
  chip = tpu.chip
  model_flops = report.model_flops_per_token * report.tokens_per_step / report.devices
  print(_memory_line("training step", report.train, report.hbm_per_chip_bytes))
  if report.eval is not None:
    print(_memory_line("evaluation step", report.eval, report.hbm_per_chip_bytes))
  if report.flops_per_step:
    ratio = report.flops_per_step / model_flops if model_flops else float("nan")
    unknown = (f" ({report.unknown_loops} loops of unknown trip count counted once)"
               if report.unknown_loops else "")
    print(f"per chip per step: {_si(report.flops_per_step, 'FLOP')} compiled (the model's "
          f"{_si(model_flops, 'FLOP')}: x{ratio:.2f}), {_si(report.bytes_per_step, 'B')} of HBM "
          f"traffic{unknown}; Mosaic kernels in the step: {report.mosaic_kernels}")
  roof = report.roofline()
  if roof:
    print(f"roofline ({chip.generation}: {_si(chip.peak_flops, 'FLOP/s')}, "
          f"{_si(chip.hbm_bandwidth, 'B/s')} per chip): {roof['step_time_s'] * 1e3:,.1f} ms "
          f"per step ({roof['bound']}-bound), {roof['tokens_per_sec_per_chip']:,.0f} tokens/s "
          f"per chip, MFU {roof['mfu']:.1%}")
  steps = f"training step {report.train.compile_s:.1f} s"
  if report.eval is not None:
    steps += f", evaluation step {report.eval.compile_s:.1f} s"
  print(f"compiled in {report.compile_s:.1f} s ({steps})")


def _not_fitting(tpu, report) -> str:
  worst = report.worst
  which = "evaluation" if worst is report.eval else "training"
  limit = report.hbm_per_chip_bytes
  if worst.memory.needed is not None:
    available = worst.memory.available
    return (f"does not fit on {tpu.name}: the {which} step needs {_size(worst.memory.needed)} "
            f"per chip, {_size(available)} available to the compiler "
            f"({tpu.chip.generation}: {_size(tpu.chip.hbm_bytes)} HBM per chip); "
            f"{_size(worst.memory.needed - available)} over")
  if worst.compiled is None:
    return f"does not fit on {tpu.name}: {worst.error}"
  return (f"does not fit on {tpu.name}: the {which} step needs {_size(worst.memory.total)} "
          f"per chip, {_size(limit)} available; {_size(worst.memory.total - limit)} over")


def _write_json(path: str, tpu, report, search) -> None:
  if not path:
    return
  record = {"topology": tpu.name, "accelerator_type": tpu.accelerator_type,
            "topology_shape": tpu.topology, "num_slices": tpu.num_slices,
            "generation": tpu.chip.generation, "chips": tpu.total_chips,
            "hbm_per_chip_bytes": tpu.chip.hbm_bytes, "fits": False}
  if report is not None:
    record.update(report.as_dict())
  if search is not None:
    record["search"] = {"compiles": search.compiles, "remat": search.remat,
                        "grad_accum_steps": search.accum_steps,
                        "tried": [{"remat": r, "grad_accum_steps": a, "fits": ok}
                                  for r, a, ok in search.tried]}
  with open(path, "w") as f:
    json.dump(record, f, indent=2)


def define_flags(flag_values):
  from absl import flags  # pylint: disable=g-import-not-at-top
  v = {"flag_values": flag_values}
  return {
      "topology": flags.DEFINE_string("topology", "", "a Cloud TPU slice name, e.g. v5p-128", **v),
      "num_slices": flags.DEFINE_integer("num_slices", 1, "slices over DCN", **v),
      "json": flags.DEFINE_string("json", "", "write the report as JSON here", **v),
      "hlo": flags.DEFINE_string("hlo", "", "write the compiled training step's HLO here", **v),
      "search": flags.DEFINE_bool("search", False, "find a remat and micro-batch that fit", **v),
      "hbm_gib": flags.DEFINE_float("hbm_gib", 0.0, "judge against this HBM per chip", **v),
      "workdir": flags.DEFINE_string("workdir", "", "ignored (train.py's flag)", **v)}


def main(argv: list[str]) -> None:
  """``argv``: the command line, program name first."""
  # Compile-only TPU devices come from libtpu; the host's own backend stays the CPU.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  with cli.user_errors():
    from recurrentgemma_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
    config, values = cli.parse_config_flags(
        argv, default_config=os.path.join(ROOT, "configs", "default.py"), define=define_flags,
        usage=__doc__)
    args = types.SimpleNamespace(**values)
    if not args.topology:
      raise ConfigError("--topology is required: a Cloud TPU slice name, e.g. --topology=v5e-8")
    if args.hbm_gib < 0:
      raise ConfigError(f"--hbm_gib={args.hbm_gib} must be positive")

  with cli.user_errors():
    from recurrentgemma_jax import aot  # pylint: disable=g-import-not-at-top
    tpu = aot.parse_slice(args.topology, args.num_slices)
    if config.mesh.slices not in (1, args.num_slices):  # (a TPU slice is one mesh slice)
      raise ConfigError(f"mesh.slices={config.mesh.slices} but --num_slices={args.num_slices}"
                        f": compile for the run's slices with --num_slices="
                        f"{config.mesh.slices}")
    config.mesh.slices = args.num_slices
    config = aot.offline_config(config)
    try:
      devices = tpu.devices()
    except aot.CompileError as e:
      _fail(3, str(e))
    aot.validate(config, devices)
  hbm = int(args.hbm_gib * 2**30) or None

  slices = f" x {tpu.num_slices} slices" if tpu.num_slices > 1 else ""
  print(f"{tpu.name}{slices}: {tpu.total_chips} chips of {devices[0].device_kind} "
        f"(topology {tpu.topology}); {config.model.family}, batch {config.batch_size} x "
        f"{config.seq_len}; compiling" + (" candidates (--search)" if args.search else ""),
        flush=True)
  with cli.user_errors():
    search = None
    if args.search:
      started = time.perf_counter()
      try:
        search = aot.search(config, devices, hbm_bytes=hbm,
                            log=lambda line: print(line, flush=True))
        search_s = time.perf_counter() - started
      except aot.CompileError as e:
        _fail(3, f"the step did not compile for {tpu.name}: {e}")
      if search.report is None:
        _write_json(args.json, tpu, None, search)
        _fail(1, f"nothing fits on {tpu.name} at batch_size={config.batch_size} "
                 f"(remat {'|'.join(aot.REMAT_ORDER)}, micro-batches down to one row per data "
                 f"shard; {search.compiles} compiles)")
      report = search.report
      config.model.remat, config.optimizer.grad_accum_steps = search.remat, search.accum_steps
      from recurrentgemma_jax import train  # pylint: disable=g-import-not-at-top
      report.eval = aot.compile_eval(config, train.setup(config, devices))
      report.compile_s += report.eval.compile_s
    else:
      report = aot.compile_step(config, devices, hbm_bytes=hbm)

  if search is not None:
    print(f"search: {search.compiles} compiles of the training step in {search_s:.1f} s; the "
          f"cheapest remat that fits and its largest micro-batch ({report.micro_batch_rows} "
          f"rows x {config.seq_len} per data shard):")
    print(f"  --config.model.remat={search.remat} "
          f"--config.optimizer.grad_accum_steps={search.accum_steps}")
  if report.train.compiled is not None:
    print(f"mesh data={report.mesh['data']} model={report.mesh['model']}, ZeRO {report.zero}, "
          f"remat {report.remat}, grad_accum_steps {report.accum_steps} (micro-batch "
          f"{report.micro_batch_rows} rows per data shard); {report.parameters / 1e6:,.2f}M "
          f"parameters, {report.tokens_per_step:,} tokens per step")
    if report.unsplit_note:
      print(report.unsplit_note)
    _print_report(tpu, report)
  _write_json(args.json, tpu, report, search)
  if args.hlo and report.train.compiled is not None:
    with open(args.hlo, "w") as f:
      f.write(report.train.compiled.as_text())

  if report.fits:
    return
  out_of_memory = any(p.out_of_memory for p in report.programs)
  if out_of_memory or report.compiled_ok:
    _fail(1, _not_fitting(tpu, report))
  failed = next(p for p in report.programs if p.compiled is None)
  _fail(3, f"the step did not compile for {tpu.name}: {failed.error}")


if __name__ == "__main__":
  cli.run(main)
