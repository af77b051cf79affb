"""Trains a model; rerunning the same command resumes from the latest checkpoint.

  python scripts/train.py [--config configs/NAME.py[:ARG]] [--workdir DIR] [--config.FIELD=VALUE ...]

With no arguments it trains the default small Griffin (configs/default.py) on the built-in
corpus into ./workdir. Metrics go to DIR/metrics.jsonl and DIR/tensorboard, checkpoints to
DIR/checkpoints. SIGTERM saves the current step and exits 0.
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from recurrentgemma_jax import cli  # pylint: disable=g-import-not-at-top


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   usage="%(prog)s [--config FILE[:ARG]] [--workdir DIR] "
                                         "[--config.FIELD=VALUE ...]")
  parser.add_argument("--config", default=os.path.join(ROOT, "configs", "default.py"))
  parser.add_argument("--workdir", default="workdir")
  args, rest = parser.parse_known_args(argv)
  overrides, bad = cli.split_config_flags(rest)
  if bad:
    print(f"error: unknown argument {bad[0]!r} (use --config.FIELD=VALUE to set a field)",
          file=sys.stderr)
    sys.exit(2)

  with cli.user_errors():
    from recurrentgemma_jax import configlib, train  # pylint: disable=g-import-not-at-top
    config = configlib.load(args.config)
    configlib.override(config, overrides)
    try:
      train.run(config, args.workdir)
    except train.NonFiniteLoss as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(3)


if __name__ == "__main__":
  main()
