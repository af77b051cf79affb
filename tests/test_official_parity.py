"""Official RecurrentGemma checkpoints give the official per-token NLL through our importer
and evaluator (float32), for patterns starting with recurrence and with attention; so do they
after an export to the transformers format and an import back (tests/data/hf/
official_export.py checks that export in transformers itself)."""


import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import run_script

rg = pytest.importorskip("recurrentgemma.jax", reason="the official package is a test dependency")


def official_model_and_params(block_types, seed):
  config = rg.GriffinConfig(
      vocab_size=101, width=48, mlp_expanded_width=80, num_heads=4, lru_width=64,
      block_types=tuple(block_types), embeddings_scale_by_sqrt_dim=True,
      attention_window_size=5, logits_soft_cap=30.0, scan_type=rg.ScanType.LINEAR_NATIVE)
  model = rg.Griffin(config, param_dtype=jnp.float32, dtype=jnp.float32)

  @jax.jit  # one compile; run eagerly, the official init compiles each of its operations
  def init(key, perturb_key):
    params = model.init(key, jnp.zeros((1, 4), jnp.int32), jnp.arange(4)[None],
                        return_cache=False)["params"]
    # Move every parameter away from its initial value (norm scales and biases start at 0).
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(perturb_key, len(leaves))
    leaves = [x + 0.2 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, leaves)

  return model, init(jax.random.PRNGKey(seed), jax.random.PRNGKey(seed + 1))


def official_logits(model, params, tokens):
  segment_pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  apply = jax.jit(lambda p, t, s: model.apply({"params": p}, t, s, return_cache=False)[0])
  return apply(params, tokens, segment_pos)


def _official_nll(model, params, tokens):
  logits = official_logits(model, params, tokens)
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
  return -np.asarray(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0])


@pytest.mark.parametrize("pattern", ["RRA", "ARR"])
def test_imported_checkpoint_matches_official_nll(tmp_path, pattern):
  block_types = [{"R": rg.TemporalBlockType.RECURRENT,
                  "A": rg.TemporalBlockType.ATTENTION}[c] for c in pattern]
  model, params = official_model_and_params(block_types, seed=len(tmp_path.name))
  src, dst = tmp_path / "official", tmp_path / "imported"
  ocp.PyTreeCheckpointer().save(str(src), params)  # the bare tree, as distributed

  imported = run_script("import_recurrentgemma.py", f"--src={src}", f"--dst={dst}",
                        "--attention_window_size=5")
  assert imported.stderr == "", imported.stderr  # (Orbax's restore warning is not the user's)
  # Through the transformers format and back.
  exported, again = tmp_path / "hf", tmp_path / "reimported"
  run_script("export_hf.py", f"--checkpoint={dst}", f"--dst={exported}")
  run_script("import_recurrentgemma.py", f"--src={exported}", f"--dst={again}")
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 101, size=(3, 17)).astype(np.int32)  # 17 > window of 5
  np.save(tmp_path / "tokens.npy", tokens)
  official = _official_nll(model, params, jnp.asarray(tokens))
  for path in (dst, again):
    proc = run_script("evaluate.py", f"--checkpoint={path}",
                      f"--tokens={tmp_path / 'tokens.npy'}", f"--nll_out={tmp_path / 'nll.npy'}",
                      "--batch_size=2")
    assert "perplexity" in proc.stdout
    ours = np.load(tmp_path / "nll.npy")
    assert ours.shape == (3, 16) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, official, atol=1e-5, rtol=1e-5, err_msg=str(path))
