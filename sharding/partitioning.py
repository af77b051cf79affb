"""Where every array lives: the (data, model) device mesh and one table of rules from the
parameters' logical axis names to mesh axes.

Kernels XLA cannot partition (Pallas calls: custom calls with no sharding rule, which the SPMD
partitioner would run on gathered, whole inputs) run per device through ``shard_local``, with
their activations' logical axes (``batch`` -> ``data``) mapped by the same table.

Megatron-style splits follow from the rules: the MLP's ``mlp`` axis, the recurrent block's
``lru`` axis and the attention's ``heads`` axis go to ``model``, so the up/branch projections are
column-parallel and the down/out projections row-parallel (one all-reduce each way per block);
the Conv1D, the RG-LRU ``a_param`` and its block-diagonal gates (``blocks``) are split by channel
with no communication; MQA's single key/value head (``kv``) is replicated.

ZeRO (``config.zero``): 1 additionally splits the optimizer state over ``data``, 3 the
parameters too (XLA gathers each layer's weights where they are used).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# logical axis -> mesh axis (None: replicated). Changing the parallelism is changing this table
# or the mesh shape, nothing else.
RULES: dict[str, str | None] = {
    "vocab": "model",
    "embed": None,
    "mlp": "model",
    "heads": "model",
    "lru": "model",
    "blocks": "model",
    "kv": None,
    "batch": "data",  # activations only: rows of a batch
    "layers": None,  # the layer axis of stacked parameters (scan_layers): see spec()
}
DATA, MODEL = "data", "model"


def make_mesh(data: int, model: int, devices=None, *, slices: int = 1) -> Mesh:
  """A ``(data, model)`` mesh; -1 on one axis takes the remaining devices.

  ``slices > 1`` spreads ``data`` over that many TPU slices (their ``slice_index``) joined by
  the slower data-centre network: ``model`` and the rest of ``data`` stay inside a slice, so
  only the data-parallel gradient reduction crosses the network. Elsewhere (GPUs, CPUs, one TPU
  slice) the processes stand for the slices, in ``slices`` equal groups of consecutive process
  indices (``process_groups``): with ``scripts/launch_gpus.sh``'s one process per GPU, one
  group per node.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  data = n // model if data == -1 else data
  model = n // data if model == -1 else model
  if data * model != n:
    raise ValueError(f"mesh data={data} x model={model} does not use the {n} devices")
  if slices == 1:
    return Mesh(np.asarray(devices).reshape(data, model), (DATA, MODEL))
  if data % slices:
    raise ValueError(f"mesh.slices={slices} does not divide the data axis ({data})")
  from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
  slice_indices = {getattr(d, "slice_index", 0) for d in devices}
  if len(slice_indices) > 1:  # multi-slice TPUs number their slices
    if len(slice_indices) != slices:
      raise ValueError(f"mesh.slices={slices} but the devices form {len(slice_indices)} slices")
    grid = mesh_utils.create_hybrid_device_mesh(
        (data // slices, model), (slices, 1), devices, process_is_granule=False)
  else:
    grid = grouped_grid(devices, process_groups([d.process_index for d in devices], slices),
                        data // slices, model)
  return Mesh(grid, (DATA, MODEL))


def process_groups(process_indices: list[int], slices: int) -> list[int]:
  """Each device's group, from its process index: the processes in index order, cut into
  ``slices`` equal runs (processes ``0 .. n/slices - 1`` are group 0, and so on)."""
  processes = sorted(set(process_indices))
  if len(processes) % slices:
    raise ValueError(f"mesh.slices={slices} does not divide the {len(processes)} processes "
                     "into equal groups")
  per_group = len(processes) // slices
  rank = {p: i for i, p in enumerate(processes)}
  return [rank[p] // per_group for p in process_indices]


def grouped_grid(devices: list, groups: list[int], rows: int, model: int) -> np.ndarray:
  """The ``(data, model)`` device grid whose ``data`` axis is each group's ``rows`` in turn
  (``groups[i]``: device i's group, 0 to slices - 1): group-local meshes stacked over the
  network, as ``create_hybrid_device_mesh`` stacks slices."""
  from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
  blocks = []
  for group in range(max(groups) + 1):
    members = [d for d, g in zip(devices, groups) if g == group]
    if len(members) != rows * model:
      raise ValueError(f"mesh.slices={max(groups) + 1}: process group {group} holds "
                       f"{len(members)} devices, not {rows * model}")
    blocks.append(mesh_utils.create_device_mesh((rows, model), members))
  return np.concatenate(blocks, axis=0)


def spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, *,
         over_data: bool = False) -> P:
  """The PartitionSpec of one array from its logical axes.

  A mesh axis is used at most once and only on a dimension it divides; ``over_data`` adds
  ``data`` on the largest remaining dimension it divides (ZeRO).

  A parameter stacked over layers (leading axis ``layers``, ``model.scan_layers``) is split as
  one of its layers is, that axis whole: the scan takes one layer per step, so a split layer
  axis would have every device gather the whole stack (ZeRO-3 gathers one layer per step).
  """
  if axes and axes[0] == "layers":
    return P(None, *spec(axes[1:], shape[1:], mesh, over_data=over_data))
  names: list[str | None] = []
  for axis, size in zip(axes, shape):
    mesh_axis = RULES.get(axis) if axis else None
    ok = mesh_axis and mesh_axis not in names and size % mesh.shape[mesh_axis] == 0
    names.append(mesh_axis if ok and mesh.shape[mesh_axis] > 1 else None)
  if over_data and mesh.shape[DATA] > 1:
    free = [i for i, n in enumerate(names) if n is None and shape[i] % mesh.shape[DATA] == 0]
    if free:
      names[max(free, key=lambda i: shape[i])] = DATA
  return P(*names)


def as_used(x, axes: tuple[str | None, ...]):
  """A parameter constrained to its sharding without ZeRO's ``data`` split, under the mesh set
  with ``jax.set_mesh`` (else ``x`` itself): ZeRO-3's gather of a weight where it is used, made
  explicit where XLA would otherwise move activations instead."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return x
  return jax.lax.with_sharding_constraint(x, spec(axes, x.shape, mesh))


def _shardings(model_abstract, mesh: Mesh, over_data: bool):
  """A State shaped like the parameters' whose leaves are NamedShardings."""
  def sharding(v: nnx.Variable):
    axes = v.get_metadata().get("axes") or (None,) * v.value.ndim
    return v.replace(NamedSharding(mesh, spec(axes, v.value.shape, mesh, over_data=over_data)))
  return jax.tree.map(sharding, nnx.state(model_abstract, nnx.Param),
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


# The config field that sets each logical axis's size (for the note below).
AXIS_FIELDS = {"vocab": "model.vocab_size", "mlp": "model.mlp_expanded_width",
               "heads": "the attention columns (heads x head size)", "lru": "model.lru_width",
               "blocks": "model.num_gate_blocks"}


def unsplit_axes(model_abstract, mesh: Mesh) -> dict[str, int]:
  """``{logical axis: size}`` of the parameters' axes that the rules put on ``model`` but
  that stay whole because ``model`` does not divide them (every device of the axis holds and
  computes them): empty on a mesh without tensor parallelism."""
  if mesh.shape[MODEL] == 1:
    return {}
  out = {}
  for v in jax.tree.leaves(nnx.state(model_abstract, nnx.Param),
                           is_leaf=lambda x: isinstance(x, nnx.Variable)):
    axes = v.get_metadata().get("axes") or ()
    shape = v.value.shape
    if axes and axes[0] == "layers":
      axes, shape = axes[1:], shape[1:]
    for axis, size in zip(axes, shape):
      if RULES.get(axis) == MODEL and size % mesh.shape[MODEL]:
        out[axis] = size
  return out


def unsplit_note(model_abstract, mesh: Mesh) -> str | None:
  """One line naming the fields of :func:`unsplit_axes`, or None."""
  axes = unsplit_axes(model_abstract, mesh)
  if not axes:
    return None
  named = ", ".join(f"{AXIS_FIELDS.get(a, a)}={n}" for a, n in axes.items())
  return (f"note: mesh.model={mesh.shape[MODEL]} does not divide {named}: "
          f"{'that dimension stays' if len(axes) == 1 else 'those dimensions stay'} whole on "
          f"every device of the model axis (replicated, computed {mesh.shape[MODEL]} times)")


def param_shardings(model_abstract, mesh: Mesh, *, zero: int):
  """NamedShardings for the model's parameter State (abstract model from ``nnx.eval_shape``)."""
  return _shardings(model_abstract, mesh, over_data=zero >= 3)


def opt_state_shardings(tx: optax.GradientTransformation, opt_abstract, model_abstract,
                        mesh: Mesh, *, zero: int):
  """Optimizer moments shard like their parameters (plus ``data`` from ZeRO-1 on);
  scalars such as the step count are replicated."""
  replicated = NamedSharding(mesh, P())
  return optax.tree_map_params(
      tx, lambda _, s: s, opt_abstract, _shardings(model_abstract, mesh, over_data=zero >= 1),
      transform_non_params=lambda _: replicated)


def process_data_shard(mesh: Mesh) -> tuple[int, int]:
  """Which share of the global batch this process feeds: ``(index, count)``.

  Processes whose devices sit at the same positions of the ``data`` axis (tensor parallelism
  across processes) must feed the same rows; the count is the number of distinct groups.
  """
  data_axis = mesh.axis_names.index(DATA)
  positions: dict[int, set[int]] = {}
  for index in np.ndindex(mesh.devices.shape):
    positions.setdefault(mesh.devices[index].process_index, set()).add(index[data_axis])
  groups = sorted({tuple(sorted(p)) for p in positions.values()})
  covered = sorted(i for g in groups for i in g)
  if covered != list(range(mesh.shape[DATA])):
    raise ValueError(f"processes cover the data axis unevenly: {groups}; choose a mesh whose "
                     "data axis splits along process boundaries")
  return groups.index(tuple(sorted(positions[jax.process_index()]))), len(groups)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows of a batch are split over ``data`` (and replicated over ``model``)."""
  return NamedSharding(mesh, P(DATA))


class OnMesh:
  """A jitted function traced (``lower``, first call) and run with ``mesh`` set
  (``jax.set_mesh``), so that the kernels inside it run per device (``shard_local``)."""

  def __init__(self, mesh: Mesh, jitted):
    self.mesh, self.jitted = mesh, jitted

  def __call__(self, *args):
    with jax.set_mesh(self.mesh):
      return self.jitted(*args)

  def lower(self, *args):
    with jax.set_mesh(self.mesh):
      return self.jitted.lower(*args)


def shard_local(fn, in_axes, out_axes):
  """``fn`` run on each device's shard of its arguments when a mesh is set (``jax.set_mesh``, as
  ``train.run`` does), else ``fn`` itself.

  For kernels XLA cannot partition: a Pallas call is a custom call without a sharding rule, so
  under ``jit`` the SPMD partitioner would gather its inputs and run it whole on every device.
  ``fn`` must act on each slice of the split axes independently (rows, channels, heads).

  Args:
    fn: a function of arrays (an argument may be None).
    in_axes: one tuple of logical axis names (``RULES``) per argument (ignored for None).
    out_axes: the same for ``fn``'s outputs, a tuple of tuples when it returns a tuple; every
      name in it must also name an axis of an argument.

  A logical axis is split over its mesh axis only where that mesh axis divides every argument's
  dimension of that name, so all arrays sharing an axis are split alike.
  """
  @functools.wraps(fn)
  def wrapped(*args):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
      return fn(*args)
    split = {}
    for axes, x in zip(in_axes, args):
      if x is None:
        continue
      for name, size in zip(axes, x.shape):
        mesh_axis = RULES.get(name) if name else None
        if mesh_axis is None or mesh.shape.get(mesh_axis, 1) == 1:
          continue
        ok = size % mesh.shape[mesh_axis] == 0 and split.get(name, True)
        split[name] = ok and mesh_axis
    def to_spec(axes):
      names = [split.get(a) or None for a in axes]
      if len([n for n in names if n]) != len({n for n in names if n}):
        raise ValueError(f"shard_local: axes {axes} put one mesh axis on two dimensions")
      return P(*names)
    present = [i for i, x in enumerate(args) if x is not None]
    def local(*xs):
      full = list(args)
      for i, x in zip(present, xs):
        full[i] = x
      return fn(*full)
    nested = bool(out_axes) and isinstance(out_axes[0], tuple)
    out_specs = tuple(map(to_spec, out_axes)) if nested else to_spec(out_axes)
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(to_spec(in_axes[i]) for i in present),
                         out_specs=out_specs, check_vma=False)(*(args[i] for i in present))
  return wrapped
