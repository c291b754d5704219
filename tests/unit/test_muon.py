"""Muon (trainer/optim/muon.py) and MuonClip's QK clip (trainer/optim/qk_clip.py).

- Newton-Schulz: the output's singular values land in the published band; batched = per matrix.
- The parameter split on Llama 3 and Qwen 3 MoE.
- Our optimizer vs a plain single-process reference of the published algorithm, 3 steps.
- SimpleFSDP on 2 gloo processes and TP on 2 thread ranks vs one process, 3 steps.
- QK clip: the logit tracking vs a dense computation; after the clip every head's max logit on
  the same inputs is min(S_h, tau), for MHA, GQA and MLA; wired into the Muon step.
- Config errors.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from models.common.attention import max_causal_logit
from models.errors import ConfigError
from parallelisms import ParallelDims, build_mesh
from tests.support.parallel_harness import (
    FAMILIES,
    QWEN3_FLAVORS,
    Qwen3,
    batch,
    full,
    llama3_args,
    lm_loss,
    parallel_fp32_model,
    reference_state,
    run_processes,
    run_threads,
)
from trainer.config import build_config
from trainer.optim import build_optimizer_for
from trainer.optim.muon import Muon, build_muon, newton_schulz5, split_muon_params, update_scale
from trainer.optim.qk_clip import QKClip, gqa_qk_clip_, mla_qk_clip_

LR, WD, BETAS, EPS, MOMENTUM = 2e-2, 0.1, (0.9, 0.95), 1e-8, 0.95
MUON_KW = dict(
    lr=LR,
    weight_decay=WD,
    betas=BETAS,
    eps=EPS,
    momentum=MOMENTUM,
    nesterov=True,
    ns_steps=5,
    ns_dtype="float32",
    exclude=("tok_embeddings", "output", "gate", "embed_tokens", "lm_head"),
)


# --- a plain reference of the published algorithm ------------------------------------------------


def reference_ns5(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic Newton-Schulz on one matrix, fp32, written out directly."""
    x = g.clone().float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.t()
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        a_mat = x @ x.t()
        b_mat = -4.7750 * a_mat + 2.0315 * (a_mat @ a_mat)
        x = 3.4445 * x + b_mat @ x
    return x.t() if tall else x


class ReferenceMuon:
    """Straightforward loop over named parameters: Muon (the original sum-form momentum,
    buf = beta*buf + g, Nesterov g + beta*buf) with Moonshot's 0.2*sqrt(max(m, n)) scale and
    decoupled weight decay for block matrices; textbook AdamW for the rest."""

    def __init__(self, model):
        self.params = [(n, p) for n, p in model.named_parameters()]
        self.state = {}
        self.t = 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        for name, p in self.params:
            g = p.grad
            parts = name.split(".")[:-1]
            if p.dim() >= 2 and not {"tok_embeddings", "output", "gate"} & set(parts):
                buf = self.state.setdefault(name, torch.zeros_like(p))
                buf.mul_(MOMENTUM).add_(g)
                u = g + MOMENTUM * buf
                if u.dim() == 3:
                    o = torch.stack([reference_ns5(u[e]) for e in range(u.shape[0])])
                else:
                    o = reference_ns5(u)
                p.mul_(1 - LR * WD)
                p.sub_(LR * 0.2 * math.sqrt(max(p.shape[-2], p.shape[-1])) * o)
            else:
                m, v = self.state.setdefault(name, (torch.zeros_like(p), torch.zeros_like(p)))
                m.mul_(BETAS[0]).add_((1 - BETAS[0]) * g)
                v.mul_(BETAS[1]).add_((1 - BETAS[1]) * g * g)
                m_hat = m / (1 - BETAS[0] ** self.t)
                v_hat = v / (1 - BETAS[1] ** self.t)
                p.mul_(1 - LR * WD)
                p.sub_(LR * m_hat / (v_hat.sqrt() + EPS))


def _model(family="llama3", args=None, state=None):
    cls, make_args, _ = FAMILIES[family]
    model = cls(args or make_args())
    if state is not None:
        model.load_state_dict(state, strict=False)
    else:
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights()
    return model


def _train(model, opt, vocab, steps=3):
    losses = []
    for i in range(steps):
        inputs, labels = batch(vocab, seed=10 + i)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(inputs), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# --- Newton-Schulz ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 96)])
def test_newton_schulz_singular_values(shape):
    """5 quintic steps push every singular value of the Frobenius-normalised matrix into about
    [0.7, 1.2] (Keller Jordan: the coefficients trade exactness for a steep slope at 0; they do
    not converge to 1 but oscillate in roughly [0.68, 1.13]). Random Gaussian matrices have
    normalised singular values >= ~1e-3 (square) so 5 steps of slope 3.4445 (x ~450) reach the
    band; the band checked, [0.55, 1.25], leaves room for the square case's smallest ones, and a
    wrong coefficient or a missing transpose falls far outside it."""
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(newton_schulz5(g, steps=5, dtype=torch.float32))
    small = s.min().item() if shape[0] != shape[1] else torch.quantile(s, 0.02).item()
    assert 0.55 < small and s.max().item() < 1.25, (s.min(), s.max())
    # bf16 (the default) stays in the same band: the iteration is self-correcting.
    s16 = torch.linalg.svdvals(newton_schulz5(g, steps=5).float())
    assert s16.max().item() < 1.25


def test_newton_schulz_batched_equals_per_matrix():
    """Experts' [E, m, n] updates: one batched NS = E separate ones (same ops per matrix: exact
    up to fp32 matmul blocking, 1e-6 of entries of size ~1/sqrt(n))."""
    g = torch.randn(3, 32, 48, generator=torch.Generator().manual_seed(1))
    batched = newton_schulz5(g, steps=5, dtype=torch.float32)
    single = torch.stack([newton_schulz5(g[e], steps=5, dtype=torch.float32) for e in range(3)])
    torch.testing.assert_close(batched, single, atol=1e-6, rtol=0)
    assert update_scale(g.shape) == pytest.approx(0.2 * math.sqrt(48))


# --- parameter split -------------------------------------------------------------------------------


def test_split_llama_and_qwen_moe():
    model = _model(args=llama3_args(1))
    muon, adamw = split_muon_params(model.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in muon) == sorted(
        f"layers.0.{m}.weight"
        for m in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "attention.wo",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
        )
    )
    assert {names[id(p)] for p in adamw} == {
        "tok_embeddings.weight",
        "output.weight",
        "norm.weight",
        "layers.0.attention_norm.weight",
        "layers.0.ffn_norm.weight",
    }
    # The hf backend's names: the router `gate` stays on AdamW, the FFN's `gate_proj` does not.
    hf = [
        (n, torch.nn.Parameter(torch.zeros(4, 4)))
        for n in (
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.mlp.gate_proj.weight",
        )
    ]
    muon, adamw = split_muon_params(hf)
    assert [id(p) for p in muon] == [id(hf[3][1])] and len(adamw) == 3
    args = dataclasses.replace(QWEN3_FLAVORS["debugmodel_moe"], n_layers=1, max_seq_len=16)
    moe = Qwen3(args)
    muon, adamw = split_muon_params(moe.named_parameters())
    names = {id(p): n for n, p in moe.named_parameters()}
    muon_names = {names[id(p)] for p in muon}
    assert {"layers.0.moe.experts.w1", "layers.0.moe.experts.w2", "layers.0.moe.experts.w3"} <= muon_names
    assert not any("gate" in n or "norm" in n for n in muon_names)


@pytest.mark.parametrize("family, flavor", [("gpt_oss", "debugmodel"), ("qwen3_5", "debugmodel_moe")])
def test_tensors_that_are_no_linear_map_stay_on_adamw(family, flavor):
    """gpt-oss's sinks [H, 1] and expert bias tables [E, n], Qwen 3.5's conv taps [C, 1, K] and its
    [1, dim] shared gate have 2+ dims but are no matrix to orthogonalise (Newton-Schulz makes each
    row a rescaled unit vector): the model class names them (`non_matrix_params`) and build_muon
    hands them to AdamW. Before the change every one of them was a Muon parameter."""
    from models import FAMILIES

    fam = FAMILIES[family]
    model = fam.model_cls(dataclasses.replace(fam.get_args(flavor), n_layers=4, max_seq_len=16))
    opt = build_muon(
        model,
        lr=1e-3,
        weight_decay=0.0,
        betas=(0.9, 0.95),
        eps=1e-8,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        ns_dtype="float32",
        exclude=("tok_embeddings", "output", "gate"),
    )
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for group in opt.param_groups if group["use_muon"] for p in group["params"]}
    vectors = {n for n, p in model.named_parameters() if set(n.split(".")) & set(fam.model_cls.non_matrix_params)}
    assert vectors and all(model.get_parameter(n).dim() >= 2 for n in vectors)
    assert not vectors & muon
    assert {n for n in names.values() if n.endswith(("experts.w1", "experts.gate_up_proj", "out_proj.weight"))} & muon


def assert_adamw_close(p, ref, name):
    """An AdamW parameter of two runs of the same steps (3 here) that differ only in the order of
    float32 reductions (module tests below).

    Where a coordinate's gradients are tiny (sqrt(v) ~ 1e-9: the head rows and embedding rows of
    rare tokens), Adam divides ~1e-14 gradient differences by ~1e-9 and its step lr * m/sqrt(v)
    moves by a large share of lr. Which coordinates those are depends on the summation order,
    i.e. on the CPU's vector width: 0 of 1,048,576 over 2e-4 on a 2-vCPU AMD EPYC, 1 (8.0e-4) on an
    Intel Xeon. So: every coordinate within 2e-4 = 1e-2 x lr except at most 1 in 1e5, and those
    within the largest difference two Adam trajectories can have, 2 x lr per step: with betas
    (0.9, 0.95) and t <= 3, Cauchy-Schwarz gives |m_hat / sqrt(v_hat)| <= 1 per step (the factor
    (1-b1)/(1-b1^t) * sqrt((1-b2^t)/(1-b2)) * sqrt(sum (b1^2/b2)^k) is 1.00 for t = 1, 2, 3),
    plus weight decay lr * wd * |p|. A wrong bias correction or a missing term moves every
    coordinate by ~lr and fails the count."""
    diff = (p.detach() - ref.detach()).abs()
    loose = int((diff > 2e-4).sum())
    assert loose <= max(1, diff.numel() // 100_000), (name, loose, float(diff.max()))
    assert float(diff.max()) <= 3 * 2 * LR * (1 + WD * float(ref.detach().abs().max())), (name, float(diff.max()))


def assert_params_close(p, ref, name, *, muon: bool):
    """Muon matrices atol 2e-6 (the reference test's bound); AdamW parameters `assert_adamw_close`."""
    if muon:
        torch.testing.assert_close(p, ref, atol=2e-6, rtol=0, msg=name)
    else:
        assert_adamw_close(p, ref, name)


# --- vs the reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama3", "qwen3_moe"])
def test_matches_reference_three_steps(family):
    """Our Muon (EMA momentum, batched NS) vs the reference loop (sum momentum, per-matrix NS),
    fp32 throughout, 3 steps on the same batches.

    Bound: the two momentum forms differ by the factor 1-beta, which NS's normalisation removes
    (up to its 1e-7 guard: relative 1e-7/|u| ~ 1e-8); the rest is fp32 rounding of differently
    ordered ops, ~1e-7 relative per op. NS amplifies a relative perturbation of its input by at
    most the product of the quintic's slopes (3.4445^5 ~ 480, only for tiny singular values),
    so the update (entries ~ lr * 0.2 = 4e-3) may differ by ~480 * 1e-7 * 4e-3 ~ 2e-7 per step;
    the gradients of steps 2-3 then see weights that differ by that, which moves a loss of ~8.3
    by ~1e-6. Checked: Muon matrices atol 2e-6 (measured 3.3e-7), losses rtol 1e-6.
    The AdamW parameters (head, embedding, norms) are ill-conditioned where |g| is tiny: the
    step lr * m/sqrt(v) moves by lr * dg/sqrt(v), and sqrt(v) ~ 1e-9 for the head rows of rare
    tokens, so the ~1e-14 gradient differences of steps 2-3 show as up to ~2.5e-5 (measured);
    they get atol 2e-4 = 1e-2 x lr (measured up to 1.9e-4 on the MoE model's embedding; a wrong
    bias correction moves step 1 by ~lr).
    A wrong scale, a missing Nesterov term or weight decay moves Muon matrices by >= 1e-4."""
    if family == "qwen3_moe":
        args = dataclasses.replace(QWEN3_FLAVORS["debugmodel_moe"], n_layers=1, max_seq_len=16)
        make = lambda: Qwen3(args)  # noqa: E731
    else:
        make = lambda: _model(args=llama3_args(2))  # noqa: E731
    torch.manual_seed(0)
    ours, ref = make(), make()
    with torch.no_grad():
        ours.init_weights()
    ref.load_state_dict(ours.state_dict())
    vocab = ours.tok_embeddings.weight.shape[0]
    opt = build_muon(ours, **MUON_KW)
    ref_opt = ReferenceMuon(ref)
    losses = _train(ours, opt, vocab)
    ref_losses = []
    for i in range(3):
        inputs, labels = batch(vocab, seed=10 + i)
        for p in ref.parameters():
            p.grad = None
        loss = lm_loss(ref(inputs), labels)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
    ref_params = dict(ref.named_parameters())
    muon = {id(p) for p in opt.param_groups[0]["params"]}
    for name, p in ours.named_parameters():
        assert_params_close(p, ref_params[name], name, muon=id(p) in muon)


# --- sharded vs one process ------------------------------------------------------------------------


def _parallel_llama(degrees: dict, world_size: int, state: dict):
    """On a rank: the 2-layer Llama parallelized under `degrees` (fp32), holding `state`."""
    cls, make_args, plan = FAMILIES["llama3"]
    return parallel_fp32_model(cls, make_args(), plan, ParallelDims(world_size=world_size, **degrees), state)[0]


def _sharded_run(degrees: dict, world_size: int, state: dict):
    """On a rank: the 2-layer Llama under `degrees`, fp32, Muon 3 steps; full params + losses."""
    model = _parallel_llama(degrees, world_size, state)
    opt = build_muon(model, **MUON_KW)
    losses = []
    for i in range(3):
        inputs, labels = batch(model.tok_embeddings.weight.shape[0], seed=10 + i)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(inputs), labels)
        loss.backward()
        opt.step()
        losses.append(full(loss.detach()).item())
    return losses, {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def _one_process():
    model = _model(state=reference_state())
    opt = build_muon(model, **MUON_KW)
    losses = _train(model, opt, model.tok_embeddings.weight.shape[0])
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _check_same(results, reference):
    """Sharded vs one process. The gradients differ by the reduction order of the sharded
    backward (reduce-scatter / TP partial sums: ~1e-7 relative in fp32); the gathered matrix is
    the same matrix, orthogonalised by the same code, so the bounds are the reference test's
    (Muon matrices atol 2e-6, AdamW parameters atol 2e-4, losses rtol 1e-6)."""
    ref_losses, ref_params = reference
    for losses, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
        for name, p in params.items():
            assert_params_close(
                p, ref_params[name], name, muon=p.dim() >= 2 and name.split(".")[0] not in ("tok_embeddings", "output")
            )


@pytest.mark.multiprocess
def test_simple_fsdp_two_gloo_ranks_equal_one_process():
    results = run_processes(2, _sharded_run, dict(dp_shard=2), 2, reference_state())
    _check_same(results, _one_process())


def test_tensor_parallel_two_ranks_equal_one_process():
    """TP 2 (thread ranks): wq/w1 Shard(0), wo/w2 Shard(1): full_tensor gathers either."""
    state = reference_state()  # in the main thread: the thread ranks share the global RNG
    results = run_threads(2, lambda: _sharded_run(dict(dp_shard=1, tp=2), 2, state))
    _check_same(results, _one_process())


# --- QK clip ---------------------------------------------------------------------------------------


def test_max_causal_logit_matches_dense():
    """Chunked tracking vs the dense masked score matrix (same fp32 products: exact up to the
    matmul blocking, rtol 1e-6), with GQA and with document masking."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 13, 8, generator=gen)
    k = torch.randn(2, 2, 13, 8, generator=gen)
    seg = torch.tensor([[0] * 6 + [1] * 7, [0] * 13])
    kk = k.repeat_interleave(2, dim=1)
    scores = q @ kk.transpose(-2, -1) / math.sqrt(8)
    causal = torch.ones(13, 13, dtype=torch.bool).tril()
    for segment_ids, mask in (
        (None, causal[None, None]),
        (seg, (causal & (seg[:, :, None] == seg[:, None, :]))[:, None]),
    ):
        dense = scores.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))
        torch.testing.assert_close(max_causal_logit(q, k, segment_ids, chunk=5), dense, rtol=1e-6, atol=0)


def _head_max(x, wq, wk, n_heads, head_dim):
    b, s, _ = x.shape
    q = (x @ wq.t()).view(b, s, n_heads, head_dim).transpose(1, 2)
    k = (x @ wk.t()).view(b, s, -1, head_dim).transpose(1, 2)
    return max_causal_logit(q, k)


@pytest.mark.parametrize("n_kv", [4, 2])
def test_gqa_clip_caps_every_head(n_kv):
    """After the clip each head's max logit on the same inputs is min(S_h, tau): the logit is
    bilinear in (W_q rows of h, W_k rows of its kv head), and the rule scales it by exactly
    gamma_h (fp32: rtol 1e-5); heads under tau keep their weights bit for bit."""
    n_heads, d, dim = 4, 8, 16
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 10, dim, generator=gen)
    wq = torch.randn(n_heads * d, dim, generator=gen) * torch.tensor([0.3, 1.0, 2.0, 0.5]).repeat_interleave(d)[:, None]
    wk = torch.randn(n_kv * d, dim, generator=gen)
    before = _head_max(x, wq, wk, n_heads, d)
    tau = float(before.sort().values[1])  # two or three heads over tau
    wq2, wk2 = wq.clone(), wk.clone()
    gqa_qk_clip_(wq2, wk2, before, tau)
    after = _head_max(x, wq2, wk2, n_heads, d)
    torch.testing.assert_close(after, torch.clamp(before, max=tau), rtol=1e-5, atol=0)
    under = (before <= tau).repeat_interleave(d)
    assert torch.equal(wq2[under], wq[under])
    if n_kv < n_heads:
        assert torch.equal(wk2, wk)  # GQA: the shared k heads are not touched


def test_mla_clip_caps_every_head():
    """MLA on tensors (DeepSeek-V3 layout, small): logit_h = (q_C.k_C + q_R.k_R) / sqrt(nope + rope)
    with k_R shared by all heads; q_C, k_C by sqrt(gamma), q_R by gamma scale the whole logit by
    gamma_h (RoPE is a linear map per position, so scaling q_R's rows commutes with it: the test
    leaves it out). After: max = min(S_h, tau), fp32 rtol 1e-5; v rows and k_R untouched."""
    h, nope, rope, vd, q_in, kv_lora, s = 3, 6, 4, 5, 12, 10, 9
    gen = torch.Generator().manual_seed(4)
    cq = torch.randn(2, s, q_in, generator=gen)
    ckv = torch.randn(2, s, kv_lora, generator=gen)
    k_rope = torch.randn(2, 1, s, rope, generator=gen)
    wq = (
        torch.randn(h * (nope + rope), q_in, generator=gen)
        * torch.tensor([0.5, 1.5, 3.0]).repeat_interleave(nope + rope)[:, None]
    )
    wkv_b = torch.randn(h * (nope + vd), kv_lora, generator=gen)

    def head_max(wq, wkv_b):
        q = (cq @ wq.t()).view(2, s, h, nope + rope).transpose(1, 2)
        kv = (ckv @ wkv_b.t()).view(2, s, h, nope + vd).transpose(1, 2)
        k = torch.cat([kv[..., :nope], k_rope.expand(2, h, s, rope)], dim=-1)
        return max_causal_logit(q, k)

    before = head_max(wq, wkv_b)
    tau = float(before.sort().values[0]) * 1.01
    weights = {"wq": wq.clone(), "wkv_b": wkv_b.clone()}
    mla_qk_clip_(weights, before, tau, n_heads=h, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=vd)
    after = head_max(weights["wq"], weights["wkv_b"])
    torch.testing.assert_close(after, torch.clamp(before, max=tau), rtol=1e-5, atol=0)
    v_rows = torch.zeros(h, nope + vd, dtype=torch.bool)
    v_rows[:, nope:] = True
    assert torch.equal(weights["wkv_b"][v_rows.reshape(-1)], wkv_b[v_rows.reshape(-1)])


def test_muon_step_applies_qk_clip():
    """Muon with QK clip = Muon without, then each layer's W_q rows of head h times gamma_h from
    the step's tracked max logits (GQA rule; the debug model has 16 q heads on 4 kv heads).
    The tracking reads the forward's own q and k, so gamma is exact; rtol 1e-6 (one fp32 multiply)."""
    state = reference_state()
    plain, clipped = _model(state=state), _model(state=state)
    tau = 1e-3  # below every head's max logit: every head is clipped
    opt_plain = build_muon(plain, **MUON_KW)
    opt_clip = build_muon(clipped, **MUON_KW, qk_clip_tau=tau)
    assert isinstance(opt_clip, Muon) and opt_clip.qk_clip is not None
    inputs, labels = batch(plain.tok_embeddings.weight.shape[0], seed=5)
    for model, opt in ((plain, opt_plain), (clipped, opt_clip)):
        opt.zero_grad()
        lm_loss(model(inputs), labels).backward()
        if model is clipped:
            maxes = [layer.attention.max_logit.clone() for layer in model.layers.values()]
        opt.step()
    assert all(layer.attention.max_logit is None for layer in clipped.layers.values())  # reset
    for layer_p, layer_c, s_h in zip(plain.layers.values(), clipped.layers.values(), maxes):
        gamma = torch.clamp(tau / s_h, max=1.0).repeat_interleave(layer_p.attention.head_dim)
        torch.testing.assert_close(
            layer_c.attention.wq.weight, layer_p.attention.wq.weight * gamma[:, None], rtol=1e-6, atol=0
        )
        assert torch.equal(layer_c.attention.wk.weight, layer_p.attention.wk.weight)


# --- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ([("optimizer.name", "sgd")], r"optimizer.name: 'sgd' is not allowed; allowed: adamw, muon"),
        ([("optimizer.muon_momentum", "1.0")], r"optimizer.muon_momentum: .*allowed: a number in \[0, 1\)"),
        ([("optimizer.muon_ns_dtype", "fp8")], r"optimizer.muon_ns_dtype: 'fp8' is not allowed"),
        ([("optimizer.muon_exclude", '["a.b"]')], r"optimizer.muon_exclude: .*allowed: a list of module-path"),
    ],
)
def test_bad_muon_config(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        build_config(None, overrides)


def test_qk_clip_needs_muon_and_no_qk_norm():
    """Without Muon: a rule of the step plan (tests/unit/test_step_plan.py), asserted here; qk_norm
    needs the built model (trainer/step/checks.py BUILD_CHECKS)."""
    with pytest.raises(AssertionError, match="RULES refuse it first"):
        build_optimizer_for(
            _model(args=llama3_args(1)),
            name="adamw",
            lr=1e-3,
            betas=BETAS,
            eps=EPS,
            weight_decay=0.0,
            qk_clip_tau=100.0,
        )
    qwen = Qwen3(dataclasses.replace(QWEN3_FLAVORS["debugmodel"], n_layers=1, max_seq_len=16))
    with pytest.raises(ConfigError, match=r"optimizer.qk_clip_tau: .*qk_norm"):
        QKClip(qwen, 100.0)


# --- graph mode ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_graph_step_matches_eager(scan):
    """The captured step (aot_eager) with Muon vs the eager step, 3 steps at a changing lr, on
    the reduced Llama 3 debug flavor (tests/support/graph_common.py), fp32 Newton-Schulz. With
    layer scan the NS runs batched over the stacked [n_layers, m, n] matrices.

    Bound: the graph computes the same ops with a tensor lr; gradients differ by fp32 summation
    order (~1e-7 relative), NS amplifies that at most ~480x on updates of entries ~lr*0.2 = 2e-4
    (lr 1e-3), i.e. ~1e-8; the AdamW parameters follow test_graph_step's 2e-6 (0.2 % of lr).
    Checked: parameters and the momentum buffers 2e-6, losses and gradient norms 1e-5 relative
    (the graph-step tests' bounds). One graph for the 3 steps."""
    from tests.support.graph_common import PLAN, batches, build_model, eager_step, max_param_diff, run
    from trainer.graph import build_graph_step

    kw = dict(MUON_KW, lr=1e-3)
    ref_model, model = build_model(2), build_model(2)
    ref_opt, opt = build_muon(ref_model, **kw), build_muon(model, **kw)
    step = build_graph_step(model=model, optimizer=opt, max_norm=1.0, backend="aot_eager", scan_layers=scan, plan=PLAN)
    data = batches(3)
    ref = run(eager_step(ref_model, ref_opt), ref_opt, data)
    got = run(step, opt, data)
    for (l1, n1), (l2, n2) in zip(ref, got):
        assert abs(l1 - l2) <= 1e-5 * abs(l1) and abs(n1 - n2) <= 1e-5 * abs(n1), (ref, got)
    assert max_param_diff(ref_model, model) <= 2e-6
    sa, sb = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for key in sa[i]:
            assert (sa[i][key].float().cpu() - sb[i][key].float().cpu()).abs().max() <= 2e-6, (i, key)
    assert step.capture.num_graphs == 1


def test_graph_step_asserts_no_qk_clip():
    """QK clip in graph mode is refused by the step plan's RULES (test_qk_clip_rules_refuse_before_building);
    the graph step asserts it."""
    from tests.support.graph_common import build_model
    from trainer.graph import build_graph_step

    model = build_model(1)
    opt = build_muon(model, **MUON_KW, qk_clip_tau=100.0)
    with pytest.raises(AssertionError, match="RULES refuse it first"):
        build_graph_step(model=model, optimizer=opt, max_norm=1.0, backend="aot_eager")


def _graph_fsdp_on_rank(state, scan):
    import torch.distributed as dist

    from tests.unit.test_graph_fsdp import _fsdp_model, _lr, _train
    from trainer.graph import build_graph_step

    dims = ParallelDims(world_size=2, dp_shard=2)
    mesh = build_mesh(dims, "cpu")
    model = _fsdp_model(state, mesh, dims)
    opt = build_muon(model, **dict(MUON_KW, lr=_lr(0)))
    step = build_graph_step(
        model=model, optimizer=opt, max_norm=1.0, backend="aot_eager", scan_layers=scan, plan=FAMILIES["llama3"][2]
    )
    losses = _train(step, dist.get_rank())
    return losses, {n: full(p).detach().clone() for n, p in model.named_parameters()}, dict(step.stats.collectives)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    "scan",
    [
        False,
        # Scanned Muon in graph mode: test_graph_step_matches_eager[scan]; its uneven stacked shards:
        # test_graph_muon_update_of_sharded_matrices.
        pytest.param(True, marks=pytest.mark.exhaustive),
    ],
    ids=["unrolled", "scan"],
)
def test_graph_step_simple_fsdp_two_gloo_ranks(scan):
    """Graph mode + SimpleFSDP (dp_shard 2, gloo) + Muon vs one eager process, 3 steps with
    clipping at a changing lr (tests/unit/test_graph_fsdp.py's setup). The Muon matrices are
    all-gathered inside the graph: one extra all-gather per Muon matrix (per stacked matrix with
    scan). Bounds: the sharded tests' (Muon matrices 2e-6, AdamW parameters 2e-4, losses 1e-5
    relative as in test_graph_fsdp)."""
    from tests.unit.test_graph_fsdp import STEPS, _lr

    state = reference_state(n_layers=2)
    model = _model(state=state)
    opt = build_muon(model, **dict(MUON_KW, lr=_lr(0)))
    ref_losses = []
    for s in range(STEPS):
        inputs, labels = batch(4096, batch_size=4, seed=s)
        for g in opt.param_groups:
            g["lr"] = _lr(s)
        opt.zero_grad()
        loss = lm_loss(model(inputs), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ref_losses.append(loss.item())
    losses, params, collectives = run_processes(2, _graph_fsdp_on_rank, state, scan)[0]
    for a, b in zip(ref_losses, losses):
        assert abs(a - b) <= 1e-5 * abs(a), (ref_losses, losses)
    for name, p in model.named_parameters():
        assert_params_close(
            params[name], p.detach(), name, muon=p.dim() >= 2 and name.split(".")[0] not in ("tok_embeddings", "output")
        )
    # Muon reaches whole matrices by all-to-alls (trainer.graph.optim._orthogonalize_spread,
    # counted in test_graph_muon_update_of_sharded_matrices), never by gathering them: the only
    # all-gathers are SimpleFSDP's parameter gathers, 2 layers x 9 + 3 (unrolled: the forward's;
    # scan: the body's forward and its recompute in the backward body, 9 + 9, + 3). Gathering the
    # Muon matrices would add 14 (unrolled) or 7 (stacked).
    assert collectives["all_gather_into_tensor"] == 21, collectives
    assert collectives["all_to_all_single"] >= 2 * 7 * (1 if scan else 2), collectives


MUON_LAYOUTS = {
    # name: (whole shape, mesh shape, placements' dims (one per mesh axis), collectives expected)
    "matrix": ((5, 8), (4,), (0,), {"all_to_all_single": 2}),  # one matrix: rows 2, 2, 1, 0
    "stacked": ((3, 5, 8), (4,), (1,), {"all_to_all_single": 2}),  # [layers, rows, cols]: 3 over 4
    "columns": ((3, 8, 5), (4,), (2,), {"all_to_all_single": 2}),  # the other matrix dim
    "layers": ((6, 5, 8), (4,), (0,), {}),  # a leading dim: whole matrices already, no traffic
    "experts_and_rows": ((4, 6, 5), (2, 2), (0, 1), {"all_to_all_single": 2}),
    "rows_and_columns": ((3, 6, 5), (2, 2), (1, 2), {"all_gather_tensor": 1, "all_to_all_single": 2}),
}


def _sharded_muon_on_rank(tensors: dict):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainer.graph import optim
    from trainer.graph.optim import muon_shards, muon_update_

    calls: dict[str, int] = {}
    funcol = optim.funcol
    for op in ("all_gather_tensor", "all_to_all_single"):

        def counted(*args, _op=getattr(funcol, op), _name=op, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _op(*args, **kwargs)

        setattr(funcol, op, counted)
    out = {}
    for layout, (param, grad, buf) in tensors.items():
        _, mesh_shape, dims, _ = MUON_LAYOUTS[layout]
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("a", "b")[: len(mesh_shape)])
        p, g, b = (distribute_tensor(t, mesh, [Shard(d) for d in dims]) for t in (param, grad, buf))
        calls.clear()
        local = p.to_local().clone()
        muon_update_(
            local,
            g.to_local(),
            b.to_local().clone(),
            lr=torch.tensor(0.1),
            momentum=0.95,
            nesterov=True,
            ns_steps=5,
            ns_dtype="float32",
            weight_decay=0.1,
            shards=muon_shards(p),
        )
        out[layout] = (local, dict(calls))
    return dist.get_rank(), out


@pytest.mark.multiprocess
def test_graph_muon_update_of_sharded_matrices():
    """Graph-mode Muon on every way a matrix stack can be sharded (MUON_LAYOUTS), 4 gloo ranks,
    against the same update on the whole tensor in one process: uneven rows (5 over 4 ranks:
    DTensor chunks of 2, 2, 1 and 0, as Kimi K2's `wq_a` over 1024 FSDP ranks), fewer matrices
    than ranks (3 layers over 4: the all-to-all pads with zero matrices), the column dim, a
    leading dim (no collective at all), and 2-D meshes. Bound: the same float32 ops on the same
    whole matrices (padding is cut off before it is used, zeros stay zeros), so equal to
    rounding, 1e-6. The collectives are counted: two all-to-alls per sharded stack (there and
    back), a gather only for a second sharded matrix dim, never a gather of the whole stack."""
    from trainer.graph.optim import muon_update_

    gen = torch.Generator().manual_seed(0)
    tensors, wants = {}, {}
    for layout, (shape, *_) in MUON_LAYOUTS.items():
        param, grad, buf = (torch.randn(shape, generator=gen) for _ in range(3))
        tensors[layout] = (param, grad, buf)
        wants[layout] = param.clone()
        muon_update_(
            wants[layout],
            grad,
            buf.clone(),
            lr=torch.tensor(0.1),
            momentum=0.95,
            nesterov=True,
            ns_steps=5,
            ns_dtype="float32",
            weight_decay=0.1,
        )
    results = dict(run_processes(4, _sharded_muon_on_rank, tensors))
    assert [results[r]["matrix"][0].shape[0] for r in range(4)] == [2, 2, 1, 0]
    for layout, (_, mesh_shape, dims, expected) in MUON_LAYOUTS.items():
        for rank in range(4):
            local, calls = results[rank][layout]
            coords = torch.arange(4).reshape(mesh_shape).eq(rank).nonzero()[0].tolist()
            piece = wants[layout]
            for axis, dim in enumerate(dims):
                chunks = torch.chunk(piece, mesh_shape[axis], dim=dim)
                piece = chunks[coords[axis]] if coords[axis] < len(chunks) else piece.narrow(dim, 0, 0)
            assert calls == expected, (layout, rank, calls)
            torch.testing.assert_close(local, piece, atol=1e-6, rtol=0, msg=f"{layout}, rank {rank}")


def test_checkpoint_state_round_trip():
    """Muon's state through DCP's optimizer state dict (what trainer/checkpoint saves): a fresh
    optimizer loaded from it continues bit for bit (same ops on the same values), with both
    kinds of state (momentum_buffer; step, exp_avg, exp_avg_sq) present."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = reference_state(n_layers=1)
    args = llama3_args(1)
    a, b = _model(args=args, state=state), _model(args=args, state=state)
    opt_a, opt_b = build_muon(a, **MUON_KW), build_muon(b, **MUON_KW)
    vocab = a.tok_embeddings.weight.shape[0]
    _train(a, opt_a, vocab, steps=1)
    saved = copy.deepcopy(get_optimizer_state_dict(a, opt_a))  # its tensors alias opt_a's state
    keys = {k for v in saved["state"].values() for k in v}
    assert keys == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}, keys
    b.load_state_dict(a.state_dict())
    set_optimizer_state_dict(b, opt_b, saved)
    _train(a, opt_a, vocab, steps=1)
    _train(b, opt_b, vocab, steps=1)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def _qk_clip_run(degrees: dict, world_size: int, state: dict, tau: float):
    """On a rank: 2 Muon + QK clip steps; each rank sees its own half of the batch (dp), so the
    max logits must be all-reduced for the ranks to clip alike."""
    import torch.distributed as dist

    model = _parallel_llama(degrees, world_size, state)
    opt = build_muon(model, **MUON_KW, qk_clip_tau=tau)
    rank = dist.get_rank()
    for i in range(2):
        inputs, labels = batch(4096, seed=10 + i)
        opt.zero_grad(set_to_none=True)
        lm_loss(model(inputs[2 * rank : 2 * rank + 2]), labels[2 * rank : 2 * rank + 2]).backward()
        opt.step()
    return {n: full(p.detach()).clone() for n, p in model.named_parameters() if "attention.w" in n}


def test_qk_clip_simple_fsdp_two_ranks_equal_one_process():
    """QK clip under SimpleFSDP (dp_shard 2, thread ranks, each rank half the batch): the max
    logits are all-reduced (MAX) and each rank scales its own rows of the Shard(0) W_q. Equal
    to one process on the whole batch within the sharded tests' bound (2e-6; the clip is one
    fp32 multiply per row). tau 0.3 sits inside the heads' max-logit range of the first step
    (0.24-0.47 at init on this model), so some heads are clipped and others not."""
    state = reference_state()
    tau = 0.3
    model = _model(state=state)
    opt = build_muon(model, **MUON_KW, qk_clip_tau=tau)
    clipped = 0
    for i in range(2):
        inputs, labels = batch(4096, seed=10 + i)
        opt.zero_grad(set_to_none=True)
        lm_loss(model(inputs), labels).backward()
        clipped += sum(int((layer.attention.max_logit > tau).sum()) for layer in model.layers.values())
        opt.step()
    assert 0 < clipped < 2 * 2 * 16
    results = run_threads(2, lambda: _qk_clip_run(dict(dp_shard=2), 2, state, tau))
    ref = dict(model.named_parameters())
    for params in results:
        for name, p in params.items():
            torch.testing.assert_close(p, ref[name].detach(), atol=2e-6, rtol=0, msg=name)


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (
            [("optimizer.name", "muon"), ("optimizer.qk_clip_tau", "100"), ("compile.mode", "graph")],
            r"optimizer.qk_clip_tau: > 0 runs in the eager step only",
        ),
        (
            [
                ("optimizer.name", "muon"),
                ("optimizer.qk_clip_tau", "100"),
                ("parallelism.context_parallel_degree", "2"),
            ],
            r"optimizer.qk_clip_tau: > 0 with context parallelism is not implemented",
        ),
        ([("optimizer.qk_clip_tau", "100")], r"optimizer.qk_clip_tau: > 0 is MuonClip, part of the Muon step"),
    ],
)
def test_qk_clip_rules_refuse_before_building(overrides, pattern):
    """The step plan's RULES refuse QK clip without Muon, with graph mode and with CP (read before
    anything is built)."""
    from trainer.job import plan_job

    cfg = build_config("configs/llama3_debug.toml", overrides)
    with pytest.raises(ConfigError, match=pattern):
        plan_job(cfg, world_size=2, device_type="cpu")


@pytest.mark.parametrize("recipe", ["configs/llama3_debug.toml", "configs/deepseek_v3_debug.toml"])
def test_qk_clip_plans_with_tensor_parallelism(recipe):
    """QK clip with TP 2 (and MLA) passes the step plan's RULES (tests/unit/test_qk_clip.py runs it)."""
    from trainer.job import plan_job

    cfg = build_config(
        recipe,
        [("optimizer.name", "muon"), ("optimizer.qk_clip_tau", "100"), ("parallelism.tensor_parallel_degree", "2")],
    )
    plan_job(cfg, world_size=2, device_type="cpu")


def _moe_args():
    return dataclasses.replace(QWEN3_FLAVORS["debugmodel_moe"], n_layers=1, max_seq_len=16)


def _moe_ep_run(state: dict):
    """On a rank: Qwen 3 MoE (1 layer) with EP 2 inside dp_shard 2, fp32, Muon 2 steps, each
    rank its half of the batch. Experts [E, out, in] are Shard(0) over ep: full_tensor gathers
    all experts and the batched NS runs per expert."""
    import torch.distributed as dist

    dims = ParallelDims(world_size=2, dp_shard=2, ep=2)
    model, _ = parallel_fp32_model(Qwen3, _moe_args(), FAMILIES["qwen3"][2], dims, state)
    opt = build_muon(model, **MUON_KW)
    rank = dist.get_rank()
    for i in range(2):
        inputs, labels = batch(_moe_args().vocab_size, seed=10 + i)
        opt.zero_grad(set_to_none=True)
        lm_loss(model(inputs[2 * rank : 2 * rank + 2]), labels[2 * rank : 2 * rank + 2]).backward()
        opt.step()
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def test_expert_parallel_two_ranks_equal_one_process():
    """MoE experts under EP 2 (thread ranks) vs one process on the whole batch, 2 steps. Bounds
    of the sharded tests (Muon matrices 2e-6, AdamW parameters 2e-4): the data-parallel mean of
    the two halves' gradients is the whole batch's gradient up to fp32 summation order."""
    torch.manual_seed(0)
    ref = Qwen3(_moe_args())
    with torch.no_grad():
        ref.init_weights()
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    opt = build_muon(ref, **MUON_KW)
    for i in range(2):
        inputs, labels = batch(_moe_args().vocab_size, seed=10 + i)
        opt.zero_grad(set_to_none=True)
        lm_loss(ref(inputs), labels).backward()
        opt.step()
    want = dict(ref.named_parameters())
    for params in run_threads(2, lambda: _moe_ep_run(state)):
        for name, p in params.items():
            assert_params_close(
                p,
                want[name].detach(),
                name,
                muon=want[name].dim() >= 2 and not {"tok_embeddings", "output", "gate"} & set(name.split(".")),
            )
