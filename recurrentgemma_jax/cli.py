"""What every entry point shares: one-line errors instead of tracebacks, flag parsing."""

from __future__ import annotations

import contextlib
import sys

from recurrentgemma_jax.errors import CheckpointError, ConfigError, first_line

USER_ERRORS = (ConfigError, CheckpointError)


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


def split_config_flags(args: list[str]) -> tuple[list[str], list[str]]:
  """``(overrides, unknown)``: ``--config.a.b=v`` and ``--config.a.b v`` (joined to the first
  form) versus every other argument."""
  overrides, unknown = [], []
  i = 0
  while i < len(args):
    item = args[i]
    if item.startswith("--config.") and "=" not in item and i + 1 < len(args):
      item, i = f"{item}={args[i + 1]}", i + 1
    (overrides if item.startswith("--config.") else unknown).append(item)
    i += 1
  return overrides, unknown


def parse_bool(value: str) -> bool:
  lowered = str(value).lower()
  if lowered in ("1", "true", "yes", "on"):
    return True
  if lowered in ("0", "false", "no", "off"):
    return False
  raise ValueError(f"expected true or false, got {value!r}")
