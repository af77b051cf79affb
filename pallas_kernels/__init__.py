"""Pallas kernels for the recurrent layers, each with a pure-JAX reference beside it."""
from pallas_kernels.linear_scan import (linear_scan, linear_scan_reference, rg_lru,
                                        rg_lru_reference, sequence_parallel_linear_scan)
from pallas_kernels.chunk_gla import chunk_gla, gla_recurrent_step, gla_reference
