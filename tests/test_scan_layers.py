"""model.scan_layers: the layer scan trains as the unrolled model does (losses, initial values,
shardings), and checkpoints of either layer layout restore into the other: training state
(parameters and optimizer state), model checkpoints, and those written before the option."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from helpers import ROOT
from recurrentgemma_jax import checkpoint, configlib, data, train
from recurrentgemma_jax import model as model_lib
from sharding import partitioning

# griffin: 2 x (R, R, A) in the scan, then R unrolled; hawk: 3 x R, remat of the dots.
FAMILIES = {"griffin": dict(num_layers=7, remat="block"), "hawk": dict(num_layers=3, remat="dots")}


def tiny_run_config(family, scan_layers):
  config = configlib.load(os.path.join(ROOT, "configs", "default.py"))
  config.model.update(family=family, width=32, lru_width=32, num_heads=2, num_gate_blocks=2,
                      mlp_expanded_width=64, attention_window_size=8, scan_impl="xla_linear",
                      scan_layers=str(scan_layers).lower(), **FAMILIES[family])
  config.update(batch_size=4, seq_len=32, total_steps=10)
  config.optimizer.warmup_steps = 2
  return config


def assert_trees_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("family", FAMILIES)
def test_scanned_and_unrolled_train_alike_and_resume_from_each_other(tmp_path, family):
  runs = {}
  for scan_layers in (False, True):
    config = tiny_run_config(family, scan_layers)
    plan = train.setup(config, jax.devices()[:1])
    state, step_fn = plan.initial_state(config), plan.jit_train_step(1)
    initial = jax.device_get(state["params"])
    batches = data.make_train_iterator(config)
    saver = train.Checkpoints(str(tmp_path / str(scan_layers)), 1)
    losses = []
    for step in (1, 2, 3):
      batch = {k: jax.device_put(v, plan.batch_sharding) for k, v in next(batches).items()}
      if step == 3:
        saved, last_batch = jax.device_get(state), batch
      state, metrics = step_fn(state, batch)
      losses.append(float(metrics["loss"]))
      if step == 2:
        saver.save(2, state, plan.model_cfg, batches.get_state(), {"tokenizer": "byte"})
        saver.wait()
    runs[scan_layers] = dict(plan=plan, losses=losses, saved=saved, batch=last_batch,
                             step_fn=step_fn, initial=initial)
  # The same initial values, layer by layer (init_params vmaps each layer's initialisation).
  assert_trees_equal(runs[True]["initial"], checkpoint.relayout(
      runs[False]["initial"], runs[False]["plan"].model_cfg, runs[True]["plan"].model_cfg))
  np.testing.assert_allclose(runs[True]["losses"], runs[False]["losses"], rtol=1e-5)

  # A checkpoint from before model.scan_layers existed (no such field): per layer.
  config_file = tmp_path / "False" / "checkpoints" / "2" / "model_config" / "metadata"
  meta = json.loads(config_file.read_text())
  del meta["scan_layers"]
  config_file.write_text(json.dumps(meta))

  # Each layout's checkpoint into the other: the same values, step 3 as it went uninterrupted.
  for written, into in ((False, True), (True, False)):
    plan = runs[into]["plan"]
    state, _ = train.Checkpoints(str(tmp_path / str(written)), 1).restore_latest(
        plan.abstract_state, print, plan.model_cfg)
    saved = runs[written]["saved"]
    from_cfg = runs[written]["plan"].model_cfg
    assert_trees_equal(state["params"],
                       checkpoint.relayout(saved["params"], from_cfg, plan.model_cfg))
    assert_trees_equal(state["opt_state"],
                       checkpoint.relayout(saved["opt_state"], from_cfg, plan.model_cfg))
    for name in ("params", "opt_state"):
      for got, want in zip(jax.tree.leaves(state[name]),
                           jax.tree.leaves(plan.abstract_state[name])):
        assert got.sharding == want.sharding
    _, metrics = runs[into]["step_fn"](state, runs[into]["batch"])
    np.testing.assert_allclose(float(metrics["loss"]), runs[into]["losses"][2], rtol=1e-5)

  # And as model checkpoints (what sampling and evaluation load), in either layout.
  for written in (False, True):
    for scan_layers in (False, True):
      model, _ = checkpoint.load_model(str(tmp_path / str(written)), scan_layers=scan_layers)
      want = runs[written]["saved"]["params"]
      want = checkpoint.relayout(want, runs[written]["plan"].model_cfg, model.cfg)
      assert_trees_equal(nnx.state(model), want)


def test_stacked_parameters_are_split_as_one_unrolled_layer_is():
  """On a 2 x 2 mesh, each stacked parameter is split as one of its layers is unrolled, the
  layer axis whole (ZeRO-3 included)."""
  cfg = model_lib.ModelConfig(family="griffin", vocab_size=64, width=32, lru_width=32,
                              num_layers=8, num_heads=2, num_gate_blocks=2, scan_layers=True,
                              mlp_expanded_width=64, attention_window_size=8, dtype="float32")
  unrolled_cfg = dataclasses.replace(cfg, scan_layers=False)
  assert cfg.layer_pattern == ("recurrent", "recurrent", "attention") and cfg.scan_repeats == 2
  mesh = partitioning.make_mesh(2, 2, jax.devices()[:4])
  for zero in (0, 3):
    shardings = {c.scan_layers: partitioning.param_shardings(
        nnx.eval_shape(lambda c=c: model_lib.init_model(c)), mesh, zero=zero)
                 for c in (cfg, unrolled_cfg)}
    stacked, layers = (nnx.to_pure_dict(shardings[s]) for s in (True, False))
    for g in range(3):
      for i in model_lib.stacked_layers(cfg, g):
        for s, u in zip(jax.tree.leaves(stacked["stacked_blocks"][g]),
                        jax.tree.leaves(layers["blocks"][i])):
          assert s.spec == P(None, *u.spec), (zero, g, i, s.spec, u.spec)
    for k, i in enumerate(model_lib.tail_layers(cfg)):
      assert stacked["tail_blocks"][k] == layers["blocks"][i]
    specs = [s.spec for s in jax.tree.leaves(stacked)]
    assert ("data" in str(specs)) == (zero == 3) and "model" in str(specs)



@pytest.mark.parametrize("types,pattern,repeats", [
    ("RRARRARR", "RRA", 2), ("ARRARRA", "ARR", 2), ("RRRR", "R", 4), ("RARRA", "RAR", 1),
    ("RRAA", "RRAA", 1)])
def test_layer_pattern_is_the_shortest_repeating_run(types, pattern, repeats):
  full = {"R": "recurrent", "A": "attention"}
  cfg = model_lib.ModelConfig(block_types=tuple(full[t] for t in types), num_layers=len(types))
  assert cfg.layer_pattern == tuple(full[t] for t in pattern) and cfg.scan_repeats == repeats
  placed = [(i, g) for g in range(len(pattern)) for i in model_lib.stacked_layers(cfg, g)]
  placed += [(i, k) for k, i in enumerate(model_lib.tail_layers(cfg))]
  assert sorted(i for i, _ in placed) == list(range(len(types)))
  assert all(types[i] == pattern[g] for i, g in placed)
