"""Monitor: the plan re-checked during training.

Every ``every`` steps it takes the next ``sample`` modules of the plan (in turn, so that
all are seen over len(plan) / sample checks), runs the step's batch through an fp32
shadow of the model (a copy, so that batch-norm statistics and the optimizer are not
touched) and measures each sampled module at its planned precision against fp32, as
search() did. A module leaves the budget when its error, added to the others' errors from
the search, would put the plan over it (its weight-gradient error on its own); after
``patience`` such checks in a row it is raised (fp8 -> bf16, bf16/fp16 -> fp32) or a
warning is given, as ``action`` says. It counts as back inside only once its error is
under ``release`` times its allowance (hysteresis: no flapping at the edge). Steps in
between only count: no device work, no host sync.
"""
import copy
import math
import warnings

import torch

from . import _measure
from ._plan import RAISE_TO, _recipe
from ._solve import _err


def _agree(ratios):
    """Under torch.distributed, each module's largest ratio over the ranks: every rank
    then takes the same decisions (each measured its own batch)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ratios
    t = torch.tensor([min(r, 1e30) for r in ratios.values()], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {n: (math.inf if v >= 1e30 else v) for n, v in zip(ratios, t.tolist())}


class Monitor:
    def __init__(self, applied, loss_fn=None, *, every=100, sample=2, action="raise",
                 patience=1, release=0.5, device=None):
        from ..validate._compare import default_loss
        if action not in ("raise", "warn"):
            raise ValueError(f"ampc.autoprecision.Monitor: action must be 'raise' or 'warn', "
                             f"got {action!r}")
        for name, v in (("every", every), ("sample", sample), ("patience", patience)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ampc.autoprecision.Monitor: {name} must be a positive int, "
                                 f"got {v!r}")
        if not 0 < release < 1:
            raise ValueError(f"ampc.autoprecision.Monitor: release must be in (0, 1), "
                             f"got {release!r}")
        self.applied, self.plan = applied, applied.plan
        self.loss_fn = loss_fn or default_loss
        self.every, self.sample, self.action = every, sample, action
        self.patience, self.release = patience, release
        self.device = device or self.plan.device
        self.steps = 0
        self.cursor = 0
        self.over = {}          # module -> checks in a row over its allowance
        self.out = set()        # modules currently outside the budget
        self.history = []       # {"step", "module", "choice", "errors", "ratio"}
        self.decisions = []     # {"step", "module", "from", "to", "ratio", "action"}

    def allowance(self, name):
        """{error: limit} for one module: the budget less the other modules' errors."""
        b = self.plan.budget
        others = [u for u in self.plan.units if u["module"] != name]
        out = {"wgrad_err": b.wgrad}
        for key, limit in (("loss_err", b.loss), ("dgrad_err", b.grad)):
            used = sum(_err(u["options"].get(u["choice"], {}), key) ** 2 for u in others)
            out[key] = max(limit ** 2 - used, 0.0) ** 0.5
        return out

    def step(self, batch):
        """Call once per training step; on every ``every``-th step it checks the next
        sampled modules on ``batch`` and returns the decisions taken (else [])."""
        self.steps += 1
        if self.steps % self.every:
            return []
        return self.check(batch)

    def check(self, batch):
        names = [u["module"] for u in self.plan.units]
        if not names:
            return []
        picked = [names[(self.cursor + i) % len(names)] for i in range(min(self.sample, len(names)))]
        self.cursor = (self.cursor + len(picked)) % len(names)
        errors = self.measure(batch, picked)
        ratios = {}
        for name in picked:
            e, limits = errors[name], self.allowance(name)
            ratios[name] = max((_err(e, k) / lim if lim > 0 else (math.inf if _err(e, k) > 0
                                                                  else 0.0))
                               for k, lim in limits.items())
        ratios = _agree(ratios)
        taken = []
        for name in picked:
            choice = self.plan.choices[name]
            e, ratio = errors[name], ratios[name]
            self.history.append({"step": self.steps, "module": name, "choice": choice,
                                 "errors": e, "ratio": ratio})
            if choice == "fp32":
                continue
            if ratio > 1:
                self.over[name] = self.over.get(name, 0) + 1
            else:
                self.over[name] = 0
            if name in self.out:
                if ratio < self.release:
                    self.out.discard(name)
                continue
            if self.over[name] >= self.patience:
                self.out.add(name)
                taken.append(self._act(name, choice, ratio))
        self.decisions += taken
        return taken

    def _act(self, name, choice, ratio):
        new = RAISE_TO[choice] if self.action == "raise" else choice
        d = {"step": self.steps, "module": name, "from": choice, "to": new,
             "ratio": ratio, "action": self.action}
        if self.action == "raise":
            self.applied.set(name, new)
            self.out.discard(name)          # judged afresh at its new precision
            self.over[name] = 0
        else:
            warnings.warn(f"ampc.autoprecision.Monitor: step {self.steps}: module {name} "
                          f"({choice}) is at {ratio:.1f}x its error allowance", stacklevel=3)
        return d

    def measure(self, batch, names):
        """{name: errors at its planned precision} on ``batch``, against an fp32 shadow."""
        shadow = copy.deepcopy(self.applied.model)
        units = dict(shadow.named_modules())
        batch = tuple(batch)
        with torch.random.fork_rng(devices=[]):
            loss, records, grads = _measure.capture(shadow, batch, self.loss_fn, names)
            scale = _measure.loss_scale_for(records, grads)   # where GradScaler would be now
            out = {}
            choices = self.plan.choices
            recipe = (_recipe(self.plan.data.get("fp8_recipe")) if "fp8" in choices.values()
                      else None)
            for name in names:
                rec = records.get(name)
                if rec is None or "out" not in rec:
                    out[name] = {}
                    continue
                m, c = units[name], choices[name]
                if c == "fp32":
                    out[name] = {"loss_err": 0.0, "dgrad_err": 0.0, "wgrad_err": 0.0}
                    continue
                ref_y, ref_dx, ref_dw, _ = _measure.run_unit(m, "fp32", rec, self.device, None, 1.0)
                s = scale if c == "fp16" else 1.0
                y, dx, dw, _ = _measure.run_unit(m, c, rec, self.device, recipe, s)
                out[name] = {"loss_err": _measure.loss_error(y, ref_y, rec.get("grad"), loss),
                             "dgrad_err": _measure._rel(dx, ref_dx),
                             "wgrad_err": _measure._rel(dw, ref_dw)}
        return out

    def state_dict(self):
        return {"steps": self.steps, "cursor": self.cursor, "over": dict(self.over),
                "out": sorted(self.out), "history": list(self.history),
                "decisions": list(self.decisions), "choices": self.plan.choices}

    def load_state_dict(self, state):
        """Restores the record and re-applies the choices it had taken."""
        self.steps, self.cursor = state["steps"], state["cursor"]
        self.over, self.out = dict(state["over"]), set(state["out"])
        self.history, self.decisions = list(state["history"]), list(state["decisions"])
        for name, choice in state["choices"].items():
            if self.plan.choices.get(name) != choice:
                self.applied.set(name, choice)
