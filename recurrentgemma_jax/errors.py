"""Errors a user can act on."""


class ConfigError(ValueError):
  """A config value or a file it names is not usable; the message names it and what is allowed."""


class CheckpointError(ValueError):
  """A checkpoint is missing, partial or malformed; the message names the path and the problem."""


# Checkpoint directories whose parameters could not be read, already named in one line (an
# error or a fallback's warning): TensorStore's reads of their other arrays, left unawaited by
# Orbax, report the same failure again (``cli.quiet_background_failures`` drops those).
UNREADABLE: set[str] = set()


def first_line(e: BaseException, limit: int = 300) -> str:
  """The first line of an exception's message (library errors can be pages long)."""
  text = str(e).strip()
  return text.splitlines()[0][:limit] if text else type(e).__name__
