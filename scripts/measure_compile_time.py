"""Seconds to lower and to compile a config's training step, with the layer scan
(``model.scan_layers``) on and off: for this machine's CPU, or with ``--topology`` for a Cloud
TPU slice through libtpu's compile-only devices (as ``scripts/compile_tpu.py``; the training
step alone). Nothing is allocated: the step is lowered on the abstract train state and batch.

  python scripts/measure_compile_time.py --config configs/griffin.py:400m \
      --config.model.scan_impl=xla_linear --config.batch_size=8 [--scan_layers=true,false] \
      [--topology v5e-8]
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from recurrentgemma_jax import cli  # pylint: disable=g-import-not-at-top


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=os.path.join(ROOT, "configs", "griffin.py") + ":400m")
  parser.add_argument("--scan_layers", default="true,false",
                      help="comma-separated settings to measure, in order")
  parser.add_argument("--topology", default="", help="a Cloud TPU slice name (default: CPU)")
  args, rest = parser.parse_known_args(argv)
  overrides, bad = cli.split_config_flags(rest)
  if bad:
    print(f"error: unknown argument {bad[0]!r}", file=sys.stderr)
    sys.exit(2)

  with cli.user_errors():
    from recurrentgemma_jax import aot, configlib, train  # pylint: disable=g-import-not-at-top
    devices = aot.parse_slice(args.topology).devices() if args.topology else None
    for setting in args.scan_layers.split(","):
      config = configlib.load(args.config)
      configlib.override(config, overrides + [f"--config.model.scan_layers={setting}"])
      plan = train.setup(config, devices)
      batch = aot.abstract_batch(config, plan.batch_sharding)
      step = plan.jit_train_step(config.optimizer.grad_accum_steps)
      started = time.perf_counter()
      lowered = step.lower(plan.abstract_state, batch)
      lowered_at = time.perf_counter()
      lowered.compile()
      done = time.perf_counter()
      print(json.dumps({
          "config": args.config, "scan_layers": plan.model_cfg.scan_layers,
          "layers": plan.model_cfg.num_layers, "scan_repeats": plan.model_cfg.scan_repeats,
          "lower_s": round(lowered_at - started, 1), "compile_s": round(done - lowered_at, 1),
          "total_s": round(done - started, 1), "hlo_chars": len(lowered.as_text()),
          "devices": f"{plan.mesh.size} {plan.mesh.devices.flat[0].device_kind}"}), flush=True)


if __name__ == "__main__":
  main()
