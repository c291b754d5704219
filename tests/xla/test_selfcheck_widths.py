"""The start-up self-check at the run's widths, with the real kernels and the real compiler (issue 37).

tests/xla/probes/selfcheck_widths.py (ttpu venv: libtpu 0.0.52, the one torch-tpu 0.2.0 runs):
- fallback: Llama 3 70B's head (hidden 8192, vocab 128256, 8192 rows per device) through
  `selfcheck.run` + `titan_kernels._register_tpu` as `_select_tpu` runs them, the compile-only
  check being titan_kernels/tpu/compile_check.py's deviceless XLA:TPU compile for a `v4:2x2x1`
  topology (v4's tiles) and for `v6e:2x2`; and the tile rule's VMEM arithmetic alone (generation
  not detected). The numeric part runs the real kernel in Pallas' interpreter.
- numerics: the real kernels (interpret mode, bf16) pass the self-check at recipe widths,
  including MLA's q/k 192 with v 128 (unpadded, as the model calls it) and the CP splash kernel of
  a cp rank (also at MLA's widths).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xla


@pytest.fixture(scope="module")
def widths(probe):
    return probe("ttpu", "selfcheck_widths.py", "fallback", "numerics", timeout=1200)


def test_the_70b_wide_loss_does_not_compile_for_v4_and_the_reference_serves_it(widths):
    v4 = widths["fallback"]["v4"]
    ok, note = v4["compile"]
    assert not ok and "does not compile for v4" in note and "of 16.00M" in note, note
    assert "vmem" in note.lower() and "blocks 128 x 128" in note, note
    assert not v4["ok"] and v4["serves"] == "reference", v4
    (line,) = v4["banner"]
    assert line.startswith(
        "titan-tpu: kernel self-check: fused CE (linear_cross_entropy) failed, the torch "
        "reference serves it: backward at rows 8192, hidden 8192, vocab 128256"
    ), line


def test_the_same_head_compiles_for_v6e_and_the_kernel_serves(widths):
    v6e = widths["fallback"]["v6e"]
    ok, note = v6e["compile"]
    assert ok and "forward + backward compiled for v6e" in note and "not run" in note, note
    assert v6e["ok"] and v6e["serves"] == "kernel" and v6e["banner"] == [], v6e
    assert 0 < v6e["worst"] < 2**-5 / 2, v6e


def test_an_undetected_generation_is_decided_by_the_tile_rule(widths):
    none = widths["fallback"]["none"]
    ok, note = none["compile"]
    assert not ok and "tile rule; generation not detected" in note, note
    assert none["serves"] == "reference" and len(none["banner"]) == 1, none


def test_the_real_kernels_pass_at_recipe_widths_in_interpret_mode(widths):
    results = widths["numerics"]
    assert {r["op"] for r in results.values()} == {
        "causal_attention",
        "grouped_mm",
        "linear_cross_entropy",
        "cp_attention",
    }
    for label, r in results.items():
        assert r["ok"], f"{label}: {r['reason']}"
        assert 0 < r["worst"] < 2**-5 / 2, (label, r)
    # MLA's widths as DeepSeek-V3 / Kimi K2 hand them to the op (KernelShapes.of: q/k 192, v 128).
    assert results["splash MLA 192/128"]["checked"] == "q/k 192, v 128"
    assert results["CP splash cp2 rank1 MLA 192/128"]["checked"] == "cp 2 rank 1, q/k 192, v 128"
