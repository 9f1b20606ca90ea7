"""The numerics both tools stand on: ampc.validate and ampc.autoprecision measure the same
things, and this is where each is written once.

  model.py    calling a model on a batch, its first float output, a batch on a device,
              a module's path as Python, the default loss
  errors.py   relative errors (in float64), the first-order loss error, fp16's range and
              loss scale, tensors that cannot show an error (all zero, not finite)
  capture.py  one fp32 (or mixed) step recording each module's first call: its inputs,
              output and output gradient, and every parameter's gradient
  unit.py     one module run alone on a recorded call in a given region, timed

Nothing here knows a Plan, a setup or a report: those are the tools' own.
"""
