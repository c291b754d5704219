"""Low-precision linears (`[quantize]`): the emulation against a hand-written quantizer, the error
against fp32 within the bound argued from each format's rounding, the scales, zero and non-finite
inputs, the module swap, and the swap under torch.compile, the graph step with layer scan and
SimpleFSDP on two thread ranks.

The bound (docs/low_precision.md#error-bound). Quantizing an element t of a group with scale s
rounds t / s to the format's grid, so its error is at most e(t) = max(u |t|, s d / 2): u the unit
roundoff of a normal number (2^-4 for e4m3's 3 mantissa bits, 2^-3 for e5m2's 2) and d the grid
spacing below the smallest normal (2^-9 e4m3, 2^-16 e5m2); int8 is a uniform grid, e(t) = s / 2.
A product of two quantized operands then differs from the exact one by at most
|a| e(b) + e(a) |b| + e(a) e(b) per term, so

    |a_q @ b_q^T - a @ b^T| <= e(a) @ |b|^T + |a| @ e(b)^T + e(a) @ e(b)^T      (elementwise)

plus float32 summation (K 2^-24 (|a| @ |b|^T), taken twice). Each matmul of each recipe is checked
against this bound computed from its own scales; the typical (Frobenius) error is far below it
and is pinned too, so a recipe that quietly lost precision fails.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from models.common import ops
from models.common import quantize as q
from models.common.quantize import BLOCK, E4M3, E5M2, INT8, QMAX, RECIPE_SPECS, Operand
from parallelisms.quantize import DEFAULT_FILTER_FQNS, QuantizedLinear, apply_quantize, quantized_modules

RECIPES = tuple(RECIPE_SPECS)
UNIT_ROUNDOFF = {E4M3: 2.0**-4, E5M2: 2.0**-3}
SUBNORMAL_SPACING = {E4M3: 2.0**-9, E5M2: 2.0**-16}


def _grid(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite value of a float8 format (decoded from its 256 codes) and the codes."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).float()
    keep = torch.isfinite(values)
    return values[keep].double(), codes[keep]


def _round_to_grid(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round to the nearest value of the format, ties to the even code (IEEE round-to-nearest-
    even): written from the decoded grid, independent of torch's encoder."""
    values, codes = _grid(dtype)
    out = torch.empty(v.shape, dtype=torch.float64)
    for i, x in enumerate(v.double().flatten().tolist()):
        dist = (values - x).abs()
        best = dist.min()
        ties = (dist == best).nonzero().flatten()
        pick = ties[0] if len(ties) == 1 else next(t for t in ties if int(codes[t]) % 2 == 0)
        out.view(-1)[i] = values[pick]
    return out


def _hand_quantize(t: torch.Tensor, op: Operand) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized values [R, K], per-element scale [R, K]) by explicit loops over the groups."""
    rows, cols = t.shape
    rh = {"tensor": rows, "axis": 1, "tile": 1, "block": BLOCK}[op.granularity]
    kw = {"tensor": cols, "axis": cols, "tile": BLOCK, "block": BLOCK}[op.granularity]
    deq = torch.empty(rows, cols, dtype=torch.float64)
    scale = torch.empty(rows, cols, dtype=torch.float64)
    for r0 in range(0, rows, rh):
        for k0 in range(0, cols, kw):
            g = t[r0 : r0 + rh, k0 : k0 + kw].float()
            s = torch.tensor(g.abs().max().item() / QMAX[op.dtype], dtype=torch.float32)
            if op.pow2:
                s = torch.tensor(2.0 ** math.ceil(math.log2(s.item())), dtype=torch.float32)
            v = (g / s).clamp(-QMAX[op.dtype], QMAX[op.dtype])
            if op.dtype == INT8:
                grid = torch.tensor([float(round(x)) for x in v.flatten().tolist()]).reshape(v.shape)  # half-to-even
            else:
                grid = _round_to_grid(v, op.dtype)
            deq[r0 : r0 + rh, k0 : k0 + kw] = (grid.float() * s).double()  # dequantized in fp32
            scale[r0 : r0 + rh, k0 : k0 + kw] = s.double()
    return deq, scale


def _rounding_to_the_float8_grid_equals_torchs_cast(dtype):
    """`round_to_float8` (fp32 arithmetic) gives what torch's float8 cast gives, on every grid
    value, every midpoint between neighbours (the ties), values just beside them and random ones
    across the range, subnormals included."""
    values, _ = _grid(dtype)
    values = values.float().unique()
    mids = (values[1:] + values[:-1]) / 2
    g = torch.Generator().manual_seed(7)
    rand = (torch.rand(20000, generator=g) * 2 - 1) * QMAX[dtype] * torch.logspace(-8, 0, 20000)
    v = torch.cat([values, mids, mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(0.0)), rand])
    v = v.clamp(-QMAX[dtype], QMAX[dtype])
    assert torch.equal(q.round_to_float8(v, dtype), v.to(dtype).float())


def test_rounding_to_the_float8_grid_equals_torchs_cast():
    for dtype in (E4M3, E5M2):
        _rounding_to_the_float8_grid_equals_torchs_cast(dtype)


OPERANDS = [
    Operand(E4M3),
    Operand(E5M2),
    Operand(E4M3, "axis", pow2=True),
    Operand(E4M3, "tile"),
    Operand(E4M3, "block"),
    Operand(INT8, "axis"),
]


def _quantization_equals_a_hand_written_quantizer(op):
    """Every value and every scale is the one the loops over groups and the nearest-even rounding
    on the decoded grid give: exactly (same rounding, ties included)."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(130, 260, generator=g) * torch.logspace(-3, 1, 260)  # subnormals to large
    t[0, :4] = torch.tensor([0.0, -0.0, 3.0, -3.0])
    ref, ref_scale = _hand_quantize(t, op)
    got = q.qdq(t, op).double()
    qv, s = q.quantize(t, op)
    per_elem = q.dequantize(torch.ones_like(qv, dtype=torch.float32), s, tuple(t.shape)).double()
    assert torch.equal(per_elem, ref_scale)
    assert torch.equal(got, ref), (got - ref).abs().max()


def test_quantization_equals_a_hand_written_quantizer():
    for op in OPERANDS:
        _quantization_equals_a_hand_written_quantizer(op)


def _element_error(t: torch.Tensor, op: Operand) -> torch.Tensor:
    """The bound e(t) of the module docstring, per element, from the operand's own scales."""
    if op.dtype is None:
        return torch.zeros_like(t, dtype=torch.float64)
    qv, s = q.quantize(t, op)
    scale = q.dequantize(torch.ones_like(qv, dtype=torch.float32), s, tuple(t.shape)).double()
    if op.dtype == INT8:
        return scale / 2
    return torch.maximum(UNIT_ROUNDOFF[op.dtype] * t.double().abs(), scale * SUBNORMAL_SPACING[op.dtype] / 2)


def _check_bound(a: torch.Tensor, b: torch.Tensor, spec) -> float:
    """Assert |scaled_matmul - exact| within the argued bound; return the Frobenius relative error."""
    got = q.scaled_matmul(a, b, spec, torch.float32).double()
    exact = a.double() @ b.double().t()
    ea, eb = _element_error(a, spec.a), _element_error(b, spec.b)
    aa, bb = a.double().abs(), b.double().abs()
    bound = ea @ bb.t() + aa @ eb.t() + ea @ eb.t() + 2 * a.shape[1] * 2.0**-24 * (aa @ bb.t())
    excess = (got - exact).abs() - bound
    assert excess.max() <= 0, f"over the bound by {excess.max().item():.3g}"
    return ((got - exact).norm() / exact.norm()).item()


TYPICAL = {"float8_tensorwise": 0.08, "float8_rowwise": 0.06, "float8_blockwise": 0.06, "int8": 0.02}
"""Frobenius relative error per matmul on Gaussian operands, ceilings over the measured values
(e4m3 ~0.035, e5m2 gradients ~0.06, int8 ~0.012: docs/low_precision.md)."""


def _each_matmul_is_within_the_argued_bound_of_fp32(recipe):
    g = torch.Generator().manual_seed(1)
    m, k, n = 96, 300, 72  # K not a multiple of 128: padded tiles and blocks
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.02
    dy = torch.randn(m, n, generator=g) * 1e-3
    spec = RECIPE_SPECS[recipe]
    errors = {
        "forward": _check_bound(x, w, spec.forward),
        "grad_input": _check_bound(dy, w.t(), spec.grad_input),
        "grad_weight": _check_bound(dy.t(), x.t(), spec.grad_weight),
    }
    assert 0 < errors["forward"] < TYPICAL[recipe], errors
    assert errors["grad_input"] < TYPICAL[recipe], errors
    if recipe == "int8":  # the weight gradient is not quantized: fp32 sums only
        assert errors["grad_weight"] < 1e-6, errors
    else:
        assert 0 < errors["grad_weight"] < TYPICAL[recipe], errors


def test_each_matmul_is_within_the_argued_bound_of_fp32():
    for recipe in RECIPES:
        _each_matmul_is_within_the_argued_bound_of_fp32(recipe)


def _autograd_runs_the_recipe_matmuls(recipe):
    """The op's forward and gradients are the recipe's three matmuls, bitwise."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 40, 256, generator=g, requires_grad=True)
    w = (torch.randn(192, 256, generator=g) * 0.05).requires_grad_()
    dy = torch.randn(3, 40, 192, generator=g)
    y = ops.quantized_linear(x, w, recipe)
    y.backward(dy)
    spec = RECIPE_SPECS[recipe]
    x2, dy2 = x.detach().reshape(-1, 256), dy.reshape(-1, 192)
    assert torch.equal(y.detach().reshape(-1, 192), q.scaled_matmul(x2, w.detach(), spec.forward, torch.float32))
    assert torch.equal(x.grad.reshape(-1, 256), q.scaled_matmul(dy2, w.detach().t(), spec.grad_input, torch.float32))
    assert torch.equal(w.grad, q.scaled_matmul(dy2.t(), x2.t(), spec.grad_weight, torch.float32))


def test_autograd_runs_the_recipe_matmuls():
    for recipe in RECIPES:
        _autograd_runs_the_recipe_matmuls(recipe)


def test_scales_are_per_tensor_per_row_and_per_block():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 260, generator=g)
    amax = x.abs()
    _, s = q.quantize(x, Operand(E4M3))
    assert s.shape == (1, 1) and s.item() == pytest.approx(amax.max().item() / 448, rel=1e-7)
    _, s = q.quantize(x, Operand(E4M3, "axis", pow2=True))
    rows = amax.amax(dim=1) / 448
    assert s.shape == (300, 1)
    assert torch.equal(torch.log2(s).round(), torch.log2(s))  # powers of two
    assert bool(((s[:, 0] >= rows) & (s[:, 0] < 2 * rows)).all())  # the smallest power >= amax / qmax
    _, s = q.quantize(x, Operand(E4M3, "tile"))
    assert s.shape == (300, 3)  # 260 columns: tiles of 128, 128, 4
    assert s[7, 2].item() == pytest.approx(amax[7, 256:].max().item() / 448, rel=1e-7)
    _, s = q.quantize(x, Operand(E4M3, "block"))
    assert s.shape == (3, 3)  # 128 x 128 blocks of a 300 x 260 weight
    assert s[2, 1].item() == pytest.approx(amax[256:, 128:256].max().item() / 448, rel=1e-7)
    _, s = q.quantize(x, Operand(INT8, "axis"))
    assert torch.allclose(s[:, 0], amax.amax(dim=1) / 127, rtol=1e-7, atol=0)


def _zero_input_gives_zero_and_no_nan(recipe):
    x = torch.zeros(8, 256, requires_grad=True)
    w = torch.zeros(64, 256, requires_grad=True)
    y = ops.quantized_linear(x, w, recipe)
    y.sum().backward()
    for t in (y, x.grad, w.grad):
        assert torch.equal(t, torch.zeros_like(t))


def test_zero_input_gives_zero_and_no_nan():
    for recipe in RECIPES:
        _zero_input_gives_zero_and_no_nan(recipe)


def _a_non_finite_input_poisons_what_its_scale_group_touches(recipe):
    """An inf in an activation gives NaN in every output its scale group reaches (the whole
    output for tensorwise, its row otherwise) and nowhere else: never a finite wrong number that
    the trainer's non-finite checks would miss."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 256, generator=g)
    x[1, 5] = float("inf")
    w = torch.randn(32, 256, generator=g) * 0.05
    y = ops.quantized_linear(x, w, recipe)
    bad = ~torch.isfinite(y)
    if recipe == "float8_tensorwise":
        assert bool(bad.all())
    else:
        assert bool(bad[1].all()) and not bool(bad[[0, 2, 3]].any())


def test_a_non_finite_input_poisons_what_its_scale_group_touches():
    for recipe in RECIPES:
        _a_non_finite_input_poisons_what_its_scale_group_touches(recipe)


def _the_scale_tracks_amax_so_tiny_and_huge_activations_neither_vanish_nor_overflow(recipe):
    """Scaling x by a power of two scales the output by it exactly (dynamic scales: the quantized
    values are the same). A broken scale fails this: a frozen scale flushes 2^-24 x to zero and
    clamps 2^20 x at the format's maximum; a scale not updated from this call's amax does too."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 256, generator=g)
    w = torch.randn(64, 256, generator=g) * 0.05
    base = ops.quantized_linear(x, w, recipe)
    for p in (-24, 20):
        y = ops.quantized_linear(x * 2.0**p, w, recipe)
        assert torch.isfinite(y).all()
        assert torch.equal(y, base * 2.0**p), p


def test_the_scale_tracks_amax_so_tiny_and_huge_activations_neither_vanish_nor_overflow():
    for recipe in RECIPES:
        _the_scale_tracks_amax_so_tiny_and_huge_activations_neither_vanish_nor_overflow(recipe)


def test_a_frozen_scale_is_caught(monkeypatch):
    """The test above fails when the scale does not track amax (so it can fail)."""
    monkeypatch.setattr(q, "scales", lambda t, op: torch.ones(q.group_view(t, op.granularity).shape[:2]))
    with pytest.raises(AssertionError):
        _the_scale_tracks_amax_so_tiny_and_huge_activations_neither_vanish_nor_overflow("float8_tensorwise")


# --- the module swap ------------------------------------------------------------------------------


def _llama(n_layers=2, **kw):
    from models.llama3 import FLAVORS, Transformer

    return Transformer(dataclasses.replace(FLAVORS["debugmodel"], n_layers=n_layers, **kw))


def test_swap_keeps_paths_and_state_dict_and_leaves_out_the_head_and_small_layers():
    with torch.device("meta"):
        model = _llama()
    keys = list(model.state_dict())
    assert apply_quantize(model, recipe="none", min_dim=0) == []
    assert apply_quantize(model, recipe="int8") == []  # debug widths (256, 768) are below 1024
    swapped = apply_quantize(model, recipe="float8_rowwise", min_dim=0)
    assert list(model.state_dict()) == keys
    assert "output" not in swapped and "output" in DEFAULT_FILTER_FQNS
    assert len(swapped) == 2 * 7  # q, k, v, o, w1, w2, w3 per layer
    assert set(quantized_modules(model).values()) == {"float8_rowwise"}
    assert type(model.output) is nn.Linear
    with torch.device("meta"):
        model = _llama()
    # filter_fqns replaces the default: the head is quantized once "output" is not in it
    assert apply_quantize(model, recipe="int8", min_dim=0, filter_fqns=("attention",)) == [
        f"layers.{i}.feed_forward.w{j}" for i in range(2) for j in (1, 2, 3)
    ] + ["output"]


def test_moe_router_is_left_out():
    from models.qwen3 import FLAVORS, Transformer

    with torch.device("meta"):
        model = Transformer(dataclasses.replace(FLAVORS["debugmodel_moe"], n_layers=1))
    swapped = apply_quantize(model, recipe="int8", min_dim=0)
    assert swapped and not any("router" in s for s in swapped)


def test_quantized_linear_forward_is_the_op_plus_bias():
    layer = nn.Linear(256, 64)
    ref = nn.Linear(256, 64)
    ref.load_state_dict(layer.state_dict())
    layer.__class__, layer.recipe = QuantizedLinear, "int8"
    x = torch.randn(5, 256)
    assert torch.equal(layer(x), ops.quantized_linear(x, ref.weight, "int8") + ref.bias)
    assert "recipe=int8" in repr(layer)


def _compile_aot_eager_matches_eager(recipe):
    torch.manual_seed(6)
    net = nn.Sequential(nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 256))
    apply_quantize(net, recipe=recipe, min_dim=0)
    x = torch.randn(32, 256)
    net(x).square().mean().backward()
    eager = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    compiled = torch.compile(net, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    out.square().mean().backward()
    assert torch.equal(out, net(x))
    for a, b in zip(eager, [p.grad for p in net.parameters()]):
        assert torch.equal(a, b)


def test_compile_aot_eager_matches_eager():
    for recipe in ("float8_tensorwise", "float8_blockwise"):
        _compile_aot_eager_matches_eager(recipe)


# --- the graph step with layer scan, SimpleFSDP ---------------------------------------------------


def _graph_model(recipe: str):
    from parallelisms.simple_fsdp import data_parallel
    from tests.support.graph_common import Llama3, small_args

    with torch.device("meta"):
        model = Llama3(small_args(2))
    apply_quantize(model, recipe=recipe, min_dim=0)
    data_parallel(model, mesh=None, param_dtype=torch.float32, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    return model


@pytest.mark.parametrize("recipe", ["float8_rowwise", "int8"])
def test_graph_step_with_layer_scan_matches_eager(recipe):
    """Three steps of the reduced Llama 3 debug model with every block linear quantized: the
    captured step (layer scan, aot_eager) and the eager step give the same losses and gradient
    norms (the tolerance of tests/unit/test_graph_step.py: the two run the same ops)."""
    from tests.support.graph_common import PLAN, batches, build_opt, eager_step, run
    from trainer.graph import build_graph_step

    ref_model, model = _graph_model(recipe), _graph_model(recipe)
    assert len(quantized_modules(model)) == 14
    ref_opt, opt = build_opt(ref_model), build_opt(model)
    step = build_graph_step(model=model, optimizer=opt, max_norm=1.0, backend="aot_eager", scan_layers=True, plan=PLAN)
    data = batches(3)
    ref = run(eager_step(ref_model, ref_opt), ref_opt, data)
    got = run(step, opt, data)
    assert step.stats.scans > 0
    for (l1, n1), (l2, n2) in zip(ref, got):
        assert abs(l1 - l2) <= 1e-5 * abs(l1) and abs(n1 - n2) <= 1e-5 * abs(n1), (ref, got)


def _simple_fsdp_two_thread_ranks_match_one_process(recipe):
    """SimpleFSDP over 2 ranks, each with half of a 16-sequence batch, against one process that
    runs the same halves as two accumulated micro-batches: the fp32 master weights are sharded,
    gathered, then quantized per use, so losses and gradients agree to fp32 summation order.

    The reference takes the ranks' micro-batches because quantization is discontinuous: a
    one-process run of the whole batch sums the unquantized output head's backward in another
    order (a matmul of 256 rows, not 128), and the last-bit differences flip a few roundings
    in the next quantized gradient; the gradients then differ by up to ~1 % (measured 0.8 % on
    the embedding, int8), against 1e-6 without quantization. Scales of activations and
    gradients are per rank (per micro-batch), as torchao's."""
    from parallelisms import ParallelDims, build_mesh, parallelize_model
    from parallelisms.quantize import QuantizePlan
    from tests.support.parallel_harness import (
        FAMILIES,
        RNG_LOCK,
        batch,
        full,
        lm_loss,
        load_full_state,
        reference_state,
        rel_diff,
        run_threads,
    )

    cls, make_args, plan = FAMILIES["llama3"]
    state = reference_state("llama3")
    inputs, labels = batch(make_args().vocab_size, batch_size=16)
    fp32 = dict(param_dtype=torch.float32, reduce_dtype=torch.float32)

    ref = cls(make_args())
    apply_quantize(ref, recipe=recipe, min_dim=0)
    ref.load_state_dict(state, strict=False)
    ref_loss = 0.0
    for i in range(2):
        loss = lm_loss(ref(inputs.chunk(2)[i]), labels.chunk(2)[i]) / 2
        loss.backward()
        ref_loss += loss.detach()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    def rank_fn():
        dims = ParallelDims(world_size=2, dp_shard=2)
        mesh = build_mesh(dims, "cpu")
        with torch.device("meta"):
            model = cls(make_args())
        quantize = QuantizePlan(recipe, min_dim=0)
        parallelize_model(model, plan=plan, parallel_dims=dims, mesh=mesh, quantize=quantize, **fp32)
        model.to_empty(device="cpu")
        with RNG_LOCK, torch.no_grad():
            model.init_weights()
        load_full_state(model, state)
        rank = dims.dp_rank(mesh)
        loss = lm_loss(model(inputs.chunk(2)[rank]), labels.chunk(2)[rank])
        loss.backward()
        return loss.detach(), {n: full(p.grad) for n, p in model.named_parameters()}, len(quantized_modules(model))

    results = run_threads(2, rank_fn)
    assert all(r[2] == 14 for r in results)
    assert rel_diff(torch.stack([r[0] for r in results]).mean(), ref_loss) < 1e-6
    for _, grads, _ in results:
        worst = max((rel_diff(grads[n], ref_grads[n]), n) for n in ref_grads)
        assert worst[0] < 1e-5, worst


def test_simple_fsdp_two_thread_ranks_match_one_process():
    for recipe in RECIPES:
        _simple_fsdp_two_thread_ranks_match_one_process(recipe)


def _the_cuda_implementation_computes_the_emulation(recipe, monkeypatch):
    """titan_kernels/cuda_quantize.py calls `torch._scaled_mm` / `torch._int_mm`, which torch 2.13
    also runs on the CPU: with its CUDA-only guard lifted, forward and gradients equal the
    emulation (int8: exactly, int32 sums; float8: to fp32 summation order). What this cannot show:
    the CUDA kernels' own behaviour (no GPU here; docs/low_precision.md)."""
    from titan_kernels import cuda_quantize as cq

    monkeypatch.setattr(cq, "_kernel_ok", lambda a, b, spec: cq._kernels_take(a, b, spec, "cpu"))
    calls = []
    for name in ("_scaled_mm", "_int_mm"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, 256, generator=g, requires_grad=True)
    w = (torch.randn(48, 256, generator=g) * 0.05).requires_grad_()
    dy = torch.randn(64, 48, generator=g)
    got = [cq._CudaQuantizedLinear.apply(x, w, recipe)]
    got += torch.autograd.grad(got[0], (x, w), dy)
    ref = [q.emulated_linear(x, w, recipe)]
    ref += torch.autograd.grad(ref[0], (x, w), dy)
    for a, b in zip(got, ref):
        assert (a - b).abs().max() <= 2 * 256 * 2.0**-24 * b.abs().max(), recipe
    kernels = {"float8_tensorwise": 3, "float8_rowwise": 3, "float8_blockwise": 0, "int8": 2}[recipe]
    assert len(calls) == kernels, calls  # blockwise: the emulation; int8's weight gradient: fp32


def test_the_cuda_implementation_computes_the_emulation(monkeypatch):
    for recipe in RECIPES:
        _the_cuda_implementation_computes_the_emulation(recipe, monkeypatch)


def test_the_cuda_implementation_takes_a_float8_gathered_weight(monkeypatch):
    """float8_tensorwise with the weight gathered in float8: titan_kernels/cuda_quantize.py hands
    the float8 weight to `torch._scaled_mm` as it is (its transposed copy for the input gradient)
    and quantizes only x and dy; on torch's CPU kernels, with the CUDA-only guard lifted, the
    forward and both gradients (dw reaching the carrier) equal the emulation on the same values to
    fp32 summation order, with 3 `_scaled_mm` calls and no quantization of the weight."""
    from titan_kernels import cuda_quantize as cq

    monkeypatch.setattr(cq, "_kernel_ok", lambda a, b, spec: cq._kernels_take(a, b, spec, "cpu"))
    calls, quantized = [], []
    real_mm, real_q = torch._scaled_mm, q.quantize
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(a[1].dtype) or real_mm(*a, **k))
    monkeypatch.setattr(q, "quantize", lambda t, op: quantized.append(tuple(t.shape)) or real_q(t, op))
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 256, generator=g, requires_grad=True)
    w = torch.randn(48, 256, generator=g) * 0.05
    dy = torch.randn(64, 48, generator=g)
    values, scale = real_q(w, q.Operand(q.E4M3))
    w_q, scale = values.reshape(w.shape).to(q.E4M3), scale.reshape(())
    carrier = torch.zeros(()).expand(48, 256).requires_grad_()
    got = [cq._CudaW8Linear.apply(x, carrier, w_q, scale, "float8_tensorwise")]
    got += torch.autograd.grad(got[0], (x, carrier), dy)
    held = w_q.float().requires_grad_()
    ref = [q.emulated_linear(x, held, "float8_tensorwise", scale)]
    ref += torch.autograd.grad(ref[0], (x, held), dy)
    for a, b in zip(got, ref):
        assert (a - b).abs().max() <= 2 * 256 * 2.0**-24 * b.abs().max()
    assert len(calls) == 3 and calls[:2] == [q.E4M3, q.E4M3], calls  # fwd and dx read the float8 weight
    assert (48, 256) not in quantized and (256, 48) not in quantized, quantized
    assert getattr(cq.quantized_linear, "takes_float8_weight", False)


def _tensor_parallel_two_thread_ranks_forward_equals_one_process(recipe):
    """TP 2 (eager): the quantized linears compute on DTensors, so a scale's amax is the global
    one (DTensor reduces it over the TP shards) and the loss is bitwise one process's. The
    gradients agree within the rounding flips of the FSDP test's docstring (here TP's sharded
    sums of the unquantized ops): measured <= 1.0 % (tensorwise), 0.25 % (int8). Scales taken per
    shard would change the forward of the K-sharded (row-parallel) linears, so the loss itself."""
    from parallelisms import ParallelDims, build_mesh, parallelize_model
    from parallelisms.quantize import QuantizePlan
    from tests.support.parallel_harness import (
        FAMILIES,
        RNG_LOCK,
        batch,
        full,
        lm_loss,
        load_full_state,
        reference_state,
        rel_diff,
        run_threads,
    )

    cls, make_args, plan = FAMILIES["llama3"]
    state = reference_state("llama3")
    inputs, labels = batch(make_args().vocab_size, batch_size=4)
    ref = cls(make_args())
    apply_quantize(ref, recipe=recipe, min_dim=0)
    ref.load_state_dict(state, strict=False)
    ref_loss = lm_loss(ref(inputs), labels)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    def rank_fn():
        dims = ParallelDims(world_size=2, dp_shard=1, tp=2)
        mesh = build_mesh(dims, "cpu")
        with torch.device("meta"):
            model = cls(make_args())
        quantize = QuantizePlan(recipe, min_dim=0)
        fp32 = dict(param_dtype=torch.float32, reduce_dtype=torch.float32)
        parallelize_model(model, plan=plan, parallel_dims=dims, mesh=mesh, quantize=quantize, **fp32)
        model.to_empty(device="cpu")
        with RNG_LOCK, torch.no_grad():
            model.init_weights()
        load_full_state(model, state)
        loss = lm_loss(model(inputs), labels)
        loss.backward()
        return loss.detach(), {n: full(p.grad) for n, p in model.named_parameters()}

    for loss, grads in run_threads(2, rank_fn):
        assert torch.equal(loss, ref_loss.detach())
        worst = max((rel_diff(grads[n], ref_grads[n]), n) for n in ref_grads)
        assert worst[0] < 0.03, worst


def test_tensor_parallel_two_thread_ranks_forward_equals_one_process():
    for recipe in ("float8_tensorwise", "int8"):
        _tensor_parallel_two_thread_ranks_forward_equals_one_process(recipe)
