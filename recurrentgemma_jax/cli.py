"""What every entry point shares: one-line errors instead of tracebacks, flag parsing, and
the CPU without libtpu's start-up attempt on a machine that has no accelerator."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import logging
import os
import sys
import traceback

from absl import logging as absl_logging

from recurrentgemma_jax import errors
from recurrentgemma_jax.errors import CheckpointError, ConfigError, first_line

USER_ERRORS = (ConfigError, CheckpointError)

# train.py's exit code after a Ctrl-C (the shell's for an interrupt), the step in progress saved;
# how the scripts that run trainings report one.
INTERRUPTED = 130
INTERRUPTED_RUN = "interrupted (Ctrl-C; its step is saved: rerun to continue)"

# Device nodes of the accelerators JAX runs on: NVIDIA (and WSL's), AMD, TPUs (v4: accel; v5e
# and later: vfio).
_ACCELERATOR_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg", "/dev/kfd", "/dev/accel*",
                      "/dev/vfio")
_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips (and some of Google's other devices)


def accelerator_present() -> bool:
  """Whether this machine may have an accelerator: any of its device nodes, or a PCI device of
  Google's (a TPU). Errs towards yes."""
  if any(glob.glob(node) for node in _ACCELERATOR_NODES):
    return True
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      with open(vendor) as f:
        if f.read().strip() == _GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return False


def cpu_without_accelerators() -> None:
  """On a machine without an accelerator where libtpu is installed (``.[tpu]``, ``.[test]``:
  the TPU compile), JAX still tries libtpu's TPU backend at start-up, and libtpu prints five
  lines of missing-metadata errors before JAX falls back to the CPU. There, the entry points
  choose the CPU up front (``JAX_PLATFORMS=cpu``); an explicit ``JAX_PLATFORMS`` or
  ``JAX_FORCE_TPU_INIT``, and any machine with an accelerator, are left alone."""
  if os.environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in os.environ:
    return
  if importlib.util.find_spec("libtpu") is None or accelerator_present():
    return
  # Read when jax is imported, which every entry point does after importing this module.
  os.environ["JAX_PLATFORMS"] = "cpu"


cpu_without_accelerators()  # (on import: every entry point imports this module first)


@contextlib.contextmanager
def user_errors():
  """Turns a user error into ``error: <line>`` lines on stderr (one per problem), exit 2."""
  try:
    yield
  except USER_ERRORS as e:
    lines = [line for line in str(e).splitlines() if line.strip()] or [first_line(e)]
    for line in lines:
      print(f"error: {line[:1000]}", file=sys.stderr)
    sys.exit(2)


_QUIETED = []  # (quiet_background_failures once per process: the tests call mains again)


def quiet_background_failures() -> None:
  """A checkpoint write that fails in Orbax's background threads is reported by the run in one
  line (``train.Checkpoints``), and so is a damaged checkpoint that a script cannot read
  (``checkpoint.restore_newest``). Orbax also logs the failure, with a traceback, from each
  thread and task it passed through (absl and asyncio loggers), and TensorStore reads and
  writes that finish after Orbax closed its event loop print ``Event loop is closed``
  tracebacks (hundreds of lines), and asyncio reports reads of a checkpoint already named
  unreadable that no one awaited (``errors.UNREADABLE``): those repeats are dropped. Every
  other log record and exception is untouched. For every entry point that reads or writes
  checkpoints."""
  if _QUIETED:
    return
  _QUIETED.append(True)
  orbax = f"{os.sep}orbax{os.sep}"

  def keep(record: logging.LogRecord) -> bool:
    if not record.exc_info:
      return True
    # asyncio's "Future exception was never retrieved" for such a read (its exception comes
    # from TensorStore, without Python frames): named by path, as the one line named it.
    failure = str(record.exc_info[1])
    if any(f'"{path}{os.sep}' in failure for path in errors.UNREADABLE):
      return False
    if orbax in record.pathname or ".orbax-checkpoint-tmp" in record.getMessage():
      return False
    return not any(orbax in frame.filename
                   for frame in traceback.extract_tb(record.exc_info[2]))

  absl_logging.get_absl_logger().addFilter(keep)
  logging.getLogger("asyncio").addFilter(keep)
  previous = sys.unraisablehook  # (how TensorStore reports an exception in its callbacks)

  def hook(unraisable):
    value = unraisable.exc_value
    if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
      return
    # A damaged checkpoint's read: each of Orbax's reading coroutines left unawaited reports
    # its array's failure again (a page of TensorStore's spec each).
    if unraisable.exc_traceback is not None and any(
        orbax in frame.filename for frame in traceback.extract_tb(unraisable.exc_traceback)):
      return
    previous(unraisable)

  sys.unraisablehook = hook


def split_config_flags(args: list[str]) -> tuple[list[str], list[str]]:
  """``(overrides, unknown)``: ``--config.a.b=v`` and ``--config.a.b v`` (joined to the first
  form) versus every other argument."""
  overrides, unknown = [], []
  i = 0
  while i < len(args):
    item = args[i]
    if (item.startswith("--config.") and "=" not in item and i + 1 < len(args)
        and not args[i + 1].startswith("--")):  # (a bare boolean field: --config.a.flag)
      item, i = f"{item}={args[i + 1]}", i + 1
    (overrides if item.startswith("--config.") else unknown).append(item)
    i += 1
  return overrides, unknown


def _config_spec(args: list[str], default: str) -> tuple[str, list[str]]:
  """The ``--config`` value (``--config=SPEC`` or ``--config SPEC``) and the other args."""
  spec, rest, i = default, [], 0
  while i < len(args):
    if args[i] == "--config" and i + 1 < len(args):
      spec, i = args[i + 1], i + 2
      continue
    if args[i].startswith("--config="):
      spec = args[i].split("=", 1)[1]
    else:
      rest.append(args[i])
    i += 1
  return spec, rest


HELP_FLAGS = ("-h", "--help", "--helpfull")


def config_fields(config, prefix: str = "") -> list[tuple[str, object]]:
  """``(dotted name, value)`` of every leaf field of a ConfigDict, in its order."""
  out = []
  for name, value in config.items():
    if hasattr(value, "items"):
      out += config_fields(value, f"{prefix}{name}.")
    else:
      out.append((f"{prefix}{name}", value))
  return out


def help_text(usage: str, spec: str, config, values, names) -> str:
  """``--help``'s text: the script's usage, its own flags, then every config field as the
  ``--config.FIELD=VALUE`` that sets it, with the value it has in ``spec`` (and the command
  line's overrides)."""
  path, colon, arg = spec.partition(":")
  shown = (os.path.relpath(path) if os.path.exists(path) else path) + colon + arg
  lines = [usage.strip(), "", "Flags:",
           f"  --config=FILE[:ARG]: a config file and its argument (now {shown})"]
  lines += [f"  --{name}: {values[name].help} (default {values[name].default!r})"
            for name in names]
  lines += ["", f"Config fields of {shown}, as set by --config.FIELD=VALUE:"]
  lines += [f"  --config.{name}={value!r}" if isinstance(value, str) and not value
            else f"  --config.{name}={value}" for name, value in config_fields(config)]
  return "\n".join(lines)


def parse_config_flags(argv: list[str], *, default_config: str, define=None, usage: str = ""):
  """A config script's command line (``argv[0]`` is the program) through absl flags:
  ``--config=FILE[:ARG]`` and ``--config.FIELD=VALUE`` with ``ml_collections.config_flags``,
  the script's own flags with ``define(flag_values) -> {name: FlagHolder}``. Returns
  ``(config, {name: value})``.

  The config fields are checked first by ``configlib`` (one ConfigError line naming the
  field, the value and what is allowed); a FlagValues of its own per call lets a script's
  ``main`` run more than once in a process (the tests do). ``-h`` / ``--help``: prints
  ``usage``, the flags and every config field with its value (``help_text``), then exits 0.
  """
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import configlib  # pylint: disable=g-import-not-at-top

  spec, rest = _config_spec(list(argv[1:]), default_config)
  overrides, others = split_config_flags(rest)  # (the others are absl's to parse)
  config = configlib.load(spec)
  configlib.override(config, overrides)  # our one-line errors first
  # absl gets each override as configlib parsed it: its boolean flags take neither
  # yes/no/on/off nor a separate value (--config.data.shuffle false).
  rest = [configlib.canonical(config, item) for item in overrides] + others

  values = flags.FlagValues()
  if any(arg in HELP_FLAGS for arg in rest):
    holders = define(values) if define else {}
    print(help_text(usage or f"usage: {os.path.basename(argv[0])}", spec, config, values,
                    list(holders)))
    sys.exit(0)
  argv = [argv[0], f"--config={spec}", *rest]
  holder = config_flags.DEFINE_config_file(
      "config", None, "a config file and its argument, FILE[:ARG]", flag_values=values,
      lock_config=False, sys_argv=argv)
  holders = define(values) if define else {}
  try:
    positional = values(argv)[1:]
  except flags.UnrecognizedFlagError as e:
    raise ConfigError(f"unknown argument '--{e.flagname}' (use --config.FIELD=VALUE to set a "
                      "field)") from None
  except Exception as e:  # pylint: disable=broad-except  (absl and config_flags raise many)
    raise ConfigError(first_line(e)) from None
  if positional:
    raise ConfigError(f"unknown argument {positional[0]!r}")
  return holder.value, {name: h.value for name, h in holders.items()}


def run_trainings(main) -> None:
  """``main()`` of a script that runs trainings as subprocesses: a Ctrl-C, which reaches them
  too (each saves its step and stops), is one line and exit ``INTERRUPTED``."""
  try:
    main()
  except KeyboardInterrupt:
    print("interrupted (Ctrl-C): each training saves the step it is at; rerun the same command "
          "to resume", file=sys.stderr)
    sys.exit(INTERRUPTED)


def run(main) -> None:
  """``absl.app.run(main)`` with the whole command line left to ``main``, which parses it
  (:func:`parse_config_flags`); absl's global flags keep their defaults."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top

  def absl_flags_only(argv):
    flags.FLAGS(argv[:1])
    return argv

  def quiet_main(argv):
    absl_logging.set_verbosity(absl_logging.WARNING)  # (Orbax logs every step at INFO)
    return main(argv)

  app.run(quiet_main, flags_parser=absl_flags_only)


def parse_bool(value: str) -> bool:
  lowered = str(value).lower()
  if lowered in ("1", "true", "yes", "on"):
    return True
  if lowered in ("0", "false", "no", "off"):
    return False
  raise ValueError(f"expected true or false, got {value!r}")
