"""ampc.validate: mixed precision checked against its fp32 baseline.

``compare`` trains the same model on the same batches in fp32 and under each
mixed-precision setup (torch.amp, ampc.autocast + GradScaler, ampc master weights; fp16 or
bf16; and, by name, ampc.fp8, with FP8 GEMMs, and ampc.lean, ampc.prepare with
state="lean") and reports how far each loss curve drifts
from fp32's, next to fp32's own run-to-run spread, with gradient-norm ratios, skipped steps and the loss scale.
``layers`` runs one step both ways and ranks the modules by the error they add, with the
``ampc.policy.module_scope`` lines that keep the worst ones in fp32. ``fp16_ready`` says,
for a model trained in fp32 or bf16, which modules' outputs or gradients fp16 cannot hold.

    report = ampc.validate.compare(make_model, make_batch, steps=200)
    print(report.table()); report.save("out")          # out/compare.{txt,json,png}
    print(ampc.validate.layers(model, batch).table())

``train(setup, dtype, make_model, batches)`` trains one setup (a name of ``ALL_SETUPS`` or a
Plan) and returns its ``Run``; ``torch_adamw(params, lr)`` is the optimizer its fp32 and
torch.amp setups train with.

Command line: ``python -m ampc.validate mymodels:make_model --steps 200 --out out``.
"""
from ._compare import (ALL_SETUPS, CONTRAST_SETUPS, DEFAULT_DTYPE, DTYPES, LEAN_SETUP, SETUPS, Run,
                       compare, default_loss, evaluate)
from ._compare import train_one as train
from ._fp16_ready import Fp16Readiness, fp16_ready
from ._layers import layers
from ._report import Comparison, LayerReport, format_table
from ._setups import torch_adamw

__all__ = ["compare", "layers", "fp16_ready", "Comparison", "LayerReport", "Fp16Readiness", "Run",
           "SETUPS", "ALL_SETUPS", "CONTRAST_SETUPS", "LEAN_SETUP", "DTYPES", "DEFAULT_DTYPE",
           "default_loss", "evaluate", "format_table", "torch_adamw", "train"]
