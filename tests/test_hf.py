"""HuggingFace transformers interop: checkpoints made with transformers (tests/data/hf, written
by make_checkpoints.py there, with transformers' logits) import to transformers' logits in
float32; export then import gives back every parameter bit for bit, for per-layer and
layer-stacked checkpoints, in one file or sharded; what transformers' RecurrentGemma cannot
express is refused with one line and exit status 2. No torch needed."""

import dataclasses
import importlib.util
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import ROOT
from recurrentgemma_jax import checkpoint, hf
from recurrentgemma_jax import model as model_lib
from recurrentgemma_jax.errors import CheckpointError

DATA = os.path.join(ROOT, "tests", "data", "hf")
STORED = ["griffin", "attention_first"]  # the transformers checkpoints under DATA


def load_script(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


import_script, export_script = load_script("import_recurrentgemma"), load_script("export_hf")


def refused(capsys, main, *args) -> str:
  """The one error line of ``main(args)``, which must exit with status 2."""
  capsys.readouterr()
  with pytest.raises(SystemExit) as exc:
    main(list(args))
  assert exc.value.code == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), lines
  return lines[0]


def logits(path, tokens, **overrides) -> np.ndarray:
  """Float32 logits of the checkpoint at ``path`` for rows holding one document each."""
  model, _ = checkpoint.load_model(str(path), dtype="float32", scan_impl="xla_linear",
                                   **overrides)
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, *rows: nnx.merge(graphdef, state)(*rows))
  return np.asarray(forward(state, jnp.asarray(tokens), jnp.asarray(positions)))


def saved_params(path) -> tuple[model_lib.ModelConfig, dict]:
  """A checkpoint's config and parameter tree as saved (its own layer layout)."""
  path = checkpoint.resolve_model_dir(str(path))
  cfg, _ = checkpoint.read_model_config(path)
  cfg = dataclasses.replace(cfg, scan_impl="xla_linear")
  abstract = nnx.state(nnx.eval_shape(lambda: model_lib.init_model(cfg)))
  return cfg, jax.tree.map(np.asarray,
                           nnx.to_pure_dict(checkpoint.restore_params(path, abstract)))


def assert_bitwise_equal(got: dict, want: dict):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    key = jax.tree_util.keystr(path)
    assert a.dtype == b.dtype and a.shape == b.shape, (key, a.dtype, b.dtype, a.shape, b.shape)
    assert a.tobytes() == b.tobytes(), key


def stored_tensors(path) -> dict[str, np.ndarray]:
  with hf.SafetensorsReader(str(path)) as reader:
    return {name: reader.get(name) for name in reader.names()}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  """Each stored transformers checkpoint, imported once by the script."""
  root = tmp_path_factory.mktemp("imported")
  for name in STORED:
    import_script.main([f"--src={DATA}/{name}", f"--dst={root / name}"])
  return root


@pytest.mark.parametrize("name", STORED)
def test_import_gives_transformers_logits(imported, name):
  tokens = np.load(os.path.join(DATA, name, "tokens.npy"))
  want = np.load(os.path.join(DATA, name, "logits.npy"))
  with open(os.path.join(DATA, name, "config.json")) as f:
    stored = json.load(f)
  cfg, meta = checkpoint.read_model_config(str(imported / name))
  # transformers' window W is W keys; ours (the official one) is window + 1 keys.
  assert cfg.attention_window_size == stored["attention_window_size"] - 1
  assert tokens.shape[1] > cfg.attention_window_size + 1  # the window cuts the rows
  assert cfg.param_dtype == {"float32": "float32", "bfloat16": "bfloat16"}[stored["dtype"]]
  assert not cfg.layers_scanned and cfg.num_gate_blocks == stored["num_attention_heads"]
  got = logits(imported / name, tokens)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  # The window mapping matters for these rows: transformers' W read as ours is wrong.
  off_by_one = logits(imported / name, tokens,
                      attention_window_size=stored["attention_window_size"])
  assert np.abs(off_by_one - want).max() > 1e-3
  tokenizer = os.path.join(DATA, name, "tokenizer.model")
  if os.path.exists(tokenizer):  # kept with the checkpoint and recorded
    assert meta["tokenizer"] == str(imported / name / "tokenizer.model")
    with open(tokenizer, "rb") as a, open(meta["tokenizer"], "rb") as b:
      assert a.read() == b.read()
  else:
    assert meta["tokenizer"] is None


@pytest.mark.parametrize("name", STORED)
def test_export_of_import_rewrites_the_transformers_files_and_imports_back(
    imported, tmp_path, capsys, name):
  exported = tmp_path / "exported"
  export_script.main([f"--checkpoint={imported / name}", f"--dst={exported}"])
  assert "exported" in capsys.readouterr().out
  # Every tensor as transformers wrote it: names, dtypes, shapes and bytes.
  want, got = stored_tensors(os.path.join(DATA, name)), stored_tensors(exported)
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
    assert got[key].tobytes() == value.tobytes(), key
  with open(os.path.join(DATA, name, "config.json")) as f:
    stored = json.load(f)
  with open(exported / "config.json") as f:
    config = json.load(f)
  for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
              "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "lru_width",
              "block_types", "attention_window_size", "conv1d_width", "logits_soft_cap",
              "rms_norm_eps", "hidden_activation", "rope_parameters", "tie_word_embeddings",
              "attention_bias", "dtype"):
    assert config[key] == stored[key], key
  assert os.path.exists(exported / "tokenizer.model") == os.path.exists(
      os.path.join(DATA, name, "tokenizer.model"))
  if (exported / "tokenizer.model").exists():  # its special ids
    assert (config["pad_token_id"], config["eos_token_id"], config["bos_token_id"]) == (0, 1, 2)

  again = tmp_path / "again"
  import_script.main([f"--src={exported}", f"--dst={again}"])
  first_cfg, first = saved_params(imported / name)
  second_cfg, second = saved_params(again)
  assert second_cfg == first_cfg
  assert_bitwise_equal(second, first)


def perturbed_params(cfg: model_lib.ModelConfig, seed: int) -> dict:
  """``init_params`` with every parameter moved (norm scales and biases start at zero)."""
  params = nnx.to_pure_dict(model_lib.init_params(cfg, seed))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  leaves = [(x.astype(jnp.float32) + 0.2 * jax.random.normal(k, x.shape)).astype(x.dtype)
            for x, k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, leaves)


TRAINED = {
    # 2 x (R, R, A) stacked, then R unrolled; sharded export.
    "griffin_scanned": dict(family="griffin", num_layers=7, scan_layers=True, remat="block",
                            param_dtype="float32", attention_window_size=3),
    # bfloat16 parameters, per layer, one file; gate blocks != heads (no attention).
    "hawk_bfloat16": dict(family="hawk", num_layers=3, scan_layers=False, num_gate_blocks=8,
                          param_dtype="bfloat16"),
}


@pytest.mark.parametrize("name", TRAINED)
def test_training_checkpoint_round_trip(tmp_path, capsys, name):
  cfg = model_lib.ModelConfig(vocab_size=61, width=32, num_heads=4, lru_width=48,
                              mlp_expanded_width=40, dtype="float32", scan_impl="xla_linear",
                              **TRAINED[name])
  params = perturbed_params(cfg, seed=len(name))
  workdir = tmp_path / "workdir"
  checkpoint.save_model(str(workdir / "checkpoints" / "4"), params, cfg, tokenizer="byte")
  exported, again = tmp_path / "exported", tmp_path / "again"
  max_shard = 10_000 if cfg.family == "griffin" else 10**9
  export_script.main([f"--checkpoint={workdir}", f"--dst={exported}",
                      f"--max_shard_bytes={max_shard}"])
  with open(exported / "config.json") as f:
    config = json.load(f)
  assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (0, 1, 2)
  assert config["attention_window_size"] == cfg.attention_window_size + 1
  assert not (exported / "tokenizer.model").exists()  # (byte-level: nothing to ship)
  assert config[hf.BYTE_TOKENIZER_KEY] == "byte"  # (and the import records it again)
  assert config["torch_dtype"] == config["dtype"] == cfg.param_dtype

  files = sorted(os.listdir(exported))
  if cfg.family == "griffin":  # sharded: every tensor in the shard its index names
    with open(exported / hf.INDEX) as f:
      index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and files == sorted(shards + [hf.INDEX, "config.json"])
    total = 0
    for shard in shards:
      with hf.SafetensorsReader(str(exported)) as reader:
        names = [n for n, file in reader.files.items() if os.path.basename(file) == shard]
        sizes = [reader.get(n).nbytes for n in names]
      assert names and (sum(sizes) <= max_shard or len(names) == 1), shard
      total += sum(sizes)
    assert index["metadata"]["total_size"] == total
  else:
    assert files == ["config.json", hf.SINGLE_FILE]

  import_script.main([f"--src={exported}", f"--dst={again}"])
  assert "transformers" in capsys.readouterr().out
  assert checkpoint.read_model_config(str(again))[1]["tokenizer"] == "byte"
  cfg_again, params_again = saved_params(again)
  assert cfg_again.param_dtype == cfg.param_dtype and not cfg_again.layers_scanned
  per_layer = dataclasses.replace(cfg, scan_layers=False)
  want = jax.tree.map(np.asarray, checkpoint.relayout(params, cfg, per_layer))
  assert_bitwise_equal(params_again, want)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11)).astype(np.int32)
  np.testing.assert_allclose(logits(again, tokens), logits(workdir, tokens), atol=1e-5, rtol=0)


def tiny_checkpoint(path, **fields) -> str:
  cfg = model_lib.ModelConfig(**{**dict(vocab_size=31, width=16, num_layers=3, num_heads=2,
                                        lru_width=16, mlp_expanded_width=24), **fields})
  checkpoint.save_model(str(path), nnx.to_pure_dict(model_lib.init_params(cfg)), cfg)
  return str(path)


@pytest.mark.parametrize("fields, message", [
    (dict(family="mqa"), "model.family='mqa'"),
    (dict(family="gla", gla_num_heads=2), "model.family='gla'"),
    (dict(family="griffin", block_types=("recurrent", "global_attention", "recurrent")),
     "global attention block (no window)"),
])
def test_export_refuses_what_transformers_cannot_express(tmp_path, capsys, fields, message):
  path = tiny_checkpoint(tmp_path / "ckpt", **fields)
  line = refused(capsys, export_script.main, f"--checkpoint={path}", f"--dst={tmp_path / 'x'}")
  assert "cannot be exported to transformers" in line and message in line
  assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("fields, message", [
    (dict(num_gate_blocks=4), "one RG-LRU gate block per head"),
    (dict(embeddings_scale_by_sqrt_dim=False), "always scales the embedding"),
    (dict(logits_soft_cap=0.0), "always caps the logits"),
])
def test_export_problem_names_the_setting(fields, message):
  cfg = model_lib.ModelConfig(family="griffin", width=16, num_heads=2, lru_width=16, **fields)
  assert message in hf.export_problem(cfg)
  assert hf.export_problem(model_lib.ModelConfig(family="hawk", num_gate_blocks=4)) is None


def test_export_refusal_names_every_problem_at_once(tmp_path, capsys):
  # (The Griffin paper's presets: gate blocks not the heads, no embedding scaling, no cap.)
  path = tiny_checkpoint(tmp_path / "ckpt", num_gate_blocks=4,
                         embeddings_scale_by_sqrt_dim=False, logits_soft_cap=0.0)
  line = refused(capsys, export_script.main, f"--checkpoint={path}", f"--dst={tmp_path / 'x'}")
  for message in ("one RG-LRU gate block per head", "always scales the embedding",
                  "always caps the logits"):
    assert message in line, line


def test_a_relative_tokenizer_is_copied_in_and_exported_from_anywhere(tmp_path, capsys,
                                                                      monkeypatch):
  shutil.copyfile(os.path.join(DATA, "griffin", "tokenizer.model"), tmp_path / "sp.model")
  monkeypatch.chdir(tmp_path)
  # (attention_first has no tokenizer of its own)
  import_script.main([f"--src={DATA}/attention_first", "--dst=ours", "--tokenizer=sp.model"])
  _, meta = checkpoint.read_model_config(str(tmp_path / "ours"))
  assert meta["tokenizer"] == str(tmp_path / "ours" / "tokenizer.model")
  assert os.path.isfile(meta["tokenizer"])
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  monkeypatch.chdir(elsewhere)
  capsys.readouterr()
  export_script.main([f"--checkpoint={tmp_path / 'ours'}", "--dst=hf"])
  assert "warning" not in capsys.readouterr().err
  with open(elsewhere / "hf" / "config.json") as f:
    config = json.load(f)
  assert (elsewhere / "hf" / "tokenizer.model").exists()
  assert (config["pad_token_id"], config["eos_token_id"], config["bos_token_id"]) == (0, 1, 2)
  line = refused(capsys, import_script.main, f"--src={DATA}/attention_first", "--dst=again",
                 "--tokenizer=sp.model")  # (relative to elsewhere: not there)
  assert "--tokenizer 'sp.model' is not a file" in line
  # A checkpoint moved (or copied to another machine) finds the copy inside it.
  shutil.move(tmp_path / "ours", tmp_path / "moved")
  _, meta = checkpoint.read_model_config(str(tmp_path / "moved"))
  assert meta["tokenizer"] == str(tmp_path / "moved" / "tokenizer.model")


def test_an_export_without_the_tokenizer_says_so_in_one_line(tmp_path, capsys):
  path = tiny_checkpoint(tmp_path / "ckpt")  # records no tokenizer
  capsys.readouterr()
  export_script.main([f"--checkpoint={path}", f"--dst={tmp_path / 'a'}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "records no tokenizer" in err[0], err
  config_file = tmp_path / "ckpt" / "model_config" / "metadata"
  with open(config_file) as f:
    meta = json.load(f)
  with open(config_file, "w") as f:
    json.dump(meta | {"tokenizer": "moved/away.model"}, f)
  export_script.main([f"--checkpoint={path}", f"--dst={tmp_path / 'b'}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "'moved/away.model' recorded with checkpoint" in err[0], err
  assert "does not exist" in err[0] and "no pad, bos and eos ids" in err[0]
  with open(tmp_path / "b" / "config.json") as f:
    assert "bos_token_id" not in json.load(f)
  assert sorted(os.listdir(tmp_path / "b")) == ["config.json", hf.SINGLE_FILE]


def test_a_byte_model_exported_before_the_mark_imports_as_byte_level(tmp_path):
  path = tiny_checkpoint(tmp_path / "ckpt", vocab_size=259)
  with open(tmp_path / "ckpt" / "model_config" / "metadata") as f:
    meta = json.load(f)
  with open(tmp_path / "ckpt" / "model_config" / "metadata", "w") as f:
    json.dump(meta | {"tokenizer": "byte"}, f)
  hf.export_checkpoint(path, str(tmp_path / "hf"))
  with open(tmp_path / "hf" / "config.json") as f:
    config = json.load(f)
  del config[hf.BYTE_TOKENIZER_KEY]
  with open(tmp_path / "hf" / "config.json", "w") as f:
    json.dump(config, f)
  hf.import_checkpoint(str(tmp_path / "hf"), str(tmp_path / "again"))
  assert checkpoint.read_model_config(str(tmp_path / "again"))[1]["tokenizer"] == "byte"


def edited_copy(tmp_path, name, **changes) -> str:
  """A copy of a stored transformers checkpoint with ``config.json`` fields changed."""
  dst = tmp_path / f"{name}_edited"
  shutil.copytree(os.path.join(DATA, name), dst)
  with open(dst / "config.json") as f:
    config = json.load(f)
  config.update(changes)
  with open(dst / "config.json", "w") as f:
    json.dump(config, f)
  return str(dst)


@pytest.mark.parametrize("changes, message", [
    (dict(attention_window_size=1), "attention_window_size=1 lets a token see only itself"),
    (dict(num_key_value_heads=4), "num_key_value_heads=4: ours has one key/value head"),
    (dict(num_key_value_heads=None), "num_key_value_heads=4"),  # (defaults to the heads)
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    (dict(attention_bias=True), "attention_bias=true"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                           "partial_rotary_factor": 1.0}), "partial_rotary_factor=1.0"),
    (dict(lru_width=40), "'model.layers.0.temporal_block.linear_x.weight' has shape [48, 32]"),
    (dict(model_type="gemma"), "model_type is 'gemma'"),
])
def test_import_refuses_what_ours_cannot_express(tmp_path, capsys, changes, message):
  src = edited_copy(tmp_path, "griffin", **changes)
  line = refused(capsys, import_script.main, f"--src={src}", f"--dst={tmp_path / 'x'}")
  assert message in line, line


def test_import_refuses_flags_and_broken_directories(tmp_path, capsys):
  src = os.path.join(DATA, "griffin")
  line = refused(capsys, import_script.main, f"--src={src}", f"--dst={tmp_path / 'x'}",
                 "--attention_window_size=7")
  assert "--attention_window_size applies to official checkpoints" in line
  # A shard the index names is missing; a tensor the architecture has no place for.
  sharded = tmp_path / "sharded"
  shutil.copytree(os.path.join(DATA, "attention_first"), sharded)
  os.remove(sharded / "model-00002-of-00004.safetensors")
  line = refused(capsys, import_script.main, f"--src={sharded}", f"--dst={tmp_path / 'y'}")
  assert "'model-00002-of-00004.safetensors', which does not exist" in line
  extra = tmp_path / "extra"
  shutil.copytree(src, extra)
  tensors = stored_tensors(src)
  tensors["model.layers.9.mlp_block.down_proj.bias"] = tensors["model.final_norm.weight"]
  os.remove(extra / hf.SINGLE_FILE)
  hf.write_safetensors(str(extra), sorted(tensors.items()), np.float32)
  line = refused(capsys, import_script.main, f"--src={extra}", f"--dst={tmp_path / 'z'}")
  assert "'model.layers.9.mlp_block.down_proj.bias' that config.json's architecture" in line


def test_untied_output_layer_is_refused_and_a_tied_copy_accepted(tmp_path):
  tensors = stored_tensors(os.path.join(DATA, "griffin"))
  for head, ok in ((tensors["model.embed_tokens.weight"], True),
                   (tensors["model.embed_tokens.weight"] + 1, False)):
    src = tmp_path / f"head_{ok}"
    shutil.copytree(os.path.join(DATA, "griffin"), src)
    os.remove(src / hf.SINGLE_FILE)
    hf.write_safetensors(str(src), sorted({**tensors, hf.LM_HEAD: head}.items()), np.float32)
    if ok:
      hf.import_checkpoint(str(src), str(tmp_path / "imported"))
    else:
      with pytest.raises(CheckpointError, match="'lm_head.weight' differs from"):
        hf.import_checkpoint(str(src), str(tmp_path / "refused"))


def test_written_safetensors_are_read_by_safetensors(tmp_path):
  """The writer's files as safetensors' own reader sees them; shards split at the limit."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  tensors = [("a", rng.normal(size=(3, 5)).astype(np.float32)),
             ("b", rng.normal(size=(7,)).astype(np.float32).T),
             ("c", rng.normal(size=(4, 2, 3)).astype(np.float32).transpose(2, 0, 1)),
             ("d", rng.normal(size=(100,)).astype(np.float32))]
  for dtype in (np.float32, jnp.bfloat16):
    dst = tmp_path / np.dtype(dtype).name
    dst.mkdir()
    files = hf.write_safetensors(str(dst), tensors, dtype, max_shard_bytes=30 * 4)
    # a 15-element and a 7-element tensor fit 30 elements of float32; d is alone.
    sizes = {"float32": [["a", "b"], ["c"], ["d"]], "bfloat16": [["a", "b", "c"], ["d"]]}
    assert len(files) == len(sizes[np.dtype(dtype).name]) + 1 and files[-1] == hf.INDEX
    for file, names in zip(files, sizes[np.dtype(dtype).name]):
      with safe_open(str(dst / file), framework="np") as f:
        assert list(f.keys()) == names and f.metadata() == {"format": "pt"}
        for name in names:
          want = np.asarray(dict(tensors)[name], dtype=dtype)
          assert f.get_tensor(name).dtype == want.dtype
          np.testing.assert_array_equal(f.get_tensor(name), want)
