"""The zero-bubble schedules' bubble in the planner (planner/pipeline.py `zero_bubble_costs`,
`mixing_share`, `PipelineCost.bubble`): B (the input gradient) holds the attention products'
backward, W (the weight gradient) only the matmuls', so W cannot fill all of B's bubble.

Every figure here is arithmetic on the model's own FLOPs count, checked against a count by hand;
exact up to float rounding (1e-12)."""

from __future__ import annotations

import dataclasses

import pytest

from parallelisms.pipeline_parallel import bubble_fraction

SHARE = 1_572_864 / (6 * 754_208 + 1_572_864)
"""The bench model's attention share by hand (`test_mixing_share_of_the_bench_model_by_hand`)."""


def _debug_llama(n_layers: int = 8):
    from models.llama3 import FLAVORS

    return dataclasses.replace(FLAVORS["debugmodel"], n_layers=n_layers)


@pytest.mark.parametrize("a", [0.0, 0.25, 0.6, 1.0])
def test_zero_bubble_costs_split_the_stage_s_flops(a):
    """(f, b, w) are shares of a stage's training FLOPs: they sum to 1, f is a third (the forward of
    a 1 : 2 forward : backward split), and what W cannot fill, f + b - 2 w, is the attention share."""
    from planner.pipeline import zero_bubble_costs

    f, b, w = zero_bubble_costs(a)
    assert f + b + w == pytest.approx(1.0, abs=1e-12)
    assert f == pytest.approx(1 / 3, abs=1e-12) and b + w == pytest.approx(2 / 3, abs=1e-12)
    assert f + b - 2 * w == pytest.approx(a, abs=1e-12)


def test_mixing_share_of_the_bench_model_by_hand():
    """The 8-layer debug Llama at seq 512 (scripts/bench/bench_pipeline.py's model): per layer and
    token the parameters are q 256x256 + k, v 256x64 + o 256x256 + w1, w2, w3 3 x 256x768 = 753,664,
    the two norms' 512 and an eighth of the final norm's 256 (the count the FLOPs take), 6 x 754,208
    FLOPs, and the attention products 12 x 16 heads x 16 x 512 = 1,572,864: a share of 0.2579; with
    the FLOPs count the planner uses (trainer/runtime/flops.py)."""
    from planner.pipeline import mixing_share
    from trainer.runtime.flops import model_flops_per_token

    args = _debug_llama()
    flops = model_flops_per_token(args, 512)["palm"]
    by_hand = SHARE
    assert mixing_share(args.shape(), flops, 512) == pytest.approx(by_hand, rel=1e-12)
    assert mixing_share(args.shape(), None, 512) == 0.0


@pytest.mark.parametrize("m", [2, 4, 8])
def test_zbv_bubble_is_the_attention_share_w_cannot_fill(m):
    """ZBV on pp 2 (v 2) at the bench model's share a: bubble (p - 1) a / v over that plus m (the
    formula with f, b, w of `zero_bubble_costs`), 6.1 / 3.1 / 1.6 % at m 2 / 4 / 8 where f = b = w
    says 0; without attention it is 0 again, and the one-stage schedules do not change."""
    from planner.pipeline import PipelineCost, PipelineSpec, zero_bubble_costs

    a = SHARE
    spec = PipelineSpec(pp=2, schedule="ZBVZeroBubble", microbatches=m, first_less=0, last_less=0)
    cost = PipelineCost(
        spec=spec,
        rank=0,
        rank_layers=(4, 4),
        rank_totals=(0, 0),
        micro_batch=1,
        in_flight=1.0,
        imbalance=1.0,
        p2p_bytes=0,
        transfer_bytes=0,
        link="ICI",
        link_bytes_per_s=1.0,
        mixing_share=a,
    )
    assert spec.bubble == 0.0
    assert cost.bubble == pytest.approx((a / 2) / (a / 2 + m), rel=1e-12)
    assert cost.bubble == pytest.approx({2: 0.0606, 4: 0.0312, 8: 0.0159}[m], abs=1e-4)
    assert dataclasses.replace(cost, mixing_share=0.0).bubble == 0.0
    one = dataclasses.replace(cost, spec=dataclasses.replace(spec, schedule="1F1B"))
    assert one.bubble == bubble_fraction("1F1B", 2, m) == 1 / (m + 1)
    f, b, w = zero_bubble_costs(a)
    assert cost.bubble == bubble_fraction("ZBVZeroBubble", 2, m, 2, f=f, b=b, w=w)
