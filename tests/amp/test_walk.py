"""The one walk over nested arguments that autocast and prepare share."""
import collections

import torch

from ampc._walk import map_tensors, tensors

Pair = collections.namedtuple("Pair", "a b")


def test_map_tensors_keeps_every_container_type():
    t, u = torch.ones(2), torch.zeros(3)
    dd = collections.defaultdict(list, {"k": t})
    value = [t, (u, "s", 3), Pair(t, [u]), {"x": t, "y": None}, collections.OrderedDict(z=u), dd]
    out = map_tensors(lambda x: x * 2, value)
    assert type(out) is list and type(out[1]) is tuple and out[1][1:] == ("s", 3)
    assert type(out[2]) is Pair and torch.equal(out[2].a, t * 2) and torch.equal(out[2].b[0], u * 2)
    assert out[3]["y"] is None and torch.equal(out[3]["x"], t * 2)
    assert type(out[4]) is collections.OrderedDict and type(out[5]) is collections.defaultdict
    assert out[5].default_factory is list and torch.equal(out[5]["k"], t * 2)
    assert [x.shape for x in tensors(value)] == [x.shape for x in tensors(out)]
    assert len(tensors(value)) == 7


def test_map_tensors_rebuilds_nothing_when_nothing_changes():
    value = ([torch.ones(1)], {"a": (torch.ones(1),)}, Pair(1, 2))
    assert map_tensors(lambda x: x, value) is value
    assert map_tensors(lambda x: x, "text") == "text"
