"""Mqa at a Griffin-paper size (Table 2): `--config configs/mqa.py:SIZE` with SIZE one of
100m (default), 200m, 400m, 1.3b, 3b, 7b, 14b."""

from recurrentgemma_jax import configlib


def get_config(arg=None):
  return configlib.family_config("mqa", arg)
