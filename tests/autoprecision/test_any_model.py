"""autoprecision and validate on models outside the tidy ones: every failure backs off or
stops with an ampc error that names the module, the batch or loss_fn, and the fix."""
import inspect
import itertools

import pytest
import torch
from torch import nn

import ampc
from ampc.autoprecision import Plan, search

transformers = pytest.importorskip("transformers")


# ---- mixed 16-bit dtypes meeting between modules (a T5's cache concatenates) ----

def t5():
    cfg = transformers.T5Config(vocab_size=64, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                pad_token_id=0)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(cfg)


def t5_batch(k):
    g = torch.Generator().manual_seed(k)
    labels = torch.randint(1, 64, (2, 6), generator=g)
    return {"input_ids": torch.randint(1, 64, (2, 8), generator=g), "labels": labels}, labels


def hand_plan(model, choices):
    """A plan giving the model's Linears ``choices`` in turn, without a search."""
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    units = [{"module": n, "type": "Linear", "choice": c}
             for n, c in zip(names, itertools.cycle(choices))]
    return Plan({"version": 1, "device": "cpu", "objective": "memory",
                 "candidates": ["fp32", "bf16", "fp16", "fp8"],
                 "budget": {"loss": 0.01, "grad": 0.05, "wgrad": 0.1}, "units": units})


@pytest.mark.parametrize("rest", [None, "fp32"])
def test_fp16_fp8_bf16_side_by_side_in_a_t5(rest):
    model = t5()
    plan = hand_plan(model, ("fp16", "fp8", "bf16"))
    plan.data["rest"] = rest
    inputs, _ = t5_batch(0)
    ref = model(**inputs).loss
    plan.apply(model)
    with plan.autocast():
        loss = model(**inputs).loss
    loss.backward()             # the cache's torch.cat met fp16 keys in a bf16 region here
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) < 0.05 * ref.item()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_fp16_module_in_bf16_region_hands_back_fp32():
    lin = nn.Linear(8, 8)
    ampc.policy.module_scope(lin, dtype=torch.float16, cast_outputs=torch.float32)
    x = torch.randn(2, 8)
    with ampc.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
        assert y.dtype == torch.float32
        torch.cat([y, torch.randn(2, 8, dtype=torch.bfloat16)])     # promote: no error
    assert lin(x).dtype == torch.float32                            # outside: untouched
    with pytest.raises(ValueError, match="ampc.policy.module_scope: cast_outputs"):
        ampc.policy.module_scope(lin, cast_outputs=torch.float64)


def test_plan_python_says_the_output_cast():
    plan = hand_plan(t5(), ("fp16", "bf16"))
    text = plan.python()
    assert "dtype=torch.float16, cast_outputs=torch.float32)" in text
    assert "dtype=torch.bfloat16, cast_outputs" not in text


def test_t5_memory_search_and_its_plan_run():
    # the search's own whole-plan check ran the mixed plan, and died there
    plan = search(t5(), [t5_batch(0), t5_batch(1)], candidates=("fp32", "fp16", "fp8"),
                  objective="memory", repeats=1)
    m = t5()
    plan.apply(m)
    with plan.autocast():
        loss = m(**t5_batch(2)[0]).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_t5_plan_with_blocks_recomputed_trains_as_the_one_that_saves():
    # what the memory search above chose on a loaded machine: fp16, fp8 and fp32 Linears, the
    # rest fp32, blocks recomputed; the recomputation ran outside the scopes and torch stopped
    # the backward (CheckpointError, or an attention mask in bf16 against fp32 queries)
    def run(recompute):
        m = t5()
        plan = hand_plan(m, ("fp16", "fp8", "fp32"))
        plan.data["rest"] = "fp32"
        if recompute:
            plan.set_step(recompute=[n for n, _ in m.named_modules()
                                     if n.count(".") == 2 and ".block." in n])
        plan.apply(m)
        with plan.autocast():
            loss = m(**t5_batch(0)[0]).loss
        loss.backward()
        return loss.detach(), [p.grad for p in m.parameters()]

    want, got = run(False), run(True)
    assert torch.equal(got[0], want[0])
    # fp16 gradients meeting in another order (a position bias shared by blocks): not bit-equal
    for a, b in zip(got[1], want[1]):
        assert torch.allclose(a, b, rtol=0, atol=1e-3 * float(b.abs().max()))


# ---- small models that fail in their own ways ----

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(torch.relu(self.b(self.a(x))))


def batches(n=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 32, generator=g).to(dtype), torch.randint(0, 8, (16,), generator=g))
            for _ in range(n)]


def make_batch(k):
    return batches(3)[k % 3]


def quick(model, data, loss_fn=None):
    """The memory objective, by bytes alone (no time ceiling, where search has one): the
    same plan on a busy machine."""
    free = {"max_slowdown": None} if "max_slowdown" in inspect.signature(search).parameters \
        else {}
    return search(model, data, loss_fn, candidates=("fp32", "bf16"), objective="memory",
                  repeats=1, **free)


def per_example(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def test_a_loss_that_is_not_a_scalar_is_named():
    with pytest.raises(ValueError, match=r"ampc.autoprecision.search: loss_fn per_example "
                                         r"returned a tensor of shape \(16,\), expected a scalar"):
        quick(Net(), batches(), per_example)
    with pytest.raises(ValueError, match=r"ampc.validate.compare: loss_fn per_example"):
        ampc.validate.compare(Net, make_batch, per_example, steps=2, seeds=(0,), progress=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_batches_of_another_dtype_are_named(dtype):
    name = str(dtype).replace("torch.", "")
    with pytest.raises(TypeError, match=f"ampc.autoprecision.search: batch 0's inputs hold "
                                        f"{name} .*give it float32 inputs"):
        quick(Net(), batches(dtype=dtype))

    def bad_batch(k):
        x, y = make_batch(k)
        return x.to(dtype), y
    with pytest.raises(TypeError, match=f"ampc.validate.compare: batch 0's inputs hold {name}"):
        ampc.validate.compare(Net, bad_batch, steps=2, seeds=(0,), progress=False)


class Matmul(torch.autograd.Function):
    """x @ w, its backward by hand, without torch.amp.custom_fwd: under autocast the
    forward saves what it was given and the backward meets a bf16 gradient with fp32 w."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.t(), x.t() @ g


class WithFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.w = nn.Parameter(torch.randn(32, 32) / 6)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(Matmul.apply(self.a(x), self.w))


def test_a_custom_function_without_custom_fwd_backs_off_and_is_named():
    torch.manual_seed(0)
    plan = quick(WithFunction(), batches())
    notes = " ".join(plan.data["notes"])
    assert "the whole plan raised RuntimeError" in notes
    assert "custom autograd.Function Matmul (applied in the model)" in notes
    assert "custom_fwd(device_type='cpu', cast_inputs=torch.float32)" in notes
    assert plan.data["backoffs"] and set(plan.choices.values()) == {"fp32"}
    # the lean state's bf16 weights meet the function's fp32 input (no cast list reaches
    # it): that move is left, saying why, not a crash
    assert plan.step.state == "fp32"
    assert plan.step.why["state"].startswith("left: the step raised RuntimeError")
    with pytest.raises(RuntimeError, match=r"ampc.validate.compare: torch.amp bf16 failed at "
                                           r"step 0: .*Matmul \(applied in the model\)"):
        ampc.validate.compare(WithFunction, make_batch, steps=2, seeds=(0,), progress=False)


class Fragile(nn.Module):
    """Refuses a 16-bit activation from its first layer, as torch's cat refused a foreign
    16-bit dtype: a plan fails inside it until its layers run fp32."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        h = self.l1(x)
        if h.dtype != torch.float32:
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
        return self.l2(torch.relu(h))


def test_a_failing_whole_plan_raises_the_modules_involved():
    torch.manual_seed(0)
    model = Net()
    model.b = Fragile()
    plan = quick(model, batches())
    assert {b["module"] for b in plan.data["backoffs"]} == {"b.l1", "b.l2"}
    assert plan.choices == {"a": "bf16", "b.l1": "fp32", "b.l2": "fp32", "head": "bf16"}
    # the fp32 step is timed on the machine, but the memory objective chose by bytes
    assert any("the whole plan raised RuntimeError: Unexpected floating" in n and " in b" in n
               for n in plan.data["notes"])


# ---- torch.compile'd parts ----

def test_a_compiled_part_is_searched_through_and_apply_says_how():
    torch.manual_seed(0)
    model = Net()
    model.b = torch.compile(model.b, backend="eager")
    plan = quick(model, batches())
    assert set(plan.choices) == {"a", "b.0", "b.2", "head"}       # the uncompiled names
    assert any("b compiled with torch.compile" in n and "model.b = model.b._orig_mod" in n
               for n in plan.data["notes"])
    assert isinstance(model.b, torch._dynamo.eval_frame.OptimizedModule)    # left as it was
    with pytest.raises(ValueError, match=r"ampc.autoprecision.Plan.apply: b is compiled with "
                                         r"torch.compile .*\(model.b = model.b._orig_mod\)"):
        plan.apply(model)
    assert ampc.policy.module_scope_of(model.b._orig_mod[0]) is None      # nothing changed
    model.b = model.b._orig_mod
    plan.apply(model)
    with plan.autocast():
        assert torch.isfinite(model(batches()[0][0])).all()


def test_a_scope_exit_is_not_masked_by_a_module_scope_that_never_entered():
    # a module scope's forward hook runs (always_call) though its pre-hook did not: as when
    # torch.compile traced the pre-hook and then failed; it popped the enclosing scope's
    # entry, and that scope's exit raised IndexError over the real error
    lin = nn.Linear(4, 4)
    ampc.policy.module_scope(lin, dtype=torch.float32)

    def fail(mod, args):
        raise ValueError("the real error")
    lin.register_forward_pre_hook(fail, prepend=True)
    with pytest.raises(ValueError, match="the real error"):
        with ampc.autocast("cpu", dtype=torch.bfloat16), ampc.policy.scope(ops={"mm": "fp32"}):
            lin(torch.randn(2, 4))
    assert ampc.policy.current_scope() is None and not torch.is_autocast_enabled("cpu")
