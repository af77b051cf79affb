"""Shared test utilities: running the entry points as a user would."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name: str, *args: str, check: bool = True, timeout: int = 600,
               env: dict | None = None) -> subprocess.CompletedProcess:
  """Runs ``scripts/NAME`` in a fresh Python process; returns the completed process."""
  full_env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  full_env.pop("XLA_FLAGS", None)  # one CPU device, as on a user's laptop
  full_env.update(env or {})
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *args],
                        capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
  if check and proc.returncode != 0:
    raise AssertionError(f"{name} {' '.join(args)} exited {proc.returncode}:\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
  return proc
