"""The model library: packing, gradients (finite differences, float64), the pure-JAX scans."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

import helpers
from recurrentgemma_jax import model as model_lib
from recurrentgemma_jax import scan as scan_lib

BLOCK_TYPES = ["recurrent", "attention", "global_attention", "gla"]


def tiny_config(**kw):
  base = dict(family="griffin", vocab_size=53, width=24, num_layers=3, num_heads=2,
              lru_width=32, mlp_expanded_width=40, attention_window_size=3, dtype="float32",
              scan_impl="xla_linear")
  base.update(kw)
  return model_lib.ModelConfig(**base)


def perturbed(module, seed, scale=0.3):
  """Moves every parameter off its initial value (norm scales and biases start at zero)."""
  graphdef, state = nnx.split(module)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  leaves = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_init_params_equals_the_whole_model_program_and_shards_each_part(scan_layers):
  """Part by part (one program per kind of block, or of stacked layers), the values of one
  jitted init of the whole model, bit for bit; with shardings, every array lands with its
  parameter's sharding."""
  from sharding import partitioning  # pylint: disable=g-import-not-at-top
  cfg = tiny_config(num_layers=5, width=32, mlp_expanded_width=48, scan_layers=scan_layers)
  whole = jax.jit(lambda: nnx.state(model_lib.init_model(cfg, 7)))()
  mesh = partitioning.make_mesh(2, 2, jax.devices()[:4])
  shardings = partitioning.param_shardings(
      nnx.eval_shape(lambda: model_lib.init_model(cfg, 7)), mesh, zero=3)
  for sh in (None, shardings):
    parts = model_lib.init_params(cfg, 7, sh)
    assert jax.tree.structure(parts) == jax.tree.structure(whole)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(parts), jax.tree.leaves(whole)):
      np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  for a, s in zip(jax.tree.leaves(parts), jax.tree.leaves(shardings)):
    assert a.sharding == s
  assert any(not s.is_fully_replicated for s in jax.tree.leaves(shardings))
  # Each block's values come from its own key: blocks of one kind differ.
  blocks = nnx.to_pure_dict(parts)
  if scan_layers:
    blocks = model_lib.unstack_layers(blocks, cfg)
  blocks = blocks["blocks"]
  assert not np.array_equal(blocks[0]["recurrent_block"]["linear_x"]["kernel"],
                            blocks[1]["recurrent_block"]["linear_x"]["kernel"])


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
def test_packed_row_equals_separate_documents(block_type):
  cfg = tiny_config(block_types=(block_type,) * 2, num_layers=2)
  model = perturbed(model_lib.init_model(cfg, seed=1), seed=2)
  rng = np.random.default_rng(3)
  doc_a, doc_b = rng.integers(0, 53, 7), rng.integers(0, 53, 9)  # both longer than the window
  packed = jnp.asarray(np.concatenate([doc_a, doc_b]))[None]
  packed_pos = jnp.asarray(np.concatenate([np.arange(7), np.arange(9)]))[None]
  forward = nnx.jit(lambda m, tokens, pos: m(tokens, pos)[0])  # (op by op: seconds a call)
  out_packed = forward(model, packed, packed_pos)
  out_a = forward(model, jnp.asarray(doc_a)[None], jnp.arange(7)[None])
  out_b = forward(model, jnp.asarray(doc_b)[None], jnp.arange(9)[None])
  np.testing.assert_allclose(out_packed[:7], out_a, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(out_packed[7:], out_b, rtol=2e-5, atol=2e-5)
  # And the second document really does depend on its own earlier tokens.
  alone = forward(model, jnp.asarray(doc_b[-1:])[None], jnp.zeros((1, 1), int))
  assert not np.allclose(out_b[-1], alone[-1])


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
def test_block_gradients_match_finite_differences(block_type):
  with jax.enable_x64(True):
    cfg = tiny_config(width=8, num_heads=2, lru_width=8, mlp_expanded_width=12,
                      attention_window_size=2, num_layers=1, dtype="float64",
                      param_dtype="float64")
    block = perturbed(model_lib.ResidualBlock(block_type, cfg, rngs=nnx.Rngs(0)), seed=4)
    graphdef, params = nnx.split(block)
    x = jax.random.normal(jax.random.PRNGKey(5), (2, 6, 8), jnp.float64)
    segment_pos = jnp.asarray([[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2]])

    @jax.jit  # (op by op, each of check_grads' evaluations takes seconds)
    def loss(params, x):
      y, _ = nnx.merge(graphdef, params)(x, segment_pos)
      return jnp.sum(jnp.sin(y))

    check_grads(loss, (params, x), order=1, modes=["rev"], atol=1e-6, rtol=1e-6, eps=1e-6)


def _reference_scan(x, a, h0, reverse=False):
  x, a = np.asarray(x, np.float64), np.asarray(a, np.float64)
  h = np.zeros(x.shape[::2]) if h0 is None else np.asarray(h0, np.float64)
  ys = np.zeros_like(x)
  order = range(x.shape[1] - 1, -1, -1) if reverse else range(x.shape[1])
  for t in order:
    h = a[:, t] * h + x[:, t]
    ys[:, t] = h
  return ys, h


@pytest.mark.parametrize("impl", ["xla_linear", "xla_associative"])
@pytest.mark.parametrize("shape,with_h0", [((2, 1, 5), True), ((3, 33, 7), False),
                                           ((1, 64, 3), True)])
def test_pure_jax_scans_match_float64_reference(impl, shape, with_h0):
  rng = np.random.default_rng(sum(shape))
  x = rng.normal(size=shape).astype(np.float32)
  a = rng.uniform(0.5, 1.0, size=shape).astype(np.float32)
  h0 = rng.normal(size=(shape[0], shape[2])).astype(np.float32) if with_h0 else None
  y, h_last = scan_lib.linear_scan(jnp.asarray(x), jnp.asarray(a),
                                   None if h0 is None else jnp.asarray(h0), impl=impl)
  y_ref, h_ref = _reference_scan(x, a, h0)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(h_last, h_ref, rtol=1e-5, atol=1e-5)

  # Backward: the gradient of <w, y> + <v, h_last> is the reverse scan of the cotangents.
  w = rng.normal(size=shape).astype(np.float32)
  v = rng.normal(size=(shape[0], shape[2])).astype(np.float32)

  def loss(x, a, h0):
    y, h = scan_lib.linear_scan(x, a, h0, impl=impl)
    return jnp.sum(y * w) + jnp.sum(h * v)

  h0_arg = jnp.zeros((shape[0], shape[2])) if h0 is None else jnp.asarray(h0)
  dx, da, dh0 = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(x), jnp.asarray(a), h0_arg)
  cot = w.astype(np.float64).copy()
  cot[:, -1] += v
  a_next = np.concatenate([a[:, 1:], np.zeros_like(a[:, :1])], axis=1)
  dh_ref, _ = _reference_scan(cot, a_next, None, reverse=True)  # dL/dh_t
  h_prev = np.concatenate([np.asarray(h0_arg)[:, None], y_ref[:, :-1]], axis=1)
  np.testing.assert_allclose(dx, dh_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(da, dh_ref * h_prev, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dh0, a[:, 0] * dh_ref[:, 0], rtol=1e-5, atol=1e-5)


def test_config_errors_name_the_field():
  errors = tiny_config(width=25).errors()
  assert any("model.num_heads=2 does not divide model.width=25" in e for e in errors)
  assert tiny_config(family="rwkv").errors() == [
      "model.family='rwkv' is not one of griffin|hawk|mqa|gla"]
  assert any("num_gate_blocks" in e for e in tiny_config(num_gate_blocks=5).errors())
  assert dataclasses.replace(tiny_config(), scan_impl="cuda").errors()[0].startswith(
      "model.scan_impl='cuda'")
  assert tiny_config(rg_lru_min_ac=0.99, rg_lru_max_ac=0.9).errors() == [
      "model.rg_lru_min_ac=0.99 and model.rg_lru_max_ac=0.9 must satisfy 0 < min < max < 1"]


@pytest.mark.parametrize("low,high", [(0.9, 0.999), (0.99, 0.9999)])
def test_rg_lru_decay_starts_in_the_configured_range(low, high):
  # a^c = exp(-c softplus(a_param)) uniform in [low, high] in every recurrent layer (the
  # synthetic Selective Copying config starts Hawk with the longer memory, docs/synthetic.md).
  model = model_lib.init_model(tiny_config(family="hawk", lru_width=512, rg_lru_min_ac=low,
                                           rg_lru_max_ac=high), seed=3)
  from recurrentgemma_jax import recurrent  # pylint: disable=g-import-not-at-top
  ac = np.concatenate([
      np.exp(-recurrent.C * np.asarray(jax.nn.softplus(b.temporal.rg_lru.a_param.value)))
      for b in model.blocks])
  assert low - 1e-6 <= ac.min() < low + 0.05 * (high - low)
  assert high - 0.05 * (high - low) < ac.max() <= high + 1e-6
  assert abs(ac.mean() - (low + high) / 2) < 0.05 * (high - low)


@pytest.mark.parametrize("t,window,band_block", [(17, 5, None), (9, 3, None), (64, 16, None),
                                                 (23, 9, 4), (30, 7, 3), (50, 12, 12)])
def test_banded_local_attention_equals_dense(t, window, band_block):
  from recurrentgemma_jax import attention
  block = perturbed(attention.MQAttention(32, 4, window, rngs=nnx.Rngs(0)), seed=t)
  if band_block:  # query blocks smaller than the window, not dividing it or T
    block.band_block = band_block
  assert t > block._band_keys  # the O(T * (window + band_block)) path runs
  x = jax.random.normal(jax.random.PRNGKey(t), (2, t, 32))
  pos = jnp.stack([jnp.arange(t), jnp.concatenate([jnp.arange(t // 3), jnp.arange(t - t // 3)])])
  banded, _ = block(x, pos)
  q = attention.apply_rope(block.proj_q(x).reshape(2, t, 4, 8), pos)
  k = attention.apply_rope(block.proj_k(x).reshape(2, t, 1, 8), pos)[:, :, 0]
  v = block.proj_v(x).reshape(2, t, 8)
  mask = attention.attention_mask(pos, window)[:, None]
  dense = block.proj_final(attention._masked_attention(q, k, v, mask, 8**-0.5).reshape(2, t, -1))
  np.testing.assert_allclose(banded, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_fused_attention_arguments_give_our_masks(window):
  # The cudnn path (attention_impl=cudnn) passes exactly these arguments to
  # jax.nn.dot_product_attention; its XLA implementation checks their meaning here: causal,
  # window + 1 keys including the query, nothing across documents, gradients included.
  from recurrentgemma_jax import attention
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
             for s in ((2, 23, 3, 8), (2, 23, 8), (2, 23, 8)))
  pos = jnp.stack([jnp.arange(23), jnp.concatenate([jnp.arange(9), jnp.arange(14)])])

  def ours(q, k, v):
    mask = attention.attention_mask(pos, window)[:, None]
    return jnp.sum(jnp.sin(attention._masked_attention(q, k, v, mask, 0.3)))

  def fused(q, k, v):
    return jnp.sum(jnp.sin(attention.document_mask_attention(q, k, v, pos, window, 0.3, "xla")))

  np.testing.assert_allclose(fused(q, k, v), ours(q, k, v), rtol=1e-5)
  for g_fused, g_ours in zip(jax.grad(fused, (0, 1, 2))(q, k, v), jax.grad(ours, (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(g_fused, g_ours, atol=1e-5, rtol=1e-5)


def test_document_segments_match_a_numpy_count():
  from recurrentgemma_jax import attention
  rng = np.random.default_rng(3)
  pos = np.zeros((6, 40), np.int32)
  for b in range(6):  # rows of 1..6 documents, some starting mid-document
    cuts = np.sort(rng.choice(np.arange(1, 40), b, replace=False))
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, 40]):
      pos[b, lo:hi] = np.arange(hi - lo) + (5 if lo == 0 and b % 2 else 0)
  lengths, offsets, count = attention.document_segments(jnp.asarray(pos), 4)
  for b in range(6):
    starts = [0] + [i for i in range(1, 40) if pos[b, i] == 0]
    sizes = np.diff(starts + [40])
    assert count[b] == len(starts) == b + 1
    m = min(len(starts), 4)
    np.testing.assert_array_equal(lengths[b], list(sizes[:m]) + [-1] * (4 - m))
    np.testing.assert_array_equal(offsets[b], starts[:m] + [-1] * (5 - m))


@pytest.mark.parametrize("window,docs,bounds",
                         [(w, d, (4, 8)) for w in (None, 5) for d in (1, 3, 6, 20)]
                         + [(5, 3, ())])
def test_fused_attention_gives_each_document_its_own_attention(monkeypatch, window, docs,
                                                               bounds):
  # fused_attention picks causal (one document a row), packed segments (the first bound the
  # documents fit; none, as before Hopper) or the dense mask (more) at run time; with cuDNN's
  # semantics written out in jnp (a CPU has no cuDNN), each choice must equal our masks,
  # gradients included. On an H100 the real kernels are checked against XLA by
  # scripts/bench/bench_attention.py.
  from recurrentgemma_jax import attention
  masked = attention.document_mask_attention
  helpers.cudnn_attention_on_cpu(monkeypatch)
  rng = np.random.default_rng(docs)
  q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
             for s in ((3, 24, 2, 8), (3, 24, 8), (3, 24, 8)))
  pos = np.zeros((3, 24), np.int32)
  for b in range(3):
    cuts = np.sort(rng.choice(np.arange(1, 24), docs - 1, replace=False))
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, 24]):
      pos[b, lo:hi] = np.arange(hi - lo) + (2 if lo == 0 and b == 1 else 0)
  pos = jnp.asarray(pos)

  def loss(fn):
    return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, pos, window, 0.3)))

  fused = loss(functools.partial(attention.fused_attention, implementation="cudnn",
                                 segment_bounds=bounds))
  want = loss(functools.partial(masked, implementation="xla"))
  np.testing.assert_allclose(jax.jit(fused)(q, k, v), want(q, k, v), rtol=1e-5)
  for got, ref in zip(jax.jit(jax.grad(fused, (0, 1, 2)))(q, k, v),
                      jax.grad(want, (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)


def test_switch_keeping_operands_differentiates_as_lax_switch_without_returning_operands():
  # Branches shaped like jax's cuDNN attention: a custom VJP that keeps its inputs, its output
  # and a statistic of its own, of a different size in each branch.
  from recurrentgemma_jax import attention

  def branch(m):
    @jax.custom_vjp
    def f(x, w, n):
      return jnp.tanh(x * w) * m + n.astype(x.dtype)

    def fwd(x, w, n):
      out = f(x, w, n)
      return out, (x, w, out, jnp.full((m, 3), jnp.sum(x)))

    def bwd(res, g):
      x, w, out, stat = res  # (out and stat only to be kept, as cuDNN keeps its own)
      d = g * m * (1 - jnp.tanh(x * w) ** 2) + 0 * (jnp.sum(out) + jnp.sum(stat))
      return d * w, jnp.sum(d * x, 0), None
    f.defvjp(fwd, bwd)
    return f

  branches = [branch(m) for m in (1, 2, 5)]
  rng = np.random.default_rng(0)
  x, w = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), jnp.asarray(rng.normal(size=3))
  n = jnp.arange(3)
  for index in range(3):
    def loss(switch):
      return lambda x, w: jnp.sum(jnp.sin(switch(jnp.int32(index), branches, x, w, n)))
    got, want = loss(attention.switch_keeping_operands), loss(jax.lax.switch)
    np.testing.assert_allclose(jax.jit(got)(x, w), want(x, w), rtol=1e-6)
    for a, b in zip(jax.jit(jax.grad(got, (0, 1)))(x, w), jax.grad(want, (0, 1))(x, w)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # The forward switch returns the output and each branch's statistic only; lax.switch's
  # also returns the inputs and the output each branch keeps.
  conds = lambda switch: [e for e in jax.make_jaxpr(jax.grad(
      lambda x, w: jnp.sum(switch(jnp.int32(0), branches, x, w, n))))(x, w).eqns
      if e.primitive.name == "cond"]
  assert [v.aval.shape for v in conds(attention.switch_keeping_operands)[0].outvars] == [
      (4, 3), (1, 3), (2, 3), (5, 3)]
  assert len(conds(jax.lax.switch)[0].outvars) > 4


def test_attention_impl_auto_picks_xla_off_gpus_and_explicit_choices_stand():
  # (On an NVIDIA GPU of compute capability >= 8.0, auto picks cudnn for bfloat16 models.)
  cfg = model_lib.ModelConfig(vocab_size=64, width=32, num_heads=2, num_layers=2,
                              dtype="bfloat16")
  assert cfg.attention_impl == "auto"
  assert cfg.resolved_attention_impl == ("cudnn" if jax.default_backend() == "gpu" else "xla")
  assert dataclasses.replace(cfg, dtype="float32").resolved_attention_impl == "xla"
  for impl in ("xla", "cudnn"):
    assert dataclasses.replace(cfg, attention_impl=impl).resolved_attention_impl == impl
  blocks = model_lib.Model(dataclasses.replace(cfg, block_types=("attention",) * 2,
                                               scan_layers=False), rngs=nnx.Rngs(0)).blocks
  assert {b.temporal.impl for b in blocks} == {"xla"}


def test_cudnn_attention_rows_of_odd_length_take_the_xla_path():
  # cuDNN refuses its document mask for odd lengths; such rows must give the XLA result (on the
  # CPU an even length would reach cuDNN and fail, so only the odd-length branch runs here).
  from recurrentgemma_jax import attention
  xla = perturbed(attention.MQAttention(32, 4, 6, rngs=nnx.Rngs(0), impl="xla"), seed=1)
  cudnn = perturbed(attention.MQAttention(32, 4, 6, rngs=nnx.Rngs(0), impl="cudnn"), seed=1)
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 13, 32))
  pos = jnp.stack([jnp.arange(13), jnp.concatenate([jnp.arange(5), jnp.arange(8)])])
  np.testing.assert_array_equal(cudnn(x, pos)[0], xla(x, pos)[0])


def test_cudnn_attention_switch_under_remat_gives_the_same_gradients(monkeypatch):
  # fused_attention's switch is a custom VJP (switch_keeping_operands); rematerialised blocks
  # (remat block / dots) run its forward again in the backward and must give the gradients
  # of XLA's masked attention. cuDNN runs as its semantics in jnp.
  from recurrentgemma_jax import attention
  helpers.cudnn_attention_on_cpu(monkeypatch)
  monkeypatch.setattr(attention, "packed_segments_supported", lambda: True)
  cfg = model_lib.ModelConfig(family="griffin", vocab_size=41, width=32, num_layers=3,
                              num_heads=2, lru_width=32, mlp_expanded_width=48,
                              attention_window_size=4, dtype="float32", attention_impl="cudnn",
                              scan_impl="xla_linear", scan_layers=False)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, 41)
  pos = jnp.stack([jnp.arange(12), jnp.concatenate([jnp.arange(4), jnp.arange(8)])])
  loss, grads, _ = helpers.loss_grads_and_kernels(
      dataclasses.replace(cfg, attention_impl="xla"), tokens, pos)  # XLA's masks, no remat
  for remat in ("none", "block", "dots"):
    other_loss, other_grads, _ = helpers.loss_grads_and_kernels(
        dataclasses.replace(cfg, remat=remat), tokens, pos)
    np.testing.assert_allclose(other_loss, loss, rtol=1e-6)
    helpers.assert_grads_close(other_grads, grads)
