"""The linear scan with the time axis split over a mesh axis (sequence parallelism).

Shard i holds times ``[i T/n, (i+1) T/n)``. Over a shard the recurrence is affine in the state
it starts from: ``h_end = P_i h_start + e_i``, with ``P_i`` the product of the shard's ``a`` and
``e_i`` the shard's final state from a zero start. So:

1. each shard scans locally from zero (the Pallas kernel) to get ``e_i``, and takes ``P_i``;
2. all ``(e_i, P_i)`` are all-gathered (``2 n B D`` floats) and every shard composes them in scan
   order to get its own starting state (and the global final state);
3. each shard scans again from its starting state.

The second scan costs one more read of x and a, but no per-step correction terms (the
alternative, ``y += cumprod(a) * h_start``, reads and writes more). Everything is differentiable
(the kernel's custom VJP, ``all_gather``'s transpose), so the backward needs no extra code.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.rg_lru.scan import linear_scan


def sequence_parallel_linear_scan(x, a, h0=None, *, mesh, axis_name, reverse=False,
                                  interpret=False):
  """``linear_scan`` with T sharded over ``mesh`` axis ``axis_name``.

  Args:
    x, a: ``[B, T, D]``, T divisible by the size of the mesh axis (global arrays; other mesh
      axes replicate them).
    h0: ``[B, D]`` float32 or None (zeros).
    mesh: a ``jax.sharding.Mesh`` holding ``axis_name``.
    axis_name: the mesh axis that splits T.
    reverse, interpret: as in ``linear_scan``.

  Returns:
    ``y: [B, T, D]`` (sharded like x) in ``x``'s dtype and ``h_last: [B, D]`` float32
    (replicated). Differentiable in ``x``, ``a`` and ``h0``.
  """
  n = mesh.shape[axis_name]
  if x.shape[1] % n:
    raise ValueError(f"T={x.shape[1]} is not divisible by the {n} shards of {axis_name!r}")
  if h0 is None:
    h0 = jnp.zeros((x.shape[0], x.shape[2]), jnp.float32)
  seq = P(None, axis_name, None)
  local = functools.partial(_local_scan, n=n, axis_name=axis_name, reverse=reverse,
                            interpret=interpret)
  # check_vma=False: the Pallas call inside does not take part in the varying-axes checks.
  return jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, P()), out_specs=(seq, P()),
                       check_vma=False)(x, a, h0.astype(jnp.float32))


def _local_scan(x, a, h0, *, n, axis_name, reverse, interpret):
  _, end_from_zero = linear_scan(x, a, reverse=reverse, interpret=interpret)
  decay = jnp.prod(a.astype(jnp.float32), axis=1)
  ends = jax.lax.all_gather(end_from_zero, axis_name)  # [n, B, D]
  decays = jax.lax.all_gather(decay, axis_name)
  starts = [None] * n
  h = h0
  for i in (reversed(range(n)) if reverse else range(n)):
    starts[i] = h
    h = decays[i] * h + ends[i]
  start = jnp.stack(starts)[jax.lax.axis_index(axis_name)]
  y, _ = linear_scan(x, a, start, reverse=reverse, interpret=interpret)
  return y, h
