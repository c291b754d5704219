"""MoE pieces against hand computations and per-token / per-expert reference loops."""

import math

import pytest
import torch
import torch.nn.functional as F

from models.common.moe import GroupedExperts, MoE, TokenChoiceTopKRouter, load_balance_loss


def _reference_experts(x, counts, w1, w2, w3):
    """Independent reference: slice each expert's rows and run its SwiGLU."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        rows = x[start : start + n]
        outs.append(F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e]))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 10, 0], [4, 1, 1, 4], [0, 0, 0, 0]])
@pytest.mark.parametrize("dim,hidden", [(16, 32), (6, 10)])  # grouped GEMM path / fallback loop
def test_grouped_experts_match_per_expert_loop(counts, dim, hidden):
    torch.manual_seed(0)
    experts = GroupedExperts(dim=dim, hidden_dim=hidden, num_experts=4)
    x = torch.randn(sum(counts), dim, requires_grad=True)
    num_tokens = torch.tensor(counts)
    out = experts(x, num_tokens)
    grad = torch.randn_like(out)
    out.backward(grad)

    ref_params = [p.detach().clone().requires_grad_() for p in (experts.w1, experts.w2, experts.w3)]
    x_ref = x.detach().clone().requires_grad_()
    ref = _reference_experts(x_ref, counts, *ref_params)
    ref.backward(grad)

    assert out.shape == (sum(counts), dim)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-6, rtol=1e-5)
    for p, p_ref in zip((experts.w1, experts.w2, experts.w3), ref_params):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-6, rtol=1e-5)
    # Experts without tokens get exactly zero gradient.
    for e, n in enumerate(counts):
        if n == 0:
            assert experts.w1.grad[e].abs().max() == 0


U_BF16 = 2.0**-8  # bfloat16's unit roundoff: 8 significant bits, round to nearest


@pytest.mark.parametrize("dim,hidden", [(16, 32), (6, 10)])  # grouped GEMM path / fallback loop
def test_grouped_experts_bf16(dim, hidden):
    """bf16 experts against a float64 reference on the same bf16 inputs and weights, element by
    element within a first-order rounding bound.

    Model: each bf16 op returns its exact result on its (bf16) inputs times (1 + d), |d| <= u =
    2^-8; the GEMMs accumulate in fp32, so their K <= 32 terms add ~K 2^-24, negligible. gate =
    W1 x and up = W3 x each carry u; silu(gate) carries kappa u from gate (kappa = |z silu'(z) /
    silu(z)| = |1 + z (1 - sigmoid(z))| at z = gate) plus u of its own; the product a another u:
    |da| <= (kappa + 3) u |a|. The down projection adds sum_k |W2_jk| |da_k| and its own rounding
    u |out_j|; second-order terms (~(kappa + 3)^2 u^2, < 1e-3 of the bound) are covered by 1 %.
    Measured: errors reach 0.18-0.28 of this bound (six seeds, both paths). The outputs are
    ~1e-3 here (weights of std 0.02), so an absolute tolerance like the former 2e-2 would pass
    even an all-zero output; this bound is ~2 % of each output's terms.
    """
    torch.manual_seed(0)
    experts = GroupedExperts(dim=dim, hidden_dim=hidden, num_experts=3).to(torch.bfloat16)
    counts = [5, 0, 7]
    x = torch.randn(12, dim, dtype=torch.bfloat16)
    out = experts(x, torch.tensor(counts))
    assert out.dtype == torch.bfloat16
    w1, w2, w3, x64 = (t.detach().double() for t in (experts.w1, experts.w2, experts.w3, x))
    ref, bound = torch.zeros(12, dim, dtype=torch.float64), torch.zeros(12, dim, dtype=torch.float64)
    start = 0
    for e, n in enumerate(counts):
        rows = slice(start, start + n)
        gate, up = x64[rows] @ w1[e].T, x64[rows] @ w3[e].T
        kappa = (1 + gate * (1 - torch.sigmoid(gate))).abs()
        a = F.silu(gate) * up
        ref[rows] = a @ w2[e].T
        bound[rows] = ((kappa + 3) * U_BF16 * a.abs()) @ w2[e].abs().T + U_BF16 * ref[rows].abs()
        start += n
    err = (out.double() - ref).abs()
    assert (err <= 1.01 * bound).all(), f"worst error / bound: {(err / bound).max().item():.2f}"


def _router_with_identity_gate(num_experts, top_k, norm_topk_prob):
    router = TokenChoiceTopKRouter(dim=num_experts, num_experts=num_experts, top_k=top_k, norm_topk_prob=norm_topk_prob)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(num_experts))  # logits == input
    return router


LOGITS = [[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 0.0, 3.5], [1.0, 1.5, 0.5, 0.0]]


def _softmax(row):
    total = sum(math.exp(v) for v in row)
    return [math.exp(v) / total for v in row]


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_router_top_k_by_hand(norm_topk_prob):
    router = _router_with_identity_gate(4, 2, norm_topk_prob)
    scores, experts, logits = router(torch.tensor(LOGITS))
    assert experts.tolist() == [[0, 1], [3, 1], [1, 0]]
    for row, (a, b), got in zip(LOGITS, experts.tolist(), scores.tolist()):
        probs = _softmax(row)
        want = [probs[a], probs[b]]
        if norm_topk_prob:
            want = [w / (probs[a] + probs[b]) for w in want]
        assert got == pytest.approx(want, abs=1e-6)
    assert torch.equal(logits, torch.tensor(LOGITS))


def test_aux_losses_by_hand():
    logits = torch.tensor(LOGITS)
    # top-2 picks: token0 -> {0,1}, token1 -> {3,1}, token2 -> {1,0}
    counts = torch.tensor([2, 3, 0, 1])
    probs = [_softmax(row) for row in LOGITS]
    frac = [c / 3 for c in counts.tolist()]  # copies per expert / tokens (sums to top_k)
    mean_p = [sum(p[i] for p in probs) / 3 for i in range(4)]
    want_lb = 4 * sum(f * p for f, p in zip(frac, mean_p))
    assert load_balance_loss(logits, counts, 4).item() == pytest.approx(want_lb, abs=1e-6)

    # Perfectly balanced routing (uniform probabilities) gives exactly top_k.
    uniform = torch.zeros(8, 4)
    assert load_balance_loss(uniform, torch.tensor([4, 4, 4, 4]), 4).item() == pytest.approx(2.0)


def _moe_reference(moe, x):
    """Per-token loop: sum over the token's k experts of weight * expert(token)."""
    scores, experts, _ = moe.router(x)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for s, e in zip(scores[t], experts[t].tolist()):
            acc = acc + s * F.linear(F.silu(F.linear(x[t], w1[e])) * F.linear(x[t], w3[e]), w2[e])
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_layer_matches_per_token_loop(top_k):
    torch.manual_seed(0)
    moe = MoE(dim=16, hidden_dim=24, num_experts=6, top_k=top_k, norm_topk_prob=True)
    x = torch.randn(2, 9, 16).abs()  # positive inputs, so the gate signs decide the ranking
    with torch.no_grad():
        # Experts 0-3 have positive logits, experts 4 and 5 negative ones: 4 and 5 get no tokens.
        moe.router.gate.weight[:4] = moe.router.gate.weight[:4].abs()
        moe.router.gate.weight[4:] = -1.0
    out, aux_loss, _ = moe(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out.view(-1, 16), _moe_reference(moe, x.view(-1, 16)), atol=1e-6, rtol=1e-5)
    assert aux_loss.dim() == 0 and aux_loss.requires_grad
    (out.square().mean() + aux_loss).backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0
    assert moe.experts.w1.grad[4:].abs().max() == 0  # no tokens, no gradient


def test_moe_all_tokens_to_one_expert():
    torch.manual_seed(0)
    moe = MoE(dim=8, hidden_dim=16, num_experts=4, top_k=1, norm_topk_prob=False)
    x = torch.randn(1, 10, 8).abs()  # positive inputs
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[2] = 1.0  # expert 2's logit = sum(x) > 0 = the others
    out, aux_loss, _ = moe(x)
    _, experts, _ = moe.router(x.view(-1, 8))
    assert experts.flatten().tolist() == [2] * 10
    torch.testing.assert_close(out.view(-1, 8), _moe_reference(moe, x.view(-1, 8)), atol=1e-6, rtol=1e-5)
    # All copies on one expert: f = (0, 0, 1, 0), so the loss is E * P_2.
    probs = torch.softmax(x.view(-1, 8) @ moe.router.gate.weight.T, -1)
    assert aux_loss.item() == pytest.approx(4 * probs[:, 2].mean().item(), abs=1e-6)


@pytest.mark.slow  # the unrolled compiled step is also covered by tests/unit/test_moe_trace.py's graph step;
# test_moe_scan_forward_backward_matches_the_loop below compiles the scanned model by default
def test_moe_model_compiles_fullgraph_with_aux_loss():
    """One graph for forward + aux losses (module attribute writes are fine for dynamo).

    In float32 this also runs the traceable expert fallback, since torch 2.13's meta function
    for `_grouped_mm` accepts bfloat16 only.
    """
    import models

    family = models.get_model_family("qwen3")
    args = family.get_args("debugmodel_moe", n_layers=2)
    torch.manual_seed(0)
    model = family.model_cls(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 16))

    def loss_fn(tokens):
        logits = model(tokens)
        return logits.logsumexp(-1).mean() + 0.01 * model.pop_aux_loss()

    eager = loss_fn(tokens)
    eager.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")(tokens)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_grouped_experts_bf16_compiles_fullgraph():
    torch.manual_seed(0)
    experts = GroupedExperts(dim=16, hidden_dim=32, num_experts=4).to(torch.bfloat16)
    x = torch.randn(10, 16, dtype=torch.bfloat16)
    counts = torch.tensor([3, 0, 5, 2])
    torch._dynamo.reset()
    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, counts), experts(x, counts), atol=0, rtol=0)


# --- layer scan -----------------------------------------------------------------------------
# MoE blocks return their load-balancing loss as an output; under layer scan it is a per-layer
# scan output (models/common/stack.py). The MoE forward itself has static shapes (fixed-size
# counts, an argsort of all N*k token copies, grouped GEMMs that take device counts), so the
# dropless dispatch lives inside torch's scan HOP as is: no capacity, no padding.


def _moe_model(n_layers: int = 3):
    import dataclasses

    from models.qwen3 import FLAVORS, Transformer
    from parallelisms.simple_fsdp import data_parallel

    args = dataclasses.replace(
        FLAVORS["debugmodel_moe"],
        n_layers=n_layers,
        dim=64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        vocab_size=512,
        max_seq_len=32,
        moe_hidden_dim=32,
    )
    with torch.device("meta"):
        model = Transformer(args)
    data_parallel(model, mesh=None, param_dtype=torch.float32, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    return model


def test_moe_scan_forward_backward_matches_the_loop():
    """Loss, aux loss and every gradient of a 2-layer MoE model: scanned (compiled) = Python loop.

    fp32, same ops in the same order per layer, so the only difference is the aux sum over layers
    (stacked sum vs running sum) and the compiled backward's accumulation order: ~1e-7 relative;
    asserted 1e-6 relative, and for each gradient 1e-6 of its largest entry absolute: an entry
    near zero is a sum of terms on the tensor's scale that cancelled, so its rounding error is
    on that scale (the embedding gradient sums up to 32 positions per row; on an AMD EPYC VM one
    entry differed by 2.2e-7 with the largest entry 0.72, i.e. 3e-7 of the scale)."""
    from trainer.step import lm_loss

    loop, scanned = _moe_model(2), _moe_model(2)
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(model):
        lm = lm_loss(model(inputs), labels)
        aux = model.pop_aux_loss()
        return lm + 0.01 * aux, aux

    want_loss, want_aux = loss_fn(loop)
    want_loss.backward()
    scanned.layers.enable_scan()
    torch._dynamo.reset()
    got_loss, got_aux = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")(scanned)
    stacked = scanned.layers.stacked_parameters()
    others = {n: p for n, p in scanned.named_parameters() if not n.startswith("layers.")}
    grads = torch.autograd.grad(got_loss, [s for s, _ in stacked.values()] + list(others.values()))
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_aux, want_aux, rtol=1e-6, atol=0)
    want = dict(loop.named_parameters())
    for (name, _), grad in zip(stacked.items(), grads):
        ref = torch.stack([want[f"layers.{i}.{name}"].grad for i in range(2)])
        torch.testing.assert_close(grad, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item(), msg=name)
    for (name, _), grad in zip(others.items(), grads[len(stacked) :]):
        ref = want[name].grad
        torch.testing.assert_close(grad, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item(), msg=name)


@pytest.mark.slow  # ~60 s: captures three graph steps (unrolled, scanned, scanned with accumulation)
@pytest.mark.parametrize("accum", [1, 2])
def test_moe_graph_step_with_scan_matches_unrolled_and_eager(accum):
    """The graph trainer's step with layer scan (aux_loss_coef 0.01) for 3 steps: losses, aux
    losses, gradient norms and the parameters after the AdamW updates equal the unrolled graph
    step's and the eager step's, within tests/unit/test_moe_trace.py's tolerances (1e-5 relative on
    losses / norms; 2e-6 on parameters: a few ulps of AdamW over 3 steps in its linear regime).
    With 2 accumulation micro-batches too, which failed to capture with scan before the stack kept
    its terms in a dict (tests/unit/test_stack_terms.py)."""
    from models.qwen3.plan import PLAN
    from parallelisms.simple_fsdp import clip_grad_norm_
    from tests.support.graph_common import batches, build_opt, lr_at, max_param_diff
    from trainer.graph import build_graph_step
    from trainer.step import EagerStep

    models = [_moe_model(2) for _ in range(3)]
    opts = [build_opt(m) for m in models]
    torch._dynamo.reset()
    steps = [
        EagerStep(model=models[0], optimizer=opts[0], max_norm=1.0, aux_loss_coef=0.01, clip_grad_norm=clip_grad_norm_)
    ]
    steps += [
        build_graph_step(
            model=m,
            optimizer=o,
            max_norm=1.0,
            backend="aot_eager",
            aux_loss_coef=0.01,
            plan=PLAN,
            scan_layers=scan,
            grad_accum_steps=accum,
        )
        for m, o, scan in zip(models[1:], opts[1:], (False, True))
    ]
    data = batches(3, accum)
    curves = []
    for step, opt in zip(steps, opts):
        curve = []
        for i, mbs in enumerate(data):
            for group in opt.param_groups:
                group["lr"] = lr_at(i)
            out = step(mbs, lr_at(i))
            curve.append((float(out.loss), float(out.aux_loss), float(out.grad_norm)))
        curves.append(curve)
    # One scan over the layers in the forward, one in the backward; none unrolled.
    assert steps[2].stats.scans == 2 * accum and steps[1].stats.scans == 0
    for curve in curves[1:]:
        for got, want in zip(curve, curves[0]):
            assert got == pytest.approx(want, rel=1e-5), curves
    assert max_param_diff(models[0], models[2]) <= 2e-6
    assert max_param_diff(models[1], models[2]) <= 2e-6
