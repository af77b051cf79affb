"""The training job, top to bottom: set-up, the jitted step, the loop, checkpoints, metrics.

``scripts/train.py`` parses the command line and calls :func:`run`. A step is
:func:`make_train_step`; where each parameter lives is ``sharding/partitioning.py``; which scan
runs is ``scan.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import stat
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from pallas_kernels import dispatch
from pallas_kernels import loss as loss_kernels
from recurrentgemma_jax import checkpoint as ckpt_lib
from recurrentgemma_jax import aot, cli, configlib, data, flops
from recurrentgemma_jax import model as model_lib
from recurrentgemma_jax import workdir as workdir_lib
from recurrentgemma_jax.errors import CheckpointError, ConfigError, first_line
from sharding import distributed, partitioning

# Parameters that are never weight-decayed: norm scales, biases and the RG-LRU's a_param.
_NO_DECAY = ("scale", "bias", "b", "a_param")


class NonFiniteLoss(RuntimeError):
  pass


class Interrupted(Exception):
  """Ctrl-C (SIGINT) stopped the run after it saved the step in progress (``scripts/train.py``
  exits 130, the shell's code for it)."""


class SaveFailed(CheckpointError):
  """A checkpoint could not be written (a full disk, a file-size limit); the previous one is
  still the latest. Orbax's background threads are left broken: exit without waiting for
  them (``scripts/train.py``)."""


def make_optimizer(opt: ml_collections.ConfigDict, total_steps: int):
  """AdamW with warmup + cosine (or constant) and global-norm clipping; returns (tx, schedule)."""
  warmup = min(opt.warmup_steps, total_steps)
  if opt.schedule == "cosine":
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, opt.learning_rate, warmup, max(total_steps, warmup + 1),
        end_value=opt.learning_rate * opt.final_lr_fraction)
  else:
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, opt.learning_rate, max(warmup, 1)),
         optax.constant_schedule(opt.learning_rate)], [warmup])

  def decay_mask(tree):
    def keep(path, _):
      name = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)][-1]
      if name == "input_embedding":
        return opt.decay_embeddings
      return name not in _NO_DECAY
    return jax.tree_util.tree_map_with_path(keep, tree)

  chain = [optax.clip_by_global_norm(opt.grad_clip_norm)] if opt.grad_clip_norm else []
  chain.append(optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                           weight_decay=opt.weight_decay, mask=decay_mask))
  return optax.chain(*chain), schedule


# Above this bound exp(-2 * bound) underflows float32's normal range; a bounded log-sum-exp is
# only used below it.
MAX_LOGIT_BOUND = 40.0


def masked_cross_entropy(logits, targets, mask, logit_bound: float = 0.0,
                         impl: str = "xla"):
  """Sum of the token losses where ``mask`` is 1, and the number of such tokens.

  The target's logit is picked by comparing the targets with an iota, not gathered: the
  gradient is then one elementwise pass over the logits (softmax minus one-hot), which XLA fuses
  with the cast back to the output layer's dtype. (A gather's gradient is a scatter into a
  float32 ``[B, T, V]`` array, written, scattered into and cast in three passes.)

  ``logit_bound``: a bound ``c`` on ``|logits|`` known in advance (the model's tanh soft cap),
  or 0. With ``0 < c <= MAX_LOGIT_BOUND`` the log-sum-exp is shifted by ``c`` instead of by the
  row's maximum: ``exp(logit - c)`` lies in ``[exp(-2c), 1]``, so one pass over the ``[B, T, V]``
  logits does what a maximum pass and a sum pass do otherwise (0.7 ms of an H100 Griffin-400M
  step at 32K tokens and a 32K vocabulary).

  ``impl="pallas"`` (where there is no such bound): ``pallas_kernels.loss.cross_entropy``, whose
  log-sum-exp also takes one pass (a running maximum); interpreted on a CPU, XLA's on a TPU. The
  model's ``resolved_loss_impl`` chooses.
  """
  interpret = dispatch.triton_interpret()
  if impl == "pallas" and interpret is not None and not 0.0 < logit_bound <= MAX_LOGIT_BOUND:
    losses = loss_kernels.cross_entropy(logits, targets, interpret=interpret)
    return jnp.sum(losses * mask), jnp.sum(mask)
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  is_target = targets[..., None] == jax.lax.broadcasted_iota(targets.dtype, logits.shape,
                                                             logits.ndim - 1)
  target_logit = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
  if 0.0 < logit_bound <= MAX_LOGIT_BOUND:
    lse = logit_bound + jnp.log(jnp.sum(jnp.exp(logits - logit_bound), axis=-1))
  else:
    lse = jax.nn.logsumexp(logits, axis=-1)
  losses = lse - target_logit
  return jnp.sum(losses * mask), jnp.sum(mask)


def logit_bound(model) -> float:
  """The bound on ``|logits|`` that ``model`` guarantees (a ``Model``'s tanh soft cap), or 0
  when none is known (any other module that returns logits)."""
  return float(getattr(getattr(model, "cfg", None), "logits_soft_cap", 0.0) or 0.0)


def make_loss_sum(graphdef):
  """``(params, micro) -> (summed loss, token count)`` of the model ``graphdef`` on a batch."""

  def loss_sum(params, micro):
    model = nnx.merge(graphdef, params)
    impl = model.cfg.resolved_loss_impl
    logits = model(micro["inputs"], micro["segment_pos"], upcast_logits=impl == "xla")
    return masked_cross_entropy(logits, micro["targets"], micro["loss_mask"],
                                logit_bound(model), impl)

  return loss_sum


def make_train_step(graphdef, tx, schedule, accum_steps: int):
  """``(state, batch) -> (state, metrics)`` for the model ``graphdef``; see
  ``train_step_from_loss``."""
  return train_step_from_loss(make_loss_sum(graphdef), tx, schedule, accum_steps)


def cast_once(fn, params, *args):
  """``params`` with each leaf that ``fn(params, *args)`` reads exactly once, through a cast
  to a narrower float dtype, cast here instead: the float32 weights a bfloat16 model casts in
  every call. A gradient-accumulation loop that calls ``fn`` on these casts each weight once a
  step, not once a micro-batch (with the layout copies XLA fuses into the cast). Exact: the
  gradient with respect to the cast leaf, converted back, is the gradient of the original.
  Leaves read any other way (more than once, uncast, inside a remat or scan) stay as they
  are."""
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, args))
  jaxpr = jax.make_jaxpr(fn)(abstract[0], *abstract[1]).jaxpr
  leaves, treedef = jax.tree.flatten(params)
  uses, casts = {}, {}
  is_var = lambda v: not hasattr(v, "val")  # a Literal carries its value
  for eqn in jaxpr.eqns:
    for v in filter(is_var, eqn.invars):
      uses[id(v)] = uses.get(id(v), 0) + 1
    if eqn.primitive.name == "convert_element_type" and is_var(eqn.invars[0]):
      casts[id(eqn.invars[0])] = jnp.dtype(eqn.params["new_dtype"])
  returned = {id(v) for v in jaxpr.outvars}
  out = []
  for var, leaf in zip(jaxpr.invars[:len(leaves)], leaves):
    to = casts.get(id(var))
    narrower = (to is not None and jnp.issubdtype(to, jnp.floating)
                and jnp.issubdtype(leaf.dtype, jnp.floating) and to.itemsize < leaf.dtype.itemsize)
    once = uses.get(id(var)) == 1 and id(var) not in returned
    out.append(leaf.astype(to) if narrower and once else leaf)
  return treedef.unflatten(out)


def train_step_from_loss(loss_sum, tx, schedule, accum_steps: int):
  """``(state, batch) -> (state, metrics)`` from ``loss_sum(params, batch) -> (summed loss,
  token count)``; the batch is split into ``accum_steps`` micro-batches whose gradients are
  summed before one optimizer update."""

  grad_fn = jax.value_and_grad(loss_sum, has_aux=True)

  def step(state, batch):
    params = state["params"]
    # Micro-batch k is rows k, k + A, k + 2A, ... (A = accum_steps): each device's rows
    # (contiguous under ``data``) stay on it. (Contiguous micro-batches, rows k*B/A onwards,
    # would each be one data shard's: every device computed every micro-batch.)
    micro = jax.tree.map(
        lambda x: x.reshape(-1, accum_steps, *x.shape[1:]).swapaxes(0, 1), batch)

    # The bfloat16 copies of the weights, made once for all micro-batches (``cast_once``; with
    # one micro-batch each weight is cast once either way).
    compute_params = (cast_once(loss_sum, params, jax.tree.map(lambda x: x[0], micro))
                      if accum_steps > 1 else params)

    def accumulate(carry, mb):
      (loss, count), grads = grad_fn(compute_params, mb)
      acc_loss, acc_count, acc_grads = carry
      return (acc_loss + loss, acc_count + count,
              jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc_grads, grads)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    (loss, count, grads), _ = jax.lax.scan(accumulate, (0.0, 0.0, zeros), micro)
    count = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g, p: (g / count).astype(p.dtype), grads, params)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                 "opt_state": opt_state}
    metrics = {"loss": loss / count, "grad_norm": optax.global_norm(grads),
               "lr": schedule(state["step"]), "tokens": count}
    return new_state, metrics

  return step


def make_eval_step(graphdef):
  """``(params, batch) -> [loss sum, token count, correct count]`` over the masked tokens
  (correct: the argmax is the target; for the synthetic tasks, the answer accuracy)."""

  def step(params, batch):
    model = nnx.merge(graphdef, params)
    logits = model(batch["inputs"], batch["segment_pos"])
    total, count = masked_cross_entropy(logits, batch["targets"], batch["loss_mask"],
                                        logit_bound(model))
    hits = (jnp.argmax(logits, axis=-1) == batch["targets"]).astype(jnp.float32)
    return jnp.stack([total, count, jnp.sum(hits * batch["loss_mask"])])
  return step


def say(*args, **kwargs) -> None:
  """``print``, except that a reader gone (``| head``, a ``tee`` or ``less`` that ended:
  EPIPE) points the lost outputs at /dev/null and the run goes on, as after a hang-up."""
  try:
    print(*args, **kwargs)
  except BrokenPipeError:
    silence_lost_outputs()


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """The records of ``workdir/metrics.jsonl`` (none if it is missing); a line cut short by a
  kill is skipped."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  records = []
  with open(path) as f:
    for line in f:
      try:
        record = json.loads(line)
      except ValueError:
        continue
      if isinstance(record, dict):
        records.append(record)
  return records


class MetricsWriter:
  """``metrics.jsonl`` (one JSON object per logged step), TensorBoard, and the terminal."""

  def __init__(self, workdir: str, resume_step: int):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.tty = sys.stdout.isatty()
    self.primary = jax.process_index() == 0  # the one process that writes (shared workdir)
    self.kept: list[dict[str, Any]] = []
    self.dropped = 0  # lines of an earlier run past ``resume_step``
    if self.primary and os.path.exists(self.path):
      # Keep what the resumed run will not log again; a line cut short by a kill is dropped.
      logged = read_metrics(workdir)
      self.kept = [r for r in logged if r.get("step", resume_step + 1) <= resume_step]
      self.dropped = len(logged) - len(self.kept)
      with open(self.path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in self.kept)
      os.replace(self.path + ".tmp", self.path)
    self.tb = None
    if self.primary:
      try:
        from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
        # Steps past resume_step that an earlier run logged are dropped from TensorBoard too.
        self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"),
                                purge_step=resume_step + 1 if self.dropped else None)
      except ImportError:
        pass

  def has_eval(self, step: int) -> bool:
    return any(r["step"] == step and "eval_loss" in r for r in self.kept)

  def write(self, record: dict[str, Any], progress: str | None = None) -> None:
    if not self.primary:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    if self.tb is not None:
      for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)) and value is not None:
          self.tb.add_scalar(key, value, record["step"])
      self.tb.flush()
    if progress:
      if self.tty:
        say("\r\033[K" + progress, end="", flush=True)
      else:
        say(progress, flush=True)

  def message(self, text: str) -> None:
    if self.primary:
      say(("\n" if self.tty else "") + text, flush=True)

  def close(self) -> None:
    """Flushes and closes TensorBoard's writer. Left to its exit hook, a writer that never
    wrote (a run stopped before its first step) starts a thread at interpreter shutdown, which
    Python 3.12 refuses with a traceback."""
    if self.tb is not None:
      self.tb.close()
      self.tb = None


class Checkpoints:
  """Orbax CheckpointManager over ``WORKDIR/checkpoints``: asynchronous saves of the params,
  optimizer state, model config and data position; restores skip unreadable checkpoints."""

  ITEMS = ("params", "opt_state", "model_config", "data", "meta")

  def __init__(self, workdir: str, keep: int):
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    self.ocp = ocp
    self.workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self.workdir, "checkpoints")
    self.manager = ocp.CheckpointManager(
        self.directory, item_names=self.ITEMS,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=True))
    self.latest = self.manager.latest_step()  # the newest committed step
    self.in_flight: int | None = None

  def _checked(self, action, step: int | None = None) -> None:
    """Runs ``action``; a save that failed (now or in the background: a full disk, a file
    size limit) becomes one CheckpointError naming it and the latest committed step."""
    try:
      action()
    except Exception as e:  # pylint: disable=broad-except  (Orbax re-raises the writer's)
      failed = self.in_flight if self.in_flight is not None else step
      self.in_flight = None
      text = first_line(e, 1000)
      # TensorStore's messages end with the operating system's reason.
      reason = text.rsplit(": ", 1)[-1] if "os_error_code" in text else text[:200]
      raise SaveFailed(
          f"could not write checkpoint step {failed} in {self.directory} ({reason}); the "
          f"latest checkpoint is step {self.latest}") from None
    if self.in_flight is not None and step is None:
      self.latest, self.in_flight = self.in_flight, None

  def save(self, step: int, state, model_cfg, data_state, meta) -> None:
    ocp = self.ocp
    config_json = dataclasses.asdict(model_cfg) | {"tokenizer": meta.get("tokenizer")}
    self._checked(self.manager.wait_until_finished)  # the previous save, committed
    self._checked(lambda: self.manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(nnx.to_pure_dict(state["params"])),
        opt_state=ocp.args.StandardSave(state["opt_state"]),
        model_config=ocp.args.JsonSave(config_json),
        data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave(meta | {"step": step}))), step)
    self.in_flight = step

  def restore_latest(self, abstract_state, log, model_cfg) -> tuple[Any, Any] | None:
    """The newest readable ``(state, data_state)``; unreadable ones are moved aside. A
    checkpoint whose layer layout (``model.scan_layers``) is not ``model_cfg``'s is converted."""
    ocp = self.ocp
    for step in sorted(self.manager.all_steps(), reverse=True):
      target = {"params": nnx.to_pure_dict(abstract_state["params"]),
                "opt_state": abstract_state["opt_state"]}
      try:
        saved_cfg, _ = ckpt_lib.read_model_config(os.path.join(self.directory, str(step)))
        on_disk = {name: ckpt_lib.relayout(tree, model_cfg, saved_cfg)
                   for name, tree in target.items()}
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(on_disk["params"]),
            opt_state=ocp.args.StandardRestore(on_disk["opt_state"]),
            data=ocp.args.JsonRestore()))
      except Exception as e:  # pylint: disable=broad-except  (any damage: try the previous one)
        aside = os.path.join(self.directory, f"{step}.unreadable-{int(time.time())}")
        log(f"WARNING: checkpoint step {step} is unreadable ({first_line(e, 200)}); "
            f"its files are kept in {aside}; trying the previous checkpoint")
        if jax.process_index() == 0:
          os.rename(os.path.join(self.directory, str(step)), aside)
        if jax.process_count() > 1:  # every process sees the move before reloading
          multihost_utils.sync_global_devices(f"checkpoint {step} moved aside")
        self.manager.reload()
        continue
      trees = {"params": restored["params"], "opt_state": restored["opt_state"]}
      if saved_cfg.layers_scanned != model_cfg.layers_scanned:
        log(f"converting checkpoint step {step} to model.scan_layers="
            f"{str(model_cfg.layers_scanned).lower()}")
        trees = jax.jit(
            lambda trees: {name: ckpt_lib.relayout(tree, saved_cfg, model_cfg)
                           for name, tree in trees.items()},
            out_shardings=jax.tree.map(lambda x: x.sharding, target))(trees)
      params = ckpt_lib.state_from_pure_dict(abstract_state["params"], trees["params"])
      state = {"step": jax.device_put(jnp.asarray(step, jnp.int32),
                                      abstract_state["step"].sharding),
               "params": params, "opt_state": trees["opt_state"]}
      return state, restored["data"]
    return None

  def wait(self) -> None:
    """Until the save in flight is committed."""
    self._checked(self.manager.wait_until_finished)

  def close(self) -> None:
    """Waits for the save in flight and stops Orbax's background threads (an exit without
    this prints asyncio noise). After a failed save (already raised) it only stops them."""
    try:
      if self.in_flight is not None:
        self.wait()
    finally:
      try:
        self.manager.close()
      except Exception:  # pylint: disable=broad-except
        pass  # a failed save was raised by a wait; after a successful one nothing is pending


def _place(batch: dict[str, np.ndarray], sharding, global_rows: int) -> dict[str, jax.Array]:
  """The process-local rows -> one global array per field, split over ``data``."""
  return {k: jax.make_array_from_process_local_data(sharding, v, (global_rows, *v.shape[1:]))
          for k, v in batch.items()}


@dataclasses.dataclass
class Setup:
  """Everything a run derives from its config before touching data or parameters."""

  model_cfg: model_lib.ModelConfig
  mesh: jax.sharding.Mesh
  graphdef: Any
  params_abstract: Any
  tx: optax.GradientTransformation
  schedule: Any
  state_shardings: dict
  abstract_state: dict  # ShapeDtypeStructs carrying their shardings
  unsplit_note: str | None = None  # the dimensions tensor parallelism leaves whole, if any

  @property
  def batch_sharding(self):
    return partitioning.batch_sharding(self.mesh)

  def initial_state(self, config: ml_collections.ConfigDict) -> dict:
    """Fresh parameters (or those of ``config.init_from``) and optimizer state, created
    sharded."""
    param_sh = self.state_shardings["params"]
    if config.init_from:
      # A workdir's newest step whose parameters cannot be read: the one before it, warned.
      dirs, _, _ = ckpt_lib.newest_readable_config(config.init_from)
      params, _ = ckpt_lib.restore_newest(dirs, self.params_abstract, param_sh,
                                          cfg=self.model_cfg)
    else:
      params = model_lib.init_params(self.model_cfg, config.seed, param_sh)
    return {"step": jax.device_put(jnp.zeros((), jnp.int32), self.state_shardings["step"]),
            "params": params,
            "opt_state": jax.jit(self.tx.init,
                                 out_shardings=self.state_shardings["opt_state"])(params)}

  def jit_train_step(self, accum_steps: int):
    replicated = self.state_shardings["step"]
    return partitioning.OnMesh(self.mesh, jax.jit(
        make_train_step(self.graphdef, self.tx, self.schedule, accum_steps),
        in_shardings=(self.state_shardings, self.batch_sharding),
        out_shardings=(self.state_shardings, replicated), donate_argnums=0))

  def jit_eval_step(self):
    return partitioning.OnMesh(self.mesh, jax.jit(
        make_eval_step(self.graphdef),
        in_shardings=(self.state_shardings["params"], self.batch_sharding),
        out_shardings=self.state_shardings["step"]))


def setup(config: ml_collections.ConfigDict, devices=None) -> Setup:
  """Model, mesh, optimizer and the shardings of the train state (nothing allocated)."""
  tokenizer = data.make_tokenizer(config)
  model_cfg = configlib.model_config(config, tokenizer.vocab_size)
  try:
    mesh = partitioning.make_mesh(config.mesh.data, config.mesh.model, devices,
                                  slices=config.mesh.slices)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  with jax.set_mesh(mesh):  # kernels ("auto" settings) for the mesh's platform, not the host's
    # The parameter layout is fixed here (initialisation, restoring and the checkpoints
    # written all follow this config).
    model_cfg = dataclasses.replace(model_cfg, scan_layers=model_cfg.layers_scanned)
    model_abstract = nnx.eval_shape(lambda: model_lib.init_model(model_cfg, config.seed))
  graphdef, params_abstract = nnx.split(model_abstract)
  tx, schedule = make_optimizer(config.optimizer, config.total_steps)
  opt_abstract = jax.eval_shape(tx.init, params_abstract)
  param_sh = partitioning.param_shardings(model_abstract, mesh, zero=config.zero)
  opt_sh = partitioning.opt_state_shardings(tx, opt_abstract, model_abstract, mesh,
                                            zero=config.zero)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state_sh = {"step": replicated, "params": param_sh, "opt_state": opt_sh}
  abstract_state = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params_abstract,
       "opt_state": opt_abstract}, state_sh)
  return Setup(model_cfg, mesh, graphdef, params_abstract, tx, schedule, state_sh,
               abstract_state, partitioning.unsplit_note(model_abstract, mesh))


def _flat(config, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in config.items():
    if isinstance(value, (dict, ml_collections.ConfigDict)):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def _optimizer_difference(saved: ml_collections.ConfigDict, config: ml_collections.ConfigDict,
                          params_abstract) -> tuple[str, Any, Any] | None:
  """The first ``optimizer`` field whose saved value gives another optimizer-state structure
  than this run's (e.g. clipping on or off); None when the structures agree."""
  def structure(opt):
    tx, _ = make_optimizer(opt, config.total_steps)
    return jax.tree.structure(jax.eval_shape(tx.init, params_abstract))

  saved_opt = ml_collections.ConfigDict(config.optimizer.to_dict())
  saved_opt.update({k: v for k, v in saved.get("optimizer", {}).items() if k in saved_opt})
  ours = structure(config.optimizer)
  if structure(saved_opt) == ours:
    return None
  for name, value in config.optimizer.items():
    if saved_opt[name] != value:
      trial = ml_collections.ConfigDict(saved_opt.to_dict())
      trial[name] = value
      if structure(trial) == ours:
        return name, saved_opt[name], value
  return "optimizer state", "", ""


def check_resume(config: ml_collections.ConfigDict, plan: Setup, workdir: str
                 ) -> tuple[int, list[str]] | None:
  """Before anything compiles: the newest checkpoint of ``workdir`` whose configs are
  readable, against this run. Another parameter tree (family, shapes, vocabulary) or
  optimizer-state structure is a ConfigError naming the first differing field and both values
  (nothing is renamed or written). Otherwise ``(step, changed settings)``: those resume.
  None without a checkpoint."""
  directory = os.path.join(workdir, "checkpoints")
  for step in ckpt_lib.committed_steps(directory):
    path = os.path.join(directory, str(step))
    try:
      saved_cfg, _ = ckpt_lib.read_model_config(path)
      meta = ckpt_lib.read_json_item(path, "meta")
      saved = json.loads(meta["config"]) if "config" in meta else None
    except (CheckpointError, ValueError, TypeError):
      continue  # its bytes are damaged: restoring sets it aside and says so
    fresh = "use a new --workdir to start fresh"
    difference = ckpt_lib.shape_difference(saved_cfg, plan.model_cfg)
    if difference:
      name, theirs, ours = difference
      raise ConfigError(
          f"--workdir {workdir} holds a run of another model: model.{name} is {theirs!r} in "
          f"its checkpoint step {step} and {ours!r} in this run; nothing was changed. Rerun "
          f"with its settings to resume, or {fresh}")
    theirs, ours = meta.get("tokenizer"), config.data.tokenizer
    if configlib.other_tokenizer_kind(theirs, ours):  # (as init_from)
      raise ConfigError(
          f"--workdir {workdir} holds a run trained with the tokenizer {theirs!r} (checkpoint "
          f"step {step}) but this run has data.tokenizer={ours!r}; nothing was changed. Rerun "
          f"with --config.data.tokenizer={theirs}, or {fresh}")
    if saved is None:
      return step, []
    difference = _optimizer_difference(saved, config, plan.params_abstract)
    if difference:
      name, theirs, ours = difference
      raise ConfigError(
          f"--workdir {workdir} holds a run of another optimizer state: optimizer.{name} is "
          f"{theirs!r} in its checkpoint step {step} and {ours!r} in this run; nothing was "
          f"changed. Rerun with its settings to resume, {fresh}, or start from its weights "
          f"with --config.init_from={path} in a new --workdir")
    before, now = _flat(saved), _flat(config.to_dict())
    changed = [f"{k} {before.get(k, '(unset)')!r} -> {now.get(k, '(unset)')!r}"
               for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
    return step, changed
  return None


@contextlib.contextmanager
def _one_run_per_workdir(workdir: str, log):
  """Holds ``WORKDIR/lock`` for the run's life (process 0 holds it; every process learns
  whether it got it)."""
  lock, error = None, None
  if jax.process_index() == 0:
    try:
      lock = workdir_lib.WorkdirLock(workdir).acquire()
    except ConfigError as e:
      error = e
  if not process_0s(error is None) and error is None:
    error = ConfigError(f"--workdir {workdir}: process 0 could not take the workdir's lock")
  if error is not None:
    raise error
  if lock is not None and lock.note:
    log(f"note: {lock.note}")
  try:
    yield
  finally:
    if lock is not None:
      lock.release()


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains (or resumes) according to ``config``; returns the last logged metrics."""
  distributed.initialize()
  workdir_lib.check(workdir)
  configlib.validate(config, process_count=jax.process_count(), device_count=jax.device_count())
  aot.check_devices(config, jax.devices())
  plan = setup(config)
  log = say if jax.process_index() == 0 else (lambda *_: None)
  workdir = workdir_lib.prepare(workdir) if jax.process_index() == 0 else os.path.abspath(
      workdir)
  stop = _Stop()  # from here on, SIGTERM stops the run cleanly
  try:
    with _one_run_per_workdir(workdir, log):
      resume = check_resume(config, plan, workdir)
      if resume and resume[0] > config.total_steps:
        raise ConfigError(
            f"total_steps={config.total_steps} is below step {resume[0]}, the latest checkpoint "
            f"in --workdir {workdir}; raise total_steps to train on, or use a new --workdir")
      if resume and resume[0] == config.total_steps and _finished(config, plan, workdir, log):
        log(f"done already: step {resume[0]} of {config.total_steps} is in {workdir}/"
            "checkpoints with its evaluation; raise total_steps to train on")
        return {}
      if resume and resume[1]:
        log(f"resuming step {resume[0]} with changed settings: {'; '.join(resume[1])}")
        warning = _split_change_warning(resume[1])
        if warning and jax.process_index() == 0:
          say(f"warning: {warning}", file=sys.stderr, flush=True)
      return _train(config, workdir, plan, log, stop)
  finally:
    stop.restore()


def _block_counts(types: tuple[str, ...]) -> str:
  """``'5 blocks: 4 recurrent, 1 attention'`` (the kinds in order of first use), so that a
  Griffin-family model listing only one kind (the synthetic tasks' Hawk) says what it is."""
  kinds = dict.fromkeys(types)
  return f"{len(types)} blocks: " + ", ".join(f"{types.count(k)} {k}" for k in kinds)


# The fields that choose which documents are held out: changing one on resume can move
# documents the run has trained on into the held-out split.
_SPLIT_FIELDS = ("data.source", "data.paths", "data.eval_paths", "data.eval_fraction",
                 "data.tfds_name", "data.tfds_data_dir", "data.tfds_train_split",
                 "data.tfds_eval_split")


def _split_change_warning(changed: list[str]) -> str | None:
  """What to warn of when a resume changes what is held out (``changed``: check_resume's)."""
  moved = [f for f in (c.split(" ", 1)[0] for c in changed) if f in _SPLIT_FIELDS]
  if not moved:
    return None
  return (f"{', '.join(moved)} changed on resume: documents held out now may have been trained "
          "on in the steps before, so held-out losses from here on do not compare with the "
          "earlier ones; use a new --workdir (or --config.init_from) for a clean held-out split")


def process_0s(flag: bool) -> bool:
  """Process 0's ``flag``, on every process (what only process 0 read: the metrics, the
  lock)."""
  if jax.process_count() == 1:
    return flag
  return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def _finished(config: ml_collections.ConfigDict, plan: Setup, workdir: str, log) -> bool:
  """Whether the run in ``workdir`` is finished: ``metrics.jsonl`` holds the evaluation of the
  last step and that step's checkpoint reads (a damaged one is set aside, and the run trains
  again from the one before). Then a rerun has nothing left to do and compiles nothing."""
  if not process_0s(jax.process_index() == 0 and any(  # process 0 reads the metrics
      r.get("step") == config.total_steps and "eval_loss" in r for r in read_metrics(workdir))):
    return False
  checkpoints = Checkpoints(workdir, config.keep_checkpoints)
  try:
    checkpoints.restore_latest(plan.abstract_state, log, plan.model_cfg)
    return checkpoints.manager.latest_step() == config.total_steps
  finally:
    checkpoints.close()


def _train(config: ml_collections.ConfigDict, workdir: str, plan: Setup, log,
           stop: "_Stop") -> dict[str, Any]:
  # The fit check, before anything is allocated or written: the steps are compiled here (and
  # then used), their memory compared with the devices'.
  started = time.perf_counter()
  log("compiling the training and evaluation steps")
  compiled = aot.fit_check(config, plan, log=log)
  limit = compiled.hbm_per_chip_bytes
  log(f"compiled in {time.perf_counter() - started:.1f} s: "
      f"{aot.human_bytes(compiled.worst.memory.total)} per device of "
      f"{aot.human_bytes(limit) if limit else 'an unknown amount'}")
  n_params = sum(x.size for x in jax.tree.leaves(plan.params_abstract))
  checkpoints = Checkpoints(workdir, config.keep_checkpoints)
  try:
    return _loop(config, plan, log, compiled, checkpoints, n_params, stop)
  finally:
    checkpoints.close()


class _Stop:
  """Whether to save and stop after a step: SIGTERM, SIGHUP or Ctrl-C (SIGINT) in a single
  process; in a multi-process run, JAX's preemption sync point (its notifier owns SIGTERM: when
  any process is signalled, all agree on one step to save), which a Ctrl-C or a hang-up joins by
  sending its process a SIGTERM. A Ctrl-C before this run's first step (nothing new to save) or
  a second one exits at once; what is already saved stays (a save cut short is never the
  latest). A hang-up (the terminal or tmux session closed, ``tee`` gone with it) also points
  standard output and error, where they were a terminal or a pipe, at /dev/null: writing the
  progress lines there would fail before the step is saved."""

  def __init__(self):
    self.multi = jax.process_count() > 1
    self.signal = None
    self.interrupted = False  # by Ctrl-C
    self.stepped = False  # whether this run has trained a step
    self.previous = {}
    if not self.multi:
      self.previous[signal.SIGTERM] = signal.signal(
          signal.SIGTERM, lambda signum, _: setattr(self, "signal", signum))
    self.previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
    self.previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._hang_up)

  def _hang_up(self, signum, _):
    silence_lost_outputs()
    if self.multi:
      os.kill(os.getpid(), signal.SIGTERM)
    else:
      self.signal = signum

  def _interrupt(self, signum, _):
    if self.interrupted or not self.stepped:
      why = ("again; exiting without waiting for the save (the checkpoints already written are "
             "kept)" if self.interrupted else "no step trained yet, nothing to save")
      sys.stdout.flush()
      print(f"interrupted (Ctrl-C): {why}", file=sys.stderr, flush=True)
      os._exit(cli.INTERRUPTED)  # pylint: disable=protected-access  (nothing unsaved is lost)
    self.interrupted = True
    if self.multi:
      os.kill(os.getpid(), signal.SIGTERM)  # to JAX's notifier: every process saves one step
    else:
      self.signal = signum

  def __call__(self, step: int) -> bool:
    self.stepped = True
    if self.multi and multihost_utils.reached_preemption_sync_point(step):
      self.signal = signal.SIGTERM
    return self.signal is not None

  def name(self) -> str:
    return f"signal {self.signal}" + {signal.SIGINT: " (Ctrl-C)",
                                      signal.SIGHUP: " (hang-up)"}.get(self.signal, "")

  def restore(self) -> None:
    for signum, handler in self.previous.items():
      signal.signal(signum, handler)


def silence_lost_outputs() -> None:
  """After a hang-up: standard output and error that were a terminal or a pipe (both gone with
  the session) write to /dev/null from now on; a file they were redirected to is kept."""
  devnull = os.open(os.devnull, os.O_WRONLY)
  for fd in (1, 2):
    try:
      mode = os.fstat(fd).st_mode
    except OSError:
      continue
    if os.isatty(fd) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
      os.dup2(devnull, fd)
  os.close(devnull)


def all_finite(state) -> jax.Array:
  """Whether every floating-point array of ``state`` is free of NaN and inf."""
  leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def shared_data_state(state: dict, shard: tuple[int, int]) -> dict:
  """What a checkpoint keeps of the data position: each data shard's iterator state (each
  reads its own documents, so each has its own), gathered to every process, as one process
  writes the checkpoint's JSON items."""
  index, count = shard
  states = {index: state}
  if jax.process_count() > 1:
    encoded = np.frombuffer(json.dumps([index, state]).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.int32(encoded.size))
    padded = np.zeros(int(np.max(sizes)), np.uint8)
    padded[:encoded.size] = encoded
    rows = multihost_utils.process_allgather(padded)
    states = dict(json.loads(bytes(row[:size])) for row, size in zip(rows, sizes))
  return {"shard_count": count, "shards": {str(i): states[i] for i in sorted(states)}}


def own_data_state(saved: dict, shard: tuple[int, int], log) -> dict | None:
  """This data shard's iterator state from a checkpoint's, or None (with a warning) when the
  checkpoint was written by a run with another number of data shards."""
  index, count = shard
  if "shards" not in saved:  # written before 2026-12-02: one iterator state, process 0's
    saved = {"shard_count": 1, "shards": {"0": saved}}
  if saved["shard_count"] != count:
    log(f"WARNING: the checkpoint's data position is of {saved['shard_count']} data shards "
        f"(processes reading their own rows) and this run has {count}; the training data "
        "starts again from the beginning of its order")
    return None
  return saved["shards"][str(index)]


def _loop(config, plan: Setup, log, compiled, checkpoints: "Checkpoints", n_params: int,
          stop: _Stop):
  model_cfg, mesh = plan.model_cfg, plan.mesh
  restored = checkpoints.restore_latest(plan.abstract_state, log, model_cfg)
  shard_index, shard_count = partitioning.process_data_shard(mesh)
  train_iter = data.make_train_iterator(config, process_index=shard_index,
                                        process_count=shard_count)
  shard = (shard_index, shard_count)
  if restored is not None:
    state, data_state = restored
    start = int(state["step"])
    log(f"resuming from {checkpoints.directory}/{start}")
    data_state = own_data_state(data_state, shard, log)
    if data_state is not None:
      try:
        train_iter.set_state(data_state)
      except (KeyError, TypeError, ValueError) as e:  # another data.source's pipeline
        log(f"warning: the checkpoint's data position does not fit this run's data pipeline "
            f"({type(e).__name__}: {first_line(e, 100)}; data.source changed?); the training "
            "data starts again from the beginning of its order")
        train_iter = data.make_train_iterator(config, process_index=shard_index,
                                              process_count=shard_count)
  else:
    log((f"reading {n_params / 1e6:.2f}M parameters from init_from={config.init_from} and "
         "initialising the optimizer state" if config.init_from else
         f"initialising {n_params / 1e6:.2f}M parameters and the optimizer state") +
        " (compiling)")
    started = time.perf_counter()
    state = jax.block_until_ready(plan.initial_state(config))
    log(f"initialised in {time.perf_counter() - started:.1f} s")
    start = 0

  flops_per_token = flops.train_flops_per_token(model_cfg, config.seq_len)
  peak = flops.device_peak_flops()
  writer = MetricsWriter(checkpoints.workdir, start)
  if not start and writer.dropped:  # an earlier run here that stopped before its first save
    writer.message(f"note: no checkpoint in {checkpoints.workdir}/checkpoints, so this run "
                   f"starts at step 0; metrics.jsonl's {writer.dropped} lines of the earlier "
                   "run are replaced")
  writer.message(
      f"{model_cfg.family} model: {n_params / 1e6:.2f}M parameters, "
      f"{_block_counts(model_cfg.resolved_block_types)}; mesh data={mesh.shape['data']} "
      f"model={mesh.shape['model']} on {jax.device_count()} {jax.devices()[0].device_kind}; "
      f"step {start} of {config.total_steps}")
  if plan.unsplit_note:
    writer.message(plan.unsplit_note)

  batch_sh = plan.batch_sharding
  train_step, eval_step = compiled.train.compiled, compiled.eval.compiled
  eval_batches = data.make_eval_batches(config, process_index=shard_index,
                                        process_count=shard_count)

  # Simulated CPU devices (--xla_force_host_platform_device_count): with several evaluation
  # steps in flight, XLA's CPU all-reduce rendezvous deadlocked (a 2 x 4 mesh on 2 cores, one
  # device never joining), so there each batch is waited for. Accelerators keep them in flight.
  wait_each = mesh.devices.size > 1 and mesh.devices.flat[0].platform == "cpu"

  def evaluate(step: int) -> dict[str, Any]:
    sums = []
    for batch in eval_batches:
      sums.append(eval_step(state["params"], _place(batch, batch_sh, config.batch_size)))
      if wait_each:
        jax.block_until_ready(sums[-1])
    total, count, correct = np.sum(jax.device_get(sums), axis=0)  # one host sync in all
    count = max(float(count), 1.0)
    mean = float(total) / count
    record = {"step": step, "eval_loss": mean, "eval_perplexity": math.exp(min(mean, 50.0)),
              "eval_accuracy": float(correct) / count}
    writer.write(record)
    writer.message(f"step {step}: eval loss {mean:.4f}, perplexity {record['eval_perplexity']:.2f}, "
                   f"accuracy {record['eval_accuracy']:.4f}")
    return record

  def eval_due(step: int) -> bool:
    return bool(config.eval_every and step % config.eval_every == 0) or (
        step == config.total_steps)

  tokenizer = config.data.tokenizer  # recorded absolute: sampling may start elsewhere
  tokenizer = tokenizer if tokenizer == "byte" else os.path.abspath(os.path.expanduser(tokenizer))
  meta = {"tokenizer": tokenizer, "config": config.to_json()}
  finite = jax.jit(all_finite, out_shardings=plan.state_shardings["step"])
  last_good = start if restored is not None else None

  def latest() -> str:
    return (f"the last checkpoint is step {last_good} in {checkpoints.directory}"
            if last_good is not None else "no checkpoint was written")

  pending: list[tuple[int, dict]] = []
  last_record: dict[str, Any] = {}
  eval_record: dict[str, Any] | None = None
  interval_start, interval_steps = time.perf_counter(), 0
  phase, step = "training step", start
  try:
    # process 0 read the metrics: every process does the same
    missing = process_0s(bool(start and eval_due(start) and not writer.has_eval(start)))
    if missing and not stop.signal:
      phase = "evaluation"  # the run that saved this step stopped before evaluating it
      eval_record = evaluate(start)
    if stop.signal and start < config.total_steps:  # signalled while starting: nothing new
      writer.message(f"stopped by {stop.name()} before training; " + (
          f"the latest checkpoint is step {start}" if restored is not None else
          "no checkpoint was written (a new run starts from scratch)"))
      return last_record
    for step in range(start + 1, config.total_steps + 1):
      phase = "training step"
      try:
        rows = next(train_iter)
      except ConfigError as e:  # a data file that vanished or changed under the run
        raise ConfigError(f"{e} (at step {step}; {latest()})") from None
      batch = _place(rows, batch_sh, config.batch_size)
      state, metrics = train_step(state, batch)
      pending.append((step, metrics))
      interval_steps += 1
      stopping = stop(step)
      at_checkpoint = step % config.checkpoint_every == 0 or step == config.total_steps
      if step % config.log_every == 0 or at_checkpoint or stopping:
        # The only host syncs: here, every log_every steps, and at checkpoints.
        host = jax.device_get(pending)
        pending.clear()
        for s, m in host:
          # The loss is of the parameters before step s; a non-finite gradient norm means the
          # update of step s made them non-finite too.
          for name in ("loss", "grad_norm"):
            if not np.isfinite(m[name]):
              raise NonFiniteLoss(f"{name.replace('_', ' ')} is {m[name]} at step {s}; "
                                  f"stopping, {latest()}")
        elapsed = time.perf_counter() - interval_start
        step_time = elapsed / interval_steps
        tokens_per_sec = config.batch_size * config.seq_len / step_time
        m = host[-1][1]
        last_record = {
            "step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
            "lr": float(m["lr"]), "tokens_per_sec": tokens_per_sec, "step_time_s": step_time,
            "mfu": (flops_per_token * tokens_per_sec / (peak * jax.device_count())
                    if peak else None)}
        eta = (config.total_steps - step) * step_time
        writer.write(last_record, progress=(
            f"step {step}/{config.total_steps}  loss {last_record['loss']:.4f}  "
            f"{tokens_per_sec:,.0f} tok/s  ETA {int(eta // 60)}m{int(eta % 60):02d}s"))
        interval_start, interval_steps = time.perf_counter(), 0
      if at_checkpoint or stopping:
        phase = "saving"
        if not bool(finite(state)):  # never a checkpoint that cannot be resumed
          raise NonFiniteLoss(f"the parameters or optimizer state after step {step} are not "
                              f"finite; not saved, {latest()}")
        checkpoints.save(step, state, model_cfg,
                         shared_data_state(train_iter.get_state(), shard), meta)
        last_good = step
      if eval_due(step) and not stopping:
        phase = "evaluation"
        eval_started = time.perf_counter()
        eval_record = evaluate(step)
        interval_start += time.perf_counter() - eval_started  # (between two logged steps)
      if interval_steps == 0:  # keep evaluation and saving out of the step timing
        interval_start = time.perf_counter()
      if stopping:
        phase = "saving"
        checkpoints.wait()
        writer.message(f"stopped by {stop.name()} after saving step {step}")
        if stop.interrupted:
          raise Interrupted(step)
        return last_record
    phase = "saving"
    checkpoints.wait()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise ConfigError(f"out of device memory at step {step} ({phase}): {first_line(e, 200)}; "
                      f"{latest()}") from None
  finally:
    writer.close()
  if eval_record is not None and config.data.source != "synthetic":
    # The unigram model of 64 training tokens a held-out one, at most 2^20 (the default run's
    # 32768 held-out tokens take the 2^20): whatever the batch size, as the held-out set; a
    # tiny run's few held-out tokens need few training rows (their packing is the slow part).
    baseline = data.unigram_baseline(config, train_tokens=min(2**20, 64 * config.data.eval_tokens))
    writer.message(f"held-out loss {eval_record['eval_loss']:.4f} nats/token; a unigram model of "
                   f"the training tokens scores {baseline:.4f} on the same held-out tokens")
  writer.message(f"done: step {config.total_steps}, checkpoints in {checkpoints.directory}")
  return last_record
