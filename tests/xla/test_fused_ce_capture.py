"""The fused loss as scripts/estimate_xla.py lowers it compiles for the recipe's chip (issue 37).

`titan_kernels/tpu/capture.py` lowered `ce_fwd`/`ce_bwd` with generation None, the conservative
rule (v4's 16 MiB scoped VMEM): `estimate_xla.py --config configs/llama3_70b_v6e.toml` stopped in
the loss' backward ("17.90M of 16.00M") and the 405B v7x recipe in its forward. `add_lowerings`
now takes the target generation. The probe (tests/xla/probes/ce_capture_compile.py, ttpu venv,
libtpu 0.0.52) compiles both programs deviceless through that code path at each recipe's width
and rows per device, with the target's generation and with None (the old behaviour).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xla

RECIPES = {"llama3_70b_v6e": "v6e", "llama3_405b_v7x": "v7x"}


@pytest.fixture(scope="module")
def compiles(probe):
    args = [f"{case}:{arg}" for case in RECIPES for arg in ("none", "")]
    return probe("ttpu", "ce_capture_compile.py", *args, timeout=900)["compiles"]


@pytest.mark.parametrize("case", sorted(RECIPES))
def test_fused_ce_compiles_for_the_target_generation(compiles, case):
    gen = RECIPES[case]
    for half in ("fwd", "bwd"):
        out = compiles[f"{case}@{gen}:{half}"]
        assert out["rows_per_device"] == 8192, out
        assert out["compiled"], f"{case} {half} with {gen}'s blocks {out['blocks']}: {out.get('error')}"
        assert out["est_vmem_mib"] <= out["limit_mib"], out


@pytest.mark.parametrize("case", sorted(RECIPES))
def test_the_conservative_rule_did_not_fit(compiles, case):
    """What the capture did before: v4's blocks and 16 MiB limit on a v6e / v7x program. 70B's
    backward (17.90M) and 405B's forward (16.19M) and backward (32.00M) exceed the 16 MiB."""
    failed = {half: compiles[f"{case}@none:{half}"] for half in ("fwd", "bwd")}
    assert not failed["bwd"]["compiled"], failed
    assert "CompileTimeScopedVmemOom" in failed["bwd"]["error"], failed
    assert failed["bwd"]["vmem_limit_mib"] == 16.0 < failed["bwd"]["vmem_used_mib"], failed
    if case == "llama3_405b_v7x":
        assert not failed["fwd"]["compiled"] and "CompileTimeScopedVmemOom" in failed["fwd"]["error"], failed
