"""The graph trainer's step, lowered to StableHLO by torchax and run on XLA:CPU (probe graph_step_xla.py).

Each variant (conftest.LOWERING_VARIANTS) is the first step of `build_graph_step(backend="aot_eager")`
on a debug flavor at its full width with 2 layers (batch 4 x 128 tokens, fp32, math SDPA, AdamW
lr 1e-3, eps 1e-6, weight decay 0.1, clipping at 1.0): the captured ATen graph (forward, loss,
backward, clipping, AdamW update) runs once under aot_eager and once as one XLA:CPU program from
the same inputs. The bounds, all fp32 (unit roundoff u = 2^-24 ~ 6e-8):

- Loss: |d loss| <= 1e-5 |loss|. Both runs compute the same ops in possibly different summation
  orders; a dot product of length K reassociated gives relative errors ~ sqrt(K) u (random-walk
  rounding, K <= 4096 here: ~4e-6) per matmul chain link, and the loss (mean log-softmax, a
  1-Lipschitz function of the logits in max-norm, ~8.3 at init) inherits the logits' relative error.
- Gradients (read back from exp_avg = (1 - beta1) g after step 1): per tensor,
  |d g| <= 1e-4 max|g|. The same reassociation argument over a backward chain of ~2L + 3 matmuls
  gives sqrt(4096) u sqrt(7) ~ 1e-5 of the magnitudes summed; 10x covers cancellation in the sums
  (magnitudes larger than the result) and stays below the worst-case (linear in K) bound 2.4e-4.
- Parameters: per element, |d p| <= lr eps |d g| / (min(|g|, |g'|) + eps)^2 (2 lr where g, g' differ in
  sign) + 4 ulp of (|p| + lr). At Adam's first step the update is lr g / (|g| + eps) (+ weight decay,
  identical on both sides); that is the mean value theorem on it, using the two runs' own gradients.
  Where |g| << eps the update is linear in g with slope lr / eps = 1000, so the bound is tight there
  (measured ratios ~0.998): it checks that XLA applied exactly the AdamW update to its gradients,
  and the gradient bound above limits those gradients.
- Gradient norm: relative 1e-4 (the gradient bound, summed in quadrature).
- Every other tensor the step updates in place (moments, step counters) came back: |diff| <= 2 lr.

Loops: with layer scan, the step's StableHLO holds exactly two `stablehlo.while` (the forward scan
and autograd's backward scan), at 2 and at 4 layers; unrolled steps hold none.
"""

from __future__ import annotations

import pytest

from tests.xla.conftest import LOWERING_VARIANTS

pytestmark = pytest.mark.xla

LOSS_REL, GRAD_REL, GRAD_NORM_REL, LR = 1e-5, 1e-4, 1e-4, 1e-3

RUN_VARIANTS = [v for v in LOWERING_VARIANTS if not v.endswith(":lower")]


def _result(lowering: dict, variant: str) -> dict:
    res = lowering["variants"][variant]
    assert "error" not in res, f"{variant} failed at {res.get('stage')}: {res['error']}\n{res.get('traceback', '')}"
    return res


@pytest.mark.parametrize("variant", RUN_VARIANTS)
def test_step_on_xla_cpu_matches_aot_eager(lowering, variant):
    res = _result(lowering, variant)
    assert abs(res["xla_loss"] - res["aot_loss"]) <= LOSS_REL * abs(res["aot_loss"]), res
    assert abs(res["xla_grad_norm"] - res["aot_grad_norm"]) <= GRAD_NORM_REL * res["aot_grad_norm"], res
    # Every parameter with an AdamW slot was checked (12 stacked/outer tensors with scan, more unrolled).
    assert res["params_checked"] >= 12, res
    assert res["grad_diff_rel"] <= GRAD_REL, res
    assert res["param_diff_over_bound"] <= 1.0, res
    assert res["max_mutated_diff"] <= 2 * LR, res
    # The unrolled graph has no loop, the scanned one one per direction.
    assert res["stablehlo_while"] == (2 if ":scan:" in variant else 0), res
    assert res["scans"] == (2 if ":scan:" in variant else 0), res


@pytest.mark.parametrize("family", ["llama3:debugmodel"])
def test_scan_is_one_loop_each_way_whatever_n_layers(lowering, family):
    two, four = (_result(lowering, f"{family}:scan:{n}" + ("" if n == 2 else ":lower")) for n in (2, 4))
    assert two["stablehlo_while"] == four["stablehlo_while"] == 2, (two, four)
    # The program does not grow with depth: same captured graph, StableHLO text within 1 %
    # (only the stacked dimension's digits change).
    assert two["graph_nodes"] == four["graph_nodes"], (two, four)
    assert abs(two["stablehlo_chars"] - four["stablehlo_chars"]) <= 0.01 * two["stablehlo_chars"], (two, four)
    unrolled = _result(lowering, f"{family}:unrolled:2")
    assert unrolled["stablehlo_while"] == 0 and unrolled["graph_nodes"] > two["graph_nodes"]
