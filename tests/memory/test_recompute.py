"""ampc.memory.recompute: modules recompute in the backward instead of saving; the gradients
are those of the plain model, bit for bit, dropout included."""
import pytest
import torch
from torch import nn

import ampc.memory as mem


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.2)
        self.calls = 0

    def forward(self, x, *, gate=None, scale=1.0):
        self.calls += 1
        h = self.drop(torch.nn.functional.gelu(self.up(self.norm(x))))
        y = self.down(h) * scale
        return x + (y if gate is None else y * gate)


class Net(nn.Module):
    def __init__(self, width=32, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.gate = nn.Parameter(torch.full((width,), 0.5))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            x = b(x, gate=self.gate if i == 1 else None, scale=0.9)
        return self.head(x)


def make():
    torch.manual_seed(0)
    return Net()


def grads(model, x, y, seed):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], torch.get_rng_state()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


@pytest.mark.parametrize("which, blocks", [("blocks.*", [0, 1, 2]), (["blocks.1"], [1]),
                                           ("module objects", [0, 2])])
def test_gradients_equal_bit_for_bit_with_dropout(which, blocks):
    x, y = batch()
    plain = make()
    want = grads(plain, x, y, seed=7)
    model = make()
    if which == "module objects":
        which = [model.blocks[0], model.blocks[2]]
    handle = mem.recompute(model, which)
    assert mem.recomputed(model) == [f"blocks.{i}" for i in blocks]   # "*" stays within one part
    got = grads(model, x, y, seed=7)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert torch.equal(got[2], want[2])     # the random state after the step, as without
    handle.remove()


def test_the_forward_runs_again_in_the_backward_and_kwargs_reach_it():
    x, y = batch()
    model = make()
    mem.recompute(model, "blocks.1")
    grads(model, x, y, seed=0)
    assert [b.calls for b in model.blocks] == [1, 2, 1]
    assert model.gate.grad is not None and model.gate.grad.abs().sum() > 0   # the gate kwarg's gradient
    with torch.no_grad():                   # nothing saved: nothing to recompute, one call
        model(x)
    assert model.blocks[1].calls == 3


def test_saved_activations_of_the_recomputed_modules_drop():
    x, y = batch()
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    before = mem.report(model, opt, (x, y))
    with mem.recompute(model, ["blocks.0", "blocks.2"]) as handle:
        assert mem.recomputed(model) == handle.names == ["blocks.0", "blocks.2"]
        after = mem.report(model, opt, (x, y))
    again = mem.report(model, opt, (x, y))

    def block(r, i):
        return sum(b for k, b in r.saved.items() if k.startswith(f"blocks.{i}"))
    # recomputed: only the block's input is kept, under the block's own name: 16 x 32 fp32
    # for block 2; block 0's input is the batch, not counted
    assert block(after, 2) == after.saved["blocks.2"] == 16 * 32 * 4 < block(before, 2) / 4
    assert block(after, 0) == 0 < block(before, 0)
    assert block(after, 1) == block(before, 1)
    assert after.recomputed == ["blocks.0", "blocks.2"] and not again.recomputed
    assert again.saved == before.saved and sum(after.saved.values()) < sum(before.saved.values())


def test_remove_restores_the_module():
    model = make()
    names = list(model.state_dict())
    handle = mem.recompute(model, "blocks.*")
    assert "forward" in model.blocks[0].__dict__ and list(model.state_dict()) == names
    handle.remove()
    handle.remove()                          # twice: nothing more to do
    assert all("forward" not in b.__dict__ for b in model.blocks) and mem.recomputed(model) == []
    mem.recompute(model, "blocks.0").remove()  # can be made again


@pytest.mark.parametrize("modules, err, msg", [
    ("blocks.9", ValueError, r"modules\[0\] 'blocks.9' names no module of the model \(close: blocks.2"),
    (["blocks.0", "nothing.*"], ValueError, r"modules\[1\] 'nothing.\*' names no module"),
    (["blocks.0", nn.Linear(2, 2)], ValueError, r"modules\[1\] \(Linear\) is not a module of model"),
    (["blocks.0", 3], TypeError, r"modules\[1\] is int"),
    ([], ValueError, "modules is empty"),
    (3.5, TypeError, "modules is float"),
])
def test_bad_input_is_refused_before_anything_changes(modules, err, msg):
    model = make()
    with pytest.raises(err, match=f"ampc.memory.recompute: {msg}"):
        mem.recompute(model, modules)
    assert mem.recomputed(model) == []


def test_recomputing_twice_is_refused():
    model = make()
    mem.recompute(model, "blocks.1")
    with pytest.raises(ValueError, match=r"ampc.memory.recompute: modules\[0\] 'blocks.1' recomputes already"):
        mem.recompute(model, ["blocks.*"])
    assert mem.recomputed(model) == ["blocks.1"]
    with pytest.raises(TypeError, match="ampc.memory.recompute: model is str"):
        mem.recompute("model", "blocks.1")


def test_a_copy_of_the_model_recomputes_its_own_modules():
    import copy
    import pickle
    x, y = batch()
    model = make()
    mem.recompute(model, "blocks.*")
    twin = copy.deepcopy(model)
    want = grads(make(), x, y, seed=3)[1]
    got = grads(twin, x, y, seed=3)[1]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(p.grad is None for p in model.parameters())       # the original was not run
    assert [b.calls for b in twin.blocks] == [2, 2, 2] and mem.recomputed(twin) == mem.recomputed(model)
    assert mem.recomputed(pickle.loads(pickle.dumps(model))) == ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize("rest", [None, torch.float32])
@pytest.mark.parametrize("backward_inside", [False, True])
def test_a_recomputed_block_runs_again_under_its_scopes_and_region(rest, backward_inside):
    # the recomputation ran outside the scopes the forward ran in (the region's, the block's
    # own, entered by a hook that does not run again); torch's checkpoint restores its
    # autocast state, but not a float32 one on the CPU: the children's 16-bit scopes
    # recomputed in fp32 and torch stopped the backward (CheckpointError: recomputed
    # float32 where float16 was saved), on a T5 plan with the rest in fp32
    import ampc

    def run(recompute):
        model = make()
        ampc.policy.module_scope(model.blocks[0], dtype=torch.float16,
                                 cast_outputs=torch.float32)
        ampc.policy.module_scope(model.blocks[1].up, dtype=torch.float16,
                                 cast_outputs=torch.float32)
        ampc.policy.module_scope(model.blocks[2], dtype=torch.float32)
        ampc.policy.module_scope(model.blocks[2].down, dtype=torch.bfloat16)
        if recompute:
            mem.recompute(model, "blocks.*")
        x, y = batch()
        torch.manual_seed(3)
        with ampc.autocast("cpu", dtype=torch.bfloat16), ampc.policy.scope(dtype=rest):
            loss = nn.functional.cross_entropy(model(x).float(), y)
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    want, got = run(False), run(True)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
