"""What the search does not spend time on: the memory objective does not run the matmul
probe (every candidate is measured on the units), units timed alike share one too-slow
verdict and the candidates it rules out are not run again on the others, and one fp32 pass
both checks the batches and finds the silent units."""
import torch
from torch import nn

import ampc.autoprecision._measure as measure_mod
import ampc.autoprecision._search as search_mod
from ampc.autoprecision import search


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 32),
                         nn.Linear(32, 32), nn.Linear(32, 4))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(2)]


def slow_fp16(candidates, device):
    return {"fp16": "its 512x512 matmul takes 5x fp32's time on this CPU"}


CANDIDATES = ("fp32", "bf16", "fp16")


def test_without_a_ceiling_every_candidate_is_measured(monkeypatch):
    calls = []
    monkeypatch.setattr(search_mod, "probe", lambda c, d: calls.append(c) or slow_fp16(c, d))
    plan = search(model(), batches(), candidates=CANDIDATES, objective="memory", check=False,
                  max_slowdown=None)
    assert not calls
    assert all(set(u.options) == set(CANDIDATES) for u in plan if u.module != "(loss)")


def test_units_timed_alike_do_not_rerun_a_candidate_judged_too_slow(monkeypatch):
    """Linears 2 and 3 have the same shapes: the first is judged, and the second never runs
    the candidate found too slow (here: every bf16 run is made to look slow)."""
    ran = []
    real = measure_mod.run_at

    def run_at(module, choice, call, device, recipe, scale):
        out = real(module, choice, call, device, recipe, scale)
        ran.append((id(module), choice))
        if choice == "bf16":
            out = out[:3] + (out[3] + 1.0,)         # a second more: far past fp32's time
        return out
    monkeypatch.setattr(measure_mod, "run_at", run_at)
    # the matmul probe passes everything (on an AVX2-only CPU it would keep bf16 off the
    # Linears before any unit is timed): this is about the units' own verdict
    monkeypatch.setattr(search_mod, "probe", lambda candidates, device: {})
    plan = search(model(), batches(), candidates=("fp32", "bf16"), objective="memory",
                  check=False)
    units = {u.module: u for u in plan}
    for name in ("2", "3"):
        assert units[name].options["bf16"].get("too_slow", "").startswith("too slow here")
        assert units[name].choice == "fp32"
    # the search worked on copies: tell the two Linears' copies apart by their runs
    per_copy = {}
    for key, choice in ran:
        per_copy.setdefault(key, set()).add(choice)
    bf16_copies = [k for k, cs in per_copy.items() if cs == {"bf16"}]
    fp32_copies = [k for k, cs in per_copy.items() if cs == {"fp32"}]
    # units 0, 1(norm), 2, 4 ran their bf16 copy (warm-up and the verdict); unit 3 did not
    assert len(fp32_copies) == 5 and len(bf16_copies) == 4


def test_one_fp32_pass_checks_the_batches_and_finds_silent_units():
    """Before measuring, one fp32 forward a batch both names a failing batch or loss_fn and
    finds the units that cannot show an error; then the measurement's own pass: with two
    batches and no whole-plan check, four forwards of the model in all (not six); one more
    where the search times a slice of a batch to decide whether to measure on slices. (The
    time objective: the memory objective measures whole steps after this, for its whole-step
    moves.)"""
    for examples, n in ((None, 4), (4, 5)):
        net = model()
        forwards = []
        net.register_forward_pre_hook(lambda m, args: forwards.append(1))   # copies keep it
        search(net, batches(), candidates=("fp32", "bf16"), objective="time", check=False,
               max_slowdown=None, loss_unit=False, examples=examples)
        assert len(forwards) == n, examples
