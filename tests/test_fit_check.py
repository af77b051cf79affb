"""The fit check of train.py, sample.py and evaluate.py: before anything is allocated or
written (or a parameter read), the compiled programs' memory against the devices' (here a
simulated small limit, --config.memory_limit_gib or --memory_limit_gib); a run that does not fit
exits 2 with one line naming a setting that fits, found by compiling it."""

import os
import re
import shutil

import numpy as np
import pytest

from helpers import ROOT, run_script

SIZE = r"[\d.]+ [KMG]iB"
FEW_STEPS = ["--config.total_steps=2", "--config.eval_every=0"]


def test_a_run_that_does_not_fit_names_a_setting_that_does(tmp_path):
  workdir = tmp_path / "run"
  limit = "--config.memory_limit_gib=0.1"  # the default model's step needs ~290 MiB
  proc = run_script("train.py", "--workdir", str(workdir), limit, *FEW_STEPS, check=False)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
  assert re.match(r"error: does not fit: the training step needs [\d.]+ MiB per device, "
                  r"102\.4 MiB available: use ", lines[0]), lines[0]
  assert list(workdir.iterdir()) == []  # nothing written (the run's lock, taken, released)
  flags = re.findall(r"--config\.[\w.]+=\w+", lines[0])
  assert any(f.startswith("--config.optimizer.grad_accum_steps=") for f in flags), flags
  # The suggestion, applied, passes the check and trains.
  run_script("train.py", "--workdir", str(workdir), limit, *FEW_STEPS, *flags)
  assert (workdir / "checkpoints" / "2").is_dir()


def test_parameters_and_optimizer_state_larger_than_the_limit_are_refused_at_once(tmp_path):
  proc = run_script("train.py", "--workdir", str(tmp_path / "run"),
                    "--config.memory_limit_gib=0.001", *FEW_STEPS, check=False)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      line for line in proc.stderr.strip().splitlines()
      if line.startswith("error: does not fit: the parameters and optimizer state alone need")]
  assert "--config.zero=3 over at least" in proc.stderr
  assert "compiling alternatives" not in proc.stdout


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """A tiny MQA checkpoint (byte tokenizer; its decoding cache grows with the tokens), and a
  copy whose parameters are junk: a script that reads none before its check refuses it alike."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import checkpoint  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  from test_model import tiny_config  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("fit")
  cfg = tiny_config(family="mqa", vocab_size=259, num_layers=2)
  model = model_lib.init_model(cfg, seed=0)
  checkpoint.save_model(str(root / "model"), nnx.to_pure_dict(nnx.state(model)), cfg,
                        tokenizer="byte")
  shutil.copytree(root / "model", root / "junk")
  shutil.rmtree(root / "junk" / "params")
  (root / "junk" / "params").mkdir()
  (root / "junk" / "params" / "junk").write_bytes(b"junk")
  return root


def _refusal(proc, flag):
  """The one error line of a refusal and the value it suggests for ``flag``."""
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
  m = re.fullmatch(rf"error: does not fit: .* needs {SIZE} per device, {SIZE} available: use "
                   rf"{flag}=(\d+) \(compiled: {SIZE} per device\)", lines[0])
  assert m, lines[0]
  return lines[0], int(m.group(1))


def test_sampling_that_does_not_fit_names_a_max_new_tokens_that_does(checkpoints):
  # ~400 bytes of decoding cache and outputs per token: 512 tokens take ~290 KiB, 256 ~190
  limit = "--memory_limit_gib=0.000225"
  args = ["--prompt=def f(x):", limit]
  proc = run_script("sample.py", f"--checkpoint={checkpoints / 'junk'}", "--max_new_tokens=512",
                    *args, check=False)
  line, suggested = _refusal(proc, "--max_new_tokens")
  assert line.startswith("error: does not fit: sampling 512 tokens after a 10-token prompt "
                         "needs "), line
  assert 0 < suggested < 512 and proc.stdout == ""
  # The suggestion, applied, passes the check and samples (the check's line on stderr).
  proc = run_script("sample.py", f"--checkpoint={checkpoints / 'model'}",
                    f"--max_new_tokens={suggested}", *args)
  assert proc.stdout.startswith("def f(x):") and proc.stdout.endswith("\n")
  assert re.search(rf"^compiled sampling {suggested} tokens after a 10-token prompt in "
                   rf"[\d.]+ s: {SIZE} per device of 235\.9 KiB$", proc.stderr, re.M), proc.stderr


def test_evaluation_that_does_not_fit_names_a_batch_size_that_does(checkpoints, tmp_path):
  from recurrentgemma_jax import checkpoint, evaluation  # pylint: disable=g-import-not-at-top
  tokens = np.random.default_rng(0).integers(0, 259, size=(5, 512)).astype(np.int32)
  np.save(tmp_path / "tokens.npy", tokens)
  # 5 rows of 512 tokens take ~30 MiB (attention scores and logits in float32), 2 rows ~8
  args = [f"--tokens={tmp_path / 'tokens.npy'}", f"--nll_out={tmp_path / 'nll.npy'}",
          "--memory_limit_gib=0.02"]
  proc = run_script("evaluate.py", f"--checkpoint={checkpoints / 'junk'}", "--batch_size=8",
                    *args, check=False)
  line, suggested = _refusal(proc, "--batch_size")
  # (5 rows: the batch is never larger than the rows)
  assert line.startswith("error: does not fit: the forward pass over 5 rows of 512 tokens "
                         "needs "), line
  assert 0 < suggested < 5 and not (tmp_path / "nll.npy").exists()
  proc = run_script("evaluate.py", f"--checkpoint={checkpoints / 'model'}",
                    f"--batch_size={suggested}", *args)
  assert re.match(rf"compiled the forward pass over {suggested} rows of 512 tokens in [\d.]+ s: "
                  rf"{SIZE} per device of 20\.5 MiB\n", proc.stdout), proc.stdout
  model, _ = checkpoint.load_model(str(checkpoints / "model"))
  np.testing.assert_allclose(np.load(tmp_path / "nll.npy"),
                             evaluation.token_nll(model, tokens, batch_size=5), rtol=1e-5,
                             atol=1e-5)


def test_a_program_that_fits_is_checked_before_any_parameter_is_read(checkpoints, tmp_path):
  np.save(tmp_path / "tokens.npy", np.zeros((2, 8), np.int32))
  proc = run_script("evaluate.py", f"--checkpoint={checkpoints / 'junk'}",
                    f"--tokens={tmp_path / 'tokens.npy'}", f"--nll_out={tmp_path / 'nll.npy'}",
                    check=False)
  assert proc.returncode == 2
  assert proc.stdout.startswith("compiled the forward pass over 2 rows of 8 tokens in ")
  assert proc.stderr.startswith("error: checkpoint ") and "cannot restore 'params'" in proc.stderr


def test_a_device_out_of_memory_while_compiling_is_named_as_such(monkeypatch):
  """When the device itself runs out of memory while compiling (e.g. another process holds
  a GPU's memory), the compiler gives no size: the one line says so, not 'needs 0.0 KiB'."""
  from recurrentgemma_jax import aot, configlib, train  # pylint: disable=g-import-not-at-top
  config = configlib.load(os.path.join(ROOT, "configs", "default.py"))
  plan = train.setup(config)
  error = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB"
  monkeypatch.setattr(aot, "_compile", lambda lowered: aot.Program(
      None, aot.Memory(), 0.0, error, out_of_memory=True))
  with pytest.raises(configlib.ConfigError) as refused:
    aot.fit_check(config, plan)
  message = str(refused.value)
  assert message.startswith("the step did not compile: the device ran out of memory while "
                            "compiling") and error in message and "0.0 KiB" not in message
  assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in message and "\n" not in message


def test_a_kernel_out_of_shared_memory_is_not_called_a_device_out_of_memory(monkeypatch):
  """A Pallas kernel whose tiles exceed an SM's shared memory (as the gate kernel's float32
  tiles once did on an H100) gets its own line, with the XLA paths that avoid the kernels."""
  from recurrentgemma_jax import aot, configlib, train  # pylint: disable=g-import-not-at-top
  config = configlib.load(os.path.join(ROOT, "configs", "default.py"))
  plan = train.setup(config)
  error = ("RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested 327680, "
           "available: 232448")
  class Failing:
    def compile(self):
      raise RuntimeError(error)
  compiled = aot._compile(Failing())
  assert compiled.compiled is None and not compiled.out_of_memory
  monkeypatch.setattr(aot, "_compile", lambda lowered: compiled)
  with pytest.raises(aot.CompileError) as refused:
    aot.fit_check(config, plan)
  message = str(refused.value)
  assert "shared memory" in message and "327680" in message and "out of memory" not in message
  assert "--config.model.gate_impl=xla" in message and "\n" not in message
