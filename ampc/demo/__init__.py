"""python -m ampc.demo: a small GPT trained on the source of Python's standard library
seven ways, side by side, in about three minutes on any machine. Its vocabulary is the
text's 4,096 most frequent pieces (words, numbers, runs of spaces, every printable
character), so its logits weigh in a step's memory as a language model's do.

  fp32              fp32 weights, torch.optim.AdamW(fused=True)
  torch.amp         torch.autocast (+ torch.amp.GradScaler for fp16), torch AdamW
  ampc drop-in      ampc.autocast (+ ampc.GradScaler for fp16), ampc.optim.AdamW
  ampc master       ampc.prepare: 16-bit weights, fp32 master weights in ampc.optim.AdamW
  ampc auto         a precision per module chosen by ampc.autoprecision.search on this
                    machine (its search time is weighed apart), ampc.optim.AdamW
  ampc memory       the plan ampc.autoprecision.search(objective="memory") finds for a
                    step's peak at half torch.amp's (8-bit saved activations, blocks
                    recomputed, the head's logits sliced), met or not, ampc.optim.AdamW
  ampc lean         ampc.prepare with ampc.optim.AdamW(state="lean"): 16-bit weights written
                    by stochastic rounding, no master copy, 8-bit moments

Each run's row also gives its peak memory (live tensors over its first steps) and its
state bytes a parameter (weights, grads, optimizer state), measured from its tensors by
ampc.lean_state.state_bytes.

The text is read at run time from the running interpreter's standard library (every
tenth file held out for validation). All runs start from the same weights and see the
same batches (ampc.validate.compare), fp32 also from a second seed for its run-to-run
spread. The model size and step count are chosen from what this machine measures: the
CPU's capability, bf16 against fp32 matmul speed, and the time of a few real steps. The
runs train in lockstep and all stop at the same step when the time budget (--budget,
150 s) is used up, however busy the machine turns out to be.
Output: a table, the validation summary, OUT/demo.{txt,json,png}, OUT/layers.*,
OUT/plan.* and OUT/memory_plan.*, and a
sample of text written by the ampc model.

A program on top of the library, shipped with it so that ``python -m ampc.demo`` runs
wherever ampc is installed: nothing in ampc imports it. Besides the public API it takes
validate's one-run trainer, default dtypes and table and file writers. Its parts: _job.py
(the command line and ``main``: size, search, train, report, write), _sizing.py (what this
machine can do, the size and steps that fit), _text.py, _model.py, _report.py.
"""
from ._job import main

__all__ = ["main"]
