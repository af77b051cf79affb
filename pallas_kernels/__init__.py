"""Pallas kernels for the recurrent layers, each with a pure-JAX reference beside it."""
