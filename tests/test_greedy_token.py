"""The greedy token from the tied output layer in one kernel (``pallas_kernels.sampling.greedy``)
against float64 NumPy, and greedy decoding with it against XLA's logits and argmax, alone and
under a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sampling import greedy
from recurrentgemma_jax import model as model_lib
from recurrentgemma_jax import sampling
from sharding import partitioning
from test_model import perturbed, tiny_config


def random_inputs(seed, n, vocab, width, dtype):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(n, width)), dtype)
  table = jnp.asarray(rng.normal(size=(vocab, width)) / np.sqrt(width), jnp.float32)
  return x, table


@pytest.mark.parametrize("n,vocab,width,dtype", [
    (5, 384, 64, jnp.float32),     # 128 columns a tile (384 is no multiple of 256), K steps of 32
    (37, 512, 128, jnp.bfloat16),  # 256 columns a tile, rows padded to 64
    (130, 256, 64, jnp.bfloat16),  # two row tiles, the second padded
])
def test_greedy_token_matches_float64(n, vocab, width, dtype):
  """Each row's token is the float64 argmax of its logits (the inputs as the kernel sees them:
  ``x`` and the table rounded to ``dtype``) wherever the best two logits are further apart than
  the logits' rounding, and elsewhere a token whose logit is within that rounding of the best."""
  x, table = random_inputs(n * vocab + width, n, vocab, width, dtype)
  got = np.asarray(greedy.greedy_token(x, table, interpret=True))
  assert got.dtype == np.int32 and got.shape == (n,)
  logits = np.asarray(x, np.float64) @ np.asarray(table.astype(dtype), np.float64).T
  best = logits.max(axis=1)
  # bfloat16: the kernel compares logits rounded to bfloat16 (8 bits); float32: summation order
  rounding = np.abs(best) * (2.0 ** -7 if dtype == jnp.bfloat16 else 1e-5)
  chosen = logits[np.arange(n), got]
  assert np.all(best - chosen <= rounding), (best - chosen).max()
  top2 = np.sort(logits, axis=1)[:, -2:]
  clear = top2[:, 1] - top2[:, 0] > rounding
  assert clear.mean() > 0.5  # the check below covers most rows
  np.testing.assert_array_equal(got[clear], logits.argmax(axis=1)[clear])
  # the per-device fallback under a mesh gives the same partials as the kernel
  want_best, want_column = greedy.partials_reference(x, table)
  got_best, got_column, cols = greedy.partials(x, table, interpret=True)
  assert cols == vocab // want_best.shape[1]
  np.testing.assert_allclose(got_best[:n], want_best, rtol=1e-2 if dtype == jnp.bfloat16 else 1e-5)
  assert np.mean(np.asarray(got_column[:n]) == np.asarray(want_column)) > 0.9


def test_greedy_token_ties_go_to_the_lower_index():
  """Equal logits (the same table row at two indices, within a tile and across tiles) pick
  the lower index, as ``jnp.argmax``; a row's maximum in a later tile is found there."""
  x, table = random_inputs(1, 6, 768, 64, jnp.float32)  # 3 tiles of 256
  want = np.asarray(greedy.reference(x, table))
  for lower, higher in ((3, 200), (10, 700), (300, 520)):
    tied = table.at[lower].set(table[want[0]]).at[higher].set(table[want[0]])
    tied = tied.at[want[0]].set(-table[want[0]])  # the original best is now the worst
    got = np.asarray(greedy.greedy_token(x, tied, interpret=True))
    assert got[0] == lower, (lower, higher, got[0])
    np.testing.assert_array_equal(got, np.asarray(greedy.reference(x, tied)))


def test_greedy_token_stays_in_the_vocabulary_with_nan_logits():
  """A NaN logit (a diverged model) still gives a token inside the vocabulary."""
  x, table = random_inputs(2, 3, 256, 64, jnp.float32)
  for rows in (slice(255, 256), slice(None)):  # the last column NaN; every column NaN
    got = np.asarray(greedy.greedy_token(x, table.at[rows].set(jnp.nan), interpret=True))
    assert np.all((got >= 0) & (got < 256)), got


def test_greedy_token_rejects_unsupported_shapes():
  x, table = random_inputs(0, 4, 200, 64, jnp.float32)
  with pytest.raises(ValueError, match="V of 128"):
    greedy.greedy_token(x, table, interpret=True)
  with pytest.raises(ValueError, match="table"):
    greedy.greedy_token(x[:, :32], table[:256], interpret=True)


def test_greedy_token_lowers_for_a_gpu():
  """The kernel lowers to Triton for CUDA on this CPU machine, at a 1.3B model's output layer."""
  import helpers  # pylint: disable=g-import-not-at-top
  for dtype in (jnp.bfloat16, jnp.float32):
    text = helpers.lower_for_cuda(greedy.greedy_token, jax.ShapeDtypeStruct((2048, 2048), dtype),
                                  jax.ShapeDtypeStruct((256_000, 2048), dtype))
    assert text.count("@__gpu$xla.gpu.triton") == 1 and "pallas_greedy_token" in text


def test_mosaic_kernel_gives_the_triton_kernels_partials():
  """``impl="mosaic"`` (Pallas' Mosaic GPU interpreter): the same per-tile maxima and first
  columns as the Triton kernel, bit for bit (both round the float32 tile to the compute dtype),
  over padded rows, ties within and across tiles, a NaN column and float16; the tokens match the
  float64 argmax as above."""
  x, table = random_inputs(3, 130, 1024, 128, jnp.bfloat16)
  want = np.asarray(greedy.reference(x, table))
  tied = table.at[3].set(table[want[0]]).at[700].set(table[want[0]])  # row 0: a tie, then one
  tied = tied.at[want[0]].set(-table[want[0]])                         # tile later
  for dtype, t in ((jnp.bfloat16, tied), (jnp.float16, table.at[255].set(jnp.nan))):
    xs = x.astype(dtype)
    got = greedy.partials(xs, t, impl="mosaic", interpret=True)
    ref = greedy.partials(xs, t, impl="triton", interpret=True)
    assert got[2] == ref[2] == 256
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]))
    assert got[0].shape == (130, 4) and got[1].dtype == jnp.int32
  assert greedy.pick(*greedy.partials(x, tied, impl="mosaic", interpret=True))[0] == 3
  with pytest.raises(ValueError, match="Mosaic GPU kernel does not take dtype float32"):
    greedy.partials(x.astype(jnp.float32), table, impl="mosaic", interpret=True)
  with pytest.raises(ValueError, match="multiples of 64 and 256"):
    greedy.partials(x, table[:384], impl="mosaic", interpret=True)


def test_greedy_path(monkeypatch):
  """``GREEDY_IMPL``: auto takes Triton's interpreter on a CPU and the Mosaic kernel on Hopper
  GPUs only; mosaic takes it where its shapes and dtype allow, else Triton; anything else is
  one line naming the setting."""
  import helpers  # pylint: disable=g-import-not-at-top
  from pallas_kernels import dispatch  # pylint: disable=g-import-not-at-top
  ok = (256_000, 2048, jnp.bfloat16)
  helpers.assert_mosaic_on_hopper(monkeypatch, dispatch.greedy_path, *ok)
  monkeypatch.setattr(dispatch, "GREEDY_IMPL", "triton")
  assert dispatch.greedy_path(*ok) == "triton"
  monkeypatch.setattr(dispatch, "GREEDY_IMPL", "mosaic")
  assert dispatch.greedy_path(256_000, 2048, jnp.bfloat16) == "mosaic"
  assert dispatch.greedy_path(256_000, 2048, jnp.float32) == "triton"
  assert dispatch.greedy_path(384, 2048, jnp.bfloat16) == "triton"
  monkeypatch.setattr(dispatch, "GREEDY_IMPL", "cudnn")
  with pytest.raises(ValueError, match="GREEDY_IMPL='cudnn': allowed auto, mosaic, triton"):
    dispatch.greedy_path(256_000, 2048, jnp.bfloat16)


def test_mosaic_kernel_lowers_for_a_gpu():
  """The Mosaic GPU kernel (the table read transposed by wgmma) lowers for CUDA on this CPU
  machine at a 1.3B model's output layer, in clusters of two CTAs (the interpreter has no
  cluster barriers, so only this lowering and the GPU check cover them), or none where asked
  or below ``MOSAIC_CLUSTER_ROWS`` rows."""
  import helpers  # pylint: disable=g-import-not-at-top
  shapes = (jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16),
            jax.ShapeDtypeStruct((256_000, 2048), jnp.bfloat16))
  text = helpers.lower_for_cuda(lambda x, t: greedy.greedy_token(x, t, impl="mosaic"), *shapes)
  assert text.count("custom_call @mosaic_gpu") == 1 and "@__gpu$xla.gpu.triton" not in text
  assert greedy.MOSAIC_CLUSTER == 2 and "cluster.wait" in text  # the cluster barrier
  for fewer in (jax.ShapeDtypeStruct((256, 2048), jnp.bfloat16), shapes[1]), shapes:  # no clusters
    text = helpers.lower_for_cuda(lambda x, t: greedy._mosaic(  # pylint: disable=protected-access
        x, t, cluster=1 if x.shape[0] == 2048 else 2)[:2], *fewer)
    assert text.count("custom_call @mosaic_gpu") == 1 and "cluster.wait" not in text


def _count_kernel_calls(monkeypatch):
  calls = []
  kernel = greedy.partials
  monkeypatch.setattr(greedy, "partials",
                      lambda x, t, **k: calls.append((x.shape[0], t.shape[0])) or kernel(x, t, **k))
  return calls


@pytest.mark.parametrize("family", ["hawk", "mqa"])
def test_greedy_sampling_with_the_kernel_equals_xla(family, monkeypatch):
  """Greedy decoding through ``decode_impl=pallas`` (``Model.greedy_extend`` with the kernel,
  interpreted) gives the tokens of ``decode_impl=xla`` (the logits, then the argmax), resets
  and prompts of two lengths included; with fewer rows than ``greedy.MIN_ROWS`` the model
  keeps XLA's path; temperature sampling and ``return_logits`` never take the kernel."""
  calls = _count_kernel_calls(monkeypatch)
  prompts = [[1, 2, 3, 4, 5], [6, 7], [9]]
  params = sampling.SamplingParams(max_new_tokens=7)
  tokens = {}
  for impl, min_rows in (("xla", 1), ("pallas", 3), ("pallas", 4)):
    monkeypatch.setattr(greedy, "MIN_ROWS", min_rows)
    jax.clear_caches()  # MIN_ROWS is read when tracing
    calls.clear()
    cfg = tiny_config(family=family, vocab_size=256, num_layers=2, width=64, decode_impl=impl,
                      mlp_expanded_width=128, attention_window_size=4)
    model = perturbed(model_lib.init_model(cfg, seed=3), seed=4, scale=0.2)
    out = sampling.sample(model, prompts, params)
    tokens[impl, min_rows] = out.tokens
    assert calls == ([(3, 256)] if (impl, min_rows) == ("pallas", 3) else []), calls
  assert len(set(tokens["xla", 1].ravel())) > 3  # the model does not repeat one token
  np.testing.assert_array_equal(tokens["pallas", 3], tokens["xla", 1])
  np.testing.assert_array_equal(tokens["pallas", 4], tokens["xla", 1])
  # the same tokens from the logits (return_logits) and no kernel then, nor when sampling
  monkeypatch.setattr(greedy, "MIN_ROWS", 1)
  jax.clear_caches()
  calls.clear()
  with_logits = sampling.sample(model, prompts, params, return_logits=True)
  np.testing.assert_array_equal(with_logits.tokens, tokens["xla", 1])
  sampling.sample(model, prompts, sampling.SamplingParams(max_new_tokens=3, temperature=1.0))
  assert not calls


def test_greedy_sampling_with_the_mosaic_kernel_equals_triton(monkeypatch):
  """``GREEDY_IMPL=mosaic`` (the Mosaic GPU kernel in its interpreter) through
  ``Model.greedy_extend`` in a bfloat16 model gives the Triton kernel's tokens."""
  from pallas_kernels import dispatch  # pylint: disable=g-import-not-at-top
  calls = _count_kernel_calls(monkeypatch)
  mosaic = greedy._mosaic  # pylint: disable=protected-access
  used = []
  monkeypatch.setattr(greedy, "_mosaic", lambda *a, **k: used.append(1) or mosaic(*a, **k))
  monkeypatch.setattr(greedy, "MIN_ROWS", 3)
  prompts = [[1, 2, 3, 4, 5], [6, 7], [9]]
  tokens = {}
  for impl in ("triton", "mosaic"):
    monkeypatch.setattr(dispatch, "GREEDY_IMPL", impl)
    jax.clear_caches()  # GREEDY_IMPL is read when tracing
    cfg = tiny_config(family="hawk", vocab_size=512, num_layers=2, width=64, decode_impl="pallas",
                      mlp_expanded_width=128, dtype="bfloat16")
    model = perturbed(model_lib.init_model(cfg, seed=3), seed=4, scale=1.0)
    tokens[impl] = sampling.sample(model, prompts, sampling.SamplingParams(max_new_tokens=5)).tokens
  assert calls and used, (calls, used)
  assert len(set(tokens["triton"].ravel())) > 3
  np.testing.assert_array_equal(tokens["mosaic"], tokens["triton"])


def _one_device_tokens(monkeypatch, family, vocab, seed, new_tokens):
  """``(model, prompts, params, tokens)``: a small float32 ``family`` model with
  ``decode_impl=pallas``, 8 prompts of 2-4 tokens, and their greedy tokens on one device, every
  batch taking the kernel (``MIN_ROWS`` 1)."""
  cfg = model_lib.ModelConfig(family=family, vocab_size=vocab, width=64, lru_width=64,
                              num_layers=2, num_heads=2, mlp_expanded_width=128,
                              dtype="float32", decode_impl="pallas")
  model = perturbed(model_lib.init_model(cfg, seed), seed=seed + 1, scale=0.2)
  prompts = [list(np.random.default_rng(r).integers(1, vocab, 2 + r % 3)) for r in range(8)]
  params = sampling.SamplingParams(max_new_tokens=new_tokens)
  monkeypatch.setattr(greedy, "MIN_ROWS", 1)
  jax.clear_caches()  # MIN_ROWS is read when tracing
  return model, prompts, params, sampling.sample(model, prompts, params)


def test_greedy_sampling_under_a_mesh(monkeypatch):
  """Under a data x model mesh the kernel runs on each device's rows and share of the
  vocabulary (rows over data, the table's rows over model), and the partials of all devices
  give the tokens of one device; a device with fewer rows than ``MIN_ROWS`` takes XLA's
  partials: same tokens."""
  calls = _count_kernel_calls(monkeypatch)
  model, prompts, params, want = _one_device_tokens(monkeypatch, "hawk", 512, 0, 5)
  assert calls == [(8, 512)]
  # model=2: 256 vocabulary rows a device (one tile of 256); model=4: 128 (one tile of 128)
  for shape, min_rows, local in (((4, 2), 1, [(2, 256)]), ((2, 4), 1, [(4, 128)]),
                                 ((4, 2), 3, [])):
    monkeypatch.setattr(greedy, "MIN_ROWS", min_rows)
    jax.clear_caches()
    calls.clear()
    with jax.set_mesh(partitioning.make_mesh(*shape)):
      got = sampling.sample(model, prompts, params)
    assert calls == local, (shape, calls)
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_greedy_sampling_under_a_mesh_with_an_odd_share_of_the_vocabulary(monkeypatch):
  """A vocabulary of 384 split over model=2 leaves each device 192 columns, no multiple of the
  kernel's 128: each device takes XLA's partials over its share as one tile, and the tokens are
  those of one device (which takes the kernel)."""
  calls = _count_kernel_calls(monkeypatch)
  model, prompts, params, want = _one_device_tokens(monkeypatch, "mqa", 384, 2, 4)
  assert calls == [(8, 384)]
  calls.clear()
  with jax.set_mesh(partitioning.make_mesh(4, 2)):
    got = sampling.sample(model, prompts, params)
  assert not calls
  np.testing.assert_array_equal(got.tokens, want.tokens)
