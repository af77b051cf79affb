"""TPU splash attention (``pallas_kernels.attention``, ``model.attention_impl=splash``): the
kernel in its interpreter against the XLA attention, forward and gradients; the model with it;
its TPU compilation under a (data, model) mesh on compile-only TPU devices."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels import attention as attention_kernels
from pallas_kernels import dispatch
from recurrentgemma_jax import attention
from recurrentgemma_jax import model as model_lib
from sharding import partitioning
import test_model


def packed_positions(t, starts, first=0):
  """``segment_pos`` of one row whose documents start at ``starts`` (the row itself starts
  inside a document at position ``first``)."""
  pos = np.arange(t) + first
  for s in starts:
    pos[s:] = np.arange(t - s)
  return pos


def random_inputs(seed, b, t, n, h, dtype):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=s), dtype) for s in ((b, t, n, h), (b, t, h), (b, t, h)))
  return q, k, v, jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)


def xla_attention(q, k, v, segment_pos, *, window, scale):
  mask = attention.attention_mask(segment_pos, window)[:, None]
  return attention._masked_attention(q, k, v, mask, scale)  # pylint: disable=protected-access


@pytest.mark.parametrize("dtype,t,window,block", [
    ("float32", 300, 150, 128),  # padded to 384: three blocks, a window longer than a block
    ("float32", 256, None, 128),  # global causal over two blocks
    ("bfloat16", 200, 37, None),  # padded to 256: one block
])
def test_splash_equals_xla_attention_forward_and_gradients(dtype, t, window, block):
  """Causal, the window's ``window + 1`` keys, documents kept apart (several starts per row at
  odd positions; the second row opens inside a document), the scale: forward and d/dq, dk, dv.
  bfloat16 is compared with float32 XLA attention of the same (rounded) inputs."""
  b, n, h, scale = 2, 3, 16, 0.31
  q, k, v, cotangent = random_inputs(t + (window or 0), b, t, n, h, jnp.dtype(dtype))
  pos = jnp.asarray(np.stack([packed_positions(t, [37, 101, 163]),
                              packed_positions(t, [9, 75, 77, 191], first=5)]))

  def forward_and_gradients(fn, q, k, v):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, pos, window=window, scale=scale), q, k, v)
    return out, vjp(cotangent.astype(out.dtype))

  splash = functools.partial(attention_kernels.splash_mqa, block=block)
  out, grads = jax.jit(functools.partial(forward_and_gradients, splash))(q, k, v)
  out_xla, grads_xla = jax.jit(functools.partial(forward_and_gradients, xla_attention))(
      *(x.astype(jnp.float32) for x in (q, k, v)))
  tol = dict(rtol=2e-5, atol=2e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(out.astype(jnp.float32), out_xla, **tol)
  for name, g, g_xla in zip("qkv", grads, grads_xla):
    assert g.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(g.astype(jnp.float32), g_xla, rtol=tol["rtol"],
                               atol=tol["atol"] * float(jnp.max(jnp.abs(g_xla))),
                               err_msg=f"d{name}")


def test_splash_blocks_and_limits():
  assert [attention_kernels.padded_length(t) for t in (1, 128, 129, 2048)] == [128, 128, 256, 2048]
  assert [attention_kernels.block_size(t) for t in (100, 384, 640, 1024, 8192)] == [
      128, 128, 128, 512, 512]
  q = jnp.zeros((1, 256, 2, 8))
  kv, pos = jnp.zeros((1, 256, 8)), jnp.zeros((1, 256), jnp.int32)
  with pytest.raises(ValueError, match="block=192 must be a multiple of 128"):
    attention_kernels.splash_mqa(q, kv, kv, pos, window=None, scale=1.0, block=192)
  assert attention_kernels.problem("bfloat16", "tpu") is None
  assert "runs on TPUs" in attention_kernels.problem("bfloat16", "gpu")
  assert "float32 or bfloat16" in attention_kernels.problem("float64", "cpu")


def tiny_config(**kw):
  return test_model.tiny_config(**{"attention_window_size": 5, **kw})


def attention_impls(model):
  return {m.impl for _, m in nnx.iter_graph(model) if isinstance(m, attention.MQAttention)}


@pytest.mark.parametrize("family", ["griffin", "mqa"])
def test_model_with_splash_equals_xla_logits_and_gradients(family, monkeypatch):
  """A tiny model (head size 12, rows of 21 tokens padded to 128 inside the kernel) with
  ``attention_impl=splash`` against ``xla``: same parameters, logits and parameter gradients.
  Griffin's attention is local (window 5), MQA's global. The splash model runs under a
  (data=2, model=2) mesh of CPU devices, the kernel interpreted per device through
  ``shard_local`` (rows and query heads split, the key/value head's gradient summed over the
  head shards); the XLA model on one device."""
  cfg = tiny_config(family=family, num_layers=3 if family == "griffin" else 1)
  models = {impl: model_lib.init_model(dataclasses.replace(cfg, attention_impl=impl), seed=3)
            for impl in ("xla", "splash")}
  assert {impl: attention_impls(m) for impl, m in models.items()} == {
      "xla": {"xla"}, "splash": {"splash"}}
  rng = np.random.default_rng(4)
  tokens = jnp.asarray(rng.integers(0, 53, (2, 21)))
  pos = jnp.asarray(np.stack([packed_positions(21, [7, 15]), packed_positions(21, [3, 13], 2)]))
  cotangent = jnp.asarray(rng.normal(size=(2, 21, 53)), jnp.float32)

  def loss(m):
    logits = m(tokens, pos)[0]
    return jnp.sum(logits * cotangent), logits

  seen = set()
  def recording(q, *args, **kwargs):
    seen.add(q.shape)
    return attention_kernels.splash_mqa(q, *args, **kwargs)
  monkeypatch.setattr(attention, "splash_mqa", recording)
  step = nnx.jit(nnx.grad(loss, has_aux=True))
  grads_xla, logits_xla = step(models["xla"])
  with jax.set_mesh(partitioning.make_mesh(2, 2, jax.devices()[:4])):
    grads, logits = step(models["splash"])
  assert seen == {(1, 21, 1, 12)}  # per device: one of 2 rows, one of 2 query heads
  np.testing.assert_allclose(logits, logits_xla, rtol=2e-5, atol=2e-5)
  for (path, g), g_xla in zip(jax.tree_util.tree_leaves_with_path(nnx.state(grads)),
                              jax.tree.leaves(nnx.state(grads_xla))):
    np.testing.assert_allclose(g, g_xla, rtol=1e-4, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))


def test_splash_config_check_names_the_field(monkeypatch):
  cfg = tiny_config(attention_impl="splash")
  assert cfg.errors() == []  # CPU: the kernel runs interpreted
  assert cfg.resolved_attention_impl == "splash"
  assert tiny_config().resolved_attention_impl == "xla"  # auto off TPUs
  assert dataclasses.replace(cfg, dtype="float64").errors() == [
      "model.attention_impl='splash' needs model.dtype float32 or bfloat16 (got 'float64') "
      "(use model.attention_impl=xla or auto)"]
  monkeypatch.setattr(dispatch, "target_platform", lambda: "gpu")
  assert cfg.errors() == [
      "model.attention_impl='splash' runs on TPUs (and in the Pallas interpreter on a CPU); "
      "this run's devices are gpu (use model.attention_impl=xla or auto)"]
  assert dataclasses.replace(cfg, family="hawk").errors() == []  # no attention: not checked


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_splash_compiles_for_tpu_under_a_mesh(topology):
  """The attention block's forward and backward, traced on this CPU for compile-only TPU
  devices under a (data=2, model=2) mesh: ``auto`` picks splash, and each device runs the
  Mosaic kernels (forward, dq, dkv) on its own rows and query heads."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  devices = topologies.get_topology_desc(
      platform="tpu", topology_name=topology, chip_config_name="default",
      chips_per_host_bounds=(2, 2, 1), num_slices=1).devices
  mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("data", "model"))
  b, t, width, heads = 4, 384, 512, 4  # head size 128
  cfg = model_lib.ModelConfig(family="mqa", vocab_size=64, width=width, num_heads=heads,
                              num_layers=1, dtype="bfloat16")
  assert cfg.resolved_attention_impl == "xla"  # (no mesh: the CPU)
  with jax.set_mesh(mesh):
    assert cfg.resolved_attention_impl == "splash"
  graphdef, params = nnx.split(nnx.eval_shape(lambda: attention.MQAttention(
      width, heads, 100, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, impl="splash")))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                        params)
  x = jax.ShapeDtypeStruct((b, t, width), jnp.bfloat16, sharding=rows)
  pos = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows)

  def loss(params, x, pos):
    return jnp.sum(nnx.merge(graphdef, params)(x, pos)[0].astype(jnp.float32) ** 2)

  with jax.set_mesh(mesh):
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x, pos).compile().as_text()
  assert text.count("tpu_custom_call") >= 3
  kernels = set(re.findall(r"%(splash_mqa_\w+?)(?:\.\d+)? = ", text))
  assert kernels == {"splash_mqa_fwd_segmented_residuals", "splash_mqa_dq_segmented_no_residuals",
                     "splash_mqa_dkv_segmented_no_residuals"}
  # The forward kernel's output: [rows 4/2, query heads 4/2, T, head 128] per device.
  assert re.search(r"%splash_mqa_fwd\S* = \(.*bf16\[2,2,384,128\]", text)
