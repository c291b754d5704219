"""MuonClip's QK clip on MLA (DeepSeek-V3) and under tensor parallelism (trainer/optim/qk_clip.py).

- MLA's tracked max logit = a plain recomputation of softmax_scale * q.k (YaRN mscale included)
  from the module's inputs and weights; tracking does not change the forward's output.
- DeepSeek-V3 + Muon + QK clip = Muon without the clip, then the published MLA rule written out
  here per head (q_C, k_C x sqrt(gamma), q_R x gamma); heads under tau bit-unchanged.
- With lr = 0 (the step is the clip alone) the recomputed max logit of every clipped head on the
  same inputs is tau, and the others are unchanged.
- SimpleFSDP (dp_shard 2), TP 2 and dp_shard 2 x TP 2 (thread ranks, each data-parallel rank its
  share of the batch) = one process on the whole batch: Llama 3 (GQA and MHA) and DeepSeek-V3
  (MLA); MLA under TP 2 also on 2 gloo processes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from models.common.rope import apply_rope
from models.deepseek_v3 import FLAVORS as DS_FLAVORS
from models.deepseek_v3 import DeepSeekV3
from models.deepseek_v3.model import MLA
from models.deepseek_v3.plan import PLAN as DS_PLAN
from parallelisms import ParallelDims
from tests.support.parallel_harness import (
    FAMILIES,
    batch,
    full,
    llama3_args,
    lm_loss,
    parallel_fp32_model,
    run_processes,
    run_threads,
)
from trainer.optim.muon import build_muon
from trainer.optim.qk_clip import QKClip, clip_factors

LR, WD = 2e-2, 0.1
MUON_KW = dict(
    lr=LR,
    weight_decay=WD,
    betas=(0.9, 0.95),
    eps=1e-8,
    momentum=0.95,
    nesterov=True,
    ns_steps=5,
    ns_dtype="float32",
    exclude=("tok_embeddings", "output", "gate"),
)


def ds_args(q_lora: bool = True):
    """DeepSeek-V3 debug sizes (8 heads, nope 32 + rope 16, v 32, YaRN factor 4: softmax_scale
    carries mscale**2 = 1.30), one dense and one MoE block (QK clip must find the MLA of both
    stacks)."""
    return dataclasses.replace(
        DS_FLAVORS["debugmodel"], n_layers=2, n_dense_layers=1, max_seq_len=16, q_lora_rank=64 if q_lora else 0
    )


def mha_args():
    return dataclasses.replace(llama3_args(2), n_kv_heads=llama3_args(2).n_heads)


MODELS = {
    "mla_lora_q": (DeepSeekV3, lambda: ds_args(True), DS_PLAN),
    "mla_full_q": (DeepSeekV3, lambda: ds_args(False), DS_PLAN),
    "gqa": (FAMILIES["llama3"][0], lambda: llama3_args(2), FAMILIES["llama3"][2]),
    "mha": (FAMILIES["llama3"][0], mha_args, FAMILIES["llama3"][2]),
}


def initial_state(key: str) -> dict[str, torch.Tensor]:
    cls, make_args, _ = MODELS[key]
    torch.manual_seed(0)
    model = cls(make_args())
    with torch.no_grad():
        model.init_weights()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def one_process(key: str, state: dict) -> torch.nn.Module:
    cls, make_args, _ = MODELS[key]
    model = cls(make_args())
    model.load_state_dict(state)
    return model


def q_weight(m: MLA) -> torch.Tensor:
    return m.wq_b.weight if m.q_lora_rank > 0 else m.wq.weight


@torch.no_grad()
def reference_mla_logits(m: MLA, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The published MLA logit, written out: per head, softmax_scale * (q_C.k_C + q_R.k_R) with k_R
    one rotary key for all heads; causal; fp32 [bs, heads, seq, seq] (-inf above the diagonal)."""
    bs, s, _ = x.shape
    nope, rope = m.qk_nope_head_dim, m.qk_rope_head_dim
    q_in = m.q_norm(x @ m.wq_a.weight.t()) if m.q_lora_rank > 0 else x
    q = (q_in @ q_weight(m).t()).view(bs, s, -1, nope + rope)
    latent = x @ m.wkv_a.weight.t()
    c_kv, k_r = latent[..., : m.kv_lora_rank], latent[..., m.kv_lora_rank :]
    kv = (m.kv_norm(c_kv) @ m.wkv_b.weight.t()).view(bs, s, -1, nope + m.v_head_dim)
    q_r, k_r = apply_rope(q[..., nope:], k_r[:, :, None, :], cos, sin)
    scores = (
        torch.einsum("bqhd,bkhd->bhqk", q[..., :nope], kv[..., :nope])
        + torch.einsum("bqhd,bkd->bhqk", q_r, k_r[:, :, 0])
    ) * m.softmax_scale
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf"))


def capture_attention_inputs(model: torch.nn.Module) -> dict[MLA, tuple]:
    """Each MLA module's forward inputs (x, rope_cos, rope_sin) of the next forward."""
    seen: dict[MLA, tuple] = {}
    for m in model.modules():
        if isinstance(m, MLA):
            m.register_forward_pre_hook(lambda mod, args: seen.__setitem__(mod, tuple(a.detach() for a in args[:3])))
    return seen


@pytest.mark.parametrize("key", ["mla_lora_q", "mla_full_q"])
def test_mla_tracks_the_softmax_logit(key):
    """The tracked max = the reference logits' max per head. Both are fp32 sums of 48 products
    (different order; the model pre-scales q by softmax_scale*sqrt(48) and the tracker divides by
    sqrt(48)): a few ulps of the ~1-size logits, rtol 1e-5. The output with tracking on is
    bit-identical to off (the tracking reads detached q and k, then the same op runs)."""
    model = one_process(key, initial_state(key))
    tokens, _ = batch(model.tok_embeddings.weight.shape[0], seed=3)
    inputs = capture_attention_inputs(model)
    with torch.no_grad():
        off = model(tokens)
        QKClip(model, 100.0)
        on = model(tokens)
    assert torch.equal(on, off)
    for m, (x, cos, sin) in inputs.items():
        ref = reference_mla_logits(m, x, cos, sin).amax(dim=(0, 2, 3))
        torch.testing.assert_close(m.max_logit, ref, rtol=1e-5, atol=0)


def test_clip_factors_leave_heads_under_tau_alone():
    """gamma = tau / S over tau, exactly 1 at or under it, including negative and -inf maxima
    (min(1, tau / S) would flip or zero those heads' weights)."""
    s = torch.tensor([4.0, 2.0, 1.0, -3.0, float("-inf")])
    assert torch.equal(clip_factors(s, 2.0), torch.tensor([0.5, 1.0, 1.0, 1.0, 1.0]))


def reference_mla_rule_(m: MLA, s_h: torch.Tensor, tau: float) -> None:
    """Kimi K2's MLA rule, head by head on the module's full weights: q_C and k_C rows x
    sqrt(gamma_h), q_R rows x gamma_h, v rows and the shared rotary key (wkv_a) untouched."""
    nope, rope, vd = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    wq, wkv_b = q_weight(m), m.wkv_b.weight
    with torch.no_grad():
        for h, s in enumerate(s_h.tolist()):
            if s <= tau:
                continue
            gamma = tau / s
            wq[h * (nope + rope) : h * (nope + rope) + nope] *= math.sqrt(gamma)
            wq[h * (nope + rope) + nope : (h + 1) * (nope + rope)] *= gamma
            wkv_b[h * (nope + vd) : h * (nope + vd) + nope] *= math.sqrt(gamma)


def _step(model, opt, seed, rows=slice(None)):
    inputs, labels = batch(model.tok_embeddings.weight.shape[0], seed=seed)
    opt.zero_grad(set_to_none=True)
    lm_loss(model(inputs[rows]), labels[rows]).backward()
    opt.step()


def _tau_inside(s: torch.Tensor) -> float:
    """Halfway between the two middle maxima of the heads: half of the heads are clipped, and no
    head sits within rounding of tau."""
    v = s.flatten().sort().values
    return float(v[v.numel() // 2 - 1] + v[v.numel() // 2]) / 2


@pytest.mark.parametrize("key", ["mla_lora_q", "mla_full_q"])
def test_deepseek_muon_clip_matches_reference_rule(key):
    """DeepSeek-V3 (2 MLA layers): Muon + QK clip = Muon alone then `reference_mla_rule_` with the
    maxima recomputed by `reference_mla_logits` on the step's own attention inputs. The gammas
    differ by the maxima's rtol 1e-5 (above): W_q / W_kv_b within rtol 2e-5 + atol 1e-7 (the
    weights are ~0.02, far from zero only via the Muon update); every other parameter, and the
    rows of heads under tau, bit-equal to the plain step."""
    state = initial_state(key)
    plain, clipped = one_process(key, state), one_process(key, state)
    inputs = capture_attention_inputs(plain)
    with torch.no_grad():  # the step's attention inputs and maxima, before its update
        plain(batch(plain.tok_embeddings.weight.shape[0], seed=5)[0])
        s_ref = {m: reference_mla_logits(m, *inputs[m]).amax(dim=(0, 2, 3)) for m in inputs}
    opt_plain = build_muon(plain, **MUON_KW)
    _step(plain, opt_plain, seed=5)
    tau = _tau_inside(torch.stack(list(s_ref.values())))
    opt_clip = build_muon(clipped, **MUON_KW, qk_clip_tau=tau)
    _step(clipped, opt_clip, seed=5)
    plain_mla = [m for m in plain.modules() if isinstance(m, MLA)]
    for m in plain_mla:
        reference_mla_rule_(m, s_ref[m], tau)
    clip_params = dict(clipped.named_parameters())
    for name, p in plain.named_parameters():
        if name.endswith(("wq.weight", "wq_b.weight", "wkv_b.weight")):
            torch.testing.assert_close(clip_params[name], p, rtol=2e-5, atol=1e-7, msg=name)
        else:
            assert torch.equal(clip_params[name], p), name
    for m_plain, m_clip in zip(plain_mla, (m for m in clipped.modules() if isinstance(m, MLA))):
        under = s_ref[m_plain] <= tau * (1 - 1e-5)
        rows_q = under.repeat_interleave(m_plain.qk_head_dim)
        assert torch.equal(q_weight(m_clip)[rows_q], q_weight(m_plain)[rows_q])
        rows_kv = under.repeat_interleave(m_plain.qk_nope_head_dim + m_plain.v_head_dim)
        assert torch.equal(m_clip.wkv_b.weight[rows_kv], m_plain.wkv_b.weight[rows_kv])


def test_deepseek_clip_caps_recomputed_logits():
    """lr = 0 and no weight decay: the Muon step leaves the weights bit-unchanged, so the step is
    the clip alone. On the same attention inputs, every clipped head's recomputed max logit is
    tau (gamma_h * S_h: a product of fp32 roundings, rtol 1e-5) and never above tau * (1 + 1e-5);
    heads under tau keep bit-identical logits."""
    model = one_process("mla_lora_q", initial_state("mla_lora_q"))
    inputs = capture_attention_inputs(model)
    with torch.no_grad():
        model(batch(model.tok_embeddings.weight.shape[0], seed=5)[0])
    before = {m: reference_mla_logits(m, *inputs[m]) for m in inputs}
    tau = _tau_inside(torch.stack([s.amax(dim=(0, 2, 3)) for s in before.values()]))
    opt = build_muon(model, **{**MUON_KW, "lr": 0.0, "weight_decay": 0.0}, qk_clip_tau=tau)
    assert len(opt.qk_clip.modules) == 2
    _step(model, opt, seed=5)
    clipped = 0
    for m, logits in before.items():
        s_before = logits.amax(dim=(0, 2, 3))
        after = reference_mla_logits(m, *inputs[m])
        s_after = after.amax(dim=(0, 2, 3))
        over = s_before > tau
        clipped += int(over.sum())
        assert (s_after <= tau * (1 + 1e-5)).all()
        torch.testing.assert_close(s_after[over], torch.full_like(s_after[over], tau), rtol=1e-5, atol=0)
        assert torch.equal(after[:, ~over], logits[:, ~over])
    assert 0 < clipped < 2 * 8


# --- sharded vs one process ------------------------------------------------------------------------


def parallel_model(key: str, degrees: dict, world_size: int, state: dict):
    """On a rank: model `key` parallelized under `degrees` (fp32), holding `state`, and the
    rank's data-parallel coordinate."""
    cls, make_args, plan = MODELS[key]
    dims = ParallelDims(world_size=world_size, **degrees)
    model, mesh = parallel_fp32_model(cls, make_args(), plan, dims, state)
    return model, dims.dp_rank(mesh), dims.dp_shard * dims.dp_replicate


def _sharded_clip_run(key: str, degrees: dict, world_size: int, state: dict, tau: float):
    """2 Muon + QK clip steps; each data-parallel rank its share of the 4-sequence batch."""
    model, dp_rank, dp = parallel_model(key, degrees, world_size, state)
    opt = build_muon(model, **MUON_KW, qk_clip_tau=tau)
    per = 4 // dp
    for i in range(2):
        _step(model, opt, seed=10 + i, rows=slice(per * dp_rank, per * (dp_rank + 1)))
    return {n: full(p.detach()).clone() for n, p in model.named_parameters() if "attention." in n}


def _one_process_clip(key: str, state: dict):
    """The same 2 steps on one process (whole batch); the tau inside the first step's maxima."""
    model = one_process(key, state)
    probe = one_process(key, state)
    tracking = QKClip(probe, 1.0)
    with torch.no_grad():
        probe(batch(model.tok_embeddings.weight.shape[0], seed=10)[0])
    s = torch.stack([m.max_logit for m in tracking.modules])
    tau = _tau_inside(s)
    opt = build_muon(model, **MUON_KW, qk_clip_tau=tau)
    clipped = 0
    for i in range(2):
        inputs, labels = batch(model.tok_embeddings.weight.shape[0], seed=10 + i)
        opt.zero_grad(set_to_none=True)
        lm_loss(model(inputs), labels).backward()
        clipped += sum(int((m.max_logit > tau).sum()) for m in opt.qk_clip.modules)
        opt.step()
    assert 0 < clipped < 2 * s.numel(), (clipped, s.numel())
    return tau, dict(model.named_parameters())


def _check_against_one_process(key, degrees, world_size, processes=False):
    """Sharded = one process within the sharded Muon tests' bounds (tests/unit/test_muon.py
    `_check_same`): the attention matrices (Muon) atol 2e-6, reduction-order gradient differences
    through Newton-Schulz, plus the clip's one fp32 multiply per row with gammas from maxima equal
    to ~1e-7 relative; MLA's latent norm weights (AdamW, whose first steps are ~lr-sized
    sign-like updates of tiny-gradient entries) atol 2e-4."""
    state = initial_state(key)  # in the main thread: the thread ranks share the global RNG
    tau, ref = _one_process_clip(key, state)
    if processes:
        results = run_processes(world_size, _sharded_clip_run, key, degrees, world_size, state, tau)
    else:
        results = run_threads(world_size, lambda: _sharded_clip_run(key, degrees, world_size, state, tau))
    for params in results:
        assert params
        for name, p in params.items():
            atol = 2e-6 if p.dim() >= 2 else 2e-4
            torch.testing.assert_close(p, ref[name].detach(), atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("key", ["mla_lora_q", "mla_full_q"])
def test_deepseek_clip_simple_fsdp_two_ranks_equal_one_process(key):
    _check_against_one_process(key, dict(dp_shard=2), 2)


@pytest.mark.parametrize("key", ["mla_lora_q", "mla_full_q", "gqa", "mha"])
def test_clip_tensor_parallel_two_ranks_equal_one_process(key):
    """TP 2: each rank tracks its own 4 (MLA) / 8 (Llama) heads; the maxima meet in one all-reduce
    at their heads' offsets and each rank scales its Shard(0) rows."""
    _check_against_one_process(key, dict(dp_shard=1, tp=2), 2)


@pytest.mark.parametrize("key", ["mla_lora_q", "gqa"])
def test_clip_fsdp_and_tensor_parallel_four_ranks_equal_one_process(key):
    """dp_shard 2 x TP 2: the rows are TP-sharded then FSDP-sharded (_StridedShard); the scale is
    distributed with the weight's own placements."""
    _check_against_one_process(key, dict(dp_shard=2, tp=2), 4)


@pytest.mark.multiprocess
def test_deepseek_clip_tensor_parallel_two_gloo_processes():
    """The MLA TP case on 2 gloo processes (the thread tests' all-reduce is the threaded backend's)."""
    _check_against_one_process("mla_lora_q", dict(dp_shard=1, tp=2), 2, processes=True)
