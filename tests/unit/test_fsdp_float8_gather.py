"""Float8 all-gather of weights under SimpleFSDP (`[quantize] fsdp_float8_all_gather`,
parallelisms/simple_fsdp.py `_Float8Gather`): what the all-gather moves, what the linears compute
with it against float8_tensorwise on the bf16-gathered weight, and the rule that refuses it.

What is equal (docs/low_precision.md, "Float8 all-gather under SimpleFSDP"): the option quantizes
the fp32 master shard; without it the recipe quantizes the bf16-rounded gathered weight. When the
masters hold bf16 values (or the compute dtype is fp32) both see the same numbers: the same amax,
the same scale, the same e4m3 values, and the step is bitwise the same. Otherwise the bf16
rounding (relative 2^-9) moves a value across an e4m3 rounding midpoint now and then: the two
quantized weights are then one e4m3 step apart there (<= 2^-3 of the value, 2^-9 x scale below
the smallest normal), and the scales differ by bf16's rounding of the amax (<= 2^-9 relative).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from models.common import quantize as q
from models.common.quantize import E4M3
from parallelisms import ParallelDims, build_mesh, parallelize_model
from parallelisms.quantize import QuantizePlan, apply_quantize, quantized_modules
from parallelisms.simple_fsdp import data_parallel
from tests.support.parallel_harness import (
    FAMILIES,
    RNG_LOCK,
    batch,
    full,
    lm_loss,
    load_full_state,
    reference_state,
    rel_diff,
    run_processes,
    run_threads,
)
from trainer.step.plan import StepRequest, refusals

RECIPE = "float8_tensorwise"
MIXED = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class _Collectives(TorchDispatchMode):
    """Records (op name, input dtype, input bytes) of every functional collective on this thread."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("_c10d_functional::") and name != "_c10d_functional::wait_tensor":
            t = args[0]
            self.calls.append((name.split("::")[1], t.dtype, t.numel() * t.element_size()))
        return func(*args, **(kwargs or {}))


def _bf16_values(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state with every float tensor rounded to bf16 (kept fp32): masters a bf16 gather keeps."""
    return {k: v.bfloat16().float() if v.is_floating_point() else v for k, v in state.items()}


def _rank_step(state, inputs, labels, *, float8: bool, recipe: str = RECIPE, count: bool = False):
    """On a thread rank of two: the debug Llama 3 with `recipe` on every block linear, bf16
    compute, fp32 reduction, holding `state`; one forward and backward on this rank's micro-batch
    -> (loss, full gradients, collectives recorded in the forward)."""
    world = 2
    cls, make_args, plan = FAMILIES["llama3"]
    dims = ParallelDims(world_size=world, dp_shard=world)
    mesh = build_mesh(dims, "cpu")
    with torch.device("meta"):
        model = cls(make_args())
    quantize = QuantizePlan(recipe, min_dim=0, fsdp_float8_all_gather=float8)
    parallelize_model(model, plan=plan, parallel_dims=dims, mesh=mesh, quantize=quantize, **MIXED)
    model.to_empty(device="cpu")
    with RNG_LOCK, torch.no_grad():
        model.init_weights()
    load_full_state(model, state)
    assert len(quantized_modules(model)) == (0 if recipe == "none" else 14)
    rank = dims.dp_rank(mesh)
    mode = _Collectives()
    with mode if count else contextlib.nullcontext():
        out = model(inputs.chunk(world)[rank])
    loss = lm_loss(out, labels.chunk(world)[rank])
    loss.backward()
    return loss.detach(), {n: full(p.grad) for n, p in model.named_parameters()}, mode.calls


def test_float8_all_gather_moves_e4m3_bytes_and_matches_the_bf16_gather():
    """Two thread ranks, bf16 compute. The forward's all-gathers of the 14 quantized weights move
    uint8 (the e4m3 bytes): exactly half the bytes of their bf16 gathers, each after one 4-byte
    all-reduce (the amax); every other parameter's gather is unchanged. With masters that hold
    bf16 values the loss and every gradient equal the bf16-gather path's bitwise. With general fp32
    masters they differ by the rounding flips of the module docstring, which are of the recipe's
    own error: measured 2026-12-05, the losses differ by 7.6e-4 and 1.7e-3 (relative, the two
    ranks), and each gradient's distance (Frobenius) to the unquantized bf16 step's is 0.96-1.07x
    the bf16-gather path's (on this 256-wide model the recipe's gradients are 4-15 % from the
    unquantized ones). Pinned: loss 4e-3, distance ratio 1.25. (The bf16-gather path on two ranks
    equals one process: test_quantize.py's SimpleFSDP test.)"""
    cls, make_args, _ = FAMILIES["llama3"]
    fp32_state = reference_state("llama3")
    bf16_state = _bf16_values(fp32_state)
    inputs, labels = batch(make_args().vocab_size, batch_size=4)

    def rank_fn():
        on = _rank_step(bf16_state, inputs, labels, float8=True, count=True)
        off = _rank_step(bf16_state, inputs, labels, float8=False, count=True)
        on32 = _rank_step(fp32_state, inputs, labels, float8=True)
        off32 = _rank_step(fp32_state, inputs, labels, float8=False)
        none32 = _rank_step(fp32_state, inputs, labels, float8=False, recipe="none")
        return on, off, on32, off32, none32

    results = run_threads(2, rank_fn)
    for on, off, on32, off32, none32 in results:
        # bytes: per quantized weight one 4-byte amax all-reduce and a uint8 gather of half the bytes
        gathers_on = [c for c in on[2] if c[0] == "all_gather_into_tensor"]
        gathers_off = [c for c in off[2] if c[0] == "all_gather_into_tensor"]
        uint8 = [c for c in gathers_on if c[1] == torch.uint8]
        assert len(uint8) == 14 and len(gathers_on) == len(gathers_off)
        reduces = [c for c in on[2] if c[0] == "all_reduce"]
        assert [c[1:] for c in reduces] == [(torch.float32, 4)] * 14
        bytes_on, bytes_off = sum(c[2] for c in gathers_on), sum(c[2] for c in gathers_off)
        assert bytes_off - bytes_on == sum(c[2] for c in uint8)  # each uint8 gather: half its bf16 one
        assert not [c for c in off[2] if c[1] == torch.uint8]
        # bf16-valued masters: bitwise the bf16-gather step
        assert torch.equal(on[0], off[0])
        for n, g in off[1].items():
            assert torch.equal(on[1][n], g), n
        # fp32 masters: the rounding flips only
        assert rel_diff(on32[0], off32[0]) < 4e-3
        for n, exact in none32[1].items():
            ratio = (on32[1][n] - exact).norm() / (off32[1][n] - exact).norm()
            assert ratio < 1.25, (n, ratio)


def test_the_gathered_weight_is_the_recipe_quantization_of_the_master():
    """The two ranks' `float8_weight()` of one linear: the e4m3 values and the scale are exactly
    the recipe's quantization of the whole fp32 master (one global amax), and against the recipe's
    quantization of its bf16 rounding (what the op quantizes without the option) every element is
    equal or one e4m3 step away, the scale within 2^-9 relative. Measured 2026-12-05: 3,447 of
    131,072 values one step apart (2.6 %), the scale -1.24e-3 relative (0.11 in bf16), the two
    dequantized weights 1.5 % apart (Frobenius), against 2.7 % from the gathered one to the master."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 512, generator=g) * 0.02
    w[5, 7] = 0.11  # the amax sits on rank 0's shard

    def rank_fn():
        layer = nn.Linear(512, 256, bias=False)
        apply_quantize(layer, recipe=RECIPE, min_dim=0)
        mesh = build_mesh(ParallelDims(world_size=2, dp_shard=2), "cpu")
        plan = QuantizePlan(RECIPE, min_dim=0, fsdp_float8_all_gather=True)
        data_parallel(layer, mesh=mesh, float8_weights=plan.float8_weights, **MIXED)
        load_full_state(layer, {"weight": w})
        values, scale, carrier = layer.float8_weight()
        return values, scale, carrier

    for values, scale, carrier in run_threads(2, rank_fn):
        # The gathered bytes as they came (no wider copy), and a carrier that holds no memory.
        assert values.dtype == E4M3 and not values.requires_grad and not scale.requires_grad
        assert carrier.shape == w.shape and carrier.dtype == torch.bfloat16 and carrier.requires_grad
        assert carrier.stride() == (0, 0) and not torch.any(carrier)
        ref_q, ref_s = q.quantize(w, q.Operand(E4M3))
        assert torch.equal(scale.reshape(1, 1), ref_s)
        assert torch.equal(values.float(), ref_q.reshape(w.shape))
        b_q, b_s = q.quantize(w.bfloat16(), q.Operand(E4M3))
        b_q = b_q.reshape(w.shape)
        assert ((b_s - ref_s).abs() <= 2.0**-9 * ref_s).all()
        step = torch.maximum(
            2.0 ** (torch.floor(torch.log2(ref_q.reshape(w.shape).abs().clamp_min(2.0**-6))) - 3), torch.tensor(2.0**-9)
        )
        diff = (values.float() - b_q).abs()
        assert (diff <= step).all()
        flips = int((diff > 0).sum())
        assert 0 < flips < 0.05 * w.numel(), flips  # measured: see the docs


def test_the_rule_refuses_what_cannot_gather_in_float8():
    ok = StepRequest(quantize=RECIPE, fsdp_float8_all_gather=True, fsdp_shard_degree=2)
    assert refusals(ok) == []
    assert refusals(StepRequest(quantize=RECIPE, fsdp_float8_all_gather=True)) == []  # degree not known
    for bad in (
        dict(quantize="float8_rowwise"),
        dict(quantize="none"),
        dict(tp_degree=2),
        dict(fsdp_shard_degree=1),
    ):
        request = StepRequest(**{**ok.__dict__, **bad})
        (line,) = refusals(request)
        assert line.startswith("quantize.fsdp_float8_all_gather: true needs quantize.recipe = float8_tensorwise")


def _gloo_rank(w: torch.Tensor, x: torch.Tensor):
    """On a gloo process: can gloo all-gather float8 itself; one float8-gathered quantized linear,
    eager and compiled (aot_eager, one graph) -> (float8 gather error or None, [(y, weight grad)])."""
    try:
        out = torch.empty(8, dtype=E4M3)
        dist.all_gather_into_tensor(out, torch.zeros(4).to(E4M3))
        error = None
    except RuntimeError as exc:
        error = str(exc)
    mesh = build_mesh(ParallelDims(world_size=2, dp_shard=2), "cpu")
    plan = QuantizePlan(RECIPE, min_dim=0, fsdp_float8_all_gather=True)
    runs = []
    for compiled in (False, True):
        layer = nn.Linear(128, 64, bias=False)
        apply_quantize(layer, recipe=RECIPE, min_dim=0)
        data_parallel(layer, mesh=mesh, float8_weights=plan.float8_weights, **MIXED)
        load_full_state(layer, {"weight": w})
        fn = torch.compile(layer, backend="aot_eager", fullgraph=True) if compiled else layer
        y = fn(x)
        y.float().square().sum().backward()
        runs.append((y.detach(), layer._parameters["weight"].grad.to_local()))
    return error, runs


@pytest.mark.multiprocess
def test_gloo_moves_the_uint8_view_and_a_compiled_layer_equals_eager():
    """gloo refuses float8 collectives ("Invalid scalar type", torch 2.13), hence the uint8 view;
    over gloo the float8-gathered linear runs, and torch.compile (aot_eager, fullgraph: the amax
    all-reduce, the uint8 gather and the reduce-scatter traced in one graph) equals eager bitwise."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g) * 0.02
    x = torch.randn(2, 16, 128, generator=g).bfloat16()
    for error, ((y, grad), (y_c, grad_c)) in run_processes(2, _gloo_rank, w, x):
        assert error is not None and "Invalid scalar type" in error
        assert torch.equal(y, y_c) and torch.equal(grad, grad_c)


def _carrier(w: torch.Tensor) -> torch.Tensor:
    """What `_Float8Gather` hands on beside the values: zeros of w's shape in bf16, a broadcast."""
    return torch.zeros((), dtype=torch.bfloat16).expand(w.shape).requires_grad_()


def test_a_device_kernel_gets_the_weight_dequantized_and_quantizes_it_back():
    """A device's `quantized_linear` that takes no quantized weight (TPU and CUDA take it since
    2026-12-06; here the emulation registered as one) gets w * scale in fp32 and quantizes it again: the same e4m3 values, the
    scale within its fp32 rounding, so each bf16 output within one bf16 rounding of the
    emulation's use of (values, scale); the weight gradient passes the dequantization unchanged
    and reaches the carrier, as the emulation's does."""
    from models.common import ops

    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 128, generator=g) * 0.03
    x = torch.randn(32, 128, generator=g).bfloat16()
    values, scale = q.quantize(w, q.Operand(E4M3))
    values = values.reshape(w.shape).to(E4M3)
    carrier = _carrier(w)
    direct = ops.quantized_linear(x, values, RECIPE, scale.reshape(()), carrier)
    (grad_direct,) = torch.autograd.grad(direct.float().sum(), carrier)
    previous = ops.register("quantized_linear", q.emulated_linear)
    try:
        fallback = ops.quantized_linear(x, values, RECIPE, scale.reshape(()), carrier)
        (grad_fallback,) = torch.autograd.grad(fallback.float().sum(), carrier)
    finally:
        ops.register("quantized_linear", previous)
    # a scale one fp32 ulp off moves a bf16 output by at most one bf16 rounding
    assert ((fallback.float() - direct.float()).abs() <= 2.0**-8 * direct.float().abs()).all()
    assert torch.equal(grad_fallback, grad_direct)
    # the gradient is the one of the emulation on the values held in bf16
    held = values.to(torch.bfloat16).requires_grad_()
    (grad_held,) = torch.autograd.grad(q.emulated_linear(x, held, RECIPE, scale.reshape(())).float().sum(), held)
    assert torch.equal(grad_direct, grad_held)


def test_a_kernel_that_takes_float8_weights_gets_the_gathered_bytes():
    """An implementation marked `takes_float8_weight` (TPU's) is handed the float8 tensor itself,
    the scale and the carrier, and whatever weight gradient it returns for the carrier is what
    reaches the gather's backward; the emulation is not called."""
    from models.common import ops

    seen = {}

    class _Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, carrier, w_q, w_scale):
            seen.update(dtype=w_q.dtype, scale=w_scale)
            ctx.save_for_backward(x)
            return x.new_zeros(x.shape[0], w_q.shape[0])

        @staticmethod
        def backward(ctx, dy):
            (x,) = ctx.saved_tensors
            return None, (dy.t().float() @ x.float()).to(torch.bfloat16), None, None

    def impl(x, w_q, recipe, w_scale, w_grad):
        return _Spy.apply(x, w_grad, w_q, w_scale)

    impl.takes_float8_weight = True
    w = torch.randn(16, 32)
    values, scale = q.quantize(w, q.Operand(E4M3))
    carrier = _carrier(w)
    x = torch.randn(8, 32).bfloat16()
    previous = ops.register("quantized_linear", impl)
    try:
        y = ops.quantized_linear(x, values.reshape(w.shape).to(E4M3), RECIPE, scale.reshape(()), carrier)
        (grad,) = torch.autograd.grad(y.float().sum(), carrier)
    finally:
        ops.register("quantized_linear", previous)
    assert seen["dtype"] == E4M3 and torch.equal(seen["scale"], scale.reshape(()))
    assert torch.equal(grad, (torch.ones(8, 16).t() @ x.float()).to(torch.bfloat16))


def _graph_scan_rank(state):
    """On a gloo process: the reduced Llama 3 (2 layers) with every block linear float8_tensorwise
    and gathered in float8, 3 steps eager and 3 steps of the captured step with layer scan
    (aot_eager), from the same weights, fp32 compute -> per variant (losses, gathered weights,
    collectives, scans)."""
    from parallelisms import parallelize_model
    from tests.support.parallel_harness import LLAMA3_PLAN, Llama3, batch, full, llama3_args, lm_loss
    from trainer.graph import build_graph_step

    dims = ParallelDims(world_size=2, dp_shard=2)
    mesh = build_mesh(dims, "cpu")
    rank = dist.get_rank()
    out = {}
    for graph in (False, True):
        with torch.device("meta"):
            model = Llama3(llama3_args())
        quantize = QuantizePlan(RECIPE, min_dim=0, fsdp_float8_all_gather=True)
        fp32 = dict(param_dtype=torch.float32, reduce_dtype=torch.float32)
        parallelize_model(model, plan=LLAMA3_PLAN, parallel_dims=dims, mesh=mesh, quantize=quantize, **fp32)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights()
        load_full_state(model, state)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.1, foreach=False)
        step = None
        if graph:
            step = build_graph_step(
                model=model, optimizer=opt, max_norm=1.0, backend="aot_eager", scan_layers=True, plan=LLAMA3_PLAN
            )
        losses, after_first = [], None
        for s in range(3):
            inputs, labels = batch(4096, batch_size=4, seed=s)
            mb = (inputs[2 * rank : 2 * rank + 2], labels[2 * rank : 2 * rank + 2])
            if graph:
                loss = step([mb], 1e-3).loss.detach().clone()
            else:
                opt.zero_grad()
                loss = lm_loss(model(mb[0]), mb[1])
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                loss = loss.detach().clone()
            dist.all_reduce(loss)
            losses.append(loss.item() / 2)
            if s == 0:
                after_first = {n: full(p).detach().clone() for n, p in model.named_parameters()}
        gathers = Counter()
        if graph:  # the captured graph and its scan bodies: the dtype each all-gather moves
            for gm in step.capture.graph_module.modules():
                for n in getattr(gm, "graph", None).nodes if isinstance(gm, torch.fx.GraphModule) else ():
                    if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default:
                        gathers[str(n.args[0].meta["val"].dtype)] += 1
        out[graph] = (losses, after_first, gathers, step.stats.scans if graph else 0)
    return out


@pytest.mark.multiprocess
def test_graph_step_with_layer_scan_gathers_in_float8_and_equals_eager():
    """The combination the Llama 3.1 405B FP8 recipe runs (float8_tensorwise, float8 all-gather,
    the captured step with layer scan), on 2 gloo ranks, fp32 compute: the scan body holds the
    uint8 all-gathers, and the first step gives the eager step's loss and weights (the same ops,
    aot_eager: fp32 summation order in the clip's and the optimizer's reductions, 1e-5, the
    tolerance of tests/unit/test_graph_fsdp.py). Steps 2 and 3 start from weights that differ in
    the last bits, and quantization is discontinuous: a weight one ulp across an e4m3 rounding
    boundary (or an amax one ulp off, moving the scale) changes its quantized value by a whole
    e4m3 step, so their losses agree only to the size of the recipe's own forward error (measured
    2026-12-06: 2.7e-4 and 4.6e-4 relative; bound 2e-3, e4m3's relative step 2^-4 averaged over
    the few flipped elements)."""
    from tests.support.parallel_harness import reference_state

    state = reference_state(n_layers=2)
    for out in run_processes(2, _graph_scan_rank, state):
        (eager_losses, eager_w, _, _), (graph_losses, graph_w, gathers, scans) = out[False], out[True]
        assert scans == 2
        assert abs(eager_losses[0] - graph_losses[0]) <= 1e-6 * abs(eager_losses[0]), (eager_losses, graph_losses)
        worst = max((graph_w[n] - eager_w[n]).abs().max().item() for n in eager_w)
        assert worst <= 1e-5, worst
        for a, b in zip(eager_losses[1:], graph_losses[1:]):
            assert abs(a - b) <= 2e-3 * abs(a), (eager_losses, graph_losses)
        # the 7 block linears' weights of the scanned body, gathered as uint8 (e4m3 bytes); the
        # norms, embedding and head in fp32
        assert gathers["torch.uint8"] >= 7 and set(gathers) == {"torch.uint8", "torch.float32"}, gathers


def test_the_scan_body_gathers_in_float8_as_simple_fsdp_does():
    """The layer-scan body's float8 gather (parallelisms/scan.py `Float8GatherShard`, functional
    collectives by group name) against SimpleFSDP's (`_Float8Gather`, DTensor) on the same shards of
    2 thread ranks, rows not divisible by the ranks (a padded last shard): the same e4m3 bytes,
    the same scale, a zero carrier, and the carrier's gradient reduce-scattered to the same shard
    gradient. The end-to-end run of the scanned step is the scheduled
    `test_graph_step_with_layer_scan_gathers_in_float8_and_equals_eager`."""
    from parallelisms.scan import Float8GatherShard, _gather_args
    from parallelisms.simple_fsdp import _Float8Gather

    g = torch.Generator().manual_seed(4)
    w = torch.randn(75, 64, generator=g) * 0.03
    grad = torch.randn(75, 64, generator=g)

    def rank_fn():
        layer = nn.Linear(64, 75, bias=False)
        apply_quantize(layer, recipe=RECIPE, min_dim=0)
        mesh = build_mesh(ParallelDims(world_size=2, dp_shard=2), "cpu")
        plan = QuantizePlan(RECIPE, min_dim=0, fsdp_float8_all_gather=True)
        data_parallel(layer, mesh=mesh, float8_weights=plan.float8_weights, **MIXED)
        load_full_state(layer, {"weight": w})
        spec = layer._simple_fsdp_specs["weight"]
        out = []
        for gather in (
            lambda t: _Float8Gather.apply(t, spec),
            lambda t: Float8GatherShard.apply(t, *_gather_args(spec, "weight")),
        ):
            shard = layer._parameters["weight"].to_local().detach().clone().requires_grad_()
            values, scale, carrier = gather(shard)
            carrier.backward(grad.bfloat16())
            out.append((values.view(torch.uint8), scale, carrier.detach(), shard.grad))
        return out

    for simple_fsdp, scan in run_threads(2, rank_fn):
        assert scan[0].shape == (75, 64) and torch.equal(scan[0], simple_fsdp[0])
        assert torch.equal(scan[1], simple_fsdp[1]) and not torch.any(scan[2])
        assert torch.equal(scan[3], simple_fsdp[3])
