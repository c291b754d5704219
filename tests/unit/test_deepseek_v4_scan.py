"""Layer scan of DeepSeek-V4's stack (models/common/stack.py `scan_layout`): the hash-routed blocks
run unrolled before a scan of the periodic rest (flash: blocks 0-2, then CSA / HCA x 20).

The model here: 7 blocks "hhh" + "ch" x 2 (3 hash-routed), so the layout is an unrolled prefix of
3 and two scan steps of period 2; dim 32, 2 mHC streams, 3 Sinkhorn iterations (the capture's
size grows with them), 32 tokens: past the window (8), 8 CSA entries of which a query keeps 2,
4 HCA entries.

Tolerances (fp32, backend aot_eager, 3 AdamW steps at lr up to 1e-3), as test_hybrid_scan's:
losses, aux losses and gradient norms within 1e-5 relative of the eager step, parameters within
2e-6 absolute (a few ulps of AdamW over 3 steps in its linear regime). The scanned step runs the
same ops per block in the same order; what differs is the aux terms' sum (prefix, then the
scan's stacked terms) and the compiled backward's accumulation order.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.deepseek_v4 import FLAVORS, DeepSeekV4
from models.deepseek_v4.plan import PLAN

SCHEDULE = "hhh" + "ch" * 2


def _args(attention_layers: str = SCHEDULE, num_hash_layers: int = 3):
    return dataclasses.replace(
        FLAVORS["debugmodel"],
        n_layers=len(attention_layers),
        attention_layers=attention_layers,
        num_hash_layers=num_hash_layers,
        dim=32,
        n_heads=2,
        head_dim=16,
        rope_head_dim=8,
        q_lora_rank=16,
        o_groups=2,
        o_lora_rank=16,
        vocab_size=512,
        sliding_window=8,
        csa_ratio=4,
        hca_ratio=8,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=2,
        max_seq_len=32,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_hidden_dim=32,
    )


def _model(seed: int = 0, **kw):
    from parallelisms.simple_fsdp import data_parallel

    with torch.device("meta"):
        model = DeepSeekV4(_args(**kw))
    data_parallel(model, mesh=None, param_dtype=torch.float32, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
        for block in model.layers.values():  # a selection bias that is not zero, so its rows show
            if not block.is_hash:
                block.moe.router.expert_bias.normal_(0, 0.1)
    return model


def test_the_hash_blocks_are_an_unrolled_prefix():
    """flash's 43 blocks (HCA x 3 hash-routed, then CSA / HCA x 20) scan with a prefix of 3 and
    period 2; the hash blocks' table keeps them out of a scan of their attention kind (the same
    schedule without hash blocks scans from block 0; with 2 of them, from block 2). The debug
    flavor (HCA, CSA hash-routed, sliding, CSA) has no periodic tail: refused with both reasons.
    Enabled on the 7-block model (full AC): the prefix blocks keep their own tensors and are
    checkpointed, the stacked rows of `0.*` / `1.*` view blocks 3, 5 / 4, 6, and the state-dict
    keys are unchanged."""
    from models.errors import ConfigError
    from trainer.graph.step import _enable_scans

    def layout(**kw):
        with torch.device("meta"):
            return DeepSeekV4(_args(**kw)).layers.scan_layout()

    with torch.device("meta"):
        assert DeepSeekV4(FLAVORS["flash"]).layers.scan_layout() == (3, 2)
    assert layout() == (3, 2)
    assert layout(attention_layers="chchch", num_hash_layers=0) == (0, 2)
    assert layout(attention_layers="chchch", num_hash_layers=2) == (2, 2)
    assert layout(attention_layers="hhhhhh", num_hash_layers=3) == (3, 1)
    with pytest.raises(
        ConfigError,
        match=r"^compile\.scan_layers: the model's `layers` cannot be scanned \(block 1 has different "
        r"parameters/buffers than block 0, and no tail of the stack \(blocks k\.\.\) repeats over two or "
        r"more scan steps\); allowed: false",
    ):
        _enable_scans(DeepSeekV4(FLAVORS["debugmodel"]), PLAN)

    model = _model()
    keys = list(model.state_dict())
    prefix = {id(p) for i in range(3) for p in model.layers[str(i)].parameters()}
    assert _enable_scans(model, PLAN, "full")[0] == {"layers": model.layers}
    assert list(model.state_dict()) == keys
    # the prefix runs outside the scan body: checkpointed as unrolled blocks are (the rest by the body's AC)
    kinds = [type(b).__name__ for b in model.layers.values()]
    assert kinds == ["CheckpointedDeepSeekV4Block"] * 3 + ["DeepSeekV4Block"] * 4, kinds
    stacked = model.layers.stacked_parameters()
    assert all(stack.shape[0] == 2 for stack, _ in stacked.values())
    assert not {id(p) for _, members in stacked.values() for p in members} & prefix
    stack, members = stacked["0.attention.indexer.wq_b.weight"]  # CSA only: blocks 3 and 5
    assert [m is model.layers[str(i)].attention.indexer.wq_b.weight for i, m in zip((3, 5), members)] == [True] * 2
    assert members[1].data_ptr() == stack[1].data_ptr()
    bias = model.layers._scan.stacked["1.moe.router.expert_bias"]  # a buffer: HCA blocks 4 and 6
    assert bias.data_ptr() == model.layers["4"].moe.router.expert_bias.data_ptr() and not torch.equal(bias[0], bias[1])


class _ToyBlock(torch.nn.Module):
    """A block of kind "a", "b" or "c": the same weights, a buffer of its own name for "b" / "c"
    (so the kinds' signatures differ), an aux term and a soft load over 4 experts."""

    def __init__(self, kind: str, width: int = 8):
        super().__init__()
        self.kind = kind
        self.w = torch.nn.Parameter(torch.randn(width, width) * 0.3)
        self.router = torch.nn.Parameter(torch.randn(width, 4))
        if kind != "a":
            self.register_buffer(f"shift_{kind}", torch.randn(width))

    def forward(self, h: torch.Tensor, x: torch.Tensor):
        h = h + torch.tanh(h @ self.w) * x
        if self.kind != "a":
            h = h + getattr(self, f"shift_{self.kind}")
        return h, (h * h).mean(), torch.softmax(h @ self.router, -1).sum((0, 1))


def _toy_stack():
    from models.common.stack import BlockStack

    torch.manual_seed(0)
    return BlockStack(_ToyBlock(kind) for kind in "aa" + "bc" * 3)


def test_a_stack_scans_its_periodic_rest_after_the_prefix(monkeypatch):
    """Blocks "aa" + "bc" x 3: layout (2, 2). The scanned forward (the prefix's loop, then torch's
    scan of 3 `PeriodGroup` steps, run through its own dynamo trace) gives the loop's output, aux sum
    and loads [8, 4] in layer order (each block's own router: a row out of place changes them).
    A wrong layout fails it: forced (0, 2), the "a" blocks' code runs with the "b" / "c" rows."""
    from models.common.stack import BlockStack

    torch._dynamo.reset()
    h, x = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    stack = _toy_stack()
    assert stack.scan_layout() == (2, 2)
    with torch.no_grad():
        want = stack.terms(h, x)
        stack.enable_scan()
        got = stack._scan_forward(h, (x,))
    assert [type(b) for b in stack.scan_prefix()] == [_ToyBlock] * 2 and stack.scan_prefix()[1] is stack["1"]
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert float(got[1]) == pytest.approx(float(want[1]), rel=1e-6)
    assert got[2].shape == want[2].shape == (8, 4) and torch.equal(got[2], want[2])
    assert not torch.equal(want[2][0], want[2][2])
    monkeypatch.setattr(BlockStack, "scan_layout", lambda self: (0, 2))
    wrong = _toy_stack()
    with torch.no_grad():
        wrong.enable_scan()
        assert (wrong._scan_forward(h, (x,))[0] - want[0]).abs().max() > 1e-2


def test_prefix_and_scan_forward_equal_the_loop():
    """The scanned forward (the prefix's loop, then torch's scan over blocks 3..6 in two steps of
    a `PeriodGroup`; the scan runs in eager through its own dynamo trace) gives the loop's streams,
    aux sum and loads [7, E] in layer order. Each block routes differently (its own rows), so a
    load row out of place, a block run twice or left out changes them. fp32: the same ops per
    block; only the aux sum's order differs (1e-6 relative)."""
    torch._dynamo.reset()
    model = _model()
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    x = model.tok_embeddings(tokens)
    h = x.unsqueeze(2).expand(-1, -1, model.args.hc_mult, -1).contiguous()
    args = (model.rope_cos, model.rope_sin, model.compress_rope_cos, model.compress_rope_sin, tokens)
    with torch.no_grad():
        want = model.layers.terms(h, *args)
        model.layers.enable_scan()
        got = model.layers._scan_forward(h, args)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert got[1] == pytest.approx(float(want[1]), rel=1e-6) and float(want[1]) > 0
    assert got[2].shape == want[2].shape == (7, 4) and torch.equal(got[2], want[2])
    assert len({tuple(row.tolist()) for row in want[2]}) > 1


@pytest.mark.parametrize("ac_mode", ["none", "full"])
def test_prefix_scan_graph_step_matches_eager(ac_mode):
    """The graph trainer's step with layer scan (3 blocks unrolled, then one forward and one
    backward scan of 2 periods) for 3 AdamW steps at aux_loss_coef 0.01: losses, aux losses,
    gradient norms and the parameters equal the eager step's (tolerances in the module
    docstring); the expert loads of a compiled forward come out in layer order. With full AC the
    prefix is checkpointed outside the scan body and the body rematerialised (measured:
    docs/results/deepseek_v4_prefix_scan_2026-12-07_aff5531.csv)."""
    from parallelisms.simple_fsdp import clip_grad_norm_
    from tests.support.graph_common import batches, build_opt, lr_at, max_param_diff
    from trainer.graph import build_graph_step
    from trainer.step import EagerStep

    models = [_model() for _ in range(2)]
    opts = [build_opt(m) for m in models]
    torch._dynamo.reset()
    eager = EagerStep(
        model=models[0], optimizer=opts[0], max_norm=1.0, aux_loss_coef=0.01, clip_grad_norm=clip_grad_norm_
    )
    graph = build_graph_step(
        model=models[1],
        optimizer=opts[1],
        max_norm=1.0,
        backend="aot_eager",
        aux_loss_coef=0.01,
        plan=PLAN,
        scan_layers=True,
        ac_mode=ac_mode,
    )
    curves = []
    for step, opt in zip((eager, graph), opts):
        curve = []
        for i, mbs in enumerate(batches(3)):
            for group in opt.param_groups:
                group["lr"] = lr_at(i)
            out = step(mbs, lr_at(i))
            curve.append((float(out.loss), float(out.aux_loss or 0.0), float(out.grad_norm)))
        curves.append(curve)
    assert graph.stats.scans == 2
    for got, want in zip(curves[1], curves[0]):
        assert got == pytest.approx(want, rel=1e-5), curves
    assert curves[0][0][1] > 0  # the aux term is there to compare
    assert max_param_diff(models[0], models[1]) <= 2e-6
    tokens = batches(1)[0][0][0]

    def loads(model):
        model(tokens)
        return model.layers.pop_expert_load()

    want = loads(models[0])
    got = torch.compile(loads, fullgraph=True, backend="aot_eager")(models[1])
    assert got.shape == want.shape == (7, 4) and torch.equal(got, want), (got, want)


@pytest.mark.parametrize("ac_mode", ["full", "none"])
def test_the_planner_charges_the_prefix_as_unrolled_blocks(ac_mode):
    """With layer scan the search passes the stack's layout (`planner.shard.scan_layout`: flash
    3, 2) to the estimate: under full AC the scan saves one input per period (20 periods) and the
    3 prefix blocks, checkpointed outside the scan body, one input each (23 x `per_block` where
    the unscanned stack keeps 43); the block transient recomputes a period of 2 blocks. Without AC
    nothing changes but the period. Synthetic shard stats (one device, no parameters to speak of):
    the activation terms alone."""
    from types import SimpleNamespace

    from parallelisms.parallel_dims import ParallelDims
    from planner import parse_target
    from planner.memory import estimate
    from planner.search import _step_terms
    from planner.shard import ShardStats, scan_layout

    flash = FLAVORS["flash"]
    assert scan_layout(flash) == (3, 2) and scan_layout(FLAVORS["debugmodel"]) is None
    step = SimpleNamespace(scan=True, fused_loss=False, scan_flips=False, undonated_update=False, scan_offload="none")
    terms = _step_terms(step, SimpleNamespace(args=flash, step=None, quantize=None))
    assert terms["stacked"] and terms["scan_layout"] == (3, 2)
    stats = ShardStats(
        n_layers=43,
        root_numel=10,
        blocks_numel=430,
        block_gathered_numel=10,
        blocks_gathered_numel=430,
        largest_block_param_gathered=10,
        root_gathered={},
        lm_head_gathered_numel=0,
        root_kept_gathered_numel=0,
        local_shapes={},
        probed=False,
    )
    common = dict(
        model="deepseek_v4",
        target=parse_target("v6e-8"),
        shape=flash.shape(),
        stats=stats,
        parallel_dims=ParallelDims(dp_shard=1, world_size=1),
        local_batch_size=1,
        seq_len=4096,
        ac_mode=ac_mode,
        loss_parallel=False,
        flops_per_token=1.0,
    )
    unscanned = estimate(**common).activations
    scanned = estimate(**common, stacked=True, scan_layout=(3, 2)).activations
    assert scanned.period == 2 and scanned.period_none == 2 * unscanned.per_block_none
    # DeepSeek-V4's own activation terms (as the search passes them): a scan step's CSA and HCA
    # blocks recomputed together, their sum, below twice the CSA block's
    from planner.deepseek_v4 import block_bytes, v4_activation_bytes

    acts = v4_activation_bytes(flash, local_batch_size=1, seq_len=4096, tp=1, ac_mode=ac_mode)
    v4 = estimate(**common, stacked=True, scan_layout=(3, 2), activations=acts).activations
    pair = max(
        block_bytes(flash, i, rows=1, seq_len=4096) + block_bytes(flash, i + 1, rows=1, seq_len=4096)
        for i in range(3, 43, 2)
    )
    assert v4.period == 2 and v4.period_none == pair < 2 * acts.per_block_none
    if ac_mode == "full":
        assert unscanned.blocks == 43 * unscanned.per_block
        assert scanned.blocks == 23 * unscanned.per_block
        assert scanned.per_block_none == 2 * unscanned.per_block_none  # the backward's recompute
        assert v4.per_block_none == pair
    else:
        assert scanned.blocks == unscanned.blocks and scanned.per_block_none == unscanned.per_block_none
