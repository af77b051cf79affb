"""Every Pallas kernel compiled for real TPU generations on this CPU machine (libtpu's
compile-only devices, jax.experimental.topologies), forward and backward, chosen as the model
chooses them: by the mesh's platform (pallas_kernels.dispatch), run per device (shard_local).

A Mosaic kernel that does not lower, or that comes out as an interpreter callback, fails here.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels
from pallas_kernels import dispatch
from sharding import partitioning

# Two chip generations, 2 x 2 chips each (mesh data=2, model=2).
GENERATIONS = ["v5e:2x2", "v6e:2x2"]


@functools.lru_cache(maxsize=None)
def tpu_mesh(topology: str):
  desc = topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                      chip_config_name="default",
                                      chips_per_host_bounds=(2, 2, 1), num_slices=1)
  return jax.sharding.Mesh(np.asarray(desc.devices).reshape(2, 2),
                           (partitioning.DATA, partitioning.MODEL))


def compiled_text(mesh, fn, *shapes):
  """``fn`` (differentiated by the caller) compiled for ``mesh`` from abstract inputs split
  over ``data`` on their first axis; returns the optimised HLO text."""
  sharded = NamedSharding(mesh, P(partitioning.DATA))
  args = [jax.ShapeDtypeStruct(s, d, sharding=sharded) for s, d in shapes]
  with jax.set_mesh(mesh):
    assert dispatch.target_platform() == "tpu"
    return jax.jit(fn).lower(*args).compile().as_text()


def loss_of(outputs):
  return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(outputs))


def assert_mosaic_only(text, at_least):
  assert text.count("tpu_custom_call") >= at_least, "Mosaic kernels missing"
  assert "callback" not in text, "an interpreter callback was compiled for the TPU"
  # Rows over data, channels / heads over model: each device runs its shard, nothing gathered.
  assert "all-gather" not in text


ROWS, STATE = ("batch", None, "lru"), ("batch", "lru")


@pytest.mark.parametrize("topology", GENERATIONS)
def test_linear_scan_compiles_for_tpu(topology):
  scan = partitioning.shard_local(pallas_kernels.linear_scan, (ROWS, ROWS, STATE),
                                  (ROWS, STATE))
  grad = jax.grad(lambda x, a, h0: loss_of(scan(x, a, h0)), argnums=(0, 1, 2))
  bf16, f32 = jnp.bfloat16, jnp.float32
  text = compiled_text(tpu_mesh(topology), grad, ((8, 200, 512), bf16), ((8, 200, 512), f32),
                       ((8, 512), f32))
  assert_mosaic_only(text, 2)  # forward and backward scans


@pytest.mark.parametrize("topology", GENERATIONS)
def test_fused_rg_lru_compiles_for_tpu(topology):
  layer = partitioning.shard_local(
      pallas_kernels.rg_lru, (ROWS, ROWS, ROWS, ("lru",), ("batch", None), STATE), (ROWS, STATE))

  def loss(x, gx, ga, a_param, segment_pos):
    return loss_of(layer(x, gx, ga, a_param, segment_pos == 0, None))

  grad = jax.grad(loss, argnums=(0, 1, 2, 3))
  shape = (8, 136, 256)
  text = compiled_text(tpu_mesh(topology), grad, *[(shape, jnp.bfloat16)] * 3,
                       ((256,), jnp.float32), ((8, 136), jnp.int32))
  assert_mosaic_only(text, 2)


@pytest.mark.parametrize("topology", GENERATIONS)
def test_chunk_gla_compiles_for_tpu(topology):
  bthk, bhkv = ("batch", None, "heads", None), ("batch", "heads", None, None)
  kernel = partitioning.shard_local(
      lambda q, k, v, g, h0, reset: pallas_kernels.chunk_gla(q, k, v, g, h0, reset=reset),
      (bthk,) * 4 + (bhkv, ("batch", None)), (bthk, bhkv))

  def loss(q, k, v, g_logits, segment_pos):
    log_g = jax.nn.log_sigmoid(g_logits.astype(jnp.float32)) / 16
    return loss_of(kernel(q, k, v, log_g, None, segment_pos == 0))

  grad = jax.grad(loss, argnums=(0, 1, 2, 3))
  b, t, h = 4, 150, 4
  text = compiled_text(tpu_mesh(topology), grad, ((b, t, h, 128), jnp.bfloat16),
                       ((b, t, h, 128), jnp.bfloat16), ((b, t, h, 256), jnp.bfloat16),
                       ((b, t, h, 128), jnp.bfloat16), ((b, t), jnp.int32))
  # states + output forward; states (recomputed), dstates and grads backward (XLA may merge
  # the two identical state passes).
  assert_mosaic_only(text, 4)


def test_on_a_cpu_the_same_calls_run_interpreted():
  # Without a TPU mesh the target is this host: the interpreter, which runs here.
  assert dispatch.target_platform() == "cpu"
  assert dispatch.scan_config().interpret
  x = jnp.ones((2, 20, 128), jnp.float32)
  y, h_last = pallas_kernels.linear_scan(x, 0.5 * x)
  np.testing.assert_allclose(h_last, 2.0 * (1 - 0.5**20) * np.ones((2, 128)), rtol=1e-6)


# The training step of each family, as train.py would run it on a 2 x 2 TPU slice.
FAMILY_KERNELS = {"griffin": 2, "hawk": 2, "gla": 4, "mqa": 2}  # Mosaic calls at least


def tiny_config(family, zero):
  from recurrentgemma_jax import configlib  # pylint: disable=g-import-not-at-top
  config = configlib.load("configs/default.py")
  config.model.update(family=family, width=128, lru_width=128, num_layers=3, num_heads=2,
                      num_gate_blocks=2, mlp_expanded_width=256, attention_window_size=64,
                      dtype="bfloat16", remat="block")
  config.update(batch_size=8, seq_len=256, zero=zero)
  config.mesh.update(data=2, model=2)
  return config


def all_gather_shapes(text):
  """The result shapes of the all-gathers in an optimised HLO text."""
  import re  # pylint: disable=g-import-not-at-top
  shapes = re.findall(r"= \(?\w+\[([\d,]*)\][^\n]*? all-gather(?:-start)?\(", text)
  return [tuple(int(d) for d in s.split(",") if d) for s in shapes]


@pytest.mark.parametrize("zero", [1, 3])
@pytest.mark.parametrize("family", list(FAMILY_KERNELS))
def test_training_step_of_each_family_compiles_for_tpu(family, zero):
  from recurrentgemma_jax import aot, train  # pylint: disable=g-import-not-at-top
  config = tiny_config(family, zero)
  mesh = tpu_mesh("v5e:2x2")
  plan = train.setup(config, devices=list(mesh.devices.flat))
  assert plan.model_cfg.scan_layers is True  # auto: the layer scan, with remat
  batch = aot.abstract_batch(config, plan.batch_sharding)
  text = plan.jit_train_step(1).lower(plan.abstract_state, batch).compile().as_text()
  assert text.count('custom_call_target="tpu_custom_call"') >= FAMILY_KERNELS[family]
  assert "callback" not in text
  # Around the kernels each device keeps its rows (and channels): no all-gather of whole
  # [B, T, ...] activations. (ZeRO-3 gathers parameters, which is expected.)
  b, t = config.batch_size, config.seq_len
  assert not [s for s in all_gather_shapes(text) if s[:2] == (b, t)], all_gather_shapes(text)
  if zero == 3:
    assert all_gather_shapes(text), "ZeRO-3 gathers the parameters where they are used"


@pytest.mark.parametrize("family", list(FAMILY_KERNELS))
def test_sampling_of_each_family_compiles_for_tpu(family):
  """sample()'s prefill and decoding loop (Conv1D ring, one-token RG-LRU step, attention
  caches) compiled for a 2 x 2 v5e slice from abstract weights, with no interpreter
  callback."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import model as model_lib, sampling  # pylint: disable=g-import-not-at-top
  from test_model import tiny_config as tiny_model_config  # pylint: disable=g-import-not-at-top
  mesh = tpu_mesh("v5e:2x2")
  cfg = tiny_model_config(family=family, num_layers=3, attention_window_size=4, dtype="bfloat16")
  replicated = NamedSharding(mesh, P())
  with jax.set_mesh(mesh):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model_lib.init_model(cfg, seed=0)))
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
                         state)
    assert dispatch.target_platform() == "tpu"
    lowered, _ = sampling.lower_sample(graphdef, state, [[1, 2, 3], [4, 5]],
                                       sampling.SamplingParams(max_new_tokens=5))
    text = lowered.compile().as_text()
  assert "while" in text and "callback" not in text
