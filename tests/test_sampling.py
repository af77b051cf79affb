"""Sampling through the decoding caches equals the full forward; official greedy parity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recurrentgemma_jax import model as model_lib
from recurrentgemma_jax import sampling
from test_model import perturbed, tiny_config


@pytest.mark.parametrize("family", ["griffin", "hawk", "mqa", "gla"])
def test_cached_sampling_logits_equal_the_full_forward(family):
  cfg = tiny_config(family=family, num_layers=3, attention_window_size=3)
  model = perturbed(model_lib.init_model(cfg, seed=3), seed=4, scale=0.1)
  rng = np.random.default_rng(5)
  prompts = [list(rng.integers(0, 53, n)) for n in (9, 2, 5)]  # 9 > window; mixed lengths
  params = sampling.SamplingParams(max_new_tokens=6)
  out = sampling.sample(model, prompts, params, return_logits=True)
  assert out.tokens.shape == (3, 6) and out.logits.shape == (3, 6, 53)
  for row, prompt in enumerate(prompts):
    full = np.concatenate([prompt, out.tokens[row]])
    logits = model(jnp.asarray(full)[None], jnp.arange(len(full))[None])[0]
    expected = logits[len(prompt) - 1: len(prompt) - 1 + 6]
    np.testing.assert_allclose(out.logits[row], expected, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out.tokens[row], np.argmax(expected, axis=-1))


def test_sampling_controls():
  cfg = tiny_config(family="hawk", num_layers=1)
  model = perturbed(model_lib.init_model(cfg, seed=1), seed=2)
  prompts = [[1, 2, 3], [4, 5]]
  greedy = sampling.sample(model, prompts, sampling.SamplingParams(max_new_tokens=5))
  for params in (sampling.SamplingParams(max_new_tokens=5, temperature=1.0, top_k=1, seed=7),
                 sampling.SamplingParams(max_new_tokens=5, temperature=1.0, top_p=1e-6, seed=7)):
    np.testing.assert_array_equal(sampling.sample(model, prompts, params).tokens, greedy.tokens)
  free = [sampling.sample(model, prompts, sampling.SamplingParams(
      max_new_tokens=8, temperature=5.0, seed=s)).tokens for s in (0, 1)]
  assert not np.array_equal(free[0], free[1])  # the seed matters when sampling
  stop = int(greedy.tokens[0, 1])
  stopped = sampling.sample(model, prompts, sampling.SamplingParams(max_new_tokens=5,
                                                                    stop_tokens=(stop,)),
                            pad_id=0)
  assert stopped.lengths[0] <= 2 and stopped.tokens[0, stopped.lengths[0] - 1] == stop
  assert (stopped.tokens[0, stopped.lengths[0]:] == 0).all()

  seen = []
  sampling.sample(model, prompts, sampling.SamplingParams(max_new_tokens=4),
                  stream=lambda tokens, done: seen.append(np.asarray(tokens).copy()))
  np.testing.assert_array_equal(np.stack(seen, axis=1), greedy.tokens[:, :4])
