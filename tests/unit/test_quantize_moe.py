"""The MoE experts under a low-precision recipe: the op `quantized_grouped_mm` (reference
models/common/quantize.py: emulated_grouped_mm) and `GroupedExperts` with a recipe.

Every scale group lies inside one expert: the emulation equals a hand-written per-group
quantizer (each group's rows quantized alone), each group's three matmuls are within the bound
argued for one linear (docs/low_precision.md#error-bound), and changing one expert's weights or
tokens leaves every other expert's outputs and gradients bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from models.common import ops
from models.common import quantize as q
from models.common.moe import GroupedExperts
from models.common.quantize import RECIPE_SPECS
from parallelisms.quantize import apply_quantize
from tests.unit.test_quantize import _check_bound, _hand_quantize

RECIPES = tuple(RECIPE_SPECS)
SIZES = [3, 0, 5, 4]  # an empty expert included; 12 rows of 14 (2 padding rows)


def _operands(seed=0, m=14, k=256, n=128):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(len(SIZES), k, n, generator=g) * 0.05
    return x, w, torch.tensor(SIZES)


def _groups():
    ends = torch.cumsum(torch.tensor(SIZES), 0).tolist()
    return [(e - s, e) for s, e in zip(SIZES, ends)]


@pytest.mark.parametrize("recipe", RECIPES)
def test_forward_equals_a_hand_written_per_group_quantizer(recipe):
    x, w, sizes = _operands()
    got = ops.quantized_grouped_mm(x, w, sizes, recipe)
    spec = RECIPE_SPECS[recipe].forward
    for g, (s, e) in enumerate(_groups()):
        if s == e:
            continue
        xa, _ = _hand_quantize(x[s:e], spec.a)  # this expert's rows alone
        wb, _ = _hand_quantize(w[g].t().contiguous(), spec.b)
        ref = xa @ wb.t()
        torch.testing.assert_close(got[s:e].double(), ref, rtol=2e-6, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(got[sum(SIZES) :], torch.zeros_like(got[sum(SIZES) :]))


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_groups_matmuls_are_within_the_argued_bound(recipe):
    x, w, _ = _operands(1)
    dy = torch.randn(x.shape[0], w.shape[-1])
    spec = RECIPE_SPECS[recipe]
    for g, (s, e) in enumerate(_groups()):
        if s == e:
            continue
        wt = w[g].t().contiguous()  # [N, K], a linear's layout
        _check_bound(x[s:e], wt, spec.forward)
        _check_bound(dy[s:e], wt.t(), spec.grad_input)
        _check_bound(dy[s:e].t(), x[s:e].t(), spec.grad_weight)


def _run(x, w, sizes, recipe):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = ops.quantized_grouped_mm(x, w, sizes, recipe)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9))
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_expert_never_moves_anothers_scales(recipe):
    x, w, sizes = _operands(2)
    base = _run(x, w, sizes, recipe)
    w2, x2 = w.clone(), x.clone()
    w2[2] *= 1000.0  # expert 2: rows 3..7
    x2[3:8] *= 1000.0
    other = _run(x2, w2, sizes, recipe)
    rows = list(range(0, 3)) + list(range(8, 12))
    for a, b in zip(base[:2], other[:2]):
        assert torch.equal(a[rows], b[rows])
    for g in (0, 3):
        assert torch.equal(base[2][g], other[2][g])


@pytest.mark.parametrize("recipe", ["float8_rowwise", "int8"])
def test_experts_layer_eager_compile_and_capacity_agree(recipe):
    torch.manual_seed(3)
    layer = GroupedExperts(dim=256, hidden_dim=128, num_experts=4)
    model = torch.nn.ModuleDict({"experts": layer})
    apply_quantize(model, recipe=recipe, min_dim=0)
    assert layer.recipe == recipe
    x, sizes = torch.randn(12, 256), torch.tensor([3, 0, 5, 4])
    out = layer(x, sizes)
    out.square().mean().backward()
    eager = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    out_c = compiled(x, sizes)
    out_c.square().mean().backward()
    assert torch.equal(out, out_c)
    for a, b in zip(eager, [p.grad for p in layer.parameters()]):
        assert torch.equal(a, b)
    # the capacity layout: expert e's rows in block e (zero padding rows), per-expert scales
    cap = torch.zeros(4, 5, 256)
    for g, (s, e) in enumerate(_groups()):
        cap[g, : e - s] = x[s:e]
    out_cap = layer.forward_capacity(cap)
    for g, (s, e) in enumerate(_groups()):
        torch.testing.assert_close(out_cap[g, : e - s], out[s:e], rtol=1e-5, atol=1e-6)


def test_experts_in_filter_fqns_stay_high_precision():
    model = torch.nn.ModuleDict({"experts": GroupedExperts(dim=256, hidden_dim=128, num_experts=2)})
    apply_quantize(model, recipe="float8_rowwise", filter_fqns=["experts"], min_dim=0)
    assert model["experts"].recipe == "none"
    assert q.emulated_batched_mm is not None


@pytest.mark.parametrize("recipe", RECIPES)
def test_capacity_layout_through_the_grouped_op_equals_one_linear_per_expert(recipe):
    """The capacity layout's op `quantized_batched_mm` as the TPU serves it (`batched_as_grouped`:
    the flattened buffer through a `quantized_grouped_mm` implementation with every group the
    capacity; here the grouped reference stands in for the TPU's ragged dots, which equal it on
    XLA:CPU, tests/xla/test_quantize_xla.py) against its reference, one `emulated_linear` per
    expert: outputs and both gradients within fp32 summation order (the grouped reference masks
    the other experts' rows to zero, which changes no amax, no scale and no product, only the
    order of a few zero terms). 160 rows: without the padding to 128-row multiples, blockwise's
    global token tiles would cross the capacity boundary (measured: dw 4.9 % apart)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 160, 256, generator=g)
    x[1, 100:] = 0.0  # padding rows of expert 1
    w = torch.randn(3, 256, 128, generator=g) * 0.05
    dy = torch.randn(3, 160, 128, generator=g)
    outs = []
    for fn in (q.emulated_batched_mm, lambda a, b, r: q.batched_as_grouped(q.emulated_grouped_mm, a, b, r)):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xx, ww, recipe)
        y.backward(dy)
        outs.append((y.detach(), xx.grad, ww.grad))
    for name, ref, got in zip(("y", "dx", "dw"), *outs):
        scale = ref.abs().max()
        assert (got - ref).abs().max() <= 2 * 256 * 2.0**-24 * scale, (recipe, name)
    # the op seam serves the capacity layout: a registered implementation is what forward_capacity calls
    layer = GroupedExperts(dim=256, hidden_dim=128, num_experts=3)
    apply_quantize(torch.nn.ModuleDict({"experts": layer}), recipe=recipe, min_dim=0)
    calls = []
    previous = ops.register("quantized_batched_mm", lambda a, b, r: calls.append(r) or q.emulated_batched_mm(a, b, r))
    try:
        layer.forward_capacity(x)
    finally:
        ops.register("quantized_batched_mm", previous)
    assert calls == [recipe] * 3
