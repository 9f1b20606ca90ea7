"""The memory moves on models the tests do not use: gradient error against the plain model, saved
bytes, and 20 AdamW steps beside the plain run.

    python benchmarks/bench_moves_models.py [--models qwen2,swin] [--moves 8bit,recompute] [--steps 20]

Each model is built from a small fresh config (transformers) or constructor (torchvision), seeded,
in train mode as it comes (dropout and stochastic depth on where the model has them: every forward
of the plain and the moved copy starts from the same seed, so they draw alike; recompute replays
it). The moves, on the model's blocks: ``ampc.memory.compress(model, blocks, "8bit")``,
``compress(..., "bf16")``, ``ampc.memory.recompute(model, blocks)``, and
``ampc.memory.sliced_head(model, "lm_head")`` on the causal LMs; ``--moves jitter`` is the
control (no move; every weight changed by 1e-5 of itself). Per model and move:

- grad err: ||g_move - g_plain|| / ||g_plain|| of all the gradients as one vector, on one batch,
  fp32 throughout; per param: the same per parameter (max and median over the parameters whose
  plain gradient is not zero up to rounding, see grad_errors); nonfinite: parameters whose
  moved gradient holds a NaN or inf; buffers: whether every buffer (running statistics, counters)
  equals the plain model's after that step;
- saved: the saved-activation bytes of ``ampc.memory.report`` (one measured training step on a
  fresh copy) with the move over those without it, and the same for the step's peak;
- 20 steps: AdamW (lr 1e-3) on the plain and the moved model from the same weights on the same
  batches; the final loss of each and their gap relative to the plain one.
"""
import argparse
import copy
import math
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

import _harness as H

ampc = H.import_ampc()

V = 512     # the language models' vocabulary


def ids(g, batch, length):
    return torch.randint(4, V, (batch, length), generator=g)


def padded(g, batch=4, length=32):
    """Token ids and an attention mask with zeros: each row but the first is padded at the end."""
    x = ids(g, batch, length)
    mask = torch.ones(batch, length, dtype=torch.long)
    for i in range(1, batch):
        mask[i, length - 5 * i:] = 0
    return x.masked_fill(mask == 0, 1), mask


def causal_lm(config_name, model_name, **cfg):
    def make():
        import transformers
        config = getattr(transformers, config_name)(
            vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, **cfg)
        return getattr(transformers, model_name)(config)

    def batch(g):
        x = ids(g, 4, 32)
        return {"input_ids": x, "labels": x}, None
    return make, batch


def encoder(config_name, model_name, **cfg):
    def make():
        import transformers
        return getattr(transformers, model_name)(getattr(transformers, config_name)(**cfg))

    def batch(g):
        x, mask = padded(g)
        return {"input_ids": x, "attention_mask": mask,
                "labels": torch.randint(0, 2, (4,), generator=g)}, None
    return make, batch


def t5():
    def make():
        import transformers
        cfg = transformers.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                    num_heads=4, relative_attention_num_buckets=8,
                                    decoder_start_token_id=0, pad_token_id=0)
        return transformers.T5ForConditionalGeneration(cfg)

    def batch(g):
        x, mask = padded(g)
        return {"input_ids": x, "attention_mask": mask, "labels": ids(g, 4, 16)}, None
    return make, batch


def vision(build, size=32):
    def make():
        return build()

    def batch(g):
        return torch.randn(4, 3, size, size, generator=g), torch.randint(0, 10, (4,), generator=g)
    return make, batch


def _tv():
    import torchvision
    return torchvision.models


def convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    return ConvNeXt([CNBlockConfig(24, 48, 2), CNBlockConfig(48, None, 2)],
                    stochastic_depth_prob=0.1, num_classes=10)


def regnet():
    from torchvision.models.regnet import BlockParams, RegNet
    params = BlockParams.from_init_params(depth=4, w_0=16, w_a=8.0, w_m=2.0, group_width=8,
                                          se_ratio=0.25)
    return RegNet(params, num_classes=10, stem_width=16)


def swin():
    from torchvision.models.swin_transformer import SwinTransformer
    return SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                           window_size=[4, 4], num_classes=10)


def maxvit():
    from torchvision.models.maxvit import MaxVit
    return MaxVit(input_size=(32, 32), stem_channels=16, partition_size=4, block_channels=[32, 64],
                  block_layers=[1, 1], head_dim=16, stochastic_depth_prob=0.1, num_classes=10)


LAYERS = "model.layers.*"
SLIDING = dict(sliding_window=16)
# name: ((make, batch), blocks, head, what it covers)
MODELS = {
    "qwen2": (causal_lm("Qwen2Config", "Qwen2ForCausalLM", use_sliding_window=True,
                        max_window_layers=1, **SLIDING), LAYERS, "lm_head",
              "GQA, sliding window on one of two layers"),
    "gemma2": (causal_lm("Gemma2Config", "Gemma2ForCausalLM", head_dim=16, **SLIDING), LAYERS,
               "lm_head", "GQA, sliding/global layers, logit soft-capping, tied head"),
    "phi3": (causal_lm("Phi3Config", "Phi3ForCausalLM", **SLIDING), LAYERS, "lm_head",
             "GQA, fused qkv and gate_up, sliding window"),
    "starcoder2": (causal_lm("Starcoder2Config", "Starcoder2ForCausalLM", **SLIDING), LAYERS,
                   "lm_head", "GQA, biases, sliding window, tied head"),
    "mixtral": (causal_lm("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                          num_experts_per_tok=2, **SLIDING), LAYERS, "lm_head",
                "GQA, sliding window, top-2 of 4 experts"),
    "roberta": (encoder("RobertaConfig", "RobertaForSequenceClassification", vocab_size=V,
                        hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=80, pad_token_id=1),
                "roberta.encoder.layer.*", None, "padding mask with zeros, dropout 0.1"),
    "distilbert": (encoder("DistilBertConfig", "DistilBertForSequenceClassification",
                           vocab_size=V, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                           pad_token_id=1), "distilbert.transformer.layer.*", None,
                   "padding mask with zeros, dropout 0.1"),
    "t5": (t5(), ["encoder.block.*", "decoder.block.*"], None,
           "relative position bias, encoder padding mask, cross-attention, dropout 0.1"),
    "mobilenet_v3": (vision(lambda: _tv().mobilenet_v3_small(num_classes=10)), "features.*",
                     None, "depthwise, squeeze-excite, in-place hardswish/ReLU, batch norm"),
    "efficientnet": (vision(lambda: _tv().efficientnet_b0(num_classes=10)), "features.*", None,
                     "depthwise, squeeze-excite, in-place SiLU, stochastic depth"),
    "densenet": (vision(lambda: _tv().DenseNet(growth_rate=12, block_config=(2, 2, 2),
                                               num_init_features=24, num_classes=10)),
                 "features.*", None, "dense connections, in-place ReLU alone as a block"),
    "convnext": (vision(convnext), "features.*", None,
                 "depthwise 7x7, LayerNorm2d, layer scale, stochastic depth"),
    "regnet": (vision(regnet), ["stem", "trunk_output.*"], None,
               "grouped conv, squeeze-excite, in-place ReLU, batch norm"),
    "swin": (vision(swin), "features.*", None,
             "shifted windows (mask), relative position bias, stochastic depth"),
    "maxvit": (vision(maxvit), ["stem", "blocks.*"], None,
               "MBConv + SE, block and grid attention, relative position bias"),
}
MOVES = ("8bit", "bf16", "recompute", "sliced_head")
# "jitter" (not run by default): how far 20 steps of the model drift from a change that small,
# the yardstick of the 20-step gap where the plain run is chaotic (tiny batches, batch norm)


def call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def loss_of(out, target):
    if target is None:
        return out.loss
    return F.cross_entropy(out, target)


def apply(model, move, blocks, head):
    if move == "jitter":       # the control: no move, the weights changed by 1e-5 of themselves
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 1e-5 * torch.randn(p.shape, generator=g))
        return None
    if move == "recompute":
        return ampc.memory.recompute(model, blocks)
    if move == "sliced_head":
        return ampc.memory.sliced_head(model, head)
    return ampc.memory.compress(model, blocks, move)


def batches(batch, n):
    return [batch(torch.Generator().manual_seed(100 + i)) for i in range(n)]


def step_grads(model, inputs, target, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_of(call(model, inputs), target)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def grad_errors(g0, g1):
    """({parameter: relative error}, the error of all gradients as one vector, parameters with
    a non-finite moved gradient). Left out of the first: parameters whose plain gradient is
    under 1e-3 of the median parameter's (a key bias under softmax, a batch norm's scale
    before a max-pool: zero up to rounding), whose relative error says nothing; the second
    counts them."""
    norms = {n: a.norm().item() for n, a in g0.items()}
    floor = 1e-3 * statistics.median(norms.values())
    errs, bad, diff, total = {}, 0, 0.0, 0.0
    for n, a in g0.items():
        b = g1.get(n, torch.zeros_like(a))
        if not torch.isfinite(b).all():
            bad += 1
            continue
        diff += (b - a).norm().item() ** 2
        total += norms[n] ** 2
        if norms[n] > floor:
            errs[n] = (b - a).norm().item() / norms[n]
    bad += sum(1 for n, b in g1.items() if n not in g0 and not torch.isfinite(b).all())
    return errs, math.sqrt(diff / total) if total else math.nan, bad


def same_buffers(a, b):
    return all(x.equal(y) for (_, x), (_, y) in zip(a.named_buffers(), b.named_buffers()))


def train(model, data, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = None
    for i in range(steps):
        inputs, target = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(1000 + i)
        loss = loss_of(call(model, inputs), target)
        loss.backward()
        opt.step()
    return loss.item()


def measured(model, data):
    """(saved-activation bytes, peak bytes) of one training step, from ampc.memory.report."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(7)
    r = ampc.memory.report(model, opt, data[0], loss_of, warmup=0)
    return sum(r.saved.values()), r.peak


def run_model(name, moves, steps):
    (make, batch), blocks, head, _ = MODELS[name]
    torch.manual_seed(0)
    plain = make().train()
    start = copy.deepcopy(plain.state_dict())
    data = batches(batch, 4)
    inputs, target = data[0]
    moves = [m for m in moves if m != "sliced_head" or head]

    def fresh(move):
        model = make().train()
        model.load_state_dict(start)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = apply(model, move, blocks, head) if move else None
        return model, handle, caught

    loss0, g0 = step_grads(plain, inputs, target, seed=1)
    base_model, _, _ = fresh(None)
    saved0, peak0 = measured(base_model, data)
    plain_model, _, _ = fresh(None)
    final0 = train(plain_model, data, steps)
    rows = []
    for move in moves:
        row = {"model": name, "move": move}
        t = time.perf_counter()
        try:
            model, _, caught = fresh(move)
            with warnings.catch_warnings(record=True) as more:
                warnings.simplefilter("always")
                loss1, g1 = step_grads(model, inputs, target, seed=1)
            errs, whole, bad = grad_errors(g0, g1)
            buffers = same_buffers(plain, model)
            saved1, peak1 = measured(fresh(move)[0], data)
            final1 = train(fresh(move)[0], data, steps)
            notes = sorted({str(w.message).split(":")[0] + ": " + str(w.message).split(":")[1][:40]
                            for w in [*caught, *more]})
            row.update({
                "grad err": whole, "per param max": max(errs.values()),
                "median": statistics.median(errs.values()),
                "worst": max(errs, key=errs.get)[-34:],
                "nonfinite": bad, "loss = plain": loss1 == loss0, "buffers = plain": buffers,
                "saved x": saved1 / saved0 if saved0 else math.nan, "peak x": peak1 / peak0,
                f"plain loss@{steps}": final0, f"moved loss@{steps}": final1,
                "gap": abs(final1 - final0) / abs(final0), "s": time.perf_counter() - t,
                "warned": "; ".join(notes)[:60]})
        except Exception as e:      # a move that fails is a row, not the end of the run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--moves", default=",".join(MOVES))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        rows += run_model(name, args.moves.split(","), args.steps)
    keys = list(dict.fromkeys(k for r in rows for k in r))    # a failed move's row: its error
    H.report(H.machine("cpu"), [{k: r.get(k, "-") for k in keys} for r in rows], False, [])


if __name__ == "__main__":
    main()
