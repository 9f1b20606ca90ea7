"""ampc.autoprecision: a precision per module, chosen from measured error and measured
time under an error budget, checked as a whole, verified in training and watched while
training goes on.

    plan = ampc.autoprecision.search(model, batches[:3], loss_fn)
    print(plan.table())                      # module, choice, errors, time per candidate
    applied = plan.apply(model)              # module_scope per module, fp8 Linears
    scaler = plan.scaler()                   # a GradScaler when a module runs fp16
    with plan.autocast():
        loss = loss_fn(model(x), y)
    plan.save("plan.json"); print(plan.python())
    print(plan.verify(make_model, make_batch, steps=100).table())
    monitor = applied.monitor(loss_fn, every=200)   # then monitor.step(batch) each step

Guide: docs/autoprecision.md.
"""
from ._monitor import Monitor
from ._plan import Applied, Plan
from ._search import search
from ._solve import Budget
from ._units import CANDIDATES, UNIT_TYPES

__all__ = ["search", "Plan", "Applied", "Budget", "Monitor", "CANDIDATES", "UNIT_TYPES"]
