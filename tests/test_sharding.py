"""Sharding on 8 simulated CPU devices: meshes and ZeRO stages give single-device losses,
parameters and optimizer state carry the intended shardings, Megatron's collectives and no
more, ZeRO-1 memory, checkpoints across meshes, and a real 2-process jax.distributed run."""

import collections
import dataclasses
import fnmatch
import json
import os
import re
import socket
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import helpers
from helpers import ROOT, run_script, script_env
from recurrentgemma_jax import attention, configlib, data, train
from recurrentgemma_jax import model as model_lib
from recurrentgemma_jax.errors import ConfigError
from sharding import distributed, partitioning

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 simulated devices "
                                "(tests/conftest.py sets them before JAX starts)")


def small_config(**overrides):
  config = configlib.load(os.path.join(ROOT, "configs", "default.py"))
  config.model.update(width=64, lru_width=64, num_layers=3, num_heads=4, num_gate_blocks=8,
                      mlp_expanded_width=128, attention_window_size=8)
  config.update(batch_size=8, seq_len=32, total_steps=10)
  config.optimizer.warmup_steps = 2
  for key, value in overrides.items():
    node = config
    *parents, name = key.split(".")
    for p in parents:
      node = node[p]
    node[name] = value
  return config


def losses_on(config, devices, steps=3):
  plan = train.setup(config, devices)
  state = plan.initial_state(config)
  step_fn = plan.jit_train_step(1)
  batches = data.make_train_iterator(config)
  out = []
  for _ in range(steps):
    batch = {k: jax.device_put(v, plan.batch_sharding) for k, v in next(batches).items()}
    state, metrics = step_fn(state, batch)
    out.append(float(metrics["loss"]))
  return out, state, plan


@pytest.fixture(scope="module")
def reference_losses():
  return losses_on(small_config(), jax.devices()[:1])[0]


# Every mesh shape and every ZeRO stage, each stage with data and model axes both over 1.
@pytest.mark.parametrize("mesh,zero", [((8, 1), 0), ((8, 1), 3), ((2, 4), 1), ((2, 4), 3),
                                       ((4, 2), 0), ((4, 2), 1), ((1, 8), 3)])
def test_mesh_and_zero_give_single_device_losses(mesh, zero, reference_losses):
  # (Layers scanned, as on TPUs; the single-device reference runs them unrolled.)
  config = small_config(**{"mesh.data": mesh[0], "mesh.model": mesh[1], "zero": zero,
                           "model.scan_layers": "true"})
  losses, state, _ = losses_on(config, jax.devices())
  np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)

  # The intended shardings: MLP columns over model, gates by block over model, K/V replicated,
  # ZeRO adding data to the optimizer moments (1, 3) and to the parameters (3). The stacked
  # layers' leading axis is never split.
  def layer_spec(variable):
    spec = tuple(variable.value.sharding.spec)
    assert not spec or spec[0] is None
    return spec[1:]

  block = state["params"]["stacked_blocks"][0]
  up = layer_spec(block["mlp_block"]["ffw_up"]["w"])
  gate = layer_spec(block["recurrent_block"]["rg_lru"]["a_gate"]["w"])
  kv = layer_spec(state["params"]["stacked_blocks"][2]["attention_block"]["proj_k"]["kernel"])
  if mesh[1] > 1:
    assert up[2] == "model" and gate[0] == "model"
  assert "model" not in up[:2] and "model" not in kv
  assert ("data" in up) == (zero == 3 and mesh[0] > 1)
  mu = layer_spec(state["opt_state"][1][0].mu["stacked_blocks"][0]["mlp_block"]["ffw_up"]["w"])
  assert ("data" in mu) == (zero >= 1 and mesh[0] > 1)


def _collectives(fn, *args):
  hlo = jax.jit(fn).lower(*args).compile().as_text()
  ops = re.findall(r"= \S+ (all-reduce|all-gather|all-to-all|collective-permute|"
                   r"reduce-scatter)(?:-start)?\(", hlo)
  return collections.Counter(ops)


def test_megatron_collectives_of_a_griffin_residual_block():
  mesh = partitioning.make_mesh(1, 4, jax.devices()[:4])
  cfg = model_lib.ModelConfig(family="griffin", vocab_size=64, width=64, lru_width=128,
                              num_layers=1, num_heads=4, num_gate_blocks=4,
                              mlp_expanded_width=128, dtype="float32", scan_impl="xla_linear")
  abstract = nnx.eval_shape(lambda: model_lib.ResidualBlock("recurrent", cfg, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(abstract)
  shardings = partitioning.param_shardings(abstract, mesh, zero=0)
  params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        params, shardings)
  replicated = NamedSharding(mesh, P())
  x = jax.ShapeDtypeStruct((2, 16, 64), jnp.float32, sharding=replicated)
  pos = jax.ShapeDtypeStruct((2, 16), jnp.int32, sharding=replicated)

  def block(p, x, pos):
    return nnx.merge(graphdef, p)(x, pos)[0]

  def block_grads(p, x, pos):
    return jax.grad(lambda p, x: jnp.sum(block(p, x, pos) ** 2), argnums=(0, 1))(p, x)

  # Forward: one all-reduce after the MLP's row-parallel down projection, one after the
  # recurrent block's output projection; nothing else.
  assert _collectives(block, params, x, pos) == {"all-reduce": 2}
  # Backward adds the input-gradient all-reduces of the two column-parallel entries (XLA may
  # combine them); still only all-reduces.
  backward = _collectives(block_grads, params, x, pos)
  assert set(backward) == {"all-reduce"} and 2 <= backward["all-reduce"] <= 4

  # The Conv1D, the RG-LRU and its block-diagonal gates, on channels split over model: no
  # communication at all, forward or backward.
  rec = params["recurrent_block"]
  lru_split = NamedSharding(mesh, P(None, None, "model"))
  h = jax.ShapeDtypeStruct((2, 16, 128), jnp.float32, sharding=lru_split)
  inner_def = nnx.graphdef(abstract.recurrent_block)

  def conv_lru(p, h, pos):
    module = nnx.merge(inner_def, p)
    y, _ = module.conv_1d(h, pos)
    return module.rg_lru(y, pos)[0]

  assert _collectives(conv_lru, rec, h, pos) == {}
  assert _collectives(lambda p, h, pos: jax.grad(
      lambda p, h: jnp.sum(conv_lru(p, h, pos) ** 2), argnums=(0, 1))(p, h), rec, h, pos) == {}


def test_zero1_cuts_optimizer_state_bytes_per_device_8x():
  sizes = {}
  for zero in (0, 1):
    plan = train.setup(small_config(**{"mesh.data": 8, "zero": zero}), jax.devices())
    init = jax.jit(plan.tx.init, out_shardings=plan.state_shardings["opt_state"])
    compiled = init.lower(plan.params_abstract).compile()
    sizes[zero] = compiled.memory_analysis().output_size_in_bytes
  assert 7.0 <= sizes[0] / sizes[1] <= 8.0, sizes


def test_tensor_parallel_names_the_dimensions_it_cannot_split():
  # 4 heads (64 query columns), 2 gate blocks, lru 64, mlp 128, the byte vocabulary of 259.
  notes = {model: train.setup(small_config(**{"mesh.data": 8 // model, "mesh.model": model,
                                               "model.num_gate_blocks": 2}),
                              jax.devices()).unsplit_note for model in (1, 2, 8)}
  assert notes[1] is None  # no tensor parallelism
  assert notes[2] == ("note: mesh.model=2 does not divide model.vocab_size=259: that dimension "
                      "stays whole on every device of the model axis (replicated, computed 2 "
                      "times)")
  assert notes[8].startswith("note: mesh.model=8 does not divide ")
  named = notes[8].split(" does not divide ")[1].split(":")[0].split(", ")
  assert sorted(named) == ["model.num_gate_blocks=2", "model.vocab_size=259"]


def test_gradient_accumulation_keeps_each_devices_rows_on_it():
  """Micro-batches are taken within each data shard: the same loss as one step over the
  batch, and no device needs another's rows (micro-batches made of whole data shards were
  all-gathered: every device computed every micro-batch)."""
  losses = {}
  for accum in (1, 2):
    config = small_config(**{"mesh.data": 4, "optimizer.grad_accum_steps": accum})
    plan = train.setup(config, jax.devices()[:4])
    batch = {k: jax.device_put(v, plan.batch_sharding)
             for k, v in next(data.make_train_iterator(config)).items()}
    compiled = plan.jit_train_step(accum).lower(plan.abstract_state, batch).compile()
    moved = re.findall(r" (all-gather|all-to-all|collective-permute)(?:-start)?\(",
                       compiled.as_text())
    assert not moved, (accum, moved)
    _, metrics = compiled(plan.initial_state(config), batch)
    losses[accum] = float(metrics["loss"])
  np.testing.assert_allclose(losses[2], losses[1], rtol=1e-5)


def test_checkpoint_from_one_mesh_restores_on_others(tmp_path):
  overrides = {"mesh.data": 2, "mesh.model": 4, "total_steps": 2, "checkpoint_every": 2,
               "log_every": 1, "eval_every": 0}
  config = small_config(**overrides)
  # The run writing the checkpoint is the user's command, in a process of its own with 8
  # simulated devices (its evaluation over both mesh axes once deadlocked in XLA's CPU
  # rendezvous: docs/reliability.md).
  flags = [f"--config.model.{k}={v}" for k, v in config.model.items()
           if k in ("width", "lru_width", "num_layers", "num_heads", "num_gate_blocks",
                    "mlp_expanded_width", "attention_window_size")]
  flags += [f"--config.{k}={config[k]}" for k in ("batch_size", "seq_len")]
  flags += ["--config.optimizer.warmup_steps=2"]
  flags += [f"--config.{k}={v}" for k, v in overrides.items()]
  run_script("train.py", f"--workdir={tmp_path}", *flags,
             env={"XLA_FLAGS": os.environ["XLA_FLAGS"]})
  config.total_steps = 3
  next_losses = {}
  for mesh, devices in [((2, 4), jax.devices()), ((8, 1), jax.devices()), ((1, 1), jax.devices()[:1])]:
    config.mesh.data, config.mesh.model = mesh
    plan = train.setup(config, devices)
    state, data_state = train.Checkpoints(str(tmp_path), 3).restore_latest(
        plan.abstract_state, print, plan.model_cfg)
    assert int(state["step"]) == 2
    batches = data.make_train_iterator(config)
    batches.set_state(train.own_data_state(data_state, (0, 1), print))
    batch = {k: jax.device_put(v, plan.batch_sharding) for k, v in next(batches).items()}
    _, metrics = plan.jit_train_step(1)(state, batch)
    next_losses[mesh] = float(metrics["loss"])
  values = list(next_losses.values())
  np.testing.assert_allclose(values, [values[0]] * 3, rtol=1e-5)


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


TWO_PROCESS_ARGS = [
    "--config.model.width=32", "--config.model.lru_width=32", "--config.model.num_layers=2",
    "--config.model.num_heads=2", "--config.model.num_gate_blocks=2",
    "--config.model.mlp_expanded_width=64", "--config.batch_size=4", "--config.seq_len=32",
    "--config.checkpoint_every=2", "--config.log_every=1", "--config.eval_every=0",
    "--config.data.eval_tokens=128"]


def _two_processes(workdir, total_steps, *extra):
  """``scripts/launch_gpus.sh`` as a user runs it, with two processes of one CPU device each."""
  env = script_env(GPUS_PER_NODE="2", COORDINATOR=f"localhost:{_free_port()}")
  proc = subprocess.run(
      ["bash", os.path.join(ROOT, "scripts", "launch_gpus.sh"), f"--workdir={workdir}",
       *TWO_PROCESS_ARGS, f"--config.total_steps={total_steps}", *extra],
      env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
  # A failing process's traceback comes first; the other's shutdown-barrier noise follows it.
  start = max(proc.stderr.find("Traceback"), 0)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[start:start + 4000]
  return proc.stdout


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return [r["loss"] for r in records if "loss" in r]


def test_data_axis_over_two_slices_trains_like_one_slice(tmp_path):
  # Each process is a "slice" (a DCN granule): the data axis spans both over the network.
  _two_processes(tmp_path / "dcn", 3, "--config.mesh.slices=2")
  _two_processes(tmp_path / "flat", 3)
  np.testing.assert_allclose(_losses(tmp_path / "dcn"), _losses(tmp_path / "flat"), rtol=1e-5)


def test_slices_off_tpus_are_equal_runs_of_consecutive_processes():
  # 4 processes (2 nodes of 2 GPUs under launch_gpus.sh), listed out of order, 2 devices each.
  assert partitioning.process_groups([1, 1, 0, 0, 3, 3, 2, 2], 2) == [0, 0, 0, 0, 1, 1, 1, 1]
  assert partitioning.process_groups([0, 1, 2, 3], 4) == [0, 1, 2, 3]
  assert partitioning.process_groups([5, 7], 1) == [0, 0]
  with pytest.raises(ValueError, match=r"^mesh.slices=3 does not divide the 4 processes into "
                     "equal groups$"):
    partitioning.process_groups([0, 1, 2, 3], 3)
  with pytest.raises(ValueError, match=r"^mesh.slices=2 does not divide the 1 processes"):
    partitioning.make_mesh(4, 2, slices=2)  # this test process: one process, 8 devices


def test_slices_lay_the_data_axis_over_the_process_groups():
  devices = jax.devices()[:8]
  groups = [1, 0, 1, 0, 0, 1, 0, 1]  # (as process_groups gives for processes 1 0 1 0 0 1 0 1)
  grid = partitioning.grouped_grid(devices, groups, 2, 2)
  assert grid.shape == (4, 2)
  # data rows 0-1 hold group 0's devices, rows 2-3 group 1's: model never crosses a group
  group_of = dict(zip(devices, groups))
  assert [[group_of[d] for d in row] for row in grid] == [[0, 0], [0, 0], [1, 1], [1, 1]]
  assert sorted(d.id for d in grid.flat) == sorted(d.id for d in devices)
  with pytest.raises(ValueError, match=r"process group 0 holds 3 devices, not 4"):
    partitioning.grouped_grid(devices, [0, 0, 0, 1, 1, 1, 1, 1], 2, 2)


def test_tensor_parallel_across_two_processes_matches_one_process(tmp_path):
  # Both processes hold the same rows (one data shard); the model is split between them.
  _two_processes(tmp_path / "tp", 3, "--config.mesh.data=1", "--config.mesh.model=2")
  run_script("train.py", f"--workdir={tmp_path / 'single'}", *TWO_PROCESS_ARGS,
             "--config.total_steps=3")
  np.testing.assert_allclose(_losses(tmp_path / "tp"), _losses(tmp_path / "single"), rtol=1e-5)


def test_two_process_jax_distributed_run_trains_checkpoints_and_resumes(tmp_path):
  # Documents of many lengths (so that the two processes' data positions differ after two
  # steps), and a learning rate that does not depend on total_steps (2 steps then 4 is 4 steps).
  for i in range(24):
    (tmp_path / f"doc{i}.txt").write_text(" ".join(f"w{i}-{j}" for j in range(3 + 11 * i % 29)))
  (tmp_path / "held_out.txt").write_text("a held-out document " * 20)
  constant = ["--config.optimizer.schedule=constant", "--config.optimizer.warmup_steps=0",
              "--config.data.source=text", f"--config.data.paths={tmp_path}/doc*.txt",
              f"--config.data.eval_paths={tmp_path}/held_out.txt"]
  first = _two_processes(tmp_path / "resumed", 2, *constant)
  assert "on 2 cpu" in first  # one global mesh over both processes' devices
  second = _two_processes(tmp_path / "resumed", 4, *constant)
  assert "resuming from" in second
  with open(tmp_path / "resumed" / "metrics.jsonl") as f:
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in f if '"loss"' in line]
  assert steps == [1, 2, 3, 4]
  saved = os.listdir(tmp_path / "resumed" / "checkpoints")
  assert sorted(int(d) for d in saved if d.isdigit()) == [2, 4]
  # Each process reads its own documents, so each resumes at its own data position.
  _two_processes(tmp_path / "straight", 4, *constant)
  assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")


def test_a_checkpoints_data_position_is_each_shards_own():
  from recurrentgemma_jax import train
  states = {0: {"next_index": 3}, 1: {"next_index": 4}}
  saved = train.shared_data_state(states[0], (0, 1))
  assert saved == {"shard_count": 1, "shards": {"0": {"next_index": 3}}}
  two = {"shard_count": 2, "shards": {str(i): s for i, s in states.items()}}
  logged = []
  assert train.own_data_state(two, (1, 2), logged.append) == {"next_index": 4}
  assert train.own_data_state({"next_index": 3}, (0, 1), logged.append) == {"next_index": 3}
  assert not logged
  # Another number of data shards: the positions do not carry over, and the run says so.
  assert train.own_data_state(two, (0, 1), logged.append) is None
  [line] = logged
  assert "of 2 data shards" in line and "this run has 1" in line


@pytest.mark.parametrize("env,tpu_vm,want", [
    ({}, False, None),  # one process, nothing to join
    ({}, True, {}),  # a Cloud TPU VM, one host or a pod's worker: JAX reads the metadata
    ({"JAX_PLATFORMS": "cpu"}, True, None),  # kept off the TPUs
    ({"JAX_PLATFORMS": "tpu,cpu"}, True, {}),
    ({"SLURM_NTASKS": "4"}, False, {}),
    ({"TPU_WORKER_HOSTNAMES": "a,b"}, False, {}),  # GKE
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, True,
     dict(coordinator_address="h:1", num_processes=2, process_id=1)),
    # one named process: nothing to join, except on a TPU VM (preemption notices)
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}, False,
     None),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}, True,
     dict(coordinator_address="h:1", num_processes=1, process_id=0))])
def test_distributed_initialises_where_the_job_has_or_may_have_several_processes(env, tpu_vm,
                                                                                 want):
  assert distributed.arguments(env, lambda: tpu_vm) == want


@pytest.mark.parametrize("env,error", [
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0"},
     "JAX_NUM_PROCESSES is unset: with JAX_COORDINATOR_ADDRESS set it must be a non-negative "
     "integer"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "x"},
     "JAX_PROCESS_ID is 'x': with JAX_COORDINATOR_ADDRESS set it must be a non-negative integer"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     "JAX_PROCESS_ID is 2: it must be below JAX_NUM_PROCESSES (2)"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "0", "JAX_PROCESS_ID": "0"},
     "JAX_PROCESS_ID is 0: it must be below JAX_NUM_PROCESSES (0)")])
def test_distributed_names_a_missing_process_variable(env, error):
  with pytest.raises(ConfigError) as e:
    distributed.arguments(env, lambda: False)
  assert str(e.value) == error


def _on_a_tpu_vm_without_job_variables(monkeypatch):
  monkeypatch.setattr(distributed, "_initialized", False)
  monkeypatch.setattr(distributed, "on_cloud_tpu_vm", lambda: True)
  for name in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES",
               "JAX_PLATFORMS"):
    monkeypatch.delenv(name, raising=False)


def test_distributed_initialize_on_a_tpu_vm_lets_jax_find_the_pod(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  _on_a_tpu_vm_without_job_variables(monkeypatch)
  distributed.initialize()
  distributed.initialize()  # once per process
  assert calls == [{}]


def test_a_tpu_vm_guess_that_jax_cannot_use_warns_and_runs_as_one_process(monkeypatch, capsys):
  def no_cluster(**kw):
    raise ValueError("coordinator_address should be defined.")
  monkeypatch.setattr(jax.distributed, "initialize", no_cluster)
  _on_a_tpu_vm_without_job_variables(monkeypatch)
  distributed.initialize()
  assert "jax.distributed.initialize() failed (coordinator_address" in capsys.readouterr().err
  # A job that names its processes fails as JAX says.
  monkeypatch.setattr(distributed, "_initialized", False)
  monkeypatch.setenv("SLURM_NTASKS", "2")
  with pytest.raises(ValueError):
    distributed.initialize()


def test_tpu_vm_probe_reads_device_nodes_and_libtpu(monkeypatch):
  nodes = []
  monkeypatch.setattr(distributed.glob, "glob",
                      lambda pattern: [n for n in nodes if fnmatch.fnmatch(n, pattern)])
  libtpu = [None]
  monkeypatch.setattr(distributed.importlib.util, "find_spec",
                      lambda name: libtpu[0] if name == "libtpu" else None)
  assert not distributed.on_cloud_tpu_vm()
  nodes.append("/dev/vfio/0")  # a v5e's chip
  assert not distributed.on_cloud_tpu_vm()  # no libtpu: not a TPU VM JAX can use
  libtpu[0] = object()
  assert distributed.on_cloud_tpu_vm()
  nodes[:] = ["/dev/accel0"]  # a v4's
  assert distributed.on_cloud_tpu_vm()
  nodes[:] = ["/dev/vfio/vfio"]  # VFIO's control node alone: no chip
  assert not distributed.on_cloud_tpu_vm()


def test_shard_local_runs_each_device_on_its_shard():
  mesh = partitioning.make_mesh(4, 2)
  seen = []

  def fn(x, h):
    seen.append((x.shape, None if h is None else h.shape))
    return jnp.cumsum(x, axis=1), x[:, -1] * (1.0 if h is None else h)

  btd, bd = ("batch", None, "lru"), ("batch", "lru")
  local = partitioning.shard_local(fn, (btd, bd), (btd, bd))
  x, h = jax.random.normal(jax.random.key(0), (8, 5, 6)), jax.random.normal(jax.random.key(1), (8, 6))
  want = fn(x, h)
  with jax.set_mesh(mesh):
    got = jax.jit(local)(x, h)
    assert seen[-1] == ((2, 5, 3), (2, 3))  # rows over data=4, channels over model=2
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    jax.jit(local)(x, None)
    assert seen[-1] == ((2, 5, 3), None)
    # 6 rows do not split over data=4: every array keeps whole rows, channels still split.
    got = jax.jit(local)(x[:6], h[:6])
    assert seen[-1] == ((6, 5, 3), (6, 3))
    np.testing.assert_allclose(got[1], want[1][:6], rtol=1e-6)
  local(x, h)  # no mesh set: fn itself, on whole arrays
  assert seen[-1] == ((8, 5, 6), (8, 6))


@pytest.mark.parametrize("kernels", ["scan+gates", "fused"])
def test_pallas_kernels_under_a_mesh_give_single_device_losses(kernels):
  """The Pallas scan, block-diagonal gates, fused RG-LRU, MLP gating, Conv1D and RMSNorm run per
  device (shard_local) and still give the single-device losses (data and model splits)."""
  overrides = {"model.scan_impl": "pallas", "model.num_gate_blocks": 2, "model.num_layers": 2,
               "model.fused_rg_lru": "true" if kernels == "fused" else "false", "model.gate_impl": "pallas",
               "model.mlp_impl": "pallas", "model.conv1d_impl": "pallas",
               "model.norm_impl": "pallas"}
  reference = losses_on(small_config(**overrides), jax.devices()[:1], steps=2)[0]
  config = small_config(**{"mesh.data": 4, "mesh.model": 2, **overrides})
  losses = losses_on(config, jax.devices(), steps=2)[0]
  np.testing.assert_allclose(losses, reference, rtol=1e-5)


def test_the_models_kernels_see_only_their_devices_shard(monkeypatch):
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  from pallas_kernels import gates  # pylint: disable=g-import-not-at-top
  seen = collections.defaultdict(set)

  def recording(name, fn):
    def wrapper(*args, **kwargs):
      seen[name].add(tuple(args[0].shape))
      return fn(*args, **kwargs)
    return wrapper

  monkeypatch.setattr(pallas_kernels, "linear_scan",
                      recording("scan", pallas_kernels.linear_scan))
  monkeypatch.setattr(gates, "block_diagonal_with_skip",
                      recording("gates", gates.block_diagonal_with_skip))
  cfg = model_lib.ModelConfig(family="hawk", vocab_size=64, width=64, lru_width=64,
                              num_layers=1, num_heads=2, num_gate_blocks=2,
                              mlp_expanded_width=128, dtype="float32", scan_impl="pallas",
                              gate_impl="pallas")
  model = model_lib.init_model(cfg, 0)
  tokens = jnp.zeros((8, 16), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(16), (8, 16))
  monkeypatch.setattr(pallas_kernels, "chunk_gla", recording("gla", pallas_kernels.chunk_gla))
  gla = model_lib.init_model(dataclasses.replace(cfg, family="gla", num_heads=4), 0)
  # cuDNN attention (a GPU kernel) runs as its semantics in jnp; the model's own
  # fused_attention (documents, lax.switch) runs around it on each device.
  helpers.cudnn_attention_on_cpu(
      monkeypatch, record=lambda q: seen["cudnn attention"].add(tuple(q.shape)))
  monkeypatch.setattr(attention, "packed_segments_supported", lambda: True)  # as on Hopper
  mqa = model_lib.init_model(dataclasses.replace(
      cfg, family="mqa", num_heads=4, block_types=("global_attention",),
      attention_impl="cudnn"), 0)
  with jax.set_mesh(partitioning.make_mesh(4, 2)):
    for m in (model, gla, mqa):
      nnx.jit(lambda m, t, p: m(t, p)[0])(m, tokens, pos)
  # rows over data=4; channels (gate blocks, heads) over model=2
  assert seen == {"scan": {(2, 16, 32)}, "gates": {(2, 16, 32)}, "gla": {(2, 16, 2, 8)},
                  "cudnn attention": {(2, 16, 2, 16)}}


def test_cudnn_attention_chooses_per_device_and_matches_one_device(monkeypatch):
  # fused_attention's lax.switch runs per device under the mesh: rows of one document on some
  # devices (causal), of at most 4 or 16 (packed segments) and of 20 (the dense mask) on
  # others. cuDNN runs as its semantics in jnp; the sharded logits must equal the unsharded.
  helpers.cudnn_attention_on_cpu(monkeypatch)
  monkeypatch.setattr(attention, "packed_segments_supported", lambda: True)  # as on Hopper
  cfg = model_lib.ModelConfig(family="mqa", vocab_size=64, width=32, num_layers=1, num_heads=4,
                              mlp_expanded_width=64, dtype="float32",
                              block_types=("global_attention",), attention_impl="cudnn")
  model = model_lib.init_model(cfg, 0)
  rng = np.random.default_rng(5)
  tokens = jnp.asarray(rng.integers(0, 64, (8, 24)), jnp.int32)
  pos = np.zeros((8, 24), np.int32)
  for row, docs in enumerate((1, 1, 3, 3, 20, 20, 1, 6)):  # two rows per device of data=4
    cuts = np.sort(rng.choice(np.arange(1, 24), docs - 1, replace=False))
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, 24]):
      pos[row, lo:hi] = np.arange(hi - lo)
  pos = jnp.asarray(pos)
  forward = nnx.jit(lambda m, t, p: m(t, p))
  want = forward(model, tokens, pos)
  with jax.set_mesh(partitioning.make_mesh(4, 2)):
    got = forward(model, tokens, pos)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gate_impl", ["xla", "pallas"])  # XLA's gates on a "no": either form
def test_recurrent_decode_kernel_per_device_matches_one_device(gate_impl, monkeypatch):
  """model.decode_impl=pallas and mlp_impl=pallas under a 4 x 2 mesh: the step kernels run on
  each device's rows (data=4) and gate blocks or MLP features (model=2), and greedy sampling
  gives one device's tokens; where a device's rows are under the kernels' MIN_ROWS, both take
  XLA's path on that device, and where its share of the MLP features does not fit the
  kernel's tiles, the MLP does: same tokens."""
  from pallas_kernels.mlp import gated_up  # pylint: disable=g-import-not-at-top
  from pallas_kernels.rg_lru import decode  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import sampling  # pylint: disable=g-import-not-at-top
  seen = set()
  monkeypatch.setattr(gated_up, "MIN_ROWS", 2)  # every device's 2 rows take the kernels
  monkeypatch.setattr(decode, "MIN_ROWS", 2)
  jax.clear_caches()  # MIN_ROWS is read when tracing
  kernel, mlp_kernel = decode.gates_update, gated_up.gated_up
  monkeypatch.setattr(decode, "gates_update",
                      lambda x, *a, **k: seen.add(tuple(x.shape)) or kernel(x, *a, **k))
  monkeypatch.setattr(gated_up, "gated_up", lambda x, w, b, **k: seen.add(
      ("mlp", *x.shape, w.shape[-1])) or mlp_kernel(x, w, b, **k))
  cfg = model_lib.ModelConfig(family="hawk", vocab_size=64, width=64, lru_width=64,
                              num_layers=2, num_heads=2, mlp_expanded_width=128,
                              dtype="float32", decode_impl="pallas",
                              mlp_impl="pallas", gate_impl=gate_impl)
  model = model_lib.init_model(cfg, 0)
  prompts = [list(np.random.default_rng(r).integers(1, 64, 2 + r % 3)) for r in range(8)]
  params = sampling.SamplingParams(max_new_tokens=4)
  want = sampling.sample(model, prompts, params, return_logits=True)
  assert seen == {(8, 64), ("mlp", 8, 64, 128)}
  seen.clear()
  with jax.set_mesh(partitioning.make_mesh(4, 2)):
    got = sampling.sample(model, prompts, params, return_logits=True)
  # 2 rows and one gate block of 32 channels, or half the 128 MLP features, per device
  assert seen == {(2, 32), ("mlp", 2, 64, 64)}, seen
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logits, want.logits, atol=1e-5, rtol=1e-5)
  # 2 rows a device under MIN_ROWS 4 (8 in all: both kernels' paths are entered): no device
  # takes a kernel. model=4: the 2 gate blocks do not split over it (each device takes all 64
  # channels of its 4 rows), and 32 MLP features a device, not a multiple of 64, take XLA's.
  checks, worthwhile = set(), decode.worthwhile
  monkeypatch.setattr(decode, "worthwhile", lambda rows, *a: checks.add(
      (rows, worthwhile(rows, *a))) or worthwhile(rows, *a))
  for min_rows, shape, kernels in ((4, (4, 2), set()), (2, (2, 4), {(4, 64)})):
    monkeypatch.setattr(gated_up, "MIN_ROWS", min_rows)
    monkeypatch.setattr(decode, "MIN_ROWS", min_rows)
    jax.clear_caches()
    seen.clear()
    checks.clear()
    with jax.set_mesh(partitioning.make_mesh(*shape)):
      got = sampling.sample(model, prompts, params, return_logits=True)
    assert seen == kernels, (shape, seen)
    # the whole batch asked first, then each device's rows (XLA's path on a "no")
    assert checks == {(8, True), (8 // shape[0], bool(kernels))}, (shape, checks)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-5, rtol=1e-5)
