"""DeepSeek-V4's lightning-indexer loss (`[model] indexer_loss_weight` > 0; models/deepseek_v4/model.py
`indexer_kl`, trainer/tasks/lm.py `IndexerLoss`): DeepSeek-V3.2's KL objective, sparse stage.

(a) the KL against a float64 by-hand computation, the target against a dense by-hand softmax;
(b) the KL's gradient reaches the indexers' parameters and nothing else; FSDP and EP x FSDP match one
    process with it (scheduled tier);
(c) the main model's gradients (and the loss value) are those of a run without it, bit for bit;
(d) the FLOPs per token count the trained indexer (6x its scores, 4x its parameters);
(e) the keys are checked and refused with TP / the engine; a debug run logs `indexer_loss`;
(f) a vector aux term ([MoE balance, KL]) sums per element through the stack's scan;
(g) graph mode (layer scan after the hash prefix) equals the eager step (scheduled tier).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from models.deepseek_v4 import FLAVORS, DeepSeekV4
from models.deepseek_v4.model import compressed_sink_attention, indexer_kl
from trainer.step.loss import lm_loss_fn
from trainer.tasks.lm import IndexerLoss


def _args(weight: float = 0.5, **kw):
    """The debug flavor's block schedule (HCA, CSA, sliding, CSA; two hash-routed blocks) at a
    quarter of its width, 32 tokens: windows of 8, 8 CSA entries of which a query keeps 2, 2 HCA
    entries, so the selection leaves entries out and rows without entries exist."""
    small = dict(
        dim=32,
        n_heads=2,
        head_dim=16,
        rope_head_dim=8,
        q_lora_rank=16,
        o_lora_rank=16,
        vocab_size=512,
        sliding_window=8,
        hca_ratio=16,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=2,
        max_seq_len=32,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        num_experts=4,
        moe_hidden_dim=32,
    )
    return dataclasses.replace(FLAVORS["debugmodel"], indexer_loss_weight=weight, **{**small, **kw})


def _model(weight: float = 0.5, seed: int = 0, **kw) -> DeepSeekV4:
    torch.manual_seed(seed)
    model = DeepSeekV4(_args(weight, **kw))
    model.init_weights()
    return model


def _tokens(seed: int = 1, b: int = 2, s: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 512, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _loss_fn(model: DeepSeekV4):
    plain = lm_loss_fn(fused=False)
    if not model.args.trains_indexer:
        return plain
    return IndexerLoss(plain, weight=model.args.indexer_loss_weight, blocks=model.args.layer_kinds().count("c"))


def test_kl_matches_a_by_hand_computation():
    """(a) `indexer_kl` against loops in float64: per query with a non-empty chosen set S, p = the
    target over S divided by its sum, q = softmax of the scores over S, KL = sum_S p log(p / q)
    (0 log 0 = 0: one chosen entry has target 0), the mean over those queries (two queries choose
    nothing and are left out). fp32 against fp64 over a handful of terms of size ~1: 1e-5 relative."""
    g = torch.Generator().manual_seed(0)
    b, s, n = 2, 5, 6
    scores = torch.randn(b, s, n, generator=g) * 3
    target = torch.rand(b, s, n, generator=g)
    chosen = torch.rand(b, s, n, generator=g) < 0.5
    chosen[0, 0] = False
    chosen[1, 2] = False
    chosen[1, 3] = False
    chosen[1, 3, 1] = chosen[1, 3, 4] = True
    target[1, 3, 4] = 0.0
    total, rows = 0.0, 0
    for i in range(b):
        for t in range(s):
            idx = [j for j in range(n) if chosen[i, t, j]]
            if not idx:
                continue
            rows += 1
            p = [float(target[i, t, j]) for j in idx]
            p = [v / sum(p) for v in p]
            logits = [float(scores[i, t, j]) for j in idx]
            top = max(logits)
            log_z = top + math.log(sum(math.exp(v - top) for v in logits))
            total += sum(pj * (math.log(pj) - (lj - log_z)) for pj, lj in zip(p, logits) if pj > 0)
    assert rows == b * s - 2
    got = indexer_kl(scores, target, chosen)
    assert float(got) == pytest.approx(total / rows, rel=1e-5)
    assert float(got) > 0.1  # the distributions differ: the comparison is not of two zeros
    same = indexer_kl(target.clamp_min(1e-30).log(), target, chosen)  # q = p: KL 0 (fp32 rounding)
    assert abs(float(same)) < 1e-6


def test_target_is_the_attention_on_the_entries_summed_over_heads():
    """(a) `compressed_sink_attention(..., entry_probs=True)`'s target against a dense by-hand
    attention in float64: logits q.k / sqrt(d) over the causal window's keys and the visible
    entries plus the sink logit, one softmax per head; the entries' columns summed over the heads.
    fp32 probabilities of ~0.1 against fp64: 1e-6 absolute. The output is the same as without."""
    g = torch.Generator().manual_seed(0)
    b, s, h, d, n, w = 2, 12, 3, 8, 4, 4
    q, kv = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, d, generator=g)
    entries, sinks = torch.randn(b, n, d, generator=g), torch.randn(h, generator=g)
    visible = torch.rand(b, s, n, generator=g) < 0.6
    out, target = compressed_sink_attention(q, kv, entries, sinks, visible, w, entry_probs=True)
    torch.testing.assert_close(out, compressed_sink_attention(q, kv, entries, sinks, visible, w), rtol=0, atol=0)
    t, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    local = (j <= t) & (j > t - w)  # [s, s]
    qd, kd, ed = q.double(), kv.double(), entries.double()
    key_logits = torch.einsum("bshd,bjd->bshj", qd, kd) / math.sqrt(d)
    key_logits = key_logits.masked_fill(~local[None, :, None, :], float("-inf"))
    entry_logits = torch.einsum("bshd,bnd->bshn", qd, ed) / math.sqrt(d)
    entry_logits = entry_logits.masked_fill(~visible[:, :, None, :], float("-inf"))
    sink = sinks.double().view(1, 1, h, 1).expand(b, s, h, 1)
    probs = torch.cat([sink, key_logits, entry_logits], dim=-1).softmax(dim=-1)
    want = probs[..., 1 + s :].sum(dim=2)
    assert target.shape == (b, s, n) and not target.requires_grad
    torch.testing.assert_close(target.double(), want, rtol=0, atol=1e-6)
    assert float(want.max()) > 0.1


def test_only_the_indexers_get_the_kl_gradient():
    """(b) The KL (`pop_indexer_loss`) of a forward of the small model (CSA blocks 1 and 3)
    differentiated alone: the indexers' projections of both CSA blocks get a gradient that is not
    zero, every parameter outside the indexers none or exact zeros (its inputs are detached, its
    target too; the MoE's are reached through the stacked aux terms with a zero gradient). Without the loss
    (weight 0) the indexers stay frozen, as before."""
    model = _model()
    inputs, _ = _tokens()
    model(inputs)
    kl = model.pop_indexer_loss()
    model.pop_aux_loss()
    params = dict(model.named_parameters())
    assert all(p.requires_grad for p in params.values())
    grads = torch.autograd.grad(kl, list(params.values()), allow_unused=True)
    # reachable through the stacked aux terms ([MoE, KL]), the MoE's parameters get exact zeros
    got = {name for (name, _), grad in zip(params.items(), grads) if grad is not None and bool(grad.any())}
    indexer = {name for name in params if ".attention.indexer." in name}
    assert got <= indexer and {name.split(".")[1] for name in indexer} == {"1", "3"}
    for name in indexer:
        if name.endswith(("wq_b.weight", "weights_proj.weight", "wkv.weight", "wgate.weight")):
            assert name in got, name
    frozen = _model(0.0)
    assert not any(p.requires_grad for n, p in frozen.named_parameters() if ".attention.indexer." in n)
    assert all(p.requires_grad for n, p in frozen.named_parameters() if ".attention.indexer." not in n)


def test_main_gradients_are_unchanged_by_it():
    """(c) The same weights with weight 0 (frozen indexers, today's model) and 0.5: the training
    loss the step differentiates (`lm` + 0.01 aux) has the same value, the indexer loss is > 0, and
    every parameter outside the indexers gets the same gradient, bit for bit (the same ops on the
    same values: the KL hangs off detached inputs, its value is taken back out of the loss). The
    trained model's indexers get a gradient (the KL's) that the frozen ones do not."""
    frozen, trained = _model(0.0), _model(0.5)
    trained.load_state_dict(frozen.state_dict())
    inputs, labels = _tokens()
    losses = {}
    for key, model in (("frozen", frozen), ("trained", trained)):
        loss_fn = _loss_fn(model)
        lm = loss_fn(model, inputs, labels)
        (lm + 0.01 * model.pop_aux_loss()).backward()
        losses[key] = lm
    assert torch.equal(losses["frozen"], losses["trained"])
    kl = _loss_fn(trained)  # a fresh loss object: the one above kept its KL for the log
    assert isinstance(kl, IndexerLoss)
    main = {n: p for n, p in frozen.named_parameters() if ".attention.indexer." not in n}
    other = dict(trained.named_parameters())
    assert len(main) > 100
    for name, p in main.items():
        assert p.grad is not None and torch.equal(p.grad, other[name].grad), name
    assert all(other[n].grad is not None for n in other if ".attention.indexer." in n)


def test_the_loss_logs_the_kl_and_weights_its_gradient():
    """(c) `IndexerLoss`: the returned value is the LM loss, `pop_mtp_losses` the mean KL over the
    CSA blocks, and the indexers' gradient is weight x blocks x d(mean KL) = weight x the sum of the
    blocks' KL gradients: at weight 0.5 and weight 1.0 on the same weights the indexer gradients
    differ by exactly 2x (a power of two: exact in floating point)."""
    grads = {}
    for weight in (0.5, 1.0):
        model = _model(weight)
        inputs, labels = _tokens()
        loss_fn = _loss_fn(model)
        loss = loss_fn(model, inputs, labels)
        model.pop_aux_loss()
        terms = loss_fn.pop_mtp_losses()
        assert terms.shape == (1,) and float(terms[0]) > 0 and loss_fn.pop_mtp_losses() is None
        loss.backward()
        grads[weight] = {n: p.grad for n, p in model.named_parameters() if ".attention.indexer." in n}
        with torch.no_grad():  # validation: the KL is popped and dropped, nothing left for the log
            loss_fn(model, inputs, labels)
            model.pop_aux_loss()
        assert loss_fn.pop_mtp_losses() is None and model.layers.pop_aux_extra() is None
    for name, grad in grads[1.0].items():
        assert torch.equal(grad, 2 * grads[0.5][name]), name


def test_flops_count_the_trained_indexer():
    """(d) Per CSA block, training the indexer adds 4 x H_I x d_I x (closed entries a causal query
    sees) for the scores' backward (2x forward -> 6x) and 2 x its parameters (forward only, 2x ->
    forward and weight gradient, 4x); "palm" doubles the score term as it doubles every attention
    product."""
    from models.contract import causal_keys

    for name in ("debugmodel", "flash"):
        frozen = FLAVORS[name]
        trained = dataclasses.replace(frozen, indexer_loss_weight=1.0)
        t = 4096
        n_csa = frozen.layer_kinds().count("c")
        scores = 4.0 * frozen.index_n_heads * frozen.index_head_dim * causal_keys(t / frozen.csa_ratio)
        params = 2.0 * frozen._indexer_params()
        f, tr = frozen.mixing_flops_per_token(t), trained.mixing_flops_per_token(t)
        assert tr["causal"] - f["causal"] == pytest.approx(n_csa * (scores + params), rel=1e-12)
        assert tr["palm"] - f["palm"] == pytest.approx(n_csa * (2 * scores + params), rel=1e-12)
        assert n_csa > 0 and scores > 0


def test_keys_checked_and_refused_where_unsupported():
    """(e) A negative or non-finite weight is refused with an allowed: line; the step plan's rule
    refuses the loss with TP (the target sums every head) and in the engine; the plain case runs."""
    from trainer.step.plan import StepRequest, refusals

    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"^indexer_loss_weight: .*allowed: 0"):
            _args(bad)
    assert not refusals(StepRequest(indexer_loss=True))
    for kw in ({"tp_degree": 2}, {"caller_loss": True}):
        (msg,) = [m for m in refusals(StepRequest(indexer_loss=True, **kw)) if m.startswith("model.indexer_loss")]
        assert msg.startswith("model.indexer_loss_weight: > 0") and "allowed: 0, or tensor_parallel_degree = 1" in msg
        assert not [m for m in refusals(StepRequest(**kw)) if m.startswith("model.indexer_loss")]


def test_the_log_names_the_terms_by_the_loss():
    """(e) metrics.jsonl's keys for `StepOutput.mtp_losses`: the loss's `term_names` when it has
    them (`indexer_loss`), else `mtp_loss_1`, ... (MTP, as before)."""
    from trainer.callbacks import MTPKeys
    from trainer.step.loss import StepOutput

    def logged(**kw):
        values = {}
        MTPKeys().on_log(1, StepOutput(loss=torch.tensor(1.0), grad_norm=torch.tensor(1.0), **kw), values)
        return values

    assert logged(mtp_losses=torch.tensor([0.25]), term_names=IndexerLoss.term_names) == {"indexer_loss": 0.25}
    assert logged(mtp_losses=torch.tensor([0.5, 0.75])) == {"mtp_loss_1": 0.5, "mtp_loss_2": 0.75}
    assert logged() == {}


def test_debug_run_logs_the_indexer_loss(tmp_path, monkeypatch):
    """(e) The debug recipe with indexer_loss_weight = 1 trains in process: metrics.jsonl holds
    `indexer_loss` at every step (finite, > 0), the LM loss falls as without it, and the indexer
    loss falls too (the indexers learn the attention's choice: at init their scores are noise)."""
    from tests.support.trainer_runs import REPO, train_in_process

    monkeypatch.chdir(REPO)
    overrides = {
        "model.indexer_loss_weight": "1.0",
        "training.seq_len": "64",
        "training.local_batch_size": "4",
        "training.steps": "8",
    }
    records = [r for _, r in sorted(train_in_process("configs/deepseek_v4_debug.toml", tmp_path, overrides).items())]
    assert len(records) == 8
    kl = [r["indexer_loss"] for r in records]
    assert all(math.isfinite(v) and v > 0 for v in kl), kl
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert min(kl[-3:]) < kl[0], kl


class _VectorAuxBlock(torch.nn.Module):
    """A toy block of kind "a" or "b" (a buffer of its own name): an aux term [2] (what a V4 block
    returns with its indexer loss) and a soft load over 4 experts."""

    def __init__(self, kind: str, width: int = 8):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(width, width) * 0.3)
        self.router = torch.nn.Parameter(torch.randn(width, 4))
        if kind == "b":
            self.register_buffer("shift", torch.randn(width))
        self.kind = kind

    def forward(self, h: torch.Tensor, x: torch.Tensor):
        h = h + torch.tanh(h @ self.w) * x + (self.shift if self.kind == "b" else 0)
        aux = torch.stack([(h * h).mean(), h.abs().mean()])
        return h, aux, torch.softmax(h @ self.router, -1).sum((0, 1))


@pytest.mark.parametrize("kinds", ["aaaa", "a" + "ab" * 2], ids=["period1", "prefix_period2"])
def test_a_vector_aux_sums_per_element_through_the_scan(kinds):
    """(f) The stack's scan (period 1; an unrolled prefix and a period of 2) sums a vector aux term
    over the layers per element, as the loop does ([2], not a scalar), and `split_aux_loss` keeps
    element 0 as the aux loss and the rest for `pop_aux_extra`. fp32, the same ops per block: the
    sums' order differs only (1e-6 relative)."""
    from models.common.stack import BlockStack

    torch._dynamo.reset()
    torch.manual_seed(0)
    stack = BlockStack(_VectorAuxBlock(k) for k in kinds)
    h, x = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    with torch.no_grad():
        want = stack.terms(h, x)
        stack.enable_scan()
        got = stack._scan_forward(h, (x,))
    assert want[1].shape == got[1].shape == (2,)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
    stack._last["aux"] = want[1]
    stack.split_aux_loss()
    assert torch.equal(stack.pop_aux_loss(), want[1][0]) and torch.equal(stack.pop_aux_extra(), want[1][1:])
    assert stack.pop_aux_extra() is None


def test_graph_step_with_layer_scan_equals_eager():
    """(g) The graph trainer's step (layer scan: the hash-routed block 0 unrolled, then the two CSA
    blocks as a scan; backend aot_eager) with the indexer loss, 3 AdamW steps at aux_loss_coef 0.01:
    losses, indexer losses and gradient norms within 1e-5 relative of the eager step and the
    parameters within 2e-6 absolute (the bounds of test_deepseek_v4_scan's graph test: the same ops
    per block in a different summation and backward order)."""
    from models.deepseek_v4.plan import PLAN
    from parallelisms.simple_fsdp import clip_grad_norm_, data_parallel
    from tests.support.graph_common import batches, build_opt, lr_at, max_param_diff
    from tests.unit.test_deepseek_v4_scan import _args as scan_args
    from trainer.graph import build_graph_step
    from trainer.step import EagerStep

    args = dataclasses.replace(scan_args("hcc", num_hash_layers=1), indexer_loss_weight=0.5)

    def built():
        with torch.device("meta"):
            model = DeepSeekV4(args)
        data_parallel(model, mesh=None, param_dtype=torch.float32, reduce_dtype=torch.float32)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights()
        return model, build_opt(model)

    (ref, ref_opt), (model, opt) = built(), built()
    assert model.layers.scan_layout() == (1, 1)

    def loss_fn():
        return IndexerLoss(lm_loss_fn(fused=False), weight=0.5, blocks=2)

    torch._dynamo.reset()
    eager = EagerStep(
        model=ref,
        optimizer=ref_opt,
        max_norm=1.0,
        aux_loss_coef=0.01,
        clip_grad_norm=clip_grad_norm_,
        loss_fn=loss_fn(),
    )
    graph = build_graph_step(
        model=model,
        optimizer=opt,
        max_norm=1.0,
        backend="aot_eager",
        aux_loss_coef=0.01,
        plan=PLAN,
        scan_layers=True,
        loss_fn=loss_fn(),
    )
    curves = []
    for step, o in ((eager, ref_opt), (graph, opt)):
        curve = []
        for i, mbs in enumerate(batches(3)):
            for group in o.param_groups:
                group["lr"] = lr_at(i)
            out = step(mbs, lr_at(i))
            assert out.term_names == ("indexer_loss",) and out.mtp_losses.shape == (1,)
            curve.append((float(out.loss), float(out.mtp_losses[0]), float(out.aux_loss), float(out.grad_norm)))
        curves.append(curve)
    assert graph.stats.scans == 2 and graph.capture.num_graphs == 1
    for got, want in zip(curves[1], curves[0]):
        assert got == pytest.approx(want, rel=1e-5), curves
    assert curves[0][0][1] > 0
    assert max_param_diff(ref, model) <= 2e-6


class _LossInAux(DeepSeekV4):
    """The model with the KL in its aux term (100 x: the harness weights the aux loss 0.01), so that
    the parallel harness's loss, LM + 0.01 aux, is the trainer's LM + aux + 1.0 x KL."""

    def pop_aux_loss(self):
        return super().pop_aux_loss() + 100.0 * self.pop_indexer_loss()


@pytest.mark.parametrize("degrees", [dict(dp_shard=2), dict(dp_shard=2, ep=2)], ids=["fsdp", "ep_fsdp"])
def test_fsdp_and_ep_match_single_process_with_the_indexer_loss(degrees):
    """(b) FSDP 2 and EP 2 x FSDP 2 (threads) with the indexer loss on: the loss and every gradient,
    the indexers' included (each parameter must have one), equal one process on the global batch
    (the bounds of tests/support/parallel_harness.py)."""
    from models.deepseek_v4.plan import PLAN
    from tests.support.parallel_harness import assert_matches_single_process

    args = dataclasses.replace(FLAVORS["debugmodel"], dim=64, vocab_size=256, max_seq_len=48, indexer_loss_weight=1.0)
    gen = torch.Generator().manual_seed(1)
    inputs, labels = (torch.randint(0, args.vocab_size, (2, 48), generator=gen) for _ in range(2))
    assert_matches_single_process(
        _LossInAux, args, PLAN, degrees, inputs, labels, perturb=("sinks.weight", "position_bias", "base")
    )
