"""Graph mode and layer scan over several block stacks (issue 12 item 6), against eager.

The model is tests/support/two_stack_model.py: FLUX's layout (double-stream blocks, then
single-stream blocks, adaLN modulation from a `vec` that requires grad) at dim 32. The loss
is the rectified-flow velocity MSE of `(model, latents, txt, y, noise, t, keep)`.

Tolerances (fp32, backend aot_eager, AdamW lr up to 1e-3, eps 1e-6): losses and gradient
norms within 1e-5 relative, parameters and AdamW moments within 2e-6 absolute. Why: the
graph step runs the same math as eager with the learning rate and step count as tensors and
the backward of a scan instead of an unrolled loop, so the gradients differ by fp32 summation
order (~1e-7 relative on these sizes); in Adam's linear regime (|m / sqrt(v)| <= ~1) an element
moves by at most ~lr per step, so a relative gradient error e changes it by ~e * lr, far below
2e-6 (0.2 % of lr). A wrong gradient (a dropped stack, a missing grad through `vec`) moves
parameters by O(lr) = 1e-3 and fails.
"""

from __future__ import annotations

import pytest
import torch

from parallelisms.activation_checkpoint import apply_ac
from tests.support.two_stack_model import PLAN, TwoStackArgs, batches, build, velocity_loss
from trainer.graph import build_graph_step
from trainer.optim import build_optimizer

PARAM_TOL, REL_TOL = 2e-6, 1e-5
LR = 1e-3


def _opt(model):
    return build_optimizer(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)


def _lr(i: int) -> float:
    return LR * (i + 1) / 4


def _eager_run(model, opt, data):
    out = []
    for i, mbs in enumerate(data):
        for group in opt.param_groups:
            group["lr"] = _lr(i)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in mbs:
            loss = velocity_loss(model, *mb)
            (loss / len(mbs)).backward()
            total += float(loss)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        out.append((total / len(mbs), float(norm)))
    return out


def _graph_run(step, opt, data):
    out = []
    for i, mbs in enumerate(data):
        for group in opt.param_groups:
            group["lr"] = _lr(i)
        result = step(mbs, _lr(i))
        out.append((float(result.loss), float(result.grad_norm)))
    return out


def _max_diff(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k] - sb[k]).abs().max().item() for k in sa)


def _state_diff(oa, ob):
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    return max(
        (sa[i][k].float() - sb[i][k].float()).abs().max().item() for i in sa for k in ("exp_avg", "exp_avg_sq", "step")
    )


def _parity(*, scan: bool, ac_mode: str = "none", accum: int = 1, steps: int = 3, args=None):
    args = args or TwoStackArgs()
    ref, model = build(args), build(args)
    ref_opt, opt = _opt(ref), _opt(model)
    if not scan:  # unrolled blocks are checkpointed where the trainer does it (parallelize_model)
        apply_ac(model, plan=PLAN, mode=ac_mode)
    step = build_graph_step(
        model=model,
        optimizer=opt,
        max_norm=1.0,
        backend="aot_eager",
        scan_layers=scan,
        ac_mode=ac_mode if scan else "none",
        grad_accum_steps=accum,
        plan=PLAN,
        loss_fn=velocity_loss,
    )
    data = batches(args, steps, accum)
    want = _eager_run(ref, ref_opt, data)
    got = _graph_run(step, opt, data)
    for (l1, n1), (l2, n2) in zip(want, got):
        assert abs(l1 - l2) <= REL_TOL * abs(l1), (want, got)
        assert abs(n1 - n2) <= REL_TOL * abs(n1), (want, got)
    assert _max_diff(ref, model) <= PARAM_TOL
    assert _state_diff(ref_opt, opt) <= PARAM_TOL
    assert step.capture.num_graphs == 1
    # The run moved the parameters by far more than the tolerance (the check can fail).
    assert _max_diff(build(args), model) > 100 * PARAM_TOL
    return step


@pytest.mark.slow
def test_two_stack_unrolled_graph_matches_eager():
    step = _parity(scan=False)
    assert step.stats.scans == 0


@pytest.mark.slow
def test_two_stack_scan_matches_eager_with_grad_accumulation():
    step = _parity(scan=True, accum=2, steps=2)
    # Per micro-batch: a forward and a backward scan for each of the two stacks.
    assert step.stats.scans == 2 * 2 * 2


def test_two_stack_scan_matches_eager():
    step = _parity(scan=True, steps=2)
    # A forward and a backward scan for each of the two stacks.
    assert step.stats.scans == 2 * 2
    assert set(step.block_stacks) == {"double_blocks", "single_blocks"}


@pytest.mark.slow
@pytest.mark.parametrize("ac_mode", ["full", "selective"])
def test_two_stack_block_ac_unrolled(ac_mode):
    step = _parity(scan=False, ac_mode=ac_mode, steps=2)
    assert step.stats.recomputed > 0


@pytest.mark.slow
def test_two_stack_scan_ac_shrinks_saved_activations():
    saved = {
        mode: _parity(scan=True, ac_mode=mode, steps=2).stats.scan_saved_bytes for mode in ("none", "selective", "full")
    }
    assert saved["full"] < saved["selective"] <= saved["none"], saved


@pytest.mark.exhaustive  # test_flux_node_count_constant_with_scan: the real two-stack FLUX
def test_two_stack_node_count_constant_with_scan():
    def nodes(depth, single, scan):
        args = TwoStackArgs(depth=depth, depth_single_blocks=single)
        model = build(args)
        opt = _opt(model)
        step = build_graph_step(
            model=model,
            optimizer=opt,
            max_norm=1.0,
            backend="aot_eager",
            scan_layers=scan,
            plan=PLAN,
            loss_fn=velocity_loss,
        )
        _graph_run(step, opt, batches(args, 1))
        return step.graph_nodes, step.stats.nodes_total

    assert nodes(1, 1, True) == nodes(3, 4, True)
    # Unrolled, the graph grows with the blocks.
    assert nodes(2, 2, False)[0] > nodes(1, 1, False)[0]


def test_scan_refuses_a_stack_that_is_not_a_block_stack():
    from models.common.plan import ModelPlan
    from models.errors import ConfigError

    model = build(TwoStackArgs())
    with pytest.raises(ConfigError, match="compile.scan_layers: the model's `final`"):
        build_graph_step(
            model=model,
            optimizer=_opt(model),
            max_norm=1.0,
            backend="aot_eager",
            scan_layers=True,
            plan=ModelPlan(block=("double_blocks", "final")),
        )


# --- FLUX.1 debugmodel (models/flux) with the trainer's rectified-flow loss (trainer/tasks/flow.py) ---


def _flux(guidance_embed: bool, *, depth: int = 2, single: int = 2, seed: int = 0):
    """FLUX debugmodel narrowed to hidden 128 / 2 heads (head_dim 64 = RoPE axes 16+24+24), built
    as the trainer builds it: meta -> SimpleFSDP (one process: the fp32 cast path) -> init."""
    import dataclasses

    from models.flux import FLAVORS, FluxTransformer
    from parallelisms.simple_fsdp import data_parallel

    args = dataclasses.replace(
        FLAVORS["debugmodel"],
        hidden_size=128,
        num_heads=2,
        depth=depth,
        depth_single_blocks=single,
        guidance_embed=guidance_embed,
    )
    with torch.device("meta"):
        model = FluxTransformer(args)
    data_parallel(model, mesh=None, param_dtype=torch.float32, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
        # adaLN-Zero starts every block as the identity (zero gates), so a few steps would leave
        # the block weights' gradients ~0 and the parity trivial: give the modulations weights.
        for name, p in model.named_parameters():
            if "mod" in name or "final_layer" in name:
                p.normal_(0, 0.02)
    return model


def _flux_batches(steps: int, accum: int = 1, batch: int = 2, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (
                torch.randn(batch, 16, 4, 4, generator=g),
                torch.randn(batch, 8, 64, generator=g),
                torch.randn(batch, 64, generator=g),
                torch.randn(batch, 16, 4, 4, generator=g),
                torch.rand(batch, generator=g),
                (torch.rand(batch, generator=g) > 0.3).float(),
            )
            for _ in range(accum)
        ]
        for _ in range(steps)
    ]


def _flux_parity(*, scan: bool, ac_mode: str = "none", guidance_embed: bool = True, steps: int = 3):
    import functools

    from models.flux.plan import PLAN as FLUX_PLAN
    from trainer.tasks.flow import flow_loss

    loss_fn = functools.partial(flow_loss, guidance=3.5 if guidance_embed else None)
    ref, model = _flux(guidance_embed), _flux(guidance_embed)
    ref_opt, opt = _opt(ref), _opt(model)
    if not scan:
        apply_ac(model, plan=FLUX_PLAN, mode=ac_mode)
    step = build_graph_step(
        model=model,
        optimizer=opt,
        max_norm=1.0,
        backend="aot_eager",
        scan_layers=scan,
        ac_mode=ac_mode if scan else "none",
        plan=FLUX_PLAN,
        loss_fn=loss_fn,
    )
    data = _flux_batches(steps)
    want, got = [], []
    for i, mbs in enumerate(data):
        for o in (ref_opt, opt):
            for group in o.param_groups:
                group["lr"] = _lr(i)
        ref_opt.zero_grad(set_to_none=True)
        loss = loss_fn(ref, *mbs[0])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        want.append((loss.item(), norm.item()))
        out = step(mbs, _lr(i))
        got.append((out.loss.item(), out.grad_norm.item()))
    for (l1, n1), (l2, n2) in zip(want, got):
        assert abs(l1 - l2) <= REL_TOL * abs(l1), (want, got)
        assert abs(n1 - n2) <= REL_TOL * abs(n1), (want, got)
    assert _max_diff(ref, model) <= PARAM_TOL
    assert _state_diff(ref_opt, opt) <= PARAM_TOL
    assert _max_diff(_flux(guidance_embed), model) > 100 * PARAM_TOL
    assert step.capture.num_graphs == 1
    return step


@pytest.mark.slow
def test_flux_graph_unrolled_and_scan_match_eager():
    """FLUX debugmodel (dev-style, with the guidance embedding): unrolled graph and graph+scan
    against eager, 3 AdamW steps, tolerances of the module docstring."""
    assert _flux_parity(scan=False).stats.scans == 0
    step = _flux_parity(scan=True)
    assert step.stats.scans == 4 and set(step.block_stacks) == {"double_blocks", "single_blocks"}


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_flux_graph_ac(scan):
    """Graph mode with activation checkpointing on FLUX: block AC (unrolled, remat pass) and
    scan AC (full) both keep eager parity (schnell-style, no guidance embedding)."""
    step = _flux_parity(scan=scan, ac_mode="full", guidance_embed=False, steps=2)
    if scan:
        assert step.stats.scans == 4
    else:
        assert step.stats.recomputed > 0


@pytest.mark.slow
def test_flux_node_count_constant_with_scan():
    """Under scan the captured graph does not grow with the blocks per stack (2+2 vs 3+5)."""
    import functools

    from models.flux.plan import PLAN as FLUX_PLAN
    from trainer.tasks.flow import flow_loss

    def nodes(depth, single):
        model = _flux(False, depth=depth, single=single)
        opt = _opt(model)
        step = build_graph_step(
            model=model,
            optimizer=opt,
            max_norm=1.0,
            backend="aot_eager",
            scan_layers=True,
            plan=FLUX_PLAN,
            loss_fn=functools.partial(flow_loss, guidance=None),
        )
        step(_flux_batches(1)[0], LR)
        return step.graph_nodes, step.stats.nodes_total

    assert nodes(2, 2) == nodes(3, 5)
