"""Gated Linear Attention at the GLA paper's sizes: `--config configs/gla.py:340m|1.3b`."""

from recurrentgemma_jax import configlib


def get_config(arg=None):
  return configlib.family_config("gla", arg or "340m")
