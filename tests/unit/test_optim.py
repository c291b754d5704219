"""Learning-rate schedule shapes and the AdamW builder."""

import math

import pytest
import torch

from trainer.optim import build_lr_scheduler, build_optimizer, lr_factor

KW = dict(total_steps=100, warmup_steps=10, decay_ratio=0.2, min_lr_factor=0.1)


@pytest.mark.parametrize("decay", ["linear", "cosine", "wsd", "constant"])
def test_warmup_is_linear_from_small(decay):
    assert lr_factor(1, decay_type=decay, **KW) == pytest.approx(0.1)
    assert lr_factor(5, decay_type=decay, **KW) == pytest.approx(0.5)
    assert lr_factor(10, decay_type=decay, **KW) == pytest.approx(1.0)


def test_decay_shapes():
    assert lr_factor(100, decay_type="linear", **KW) == pytest.approx(0.1)
    assert lr_factor(55, decay_type="linear", **KW) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_factor(100, decay_type="cosine", **KW) == pytest.approx(0.1)
    assert lr_factor(55, decay_type="cosine", **KW) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    # wsd: stable until step 80 (last 20% decays), then linear to 0.1
    assert lr_factor(80, decay_type="wsd", **KW) == 1.0
    assert lr_factor(90, decay_type="wsd", **KW) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_factor(100, decay_type="wsd", **KW) == pytest.approx(0.1)
    assert lr_factor(100, decay_type="constant", **KW) == 1.0


def test_scheduler_drives_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([p], lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1)
    sched = build_lr_scheduler(opt, decay_type="linear", **KW)
    seen = []
    for step in range(1, 101):
        seen.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(2)
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx(1e-4)
    assert seen[9] == pytest.approx(1e-3)
    assert seen[99] == pytest.approx(1e-4)
    assert opt.defaults["weight_decay"] == 0.1 and opt.defaults["betas"] == (0.9, 0.95)


def test_run_shorter_than_warmup_stops_part_way_up_the_ramp():
    # 10 steps with warmup 30: the lr climbs 1/30 of the peak per step and ends at 10/30 of it
    # (it used to squeeze the warmup into the run and reach the peak at step 10).
    short = dict(total_steps=10, warmup_steps=30, decay_ratio=0.2, min_lr_factor=0.1)
    for decay in ("linear", "cosine", "wsd", "constant"):
        assert [lr_factor(s, decay_type=decay, **short) for s in (1, 10)] == [1 / 30, 10 / 30]
    # The same ramp as in the longer run it may be resumed into.
    assert lr_factor(10, decay_type="cosine", **short) == lr_factor(
        10, decay_type="cosine", **{**short, "total_steps": 300}
    )


def _trained(lr, steps, **sched_kw):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3))
    opt = build_optimizer([p], lr=lr, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1)
    sched = build_lr_scheduler(opt, **{"decay_type": "linear", **KW, **sched_kw})
    for _ in range(steps):
        p.grad = torch.ones(3)
        opt.step()
        sched.step()
    return opt, sched


def test_resume_keeps_the_configs_lr_and_schedule():
    _, saved = _trained(1e-3, 20)
    state = saved.state_dict()
    # Same config: the lr is bit-identical to the uninterrupted run's, and nothing is reported.
    opt, sched = _trained(1e-3, 0)
    sched.load_state_dict(dict(state))
    assert opt.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"] and sched.resume_notes == []
    # Half the lr on resume (roll back, lower the lr): the config's lr for step 21, reported.
    opt, sched = _trained(5e-4, 0)
    sched.load_state_dict(dict(state))
    assert sched.last_epoch == 20
    assert opt.param_groups[0]["lr"] == 5e-4 * lr_factor(21, decay_type="linear", **KW)
    assert sched.get_last_lr() == [opt.param_groups[0]["lr"]]
    assert any("optimizer.lr (peak): checkpoint 0.001 -> config 0.0005" in n for n in sched.resume_notes)
    # Another schedule (cosine, longer run): its lr from the first resumed step on.
    opt, sched = _trained(1e-3, 0, decay_type="cosine", total_steps=400)
    sched.load_state_dict(dict(state))
    expected = 1e-3 * lr_factor(21, decay_type="cosine", **{**KW, "total_steps": 400})
    assert opt.param_groups[0]["lr"] == expected
    assert any(n.startswith("lr of step 21") for n in sched.resume_notes)
    sched.step()
    assert opt.param_groups[0]["lr"] == 1e-3 * lr_factor(22, decay_type="cosine", **{**KW, "total_steps": 400})
