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
