"""The training job end to end: every family, TFDS, corrupt checkpoints, non-finite losses,
metrics, fine-tuning from an imported checkpoint. (Kills, SIGTERM and resumption:
test_reliability.py.)"""

import json
import os

import pytest

from helpers import ROOT, build_tiny_tfds, run_script

# A model that compiles in seconds; one block of each kind in the default griffin pattern.
TINY = ["--config.model.width=32", "--config.model.lru_width=32", "--config.model.num_layers=3",
        "--config.model.num_heads=2", "--config.model.num_gate_blocks=2",
        "--config.model.mlp_expanded_width=64", "--config.model.attention_window_size=8",
        "--config.batch_size=4", "--config.seq_len=32", "--config.data.eval_tokens=256",
        "--config.optimizer.warmup_steps=2"]


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def losses(workdir):
  return {m["step"]: m["loss"] for m in read_metrics(workdir) if "loss" in m}


@pytest.mark.parametrize("family", ["griffin", "hawk", "mqa", "gla"])
def test_every_family_trains_with_the_same_command(tmp_path, family):
  run_script("train.py", f"--workdir={tmp_path}", *TINY, f"--config.model.family={family}",
             "--config.total_steps=3", "--config.log_every=1", "--config.eval_every=3")
  metrics = read_metrics(tmp_path)
  train_lines = [m for m in metrics if "loss" in m]
  assert [m["step"] for m in train_lines] == [1, 2, 3]
  for m in train_lines:
    assert {"step", "loss", "tokens_per_sec", "step_time_s", "mfu"} <= set(m)
    assert m["loss"] > 0 and m["tokens_per_sec"] > 0
  assert metrics[-1]["step"] == 3 and metrics[-1]["eval_loss"] > 0
  assert 0 <= metrics[-1]["eval_accuracy"] <= 1
  assert os.listdir(tmp_path / "tensorboard")


def test_tfds_dataset_trains_through_the_user_path(tmp_path):
  docs = [f"document number {i}: " + "lorem ipsum dolor sit amet " * (i % 5 + 1)
          for i in range(40)]
  root = build_tiny_tfds(str(tmp_path / "tfds"), docs, ["a held-out line of text"] * 4)
  run_script("train.py", f"--workdir={tmp_path / 'run'}", *TINY, "--config.data.source=tfds",
             "--config.data.tfds_name=data_test_tiny_text", f"--config.data.tfds_data_dir={root}",
             "--config.total_steps=2", "--config.log_every=1")
  assert sorted(losses(tmp_path / "run")) == [1, 2]


def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path):
  steps = ["--config.total_steps=4", "--config.checkpoint_every=2", "--config.log_every=1",
           "--config.eval_every=0"]
  run = tmp_path / "run"
  run_script("train.py", f"--workdir={run}", *TINY, *steps)
  latest = run / "checkpoints" / "4" / "params"
  for dirpath, _, files in os.walk(latest):  # damage every file of the params item
    for name in files:
      with open(os.path.join(dirpath, name), "wb") as f:
        f.write(b"garbage")

  # Fine-tuning from the workdir starts from the step before, with one warning.
  def tuned(init_from, name):
    proc = run_script("train.py", f"--workdir={tmp_path / name}", *TINY, "--config.log_every=1",
                      "--config.total_steps=1", "--config.eval_every=0",
                      f"--config.init_from={init_from}")
    return losses(tmp_path / name)[1], proc.stderr
  loss, err = tuned(run, "tuned")
  assert f"checkpoint '{run}/checkpoints/4': cannot restore 'params'" in err, err
  assert "using the step before it, 2" in err and "Traceback" not in err, err
  assert loss == tuned(run / "checkpoints" / "2", "tuned_from_2")[0]

  out = run_script("train.py", f"--workdir={run}", *TINY, *steps).stdout
  assert "checkpoint step 4 is unreadable" in out and "resuming from" in out
  assert any(d.startswith("4.unreadable") for d in os.listdir(run / "checkpoints"))
  assert os.path.isdir(run / "checkpoints" / "4")  # redone from step 2


def test_non_finite_loss_stops_with_the_step_and_keeps_the_checkpoint(tmp_path):
  proc = run_script("train.py", f"--workdir={tmp_path}", *TINY, "--config.total_steps=30",
                    "--config.checkpoint_every=2", "--config.log_every=5",
                    "--config.optimizer.learning_rate=1e30",
                    "--config.optimizer.grad_clip_norm=0", "--config.optimizer.warmup_steps=0",
                    check=False)
  assert proc.returncode == 3, proc.stdout + proc.stderr
  [line] = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert "at step" in line, line
  bad_step = int(line.split("at step ")[1].split(";")[0])
  saved = sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
  if "no checkpoint was written" not in line:
    good = int(line.split("last checkpoint is step ")[1].split()[0])
    assert good < bad_step and good == saved[-1]
  assert all(s < bad_step for s in saved)


def test_parameters_made_non_finite_by_a_step_are_not_saved(tmp_path):
  # A learning rate that is inf in float32: step 1's loss (of the initial parameters) and
  # gradients are finite, its update is not. The checkpoint of step 1 must not be written.
  proc = run_script("train.py", f"--workdir={tmp_path}", *TINY, "--config.total_steps=3",
                    "--config.checkpoint_every=1", "--config.log_every=1",
                    "--config.optimizer.learning_rate=1e39",
                    "--config.optimizer.warmup_steps=0", check=False)
  assert proc.returncode == 3, proc.stdout + proc.stderr
  [line] = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert "after step 1 are not finite; not saved, no checkpoint was written" in line, line
  assert not [d for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()]


def test_fine_tuning_starts_from_an_imported_official_checkpoint(tmp_path):
  rg = pytest.importorskip("recurrentgemma.jax")
  import jax.numpy as jnp
  import numpy as np
  import orbax.checkpoint as ocp
  import sentencepiece as spm
  from recurrentgemma_jax import checkpoint, configlib, data, train
  from test_official_parity import official_model_and_params

  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n".join(f"line {i}: the cat sat on the mat {i % 7}" for i in range(300)))
  spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"),
                                 vocab_size=101, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                                 hard_vocab_limit=False, minloglevel=2)
  _, params = official_model_and_params(
      [rg.TemporalBlockType.RECURRENT, rg.TemporalBlockType.ATTENTION], seed=5)
  ocp.PyTreeCheckpointer().save(str(tmp_path / "official"), params)
  run_script("import_recurrentgemma.py", f"--src={tmp_path / 'official'}",
             f"--dst={tmp_path / 'imported'}", "--attention_window_size=5")

  config = configlib.load(os.path.join(ROOT, "configs", "recurrentgemma.py") + ":2b")
  config.model.update(width=48, lru_width=48 + 16, mlp_expanded_width=80, num_heads=4,
                      num_gate_blocks=4, num_layers=2, block_types="recurrent,attention",
                      attention_window_size=5, vocab_size=101, dtype="float32", remat="none")
  config.update(init_from=str(tmp_path / "imported"), total_steps=1, batch_size=8, seq_len=16,
                log_every=1, eval_every=0, checkpoint_every=1)
  with open(tmp_path / "docs.jsonl", "w") as f:
    for line in corpus.read_text().splitlines():
      f.write(json.dumps({"text": line}) + "\n")
  config.data.update(source="jsonl", paths=str(tmp_path / "docs.jsonl"),
                     tokenizer=str(tmp_path / "sp.model"), eval_tokens=128)
  train.run(config, str(tmp_path / "run"))
  first_loss = losses(tmp_path / "run")[1]

  # The loss of step 1 is the imported model's loss on the first batch.
  model, _ = checkpoint.load_model(str(tmp_path / "imported"), dtype="float32")
  batch = next(data.make_train_iterator(config))
  logits = model(jnp.asarray(batch["inputs"]), jnp.asarray(batch["segment_pos"]))
  loss_sum, count = train.masked_cross_entropy(logits, jnp.asarray(batch["targets"]),
                                               jnp.asarray(batch["loss_mask"]))
  np.testing.assert_allclose(first_loss, float(loss_sum / count), rtol=1e-5)

  config.model.width = 64  # a run whose shapes differ from the checkpoint is refused up front
  with pytest.raises(Exception, match="init_from=.* has model.width=48 but this run has 64"):
    configlib.validate(config)


@pytest.mark.parametrize("bound", [0.0, 30.0, 40.0, 50.0])
def test_cross_entropy_matches_float64_with_and_without_a_logit_bound(bound):
  """The bounded log-sum-exp (one pass, shifted by the soft cap) against float64 NumPy: the
  loss sum and its gradient, on logits that reach the bound; 50 is above MAX_LOGIT_BOUND and
  takes the usual max-shifted path, 0 is no bound."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from recurrentgemma_jax import train

  rng = np.random.default_rng(int(bound))
  cap = bound or 30.0
  logits = cap * np.tanh(rng.normal(0, 3, (3, 7, 333)))  # many logits near +-cap
  logits[0, 0, :] = -cap  # a row at the lower bound (the bounded path's smallest terms)
  logits[0, 1, 5] = cap
  targets = rng.integers(0, 333, (3, 7))
  mask = (rng.random((3, 7)) > 0.2).astype(np.float32)

  def loss(x):
    return train.masked_cross_entropy(x, jnp.asarray(targets), jnp.asarray(mask), bound)[0]

  value, grad = jax.value_and_grad(loss)(jnp.asarray(logits, jnp.float32))
  m = logits.max(-1, keepdims=True)
  lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
  picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  expected = ((lse - picked) * mask).sum()
  softmax = np.exp(logits - lse[..., None])
  expected_grad = (softmax - (np.arange(333) == targets[..., None])) * mask[..., None]
  np.testing.assert_allclose(float(value), expected, rtol=2e-6)
  np.testing.assert_allclose(np.asarray(grad), expected_grad, atol=2e-6)


def test_the_logit_bound_is_the_models_soft_cap_and_zero_for_other_modules():
  from flax import nnx

  from recurrentgemma_jax import model as model_lib
  from recurrentgemma_jax import train

  cfg = model_lib.ModelConfig(family="mqa", vocab_size=11, width=16, num_layers=1, num_heads=2,
                              mlp_expanded_width=32, logits_soft_cap=25.0)
  assert train.logit_bound(model_lib.Model(cfg, rngs=nnx.Rngs(0))) == 25.0
  uncapped = model_lib.ModelConfig(**{**cfg.__dict__, "logits_soft_cap": 0.0})
  assert train.logit_bound(model_lib.Model(uncapped, rngs=nnx.Rngs(0))) == 0.0
  assert train.logit_bound(nnx.Linear(2, 3, rngs=nnx.Rngs(0))) == 0.0


def test_cast_once_casts_each_weight_read_once_through_a_cast_and_nothing_else():
  import jax
  import jax.numpy as jnp
  import numpy as np

  from recurrentgemma_jax import train

  def fn(p, x):
    twice = jnp.sum(p["twice"].astype(jnp.bfloat16) * x) + jnp.sum(p["twice"].astype(jnp.bfloat16))
    return (jnp.sum(p["once"].astype(jnp.bfloat16) * x) + twice + jnp.sum(p["uncast"] * x)
            + jnp.sum(p["wider"].astype(jnp.float32) * x) + p["count"].astype(jnp.float32))

  params = {"once": jnp.ones(3), "twice": jnp.ones(3), "uncast": jnp.ones(3),
            "wider": jnp.ones(3, jnp.bfloat16), "count": jnp.ones((), jnp.int32)}
  out = train.cast_once(fn, params, jnp.ones(3, jnp.bfloat16))
  assert {k: str(v.dtype) for k, v in out.items()} == {
      "once": "bfloat16", "twice": "float32", "uncast": "float32", "wider": "bfloat16",
      "count": "int32"}
  np.testing.assert_array_equal(np.asarray(out["once"], np.float32), np.ones(3))


def test_cast_once_gives_a_bfloat16_griffin_the_same_gradients_bit_for_bit():
  """The training step's micro-batch loop differentiates with respect to ``cast_once``'s
  bfloat16 weights: each gradient, converted to float32, equals the gradient through the
  model's own casts exactly; the weights a bfloat16 Griffin casts once (its Dense kernels and
  biases, the gates) come out cast, those it reads in float32 or twice (the norms' scales,
  the RG-LRU's decay, the tied embedding) do not."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from configs import griffin
  from recurrentgemma_jax import train

  config = griffin.get_config("100m")
  m = config.model
  m.width, m.lru_width, m.num_layers, m.num_heads = 32, 32, 3, 2
  m.mlp_expanded_width, m.num_gate_blocks, m.vocab_size = 96, 2, 64
  m.dtype, m.remat = "bfloat16", "none"
  config.batch_size, config.seq_len = 8, 12  # batch: a multiple of the test devices
  plan = train.setup(config)
  params = plan.initial_state(config)["params"]
  rng = np.random.default_rng(3)
  micro = {"inputs": jnp.asarray(rng.integers(0, 64, (2, 12)), jnp.int32),
           "targets": jnp.asarray(rng.integers(0, 64, (2, 12)), jnp.int32),
           "segment_pos": jnp.asarray([list(range(7)) + list(range(5))] * 2, jnp.int32),
           "loss_mask": jnp.asarray(rng.random((2, 12)) > 0.2, jnp.float32)}

  loss_sum = train.make_loss_sum(plan.graphdef)
  cast = train.cast_once(loss_sum, params, micro)
  dtypes = {jax.tree_util.keystr(k): str(v.dtype)
            for k, v in jax.tree_util.tree_flatten_with_path(cast)[0]}
  assert dtypes["['blocks'][0]['mlp_block']['ffw_up']['w'].value"] == "bfloat16"
  assert dtypes["['blocks'][0]['recurrent_block']['linear_x']['kernel'].value"] == "bfloat16"
  assert dtypes["['blocks'][2]['attention_block']['proj_q']['kernel'].value"] == "bfloat16"
  assert dtypes["['blocks'][0]['recurrent_block']['rg_lru']['a_param'].value"] == "float32"
  assert dtypes["['blocks'][0]['temporal_pre_norm']['scale'].value"] == "float32"
  assert dtypes["['embedder']['input_embedding'].value"] == "float32"

  grad = lambda p: jax.grad(lambda q: loss_sum(q, micro)[0])(p)
  want = jax.tree.leaves(grad(params))
  got = jax.tree.leaves(grad(cast))
  for w, g in zip(want, got):
    np.testing.assert_array_equal(np.asarray(w), np.asarray(g.astype(jnp.float32)))
