"""A transformers model as users bring one: keyword inputs (input_ids, attention_mask) in a
dict, a ModelOutput back. Built from a fresh config (no download)."""
import pytest
import torch
import torch.nn.functional as F

import ampc
from ampc.validate import default_loss

transformers = pytest.importorskip("transformers")


def make_model():
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, intermediate_size=128,
                                  max_position_embeddings=32, num_labels=3)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def make_batch(k):
    g = torch.Generator().manual_seed(k)
    mask = torch.ones(8, 16, dtype=torch.long)
    mask[:, 12:] = 0                                # padding the model must not attend to
    return ({"input_ids": torch.randint(0, 100, (8, 16), generator=g), "attention_mask": mask},
            torch.randint(0, 3, (8,), generator=g))


def test_default_loss_reads_the_logits_or_the_models_own_loss():
    model = make_model().eval()
    inputs, y = make_batch(0)
    out = model(**inputs)
    assert isinstance(out, transformers.utils.ModelOutput)
    assert torch.equal(default_loss(out, y), F.cross_entropy(out.logits.float(), y))
    own = model(**inputs, labels=y)                 # given labels, the model's loss is the loss
    assert torch.equal(default_loss(own, None), own.loss)
    assert torch.equal(default_loss(own, y), own.loss)


def test_search_and_compare_take_keyword_inputs_and_model_outputs():
    model = make_model()
    plan = ampc.autoprecision.search(model, [make_batch(0), make_batch(1)],
                                     candidates=("fp32", "bf16"), objective="memory", repeats=1,
                                     max_slowdown=None)
    assert len(plan) == 11 and plan.choice("classifier") in ("fp32", "bf16")
    report = ampc.validate.compare(make_model, make_batch, steps=3, setups=("torch.amp",),
                                   seeds=(0,), progress=False)
    assert all(torch.isfinite(torch.tensor(r.losses)).all() for r in [report.base] + report.runs)
    # the mask is honoured: changing a padded token changes nothing
    inputs, _ = make_batch(0)
    other = dict(inputs, input_ids=inputs["input_ids"].clone())
    other["input_ids"][:, 13] = (other["input_ids"][:, 13] + 1) % 100
    model.eval()
    from ampc._numerics.model import call_model
    torch.testing.assert_close(call_model(model, inputs).logits, call_model(model, other).logits)
