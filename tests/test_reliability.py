"""A run never loses work: one run per workdir, checkpoints of another model refused (not
renamed), a save that cannot be written, quiet exits, preemption agreed across two processes,
and kills at random moments (SIGKILL and SIGTERM) against an uninterrupted run, bit for bit."""

import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from helpers import ROOT, script_env

# A model that compiles in seconds; one block of each kind in the default griffin pattern.
TINY = ["--config.model.width=32", "--config.model.lru_width=32", "--config.model.num_layers=3",
        "--config.model.num_heads=2", "--config.model.num_gate_blocks=2",
        "--config.model.mlp_expanded_width=64", "--config.model.attention_window_size=8",
        "--config.batch_size=4", "--config.seq_len=32", "--config.data.eval_tokens=256",
        "--config.optimizer.warmup_steps=2"]
NOISE = ("Traceback", "Exception ignored", "Event loop is closed")


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  """JAX's persistent compilation cache, shared by this module's runs: a restarted run loads
  its compiled steps instead of compiling them again (what a user can set too)."""
  return str(tmp_path_factory.mktemp("xla_cache"))


def env(cache=None):
  """A script's environment; with ``cache``, this module's compilation cache, else none (not
  even the suite's: conftest.py)."""
  e = {k: v for k, v in script_env().items() if not k.startswith(("JAX_COMPILATION_CACHE",
                                                                    "JAX_PERSISTENT_CACHE"))}
  if cache:
    e.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return e


def train_cmd(workdir, *extra):
  return [sys.executable, os.path.join(ROOT, "scripts", "train.py"), f"--workdir={workdir}",
          *TINY, *extra]


def train(workdir, *extra, cache=None, preexec_fn=None, timeout=600):
  return subprocess.run(train_cmd(workdir, *extra), env=env(cache), cwd=ROOT, text=True,
                        capture_output=True, timeout=timeout, preexec_fn=preexec_fn)


def records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def saved_steps(workdir):
  directory = os.path.join(workdir, "checkpoints")
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def final_params(workdir, step):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  path = os.path.join(workdir, "checkpoints", str(step), "params")
  return ocp.PyTreeCheckpointer().restore(path)


def assert_quiet(proc):
  output = proc.stdout + proc.stderr
  assert not any(n in output for n in NOISE), output[-3000:]


# --- one run per workdir ---------------------------------------------------------------------

class Started:
  """A run in the background; ``wait_for(text)`` blocks until a line containing it appears."""

  def __init__(self, cmd, environment):
    self.proc = subprocess.Popen(cmd, env=environment, cwd=ROOT, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    self.lines: list[str] = []
    self.changed = threading.Condition()
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self):
    for line in self.proc.stdout:
      with self.changed:
        self.lines.append(line)
        self.changed.notify_all()
    with self.changed:
      self.lines.append(None)
      self.changed.notify_all()

  def wait_for(self, text, timeout=300) -> bool:
    """True once a line contains ``text``; False if the process ended first."""
    deadline = time.time() + timeout
    with self.changed:
      while True:
        if any(line is not None and text in line for line in self.lines):
          return True
        if self.lines and self.lines[-1] is None:
          return False
        assert time.time() < deadline, "".join(filter(None, self.lines))[-3000:]
        self.changed.wait(timeout=1)

  def output(self) -> str:
    self.proc.wait(timeout=300)
    with self.changed:
      while not self.lines or self.lines[-1] is not None:
        self.changed.wait(timeout=1)
    return "".join(filter(None, self.lines))


def test_a_second_run_on_the_same_workdir_exits_at_once_naming_the_first(tmp_path, compile_cache):
  first = Started(train_cmd(tmp_path, "--config.total_steps=100000", "--config.log_every=1",
                            "--config.eval_every=0"), env(compile_cache))
  try:
    assert first.wait_for("step 1/")
    started = time.time()
    second = train(tmp_path, "--config.total_steps=3", cache=compile_cache)
    assert second.returncode == 2
    assert time.time() - started < 60  # at once: before anything compiles
    [line] = second.stderr.strip().splitlines()
    assert line.startswith(f"error: --workdir {tmp_path} is in use by the run of pid "
                           f"{first.proc.pid} on host {socket.gethostname()!r}"), line
    assert "compiling" not in second.stdout
    lines = [r["step"] for r in records(tmp_path) if "loss" in r]
    assert lines == sorted(set(lines))  # only the first run wrote metrics
  finally:
    first.proc.send_signal(signal.SIGTERM)
  assert first.proc.wait(timeout=120) == 0
  assert not os.path.exists(tmp_path / "lock")  # released at exit


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_note(tmp_path, compile_cache):
  run = Started(train_cmd(tmp_path, "--config.total_steps=100000", "--config.eval_every=0"),
                env(compile_cache))
  assert run.wait_for("step 0 of")
  run.proc.kill()
  run.output()
  holder = json.loads((tmp_path / "lock").read_text())
  assert holder["pid"] == run.proc.pid and holder["host"] == socket.gethostname()
  again = train(tmp_path, "--config.total_steps=2", "--config.eval_every=0",
                cache=compile_cache)
  assert again.returncode == 0, again.stderr[-2000:]
  assert f"note: taking over the lock of the run of pid {run.proc.pid}" in again.stdout
  assert not os.path.exists(tmp_path / "lock")


def test_a_lock_of_another_host_is_refused_with_the_way_out(tmp_path):
  (tmp_path / "lock").write_text(json.dumps({"host": "other-host", "pid": 7, "since": "then"}))
  proc = train(tmp_path, "--config.total_steps=2")
  assert proc.returncode == 2
  [line] = proc.stderr.strip().splitlines()
  assert "locked by the run of pid 7 on host 'other-host'" in line
  assert f"remove {tmp_path / 'lock'}" in line


def test_a_workdir_that_is_a_file_is_one_line(tmp_path):
  (tmp_path / "file").write_text("x")
  proc = train(tmp_path / "file", "--config.total_steps=1")
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      f"error: --workdir {str(tmp_path / 'file')!r} exists and is not a directory"]


def test_an_empty_workdir_is_one_line_and_writes_nothing(tmp_path):
  # os.path.abspath("") is the current directory: the run trained into it.
  proc = subprocess.run(train_cmd("", "--config.total_steps=1"), env=env(), cwd=tmp_path,
                        text=True, capture_output=True, timeout=600)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      "error: --workdir is empty; name the run's directory (--workdir=runs/NAME), which is "
      "created if needed"]
  assert not os.listdir(tmp_path)


def test_ctrl_c_saves_the_step_in_progress_exits_130_and_the_rerun_resumes(tmp_path,
                                                                            compile_cache):
  steps = ["--config.total_steps=100000", "--config.log_every=1", "--config.eval_every=0",
           "--config.checkpoint_every=100000"]
  run = Started(train_cmd(tmp_path, *steps), env(compile_cache))
  assert run.wait_for("step 3/"), run.output()[-3000:]
  run.proc.send_signal(signal.SIGINT)
  output = run.output()
  assert run.proc.returncode == 130, output[-3000:]
  assert not any(n in output for n in NOISE + ("KeyboardInterrupt",)), output[-3000:]
  [step] = saved_steps(tmp_path)  # no periodic checkpoint: only the interrupted step's
  assert step >= 3 and f"stopped by signal 2 (Ctrl-C) after saving step {step}" in output
  again = Started(train_cmd(tmp_path, *steps), env(compile_cache))
  assert again.wait_for(f"step {step + 2}/"), again.output()[-3000:]
  # Ctrl-C twice: the second exits at once, whatever the first had started to save.
  again.proc.send_signal(signal.SIGINT)
  again.proc.send_signal(signal.SIGINT)
  output = again.output()
  assert f"resuming from {tmp_path}/checkpoints/{step}" in output, output[-3000:]
  assert again.proc.returncode == 130 and "Traceback" not in output, output[-3000:]
  assert saved_steps(tmp_path)[0] == step  # kept


def test_a_hang_up_saves_the_step_in_progress_and_exits_zero(tmp_path, compile_cache):
  # What closing the terminal, or tmux kill-session, sends (SIGHUP); tee, reading the run's
  # output, goes with it: the run's output is a closed pipe from then on.
  steps = ["--config.total_steps=100000", "--config.log_every=1", "--config.eval_every=0",
           "--config.checkpoint_every=100000"]
  proc = subprocess.Popen(train_cmd(tmp_path, *steps), env=env(compile_cache), cwd=ROOT,
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  seen = []
  for line in proc.stdout:
    seen.append(line)
    if "step 3/" in line:
      break
  proc.send_signal(signal.SIGHUP)
  proc.stdout.close()  # (tee gone)
  assert proc.wait(timeout=300) == 0, "".join(seen)[-3000:]
  [step] = saved_steps(tmp_path)  # no periodic checkpoint: only the hung-up step's
  assert step >= 3
  assert [r["step"] for r in records(tmp_path) if "loss" in r] == list(range(1, step + 1))
  again = train(tmp_path, "--config.total_steps=" + str(step + 2), "--config.eval_every=0",
                cache=compile_cache)
  assert again.returncode == 0 and f"checkpoints/{step}" in again.stdout, again.stdout[-2000:]


def _tensorboard_events(workdir):
  """Every event of ``workdir/tensorboard``'s files (TFRecord framing: length, its CRC, the
  record, its CRC), oldest file first."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  events = []
  for name in sorted(os.listdir(os.path.join(workdir, "tensorboard"))):
    with open(os.path.join(workdir, "tensorboard", name), "rb") as f:
      blob = f.read()
    at = 0
    while at < len(blob):
      length = int.from_bytes(blob[at:at + 8], "little")
      events.append(event_pb2.Event.FromString(blob[at + 12:at + 12 + length]))
      at += 12 + length + 4
  return events


def test_a_gone_reader_a_rewound_resume_and_another_data_source(tmp_path, compile_cache):
  # 1. The program reading the run's output ends (| head, a tee or less that quit): the run
  # trains on (its progress lines went to a broken pipe: BrokenPipeError, exit 1).
  steps = ["--config.log_every=1", "--config.eval_every=0", "--config.checkpoint_every=10"]
  proc = subprocess.Popen(train_cmd(tmp_path, "--config.total_steps=30", *steps),
                          env=env(compile_cache), cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  for line in proc.stdout:
    if "step 3/" in line:
      break
  proc.stdout.close()
  assert proc.wait(timeout=300) == 0
  assert saved_steps(tmp_path) == [10, 20, 30]
  assert [r["step"] for r in records(tmp_path) if "loss" in r] == list(range(1, 31))
  # 2. A resume before steps already logged (their checkpoint lost): metrics.jsonl drops them,
  # and TensorBoard is told to (a SessionLog START at the first step logged again).
  shutil.rmtree(tmp_path / "checkpoints" / "30")
  again = train(tmp_path, "--config.total_steps=30", *steps, cache=compile_cache)
  assert again.returncode == 0, again.stderr[-2000:]
  assert [r["step"] for r in records(tmp_path) if "loss" in r] == list(range(1, 31))
  starts = [e.step for e in _tensorboard_events(tmp_path)
            if e.HasField("session_log") and e.session_log.status == e.session_log.START]
  assert starts == [21], starts
  # 3. Another data source with the same shapes: the data position cannot be restored, said.
  other = train(tmp_path, "--config.total_steps=32", *steps, "--config.data.source=synthetic",
                "--config.data.synthetic.task=induction_heads", "--config.model.vocab_size=259",
                cache=compile_cache)
  assert other.returncode == 0, other.stderr[-2000:]
  assert "warning: the checkpoint's data position does not fit this run's data" in other.stdout
  assert saved_steps(tmp_path)[-1] == 32


def test_a_rerun_after_a_run_that_saved_no_checkpoint_says_it_starts_at_step_0(tmp_path,
                                                                              compile_cache):
  # What a run killed before its first save leaves: its metrics, no checkpoint.
  (tmp_path / "metrics.jsonl").write_text("".join(
      json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3)))
  proc = train(tmp_path, "--config.total_steps=2", "--config.eval_every=0",
               "--config.log_every=1", cache=compile_cache)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert (f"note: no checkpoint in {tmp_path}/checkpoints, so this run starts at step 0; "
          "metrics.jsonl's 3 lines of the earlier run are replaced") in proc.stdout, proc.stdout
  assert [r["loss"] != 9.0 for r in records(tmp_path) if "loss" in r] == [True, True]


def test_ctrl_c_while_compiling_exits_at_once_with_one_line(tmp_path, compile_cache):
  run = Started(train_cmd(tmp_path, "--config.total_steps=5"), env(compile_cache))
  assert run.wait_for("compiling the training"), run.output()[-3000:]
  run.proc.send_signal(signal.SIGINT)
  output = run.output()
  assert run.proc.returncode == 130, output[-3000:]
  assert "interrupted (Ctrl-C): no step trained yet, nothing to save" in output, output[-3000:]
  assert not any(n in output for n in NOISE + ("KeyboardInterrupt",)), output[-3000:]
  assert not os.path.isdir(tmp_path / "checkpoints") or not saved_steps(tmp_path)


# --- resuming against another config ----------------------------------------------------------

def test_resuming_with_another_model_or_optimizer_is_refused_and_nothing_changes(
    tmp_path, compile_cache):
  steps = ["--config.total_steps=4", "--config.checkpoint_every=2", "--config.eval_every=0"]
  assert train(tmp_path, *steps, cache=compile_cache).returncode == 0
  before = sorted(os.listdir(tmp_path / "checkpoints"))
  metrics = (tmp_path / "metrics.jsonl").read_text()

  proc = train(tmp_path, *steps, "--config.model.width=48")
  assert proc.returncode == 2
  [line] = proc.stderr.strip().splitlines()
  assert "holds a run of another model: model.width is 32 in its checkpoint step 4 and 48" \
      in line and "use a new --workdir" in line, line
  proc = train(tmp_path, *steps, "--config.model.family=hawk")
  assert proc.returncode == 2 and "model.family is 'griffin'" in proc.stderr, proc.stderr
  proc = train(tmp_path, *steps, "--config.optimizer.grad_clip_norm=0")
  assert proc.returncode == 2
  [line] = proc.stderr.strip().splitlines()
  assert "another optimizer state: optimizer.grad_clip_norm is 1.0" in line, line
  assert f"--config.init_from={tmp_path / 'checkpoints' / '4'}" in line
  # Another kind of tokenizer: the same shapes, the ids of another vocabulary.
  sentencepiece = os.path.join(ROOT, "tests", "data", "hf", "griffin", "tokenizer.model")
  proc = train(tmp_path, *steps, f"--config.data.tokenizer={sentencepiece}",
               "--config.model.vocab_size=259")
  assert proc.returncode == 2
  [line] = proc.stderr.strip().splitlines()
  assert "holds a run trained with the tokenizer 'byte'" in line, line
  assert "Rerun with --config.data.tokenizer=byte" in line
  assert sorted(os.listdir(tmp_path / "checkpoints")) == before  # nothing renamed
  assert (tmp_path / "metrics.jsonl").read_text() == metrics  # nothing written

  # Settings that keep the shapes resume, with one line listing what changed.
  proc = train(tmp_path, "--config.total_steps=6", "--config.checkpoint_every=2",
               "--config.eval_every=0", "--config.optimizer.learning_rate=0.002",
               "--config.model.remat=block", cache=compile_cache)
  assert proc.returncode == 0, proc.stderr[-2000:]
  [line] = [l for l in proc.stdout.splitlines() if "changed settings" in l]
  assert "model.remat 'none' -> 'block'" in line and "optimizer.learning_rate" in line
  assert "total_steps 4 -> 6" in line
  assert "changed on resume" not in proc.stderr  # the held-out split is the same
  assert saved_steps(tmp_path)[-1] == 6
  # A setting that moves documents between the splits resumes with a warning saying so.
  proc = train(tmp_path, "--config.total_steps=8", "--config.checkpoint_every=2",
               "--config.eval_every=0", "--config.optimizer.learning_rate=0.002",
               "--config.model.remat=block", "--config.data.eval_fraction=0.1",
               cache=compile_cache)
  assert proc.returncode == 0, proc.stderr[-2000:]
  [line] = [l for l in proc.stderr.splitlines() if "changed on resume" in l]
  assert line.startswith("warning: data.eval_fraction changed on resume: documents held out "
                         "now may have been trained on"), line
  assert saved_steps(tmp_path)[-1] == 8


# --- a save that cannot be written --------------------------------------------------------------

def test_a_checkpoint_that_cannot_be_written_stops_with_one_line_and_keeps_the_last(
    tmp_path, compile_cache):
  steps = ["--config.checkpoint_every=2", "--config.eval_every=0"]
  assert train(tmp_path, "--config.total_steps=2", *steps, cache=compile_cache).returncode == 0

  def small_files():  # a file-size limit below one optimizer-state file
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

  proc = train(tmp_path, "--config.total_steps=6", *steps, preexec_fn=small_files)
  assert proc.returncode == 2
  [line] = proc.stderr.strip().splitlines()
  assert line.startswith(f"error: could not write checkpoint step 4 in {tmp_path}/checkpoints"
                         ) and "File too large" in line and line.endswith(
                             "the latest checkpoint is step 2"), line
  assert saved_steps(tmp_path) == [2]
  # Without the limit, the run resumes from step 2 and finishes.
  proc = train(tmp_path, "--config.total_steps=6", *steps, cache=compile_cache)
  assert proc.returncode == 0 and "resuming from" in proc.stdout, proc.stderr[-2000:]
  assert saved_steps(tmp_path)[-1] == 6
  assert_quiet(proc)


# --- quiet exits --------------------------------------------------------------------------------

def test_exits_are_quiet(tmp_path, compile_cache):
  done = train(tmp_path / "a", "--config.total_steps=3", "--config.eval_every=2",
               cache=compile_cache)
  assert done.returncode == 0
  assert_quiet(done)
  # The start line says which blocks the model has (a Griffin-family model may list any mix).
  assert "griffin model: " in done.stdout and " parameters, 3 blocks: 2 recurrent, " \
      "1 attention; mesh data=1 model=1 on 1 cpu" in done.stdout, done.stdout[:2000]
  user_error = train(tmp_path / "a", "--config.total_steps=3", "--config.model.width=64")
  assert user_error.returncode == 2
  assert_quiet(user_error)
  run = Started(train_cmd(tmp_path / "b", "--config.total_steps=100000",
                          "--config.log_every=1", "--config.eval_every=0"), env(compile_cache))
  assert run.wait_for("step 2/")
  run.proc.send_signal(signal.SIGTERM)
  output = run.output()
  assert run.proc.returncode == 0
  assert not any(n in output for n in NOISE), output[-3000:]


def test_a_cpu_run_where_libtpu_is_installed_prints_nothing_of_it(tmp_path, compile_cache):
  # The test extras install libtpu (the TPU compile); on a machine without an accelerator a run
  # that leaves JAX_PLATFORMS unset, as a user's does, must not start with libtpu's errors.
  import importlib.util  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import cli  # pylint: disable=g-import-not-at-top
  if cli.accelerator_present():
    pytest.skip("this machine has an accelerator: the platforms are JAX's choice there")
  assert importlib.util.find_spec("libtpu") is not None  # (installed by the test extras)
  e = {k: v for k, v in env(compile_cache).items() if k != "JAX_PLATFORMS"}
  done = subprocess.run(train_cmd(tmp_path, "--config.total_steps=1", "--config.eval_every=0"),
                        env=e, cwd=ROOT, text=True, capture_output=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "TPU" not in done.stderr and "libtpu" not in done.stderr, done.stderr[-3000:]
  assert "on 1 cpu" in done.stdout, done.stdout[-3000:]


# --- preemption across processes ----------------------------------------------------------------

def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_one_of_two_processes_saves_the_same_step_on_both(tmp_path, compile_cache,
                                                                      sig):
  # Ctrl-C and a hang-up join JAX's preemption sync point as a SIGTERM would; after a Ctrl-C
  # its process exits 130.
  address = f"localhost:{_free_port()}"
  procs = []
  for i in range(2):
    e = env(compile_cache)
    e.update(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
    procs.append(Started(train_cmd(tmp_path, "--config.total_steps=100000",
                                   "--config.log_every=1", "--config.eval_every=0",
                                   "--config.checkpoint_every=100000"), e))
  assert procs[0].wait_for("step 3/")
  procs[1].proc.send_signal(sig)  # only the second process is signalled
  outputs = [p.output() for p in procs]
  assert [p.proc.returncode for p in procs] == [0, 130 if sig == signal.SIGINT else 0], (
      outputs[0][-2000:] + outputs[1][-2000:])
  assert not any(n in out for n in NOISE for out in outputs), outputs[1][-2000:]
  [step] = saved_steps(tmp_path)
  assert f"stopped by signal 15 after saving step {step}" in outputs[0]
  assert step >= 3
  saved = json.loads((tmp_path / "checkpoints" / str(step) / "data" / "metadata").read_text())
  assert saved  # the data position of that step was written


def test_sigterm_while_starting_exits_zero_with_one_line_and_no_checkpoint(tmp_path,
                                                                          compile_cache):
  # Signalled while compiling: the run stops before its first step, says that nothing was
  # saved, and exits cleanly (on Python 3.12 an unclosed TensorBoard writer that never wrote
  # printed a traceback at exit).
  run = Started(train_cmd(tmp_path, "--config.total_steps=5"), env(compile_cache))
  assert run.wait_for("compiling the training"), run.output()[-3000:]
  run.proc.send_signal(signal.SIGTERM)
  output = run.output()
  assert run.proc.returncode == 0, output[-3000:]
  assert not any(n in output for n in NOISE), output[-3000:]
  assert ("stopped by signal 15 before training; no checkpoint was written (a new run starts"
          " from scratch)") in output, output[-3000:]
  assert not saved_steps(tmp_path)


# A training process whose interpreter teardown takes seconds, as JAX's can on a loaded machine:
# an object of the __main__ module, destroyed after Python has reset its signal handlers.
_SLOW_TEARDOWN = """
import os, runpy, sys, time
class SlowTeardown:
  def __del__(self):
    os.write(1, b"tearing down\\n")
    time.sleep(5)
keep = SlowTeardown()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_sigterm_after_the_run_ended_still_exits_zero(tmp_path, compile_cache):
  # CI once saw -15: the signal came after "done", in the interpreter's teardown.
  cmd = train_cmd(tmp_path, "--config.total_steps=2", "--config.eval_every=0")
  run = Started([sys.executable, "-c", _SLOW_TEARDOWN, *cmd[1:]], env(compile_cache))
  assert run.wait_for("tearing down"), run.output()[-3000:]
  run.proc.send_signal(signal.SIGTERM)
  output = run.output()
  assert "done: step 2" in output, output[-3000:]
  assert run.proc.returncode == 0, output[-3000:]


def test_a_finished_run_run_again_says_so_before_compiling_unless_its_evaluation_is_missing(
    tmp_path, compile_cache):
  first = train(tmp_path, "--config.total_steps=2", cache=compile_cache)
  assert first.returncode == 0, first.stderr[-2000:]
  logged = (tmp_path / "metrics.jsonl").read_text()
  again = train(tmp_path, "--config.total_steps=2", cache=compile_cache)
  assert again.returncode == 0, again.stderr[-2000:]
  assert f"done already: step 2 of 2 is in {tmp_path}/checkpoints" in again.stdout
  assert "compiling" not in again.stdout, again.stdout
  assert (tmp_path / "metrics.jsonl").read_text() == logged
  # Stopped between its last save and its evaluation: the rerun evaluates.
  kept = [line for line in logged.splitlines(keepends=True) if "eval_loss" not in line
          or json.loads(line)["step"] != 2]
  (tmp_path / "metrics.jsonl").write_text("".join(kept))
  last = train(tmp_path, "--config.total_steps=2", cache=compile_cache)
  assert last.returncode == 0, last.stderr[-2000:]
  assert "step 2: eval loss" in last.stdout and "done already" not in last.stdout
  assert [r["step"] for r in records(tmp_path) if "eval_loss" in r][-1] == 2


# --- fault injection ----------------------------------------------------------------------------

FAULT_STEPS = ["--config.total_steps=48", "--config.log_every=1", "--config.checkpoint_every=3",
               "--config.eval_every=5", "--config.keep_checkpoints=2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, compile_cache):
  """The reference run, and how long it trains (from its model line to its exit)."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  run = Started(train_cmd(workdir, *FAULT_STEPS), env(compile_cache))
  assert run.wait_for(" of 48")
  started = time.time()
  output = run.output()
  assert run.proc.returncode == 0, output[-2000:]
  return workdir, time.time() - started


def _assert_same_run(workdir, reference):
  got, want = records(workdir), records(reference)
  losses = [r["step"] for r in got if "loss" in r]
  assert losses == list(range(1, 49)), losses  # every step logged exactly once
  assert {r["step"]: r["loss"] for r in got if "loss" in r} == {
      r["step"]: r["loss"] for r in want if "loss" in r}  # bitwise equal losses
  evals = [r["step"] for r in got if "eval_loss" in r]
  assert evals == [5, 10, 15, 20, 25, 30, 35, 40, 45, 48], evals
  assert saved_steps(workdir)[-1] == 48
  a, b = final_params(workdir, 48), final_params(reference, 48)
  import jax  # pylint: disable=g-import-not-at-top
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _interrupt_at_random_moments(tmp_path, cache, reference, duration, rng, interrupt,
                                 count=12):
  """Starts the fault run, ``interrupt(run, workdir, restorable)``s it (``restorable``: it
  started with a checkpoint to resume from) at a uniformly random moment of the next twelfth of
  its uninterrupted training time (a fresh run: after its first save), and restarts it,
  ``count`` times. A workdir
  whose run completed between interruptions is checked against ``reference`` and the next
  interruptions go to a fresh one; the last is run to its end and checked too."""
  def finish(workdir):  # the same command once more: it completes what is left (an evaluation)
    final = train(workdir, *FAULT_STEPS, cache=cache)
    assert final.returncode == 0, final.stderr[-2000:]
    _assert_same_run(workdir, reference)

  workdir, done = tmp_path / "run0", 0
  interrupted = 0
  while interrupted < count:
    if os.path.isdir(workdir / "checkpoints") and saved_steps(workdir)[-1:] == [48]:
      finish(workdir)
      done += 1
      workdir = tmp_path / f"run{done}"
    restorable = os.path.isdir(workdir / "checkpoints") and bool(saved_steps(workdir))
    run = Started(train_cmd(workdir, *FAULT_STEPS), env(cache))
    assert run.wait_for(" of 48"), run.output()[-3000:]  # the model line: restored or new
    if not restorable:
      # A fresh run first saves once, so that the next start resumes: on a loaded machine the
      # random moment below came before the first save again and again (2 of 20 resumes).
      deadline = time.time() + 120
      while run.proc.poll() is None and time.time() < deadline and not (
          os.path.isdir(workdir / "checkpoints") and saved_steps(workdir)):
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, duration / 12))
    if run.proc.poll() is not None:  # it finished first: nothing to interrupt
      assert run.output() and run.proc.returncode == 0
      continue
    interrupt(run, workdir, restorable)
    interrupted += 1
  finish(workdir)


@pytest.mark.slow  # 1-2 minutes on 2 CPU cores: 12 restarts of about 8 s each (cached compiles)
def test_sigkill_and_sigterm_at_random_moments_lose_nothing(tmp_path, compile_cache,
                                                            uninterrupted):
  """SIGKILL and SIGTERM in turn, 6 each: killed in a step, an asynchronous save, its commit,
  the metrics write, an evaluation or the final wait, every resume must continue the same run;
  terminated, the run exits 0 having saved the step in progress."""
  resumed, saved, signals = [], [], []

  def interrupt(run, workdir, restorable):
    signals.append("kill" if len(signals) % 2 == 0 else "term")
    if signals[-1] == "kill":
      run.proc.kill()
      run.output()
      # Whether the killed run had resumed (its "resuming from" line may not be out yet when a
      # loaded machine slows the restore down).
      resumed.append(restorable)
      return
    run.proc.send_signal(signal.SIGTERM)
    output = run.output()
    assert run.proc.returncode == 0, output[-3000:]
    assert not any(n in output for n in NOISE), output[-3000:]
    if "after saving step" in output:
      step = int(output.split("after saving step ")[1].split()[0])
      assert saved_steps(workdir)[-1] == step  # a checkpoint of that very step
      saved.append(step)

  _interrupt_at_random_moments(tmp_path, compile_cache, *uninterrupted, random.Random(0),
                               interrupt)
  assert signals.count("kill") == signals.count("term") == 6, signals
  assert sum(resumed) >= 3, resumed
  assert len(saved) >= 3, saved
