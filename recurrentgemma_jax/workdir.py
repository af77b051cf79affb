"""One run per workdir: the lock a training run holds for its whole life.

``WORKDIR/lock`` names its holder (host, pid, start time) and is held with ``flock`` by
process 0 of the run (one lock per run, not per process). A second run exits 2 at once naming
the holder. A lock left behind by a run that was killed on this host (the ``flock`` died with
it) is taken over with a note; one left by a run on another host is refused, since its
liveness cannot be read from here, with the command that clears it.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket

from recurrentgemma_jax.errors import ConfigError

LOCK = "lock"


def check(workdir: str) -> None:
  """Reads only (every process runs it, before anything compiles): a workdir must be a local or
  mounted directory, and not a model checkpoint. ConfigError otherwise."""
  if not workdir.strip():  # os.path.abspath("") is the current directory
    raise ConfigError("--workdir is empty; name the run's directory (--workdir=runs/NAME), "
                      "which is created if needed")
  if "://" in workdir:  # os.path would make gs://b/run a local "gs:/b/run" found at the first save
    raise ConfigError(f"--workdir {workdir!r} is a URL; it must be a directory every process "
                      "sees (for a bucket, a gcsfuse mount of it)")
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f"--workdir {workdir!r} exists and is not a directory")
  from recurrentgemma_jax import checkpoint  # pylint: disable=g-import-not-at-top  (jax, orbax)
  if checkpoint.is_model_dir(path):
    raise ConfigError(f"--workdir {workdir!r} holds a model checkpoint, not a training run; to "
                      f"train from its weights use --config.init_from={workdir} with a new "
                      "--workdir")


def prepare(workdir: str) -> str:
  """Creates ``workdir`` (and its parents) if needed, after ``check``. Returns the absolute
  path."""
  check(workdir)
  path = os.path.abspath(workdir)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"--workdir {workdir!r} cannot be created: {e.strerror}") from None
  return path


def _describe(holder: dict) -> str:
  return (f"the run of pid {holder.get('pid')} on host {holder.get('host')!r} "
          f"(started {holder.get('since')})")


class WorkdirLock:
  """``with WorkdirLock(workdir, log) as lock:`` holds ``WORKDIR/lock`` (``lock.note`` says
  whether a dead run's lock was taken over). Released (the file removed) on exit, whatever
  the exit; after SIGKILL the kernel releases the ``flock`` and the file stays."""

  def __init__(self, workdir: str):
    self.workdir = prepare(workdir)
    self.path = os.path.join(self.workdir, LOCK)
    self.fd: int | None = None
    self.note = ""

  def acquire(self) -> "WorkdirLock":
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        raise ConfigError(
            f"--workdir {self.workdir} is in use by {_describe(holder)}; one run per workdir "
            f"(wait for it, stop it, or use another --workdir)") from None
      try:  # a run that released the lock between our open and flock removed the file
        same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
      except FileNotFoundError:
        same = False
      if same:
        break
      os.close(fd)
    holder = _read(fd)
    if holder:  # never released: its run was killed (the flock died with it)
      if holder.get("host") != socket.gethostname():
        os.close(fd)
        raise ConfigError(
            f"--workdir {self.workdir} was locked by {_describe(holder)} and not released; "
            f"if that run is no longer running, remove {self.path} and start again")
      self.note = (f"taking over the lock of {_describe(holder)}, which is no longer running")
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    os.fsync(fd)
    self.fd = fd
    return self

  def release(self) -> None:
    if self.fd is None:
      return
    try:  # removed while held, so that a waiting opener sees a new file (see acquire)
      os.unlink(self.path)
    except FileNotFoundError:
      pass
    os.close(self.fd)
    self.fd = None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def _read(fd: int) -> dict:
  try:
    size = os.fstat(fd).st_size
    text = os.pread(fd, size, 0).decode(errors="replace") if size else ""
    return json.loads(text) if text.strip() else {}
  except (OSError, ValueError):
    return {"host": "?", "pid": "?", "since": "?"}
