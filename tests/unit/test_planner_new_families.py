"""The planner on the pod recipes of gpt-oss and Qwen 3.5 (configs/gpt_oss_120b_v7x.toml,
configs/qwen3_5_35b_a3b_v6e.toml): the FLOPs per token it prints count each family's own token
mixing, by hand here (gpt-oss's sliding-window blocks by their window, Qwen 3.5's Gated DeltaNet
blocks by the delta rule's recurrence), not as full attention in every block."""

from __future__ import annotations

import re

import pytest

from models import get_model_family

SEQ = 4096


def _gpt_oss_120b_by_hand() -> float:
    """6 N (active, without the embedding table) + PaLM mixing: 12 x H x Q x 2 keys per block, the
    keys a causal row sees on average: T/2 in the 18 full blocks, w - w^2 / 2T in the 18 sliding
    ones (w = 128)."""
    d, hd, h, kv, e_hid, vocab = 2880, 64, 64, 8, 2880, 201088
    attention = d * hd * (2 * h + 2 * kv) + hd * (h + 2 * kv) + d + h
    per_expert = 3 * d * e_hid + 2 * e_hid + d
    router = d * 128 + 128
    active = vocab * d + d + 36 * (attention + 2 * d + 4 * per_expert + router)  # output + final norm + blocks
    sliding_keys = 128 - 128 * 128 / (2 * SEQ)
    mixing = 18 * 12 * h * hd * 2 * (SEQ / 2) + 18 * 12 * h * hd * 2 * sliding_keys
    return 6 * active + mixing


def _qwen3_5_35b_a3b_by_hand() -> float:
    """6 N + PaLM mixing: 10 gated full-attention blocks at 12 x H x Q x T, 30 Gated DeltaNet blocks
    at 18 x d_k x d_v per value head (32 heads of 128 x 128), in both conventions."""
    n = get_model_family("qwen3_5").flavors["35B-A3B"].num_active_params(exclude_embedding=True)
    return 6 * n + 10 * 12 * 16 * 256 * SEQ + 30 * 18 * 32 * 128 * 128


@pytest.mark.parametrize(
    "recipe, by_hand, all_full",
    [
        # all-full: every block priced as full attention, 12 x L x H x Q x T (what the planner did
        # before the families said otherwise): 120B 7.25 GFLOP of mixing against 3.85, 35B 8.05 against 2.30
        ("gpt_oss_120b_v7x", _gpt_oss_120b_by_hand, 12 * 36 * 64 * 64 * SEQ),
        ("qwen3_5_35b_a3b_v6e", _qwen3_5_35b_a3b_by_hand, 12 * 40 * 16 * 256 * SEQ),
    ],
    ids=["gpt_oss_120b_v7x", "qwen3_5_35b_a3b_v6e"],
)
def test_the_estimate_prints_the_families_flops_per_token(recipe, by_hand, all_full):
    import planner
    from scripts import estimate as report
    from tools.recipe_check import planned
    from trainer.config import build_config

    cfg = build_config(f"configs/{recipe}.toml", [])
    assert cfg.training.seq_len == SEQ
    est = planned(cfg, planner.parse_target(cfg.job.target))
    text = report.format_estimate(est)
    found = re.search(r"model FLOPs per token: ([\d,.]+) GFLOP \(training, PaLM convention", text)
    assert found, text
    printed = float(found.group(1).replace(",", "")) * 1e9
    expected = by_hand()
    assert est.flops_per_token == pytest.approx(expected, rel=1e-9)
    assert printed == pytest.approx(expected, abs=0.006e9)  # printed to 0.01 GFLOP
    # the family's mixing is not the full-attention count (the test would see a regression to it)
    args = get_model_family(cfg.model.name).flavors[cfg.model.flavor]
    n6 = 6 * args.num_active_params(exclude_embedding=True)
    assert abs((n6 + all_full) - expected) > 3e9
