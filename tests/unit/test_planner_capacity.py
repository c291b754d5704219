"""The planner's capacity-dispatch terms by hand (planner/memory.py), and the recipe it was mended for.

Qwen3-30B-A3B (dim 2048, moe_hidden 768, 128 experts, top 8), 8 x 4096 tokens per device, capacity
factor 1.25: 320 copies per sequence and expert, 128 x 8 x 320 = 327,680 buffer rows, 262,144 routed
copies. The compiled program (scripts/check_recipe.py --compile, 2026-12-06) needs 18.3 GiB per
device; the planner said 25.0 because it counted the experts' rows twice (the block model's per-copy
rows and the buffer's rows, forward and gradients x 2: 7.81 GiB of "dispatch").
"""

import pytest

from models import get_model_family
from planner.memory import capacity_backward_bytes, capacity_saved_delta, ep_dispatch_bytes, expert_rows

GIB = 2**30
SHAPE = get_model_family("qwen3").flavors["30B-A3B"].shape()
ROWS, COPIES = 327_680, 262_144


def test_capacity_terms_by_hand():
    assert (SHAPE.dim, SHAPE.moe_hidden, SHAPE.num_experts, SHAPE.top_k) == (2048, 768, 128, 8)
    kw = dict(tokens=8 * 4096, ep=8, capacity_factor=1.25, local_batch_size=8, seq_len=4096)
    assert expert_rows(SHAPE, **kw) == ROWS == 128 * 8 * 320
    # the buffer's rows keep input + gate/silu/up/product; the model counted them per copy
    assert capacity_saved_delta(SHAPE, rows=ROWS, tokens=8 * 4096) == (ROWS - COPIES) * (2 * 2048 + 8 * 768)
    assert capacity_saved_delta(SHAPE, rows=ROWS, tokens=8 * 4096) == 671_088_640
    # the backward's gradients in flight: input rows (2 dim), gate and up (2 moe_hidden each)
    assert capacity_backward_bytes(SHAPE, rows=ROWS) == ROWS * (2 * 2048 + 4 * 768) == 2_348_810_240
    assert ep_dispatch_bytes(SHAPE, **kw) == 2_348_810_240  # was 2 x R x (2 d + 3 F) x 2 = 8,388,608,000
    # the block backward's change: exactly 5 GiB less
    assert 671_088_640 + 2_348_810_240 - 2 * ROWS * (2 * 2048 + 3 * 768) * 2 == -5 * GIB
    # dropless is unchanged: ep x tokens x k rows, forward and gradients
    dropless = dict(kw, capacity_factor=0.0)
    assert ep_dispatch_bytes(SHAPE, **dropless) == 2 * (8 * 32768 * 8) * (2 * 2048 + 3 * 768) * 2


def test_qwen3_30b_a3b_recipe_within_the_compile_band():
    """The recipe's plan (FSDP 256 x EP 8 on v6e-256, AC full, scan, fused loss, undonated update):
    24.98 -> 19.98 GiB, the 5 GiB above; the compiler's 18.3 GiB is within tools/tpu_compile.BAND."""
    import planner
    from tools.recipe_check import planned
    from tools.tpu_compile import BAND
    from trainer.config import build_config

    cfg = build_config("configs/qwen3_30b_a3b_v6e.toml", [])
    est = planned(cfg, planner.parse_target(cfg.job.target))
    assert est.total / GIB == pytest.approx(19.98, abs=0.01)
    assert abs(18.3 - est.total / GIB) <= BAND * est.total / GIB


def test_both_full_ac_modes_plan_the_capacity_dispatch():
    """The capacity layout's saved-row change has a value for every full `[activation_checkpoint]
    mode` (full_save_attention raised KeyError): under both the block keeps no expert rows, so the
    plans differ by attention's kept outputs alone: per token and block the bf16 output (heads x
    head_dim = 4,096 wide) and the fp32 log-sum-exp per head (32), x 8 x 4,096 tokens x 48 blocks."""
    import planner
    from tools.recipe_check import planned
    from trainer.config import build_config

    totals = {}
    for mode in ("full", "full_save_attention"):
        cfg = build_config("configs/qwen3_30b_a3b_v6e.toml", [("activation_checkpoint.mode", mode)])
        totals[mode] = planned(cfg, planner.parse_target(cfg.job.target)).total
    assert (SHAPE.n_heads, SHAPE.head_dim, SHAPE.n_layers) == (32, 128, 48)
    assert totals["full_save_attention"] - totals["full"] == 48 * 8 * 4096 * (2 * 32 * 128 + 4 * 32)


@pytest.mark.parametrize(
    "recipe, compiled, total",
    # the peak transient, before -> after (GiB): 8B loss/LM head 3.54 -> 5.86 over block 2.50, so
    # 8.03 -> 10.35; 32B loss 4.43 -> 7.33 over block 4.91, so 15.01 -> 17.42; Llama 3 8B unchanged
    [("qwen3_8b_v6e", 10.6, 10.35), ("qwen3_32b_v6e", 18.2, 17.42), ("llama3_8b_v6e", 7.3, 7.04)],
)
def test_an_uneven_vocabulary_holds_a_whole_fp32_head_gradient(recipe, compiled, total):
    """Qwen 3's 151,936-row vocabulary does not divide over 256 FSDP ranks: the compiled programs
    hold one more fp32 copy of the gathered head gradient, 4 x 151,936 x dim bytes (2.32 GiB at
    dim 4096, 2.90 at 5120), which puts the plans within the band of the compiles of 2026-12-06
    (10.6 and 18.2 GiB; they were 32 % and 21 % apart). Llama 3's 128,256 divides 256: no term."""
    import planner
    from planner.memory import uneven_vocab_bytes
    from tools.recipe_check import planned
    from tools.tpu_compile import BAND
    from trainer.config import build_config

    cfg = build_config(f"configs/{recipe}.toml", [])
    shape = get_model_family(cfg.model.name).flavors[cfg.model.flavor].shape()
    head = shape.vocab_size * shape.dim
    extra = uneven_vocab_bytes(shape, head=head, fsdp=256)
    assert extra == (4 * 151_936 * shape.dim if shape.vocab_size == 151_936 else 0)
    assert uneven_vocab_bytes(shape, head=head, fsdp=1) == 0
    est = planned(cfg, planner.parse_target(cfg.job.target))
    assert est.total / GIB == pytest.approx(total, abs=0.01)
    assert abs(compiled - est.total / GIB) <= BAND * est.total / GIB


def test_recommend_asks_the_rules_with_each_candidates_own_cp():
    """The trainer refuses the capacity-bounded dispatch with CP (rule `moe.capacity_factor`).
    `recommend` asked the rules at pp 1 with the recipe's cp (1), not the candidate's, so it
    offered plans the trainer refuses at start-up: Qwen 3 30B-A3B at 128k on v6e-256 came out as
    cp 4 x ep 64 at capacity 1.25. Each candidate's own cp now: with capacity none at cp 2, dropless
    the same search keeps them."""
    import planner as P
    from tools.recipe_check import plan_inputs
    from trainer.config import build_config

    def cps(capacity: str) -> set[int]:
        overrides = [("moe.capacity_factor", capacity), ("training.seq_len", "2048"), ("job.target", "v6e-8")]
        inputs = plan_inputs(build_config("configs/qwen3_moe_debug.toml", overrides))
        search = dict(tp_choices=[1], cp_choices=[2], ep_choices=[1], pp_choices=[1], ac_modes=("none",))
        return {c.cp for c in P.recommend(inputs, P.parse_target("v6e-8"), max_local_batch=1, **search)}

    assert cps("1.25") == set()
    assert cps("0") == {2}
