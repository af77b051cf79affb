"""Bad input gets one clear line naming what is wrong, exit status 2, and no traceback."""

import importlib.util
import os

import numpy as np
import pytest

from helpers import ROOT, run_script


def load_script(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("bad")
  (root / "garbage.model").write_bytes(b"this is not a sentencepiece model")
  (root / "not_a_checkpoint").mkdir()
  (root / "not_a_checkpoint" / "params").mkdir()
  (root / "not_a_checkpoint" / "model_config").mkdir()
  (root / "not_a_checkpoint" / "params" / "junk").write_bytes(b"junk")
  np.save(root / "tokens_1d.npy", np.arange(5))
  np.save(root / "tokens.npy", np.zeros((2, 4), np.int32))
  np.savez(root / "tokens.npz", tokens=np.zeros((2, 4), np.int32))
  (root / "run" / "checkpoints").mkdir(parents=True)  # a workdir before its first checkpoint
  (root / "file").write_text("x")
  (root / "exists").mkdir()
  (root / "typo.py").write_text(
      "from recurrentgemma_jax import configlib\n\n"
      "def get_config(arg=None):\n"
      "  c = configlib.base_config()\n"
      "  c.optimizer.learnig_rate = 1e-5\n"
      "  return c\n")
  return root


TRAIN_CASES = [
    # (arguments, a piece of the one error line)
    (["--config.model.widht=3"], "unknown config field 'model.widht'"),
    (["--config.model.family=rwkv"], "model.family='rwkv' is not one of griffin|hawk|mqa|gla"),
    (["--config.model.width=30", "--config.model.num_heads=4"],
     "model.num_heads=4 does not divide model.width=30"),
    (["--config.data.source=text", "--config.data.paths=/nonexistent/*.txt"],
     "data.paths='/nonexistent/*.txt' matches no file"),
    (["--config.data.tokenizer={root}/garbage.model"], "data.tokenizer="),
    (["--config", "{root}/nope.py"], "nope.py' does not exist"),
    (["--config", "{root}"], "is a directory; name a config file in it"),
    (["--config", os.path.join(ROOT, "configs", "default.py") + ":400m"],
     "configs/default.py takes no argument, got '400m'; for a model size use e.g. "
     "configs/griffin.py:400m"),
    (["--config", os.path.join(ROOT, "configs", "griffin.py") + ":999m"],
     "griffin size '999m' is not one of"),
    (["--config", os.path.join(ROOT, "configs", "synthetic.py") + ":induction_heads,gla"],
     "synthetic model 'gla' is not one of griffin|hawk|mqa"),
    (["--config.batch_size=abc"], "--config.batch_size='abc' is not a valid int"),
    (["--config.seq_len=-5"], "seq_len="),
    (["--config.model.lru_width=-8"], "model.lru_width=-8 must be a positive integer"),
    (["--config.zero=2"], "zero=2 is not one of 0|1|3"),
    (["--config.mesh.data=3"], "mesh.data=3"),
    (["--config.mesh.slices=3"], "mesh.slices=3 does not divide the data axis"),
    (["--config.optimizer.schedule=linear"], "optimizer.schedule='linear' is not one of"),
    (["--config.optimizer.grad_accum_steps=3", "--config.batch_size=4"],
     "optimizer.grad_accum_steps=3 does not divide"),
    (["--frobnicate"], "unknown argument '--frobnicate'"),
    (["--config.init_from=/nonexistent/ckpt"], "init_from='/nonexistent/ckpt' does not exist"),
    (["--config.init_from={root}/not_a_checkpoint"], "'model_config' is empty"),
    (["--config.model.scan_impl=cuda"], "model.scan_impl='cuda' is not one of"),
    (["--config.model.attention_impl=flash"], "model.attention_impl='flash' is not one of"),
    (["--config.model.attention_impl=cudnn"], "model.attention_impl='cudnn' needs NVIDIA GPUs"),
    (["--config.model.dtype=float16"], "model.dtype='float16' is not one of"),
    (["--config.model.family=gla", "--config.model.gla_expand_k=0.3"], "model.gla_expand_k=0.3"),
    (["--config.data.source=synthetic", "--config.data.synthetic.task=sorting"],
     "data.synthetic.task='sorting'"),
    # Typos in a config file, values that would crash or train on NaN, forgotten sources.
    (["--config", "{root}/typo.py"],
     "sets unknown field 'optimizer.learnig_rate' (did you mean 'optimizer.learning_rate'?)"),
    (["--config.model.mlp_expanded_width=-5"], "model.mlp_expanded_width=-5 must be a positive"),
    (["--config.model.num_gate_blocks=-1"], "model.num_gate_blocks=-1 must be a positive"),
    (["--config.model.family=gla", "--config.model.gla_chunk_size=0"], "gla_chunk_size=0"),
    (["--config.model.logits_soft_cap=nan"], "model.logits_soft_cap=nan must be >= 0"),
    (["--config.seed=-1"], "seed=-1 must be an integer in [0, 2**32)"),
    (["--config.memory_limit_gib=inf"], "memory_limit_gib=inf must be >= 0"),
    (["--config.optimizer.b1=2"], "optimizer.b1=2.0 must be in [0, 1)"),
    (["--config.optimizer.weight_decay=nan"], "optimizer.weight_decay=nan must be >= 0"),
    (["--config.data.shuffle=maybe"], "is not a valid bool (true|1|yes|on|false|0|no|off)"),
    (["--config.data.paths=/some/file.txt"], "data.source='builtin' does not read files"),
    (["--config.data.eval_fraction=0.999"], "has 0 train documents, 1 needed"),
    (["--config", os.path.join(ROOT, "configs", "synthetic.py") + ":induction_heads,hawk",
      "--config.model.family=gla"], "model.block_types has 'recurrent', which a gla model"),
]


@pytest.mark.parametrize("args,expected", TRAIN_CASES, ids=[c[1][:40] for c in TRAIN_CASES])
def test_train_rejects_bad_input_with_one_line(args, expected, files, tmp_path, capsys):
  train = load_script("train")
  args = [a.format(root=files) for a in args]
  with pytest.raises(SystemExit) as exit_info:
    train.main(["train.py", f"--workdir={tmp_path / 'run'}", "--config.total_steps=1", *args])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: "), err
  assert expected.format(root=files) in err[0], err
  assert not os.path.exists(tmp_path / "run" / "checkpoints")  # nothing ran


@pytest.mark.parametrize("workdir,expected", [
    ("gs://bucket/run", "is a URL; it must be a directory every process sees"),
    ("{root}/not_a_checkpoint", "holds a model checkpoint, not a training run; to train from its"
                                " weights use --config.init_from="),
])
def test_a_workdir_that_cannot_hold_a_run_is_one_line(workdir, expected, files, capsys):
  with pytest.raises(SystemExit) as exit_info:
    load_script("train").main(["train.py", f"--workdir={workdir.format(root=files)}"])
  assert exit_info.value.code == 2
  [line] = capsys.readouterr().err.strip().splitlines()
  assert expected in line, line
  assert not os.path.exists("gs:") and not os.path.exists(files / "not_a_checkpoint" / "lock")


def test_total_steps_below_the_latest_checkpoint_is_one_line(tmp_path):
  tiny = ["--config.model.width=32", "--config.model.lru_width=32", "--config.model.num_layers=1",
          "--config.model.num_heads=2", "--config.model.num_gate_blocks=2",
          "--config.model.mlp_expanded_width=64", "--config.batch_size=2", "--config.seq_len=16",
          "--config.data.eval_tokens=32", "--config.eval_every=0"]
  run_script("train.py", f"--workdir={tmp_path}", *tiny, "--config.total_steps=2")
  proc = run_script("train.py", f"--workdir={tmp_path}", *tiny, "--config.total_steps=1",
                    check=False)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  [line] = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert "total_steps=1 is below step 2, the latest checkpoint" in line, line
  assert "compiling" not in proc.stdout


@pytest.mark.parametrize("script,flag", [("train", "--help"), ("compile_tpu", "-h")])
def test_help_lists_the_flags_and_every_config_field_with_its_value(script, flag, tmp_path,
                                                                   capsys):
  module = load_script(script)
  with pytest.raises(SystemExit) as exit_info:
    module.main([f"{script}.py", f"--workdir={tmp_path / 'run'}",
                 "--config", os.path.join(ROOT, "configs", "hawk.py") + ":400m",
                 "--config.batch_size=48", flag])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith(module.__doc__.strip().splitlines()[0])  # the script's usage
  assert "  --workdir: " in out and "configs/hawk.py:400m" in out
  if script == "compile_tpu":
    assert "  --topology: a Cloud TPU slice name" in out
  fields = [line.strip() for line in out.splitlines() if line.startswith("  --config.")]
  assert "--config.batch_size=48" in fields  # the command line's override
  assert "--config.model.family=hawk" in fields and "--config.model.width=1536" in fields
  from recurrentgemma_jax import cli, configlib  # pylint: disable=g-import-not-at-top
  config = configlib.family_config("hawk", "400m")
  assert len(fields) == len(cli.config_fields(config)) > 50  # every leaf field, once
  assert not os.path.exists(tmp_path / "run")  # nothing ran


def test_boolean_fields_take_every_documented_spelling():
  """configlib's yes/no/on/off, ``--field value`` and a bare ``--field`` (true): absl's own
  boolean flags, which parse the overrides again, refused the first two forms."""
  from recurrentgemma_jax import cli  # pylint: disable=g-import-not-at-top
  default = os.path.join(ROOT, "configs", "default.py")
  for args, shuffle, scaled in (
      (["--config.data.shuffle=no"], False, False),
      (["--config.data.shuffle=on"], True, False),
      (["--config.data.shuffle", "false", "--config.model.embeddings_scale_by_sqrt_dim"],
       False, True),
      (["--config.model.embeddings_scale_by_sqrt_dim", "--config.data.shuffle", "0"],
       False, True)):
    config, _ = cli.parse_config_flags(["train.py", *args, "--config.total_steps", "3"],
                                       default_config=default)
    assert (config.data.shuffle, config.model.embeddings_scale_by_sqrt_dim,
            config.total_steps) == (shuffle, scaled, 3), args


def test_a_renamed_field_names_its_replacement(tmp_path, capsys):
  with pytest.raises(SystemExit):
    load_script("train").main(["train.py", f"--workdir={tmp_path}", "--config.data.eval_batches=2"])
  [line] = capsys.readouterr().err.strip().splitlines()
  assert "replaced by data.eval_tokens" in line, line


def test_attention_impl_is_only_checked_where_the_model_has_attention():
  """A sweep's ``--config.model.attention_impl=cudnn`` must not reject a GLA or Hawk model
  (no attention blocks); a Griffin model still gets its one line off NVIDIA GPUs."""
  from recurrentgemma_jax import configlib  # pylint: disable=g-import-not-at-top
  for family, size in (("gla", "340m"), ("hawk", "400m")):
    config = configlib.family_config(family, size)
    config.model.attention_impl = "cudnn"
    configlib.validate(config)
  config = configlib.family_config("griffin", "400m")
  config.model.attention_impl = "cudnn"
  with pytest.raises(configlib.ConfigError, match="model.attention_impl='cudnn' needs"):
    configlib.validate(config)  # (the tests run on the CPU)


@pytest.mark.parametrize("script,args,expected", [
    ("evaluate", ["--checkpoint=/nonexistent", "--tokens={root}/tokens.npy",
                  "--nll_out={root}/o.npy"], "checkpoint '/nonexistent' does not exist"),
    ("evaluate", ["--checkpoint={root}/not_a_checkpoint", "--tokens={root}/tokens.npy",
                  "--nll_out={root}/o.npy"], "not_a_checkpoint"),
    ("evaluate", ["--checkpoint={root}/exists", "--tokens={root}/tokens.npy",
                  "--nll_out={root}/o.npy"], "has no 'params' and 'model_config' items"),
    ("evaluate", ["--checkpoint={root}/exists", "--tokens={root}/tokens_1d.npy",
                  "--nll_out={root}/o.npy"], "expected integers of shape [N, T]"),
    ("evaluate", ["--checkpoint={root}/exists", "--tokens={root}/tokens.npz",
                  "--nll_out={root}/o.npy"], "is an .npz archive; save one array with np.save"),
    ("evaluate", ["--checkpoint={root}/run", "--tokens={root}/tokens.npy",
                  "--nll_out={root}/o.npy"], "is a training workdir with no checkpoint yet"),
    ("evaluate", ["--checkpoint={root}/file", "--tokens={root}/tokens.npy",
                  "--nll_out={root}/o.npy"], "is a file; expected a directory"),
    ("evaluate", ["--checkpoint={root}/exists", "--tokens={root}/tokens.npy",
                  "--nll_out={root}/o"], "--nll_out '{root}/o' must end in .npy"),
    ("evaluate", ["--checkpoint={root}/exists", "--tokens={root}/tokens.npy",
                  "--nll_out={root}/o.npy", "--train_len=-5"], "--train_len=-5 must be >= 0"),
    ("evaluate", ["--checkpoint={root}/exists", "--tokens={root}/tokens.npy",
                  "--nll_out={root}/o.npy", "--train_len=32"],
     "--train_len=32 only marks the --plot; add --plot"),
    ("sample", ["--checkpoint=/nonexistent", "--prompt=x", "--top_k=40"],
     "--top_k applies only when sampling; --temperature=0 decodes greedily"),
    ("sample", ["--checkpoint=/nonexistent", "--prompt=x", "--temperature=nan"],
     "--temperature=nan must be >= 0"),
    ("sample", ["--checkpoint=/nonexistent", "--prompt=x", "--temperature=1", "--top_p=1.5"],
     "--top_p=1.5 must be in (0, 1]"),
    ("import_recurrentgemma", ["--src=/nonexistent", "--dst={root}/x"], "is not a directory"),
    ("import_recurrentgemma", ["--src={root}/exists", "--dst={root}/exists"], "already exists"),
    ("import_recurrentgemma", ["--src={root}/not_a_checkpoint", "--dst={root}/y"],
     "is already a recurrentgemma_jax checkpoint"),
    ("import_recurrentgemma", ["--src={root}/exists", "--dst={root}/y"],
     "is not a readable Orbax checkpoint"),
])
def test_other_scripts_reject_bad_input_with_one_line(script, args, expected, files, capsys):
  module = load_script(script)
  with pytest.raises(SystemExit) as exit_info:
    module.main([a.format(root=files) for a in args])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: "), err
  assert expected.format(root=files) in err[0], err


def test_a_user_error_prints_no_traceback_from_the_command_line(tmp_path):
  proc = run_script("train.py", f"--workdir={tmp_path}", "--config.model.family=rwkv",
                    check=False)
  assert proc.returncode == 2
  assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_init_from_with_other_settings_that_keep_the_shapes_warns(tmp_path, monkeypatch, capsys):
  import dataclasses
  from recurrentgemma_jax import checkpoint, configlib
  from recurrentgemma_jax import model as model_lib
  ours = model_lib.ModelConfig(vocab_size=259, width=32, num_layers=3, num_heads=2,
                               logits_soft_cap=0.0, embeddings_scale_by_sqrt_dim=False)
  saved = dataclasses.replace(ours, logits_soft_cap=30.0, embeddings_scale_by_sqrt_dim=True,
                              block_types=("recurrent", "recurrent", "global_attention"))
  monkeypatch.setattr(checkpoint, "resolve_model_dir", lambda path: path)
  monkeypatch.setattr(checkpoint, "read_model_config", lambda path: (saved, {}))
  assert configlib._init_from_errors(str(tmp_path), ours) == []  # allowed, and said
  [message] = capsys.readouterr().err.splitlines()
  assert message.startswith("warning: init_from")
  assert "model.logits_soft_cap=30.0 -> 0.0" in message
  assert "model.embeddings_scale_by_sqrt_dim=True -> False" in message
  assert "model.block_types (local and global attention)" in message
  assert configlib._init_from_errors(str(tmp_path / "x"), ours)  # (does not exist: an error)
  # Ids of another vocabulary: a SentencePiece checkpoint fine-tuned on byte ids, or back.
  monkeypatch.setattr(checkpoint, "read_model_config",
                      lambda path: (ours, {"tokenizer": "/ckpt/tokenizer.model"}))
  [line] = configlib._init_from_errors(str(tmp_path), ours, "byte")
  assert "was trained with the tokenizer '/ckpt/tokenizer.model'" in line
  assert "data.tokenizer='byte'" in line
  assert "set --config.data.tokenizer=/ckpt/tokenizer.model" in line
  assert configlib._init_from_errors(str(tmp_path), ours, "/other/tokenizer.model") == []
  monkeypatch.setattr(checkpoint, "read_model_config", lambda path: (ours, {"tokenizer": "byte"}))
  assert "trained with the tokenizer 'byte'" in configlib._init_from_errors(
      str(tmp_path), ours, "/ckpt/tokenizer.model")[0]
