"""Trains a model; rerunning the same command resumes from the latest checkpoint.

  python scripts/train.py [--config=configs/NAME.py[:ARG]] [--workdir=DIR] [--config.FIELD=VALUE ...]

With no arguments it trains the default small Griffin (configs/default.py) on the built-in
corpus into ./workdir. Metrics go to DIR/metrics.jsonl and DIR/tensorboard, checkpoints to
DIR/checkpoints; DIR/lock keeps a second run out. SIGTERM saves the current step and exits 0
(on several processes: all save the same step), and so does a hang-up (SIGHUP: the terminal or
tmux session closed); Ctrl-C too, then exits 130 (a second Ctrl-C exits at once, keeping what
is saved). Flags are absl flags, the config through
ml_collections.config_flags.
"""

import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from recurrentgemma_jax import cli  # pylint: disable=g-import-not-at-top

DEFAULT_CONFIG = os.path.join(ROOT, "configs", "default.py")


def define_flags(flag_values):
  from absl import flags  # pylint: disable=g-import-not-at-top
  return {"workdir": flags.DEFINE_string(
      "workdir", "workdir", "checkpoints, metrics and the run's lock", flag_values=flag_values)}


def _exit_zero(signum, frame):  # pylint: disable=unused-argument
  """SIGTERM outside the training loop: before it nothing was written, after it everything was
  saved, so the process ends at once and successfully."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # pylint: disable=protected-access  (no teardown: nothing is left to save)


def _exit_interrupted(signum, frame):  # pylint: disable=unused-argument
  """Ctrl-C outside the training loop (which saves the step in progress first): as SIGTERM,
  nothing unsaved is lost; the exit code is the shell's for an interrupt."""
  sys.stdout.flush()
  print("interrupted (Ctrl-C)", file=sys.stderr, flush=True)
  os._exit(cli.INTERRUPTED)  # pylint: disable=protected-access


def main(argv: list[str]) -> None:
  """``argv``: the command line, program name first."""
  # The training loop installs its own SIGTERM, SIGHUP and SIGINT handlers (save the step,
  # then stop) and restores these when it ends.
  signal.signal(signal.SIGTERM, _exit_zero)
  signal.signal(signal.SIGHUP, _exit_zero)  # (a terminal or tmux session closed)
  signal.signal(signal.SIGINT, _exit_interrupted)
  # A file-size limit makes writes fail (EFBIG: a checkpoint that cannot be written stops the
  # run with one line) instead of killing the process.
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  cli.quiet_background_failures()
  with cli.user_errors():
    config, flags = cli.parse_config_flags(argv, default_config=DEFAULT_CONFIG,
                                           define=define_flags,
                                           usage=__doc__)
    from recurrentgemma_jax import train  # pylint: disable=g-import-not-at-top
    try:
      train.run(config, flags["workdir"])
      # The run is over and saved; the process only exits now. Python's finalisation puts a
      # handled signal back to its default (killed: -15) before JAX's teardown, which can take a
      # while; an ignored one stays ignored, so a late SIGTERM still ends in exit 0.
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
      signal.signal(signal.SIGHUP, signal.SIG_IGN)
    except train.Interrupted:  # the step in progress saved, the line printed
      sys.stdout.flush()
      sys.exit(cli.INTERRUPTED)
    except train.NonFiniteLoss as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(3)
    except train.SaveFailed as e:
      print(f"error: {e}", file=sys.stderr, flush=True)
      sys.stdout.flush()
      os._exit(2)  # pylint: disable=protected-access  (see SaveFailed)


if __name__ == "__main__":
  cli.run(main)
