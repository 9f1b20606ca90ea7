"""ampc over torch.distributed: DTensor params and grads (FSDP2's fully_shard).

Under FSDP2 each rank holds a shard of every parameter as a DTensor. The kernels are
elementwise, so the optimizer runs them on the local shards (``to_local()``), with its
state made like the param (a DTensor of the same mesh and placements). What is not
elementwise needs the other ranks: whether any grad holds an inf or a nan (reduced with
max) and the global grad norm (the sum of squares reduced), both over the mesh dims along
which the grads are sharded (every placement but Replicate). The reductions are
collectives on device tensors, so nothing waits for the device.

A Partial placement (a pending sum) is refused: its local values are not the gradient.
DDP needs nothing here: it all-reduces the grads, so every rank sees the same values.

The lean state's 8-bit moments of sharded params keep their blocks per shard
(ampc/optim/_shards.py).
"""
import sys
import weakref
from itertools import repeat

import torch.distributed as dist

__all__ = ["is_dtensor", "check_group", "local_lists", "split_grads", "agree_found_inf",
           "global_norm", "refuse_sharded_model", "watch_params"]


def _dtensor_class():
    """DTensor, or None while torch.distributed.tensor is not imported: no DTensor can exist
    before its module is, and importing it takes over half a second that a script without
    DTensors should not pay (nor a torch built without distributed)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def is_dtensor(t):
    DTensor = _dtensor_class()
    return DTensor is not None and isinstance(t, DTensor)


def _laid_out_like(t, p):
    """t is a DTensor on p's mesh with p's placements (cheap checks first: this runs per
    tensor and step)."""
    if type(t) is not type(p) and not is_dtensor(t):
        return False
    return t.placements == p.placements and (t.device_mesh is p.device_mesh
                                               or t.device_mesh == p.device_mesh)


def _refuse_partial(who, what, t):
    from torch.distributed.tensor import Partial     # t is a DTensor: the module is loaded
    if any(isinstance(pl, Partial) for pl in t.placements):
        raise ValueError(f"{who}: {what} has a Partial placement {tuple(t.placements)} (a sum "
                         "not yet reduced across ranks, so its local values are not its "
                         "value); redistribute it to Shard or Replicate first")


def _require_process_group(who):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{who}: the gradients are DTensors sharded across ranks, and "
                           "agreeing on inf/nan and the norm needs torch.distributed's "
                           "process group, which is not initialized (call "
                           "torch.distributed.init_process_group first, and destroy it "
                           "only after training)")


def _locals(dtensors):
    # what to_local() returns under no_grad (the same tensor, by its contract), without
    # its per-call cost of microseconds: this runs for every tensor of every step
    return [t._local_tensor for t in dtensors]


# ---- the optimizer: DTensor params, state made like them, the kernel on local shards ----

def check_group(who, params, group_index):
    """Refuses a param group that mixes DTensor and plain params, holds DTensor params of
    different meshes, or a param with a Partial placement."""
    dtensors = [(i, p) for i, p in enumerate(params) if is_dtensor(p)]
    if not dtensors:
        return
    if len(dtensors) != len(params):
        plain = next(i for i, p in enumerate(params) if not is_dtensor(p))
        raise ValueError(f"{who}: param group {group_index} mixes DTensor params (param "
                         f"{dtensors[0][0]}) and plain tensors (param {plain}); put them in "
                         "separate param groups")
    first, mesh = dtensors[0][0], dtensors[0][1].device_mesh
    for i, p in dtensors:
        _refuse_partial(who, f"param {i} of group {group_index}", p)
        if p.device_mesh != mesh:
            raise ValueError(f"{who}: params {first} and {i} of param group {group_index} are "
                             f"DTensors on different device meshes ({mesh} and "
                             f"{p.device_mesh}); give each mesh its own param group")


def local_lists(who, indices, params, grads, states):
    """The local shards of DTensor params, their grads and their state lists, for one
    kernel call. Every grad and state tensor must be laid out like its param."""
    for i, p, g in zip(indices, params, grads):
        if not _laid_out_like(g, p):
            got = f"placements {tuple(g.placements)}" if is_dtensor(g) else "a plain tensor"
            raise ValueError(f"{who}: param {i} is a DTensor with placements "
                             f"{tuple(p.placements)}, but its grad is {got}; the grad must "
                             "be sharded like the param")
    for key, values in states.items():
        if key == "step":
            continue
        for i, p, s in zip(indices, params, values):
            if not _laid_out_like(s, p):
                raise ValueError(f"{who}: the state '{key}' of param {i} is not a DTensor "
                                 "sharded like the param (a checkpoint loaded without "
                                 "torch.distributed.checkpoint?)")
    return (_locals(params), _locals(grads),
            {k: v if k == "step" else _locals(v) for k, v in states.items()})


# ---- the scaler: found_inf and the norm agreed across ranks ----

def _reduce_groups(who, g):
    """The process groups of the mesh dims along which the DTensor g is not replicated."""
    from torch.distributed.tensor import Replicate   # g is a DTensor: the module is loaded
    _refuse_partial(who, "a gradient", g)
    dims = [d for d, pl in enumerate(g.placements) if not isinstance(pl, Replicate)]
    if dims:
        _require_process_group(who)
    return tuple(g.device_mesh.get_group(d) for d in dims)


def split_grads(who, grads):
    """[(process groups, local grads)]: the grads by the groups their squared norms must
    be summed over (in the order of first appearance, the same on every rank); plain
    tensors and replicated DTensors have none. One entry, with no groups, for plain
    grads."""
    DTensor = _dtensor_class()
    if DTensor is None or not any(map(isinstance, grads, repeat(DTensor))):    # in C
        return [((), list(grads))] if grads else []
    classes = {}
    layouts = {}                # (mesh, placements) -> groups, looked up once per call
    for g in grads:
        if is_dtensor(g):
            layout = (id(g.device_mesh), g.placements)
            groups = layouts.get(layout)
            if groups is None:
                groups = layouts[layout] = _reduce_groups(who, g)
            g = g._local_tensor         # as in _locals
        else:
            groups = ()
        key = tuple(id(pg) for pg in groups)
        classes.setdefault(key, (groups, []))[1].append(g)
    return list(classes.values())


def _all_groups(classes):
    seen = {}
    for groups, _ in classes:
        for pg in groups:
            seen.setdefault(id(pg), pg)
    return list(seen.values())


def agree_found_inf(found_inf, classes):
    """found_inf becomes its max over every rank that holds a shard of the grads: every
    rank then skips the same steps and keeps the same scale."""
    for pg in _all_groups(classes):
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=pg)
    return found_inf


def global_norm(classes, local_norm):
    """The 2-norm of all the grads: local_norm(local grads) per class, squared in float64,
    summed over the class's groups, added up, square-rooted, as float32. Without any
    sharded grads, local_norm's own value (unchanged bits)."""
    if len(classes) == 1 and not classes[0][0]:
        return local_norm(classes[0][1])
    total = None
    for groups, grads in classes:
        sq = local_norm(grads).double().square()
        for pg in groups:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=pg)
        total = sq if total is None else total + sq
    return total.sqrt().float()


# ---- prepare: refuse what would silently train nothing ----

_FSDP2_RECIPE = ("with FSDP2 do not call prepare: shard the fp32 model with fully_shard(module, "
                 "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                 "reduce_dtype=torch.float32)) and train it with ampc.optim.AdamW: the fp32 "
                 "sharded params are the master weights")


def refuse_sharded_model(model):
    """prepare after fully_shard: the params are DTensors, and casting them would lose
    the shards' fp32 values that FSDP2 keeps as master weights."""
    for name, p in model.named_parameters():
        if is_dtensor(p):
            raise RuntimeError(f"ampc.prepare: parameter {name} is a DTensor (the model was "
                               f"sharded, e.g. by fully_shard); {_FSDP2_RECIPE}")


def watch_params(model, optimizer):
    """A one-shot forward pre-hook: the first forward checks that the optimizer still holds
    the model's params. fully_shard (or anything else) after prepare replaces them, and
    the optimizer would then step tensors no gradient reaches."""
    def check(module, args):
        if module is not target():      # a deep copy of the model (an EMA copy, say)
            return
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not held <= {id(p) for p in module.parameters()}:
            raise RuntimeError("ampc.prepare: the optimizer's params are no longer the "
                               "model's (fully_shard or another wrapper replaced them after "
                               "prepare), so its step would train nothing; "
                               + _FSDP2_RECIPE)
        handle.remove()
    target = weakref.ref(model)
    handle = model.register_forward_pre_hook(check)
    return handle
