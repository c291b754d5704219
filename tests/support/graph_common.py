"""Shared helpers of tests/test_graph_*.py (no tests here).

The model is the Llama 3 debug flavor reduced for speed (dim 64, 4 heads / 2 kv heads, FFN
192, vocab 512, sequence 32), built as the trainer builds it: meta device -> SimpleFSDP
(single process: fp32 "cast" only) -> materialize -> init_weights. The optimizer is the
trainer's AdamW (foreach=False) with eps 1e-6, which keeps Adam's first steps in its linear
regime so that parity is measured on the math, not on float noise amplified near eps.
"""

from __future__ import annotations

import dataclasses

import torch

from models.llama3 import FLAVORS
from models.llama3 import Transformer as Llama3
from models.llama3.plan import PLAN
from parallelisms.simple_fsdp import clip_grad_norm_, data_parallel
from trainer.optim import build_optimizer
from trainer.step import EagerStep

VOCAB, SEQ, BATCH = 512, 32, 2
LR = 1e-3


def small_args(n_layers: int = 2):
    return dataclasses.replace(
        FLAVORS["debugmodel"],
        n_layers=n_layers,
        dim=64,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        multiple_of=64,
    )


def build_model(n_layers: int = 2, seed: int = 0, param_dtype=torch.float32) -> torch.nn.Module:
    """The model; its attention is whatever `kernels` serves (tests/conftest.py: SDPA unless a
    test selects another implementation)."""
    with torch.device("meta"):
        model = Llama3(small_args(n_layers))
    data_parallel(model, mesh=None, param_dtype=param_dtype, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
    return model


def build_opt(model: torch.nn.Module) -> torch.optim.AdamW:
    return build_optimizer(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)


def eager_step(model, opt, max_norm: float = 1.0) -> EagerStep:
    return EagerStep(model=model, optimizer=opt, max_norm=max_norm, aux_loss_coef=0.0, clip_grad_norm=clip_grad_norm_)


def batches(steps: int, accum: int = 1, seed: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        mbs = []
        for _ in range(accum):
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
            mbs.append((tokens[:, :-1], tokens[:, 1:]))
        out.append(mbs)
    return out


def lr_at(step: int) -> float:
    """A warmup-like schedule: a different lr every step (must not recompile the graph)."""
    return LR * (step + 1) / 5


def run(step_fn, opt, data) -> list[tuple[float, float]]:
    out = []
    for i, mbs in enumerate(data):
        lr = lr_at(i)
        for group in opt.param_groups:  # what the lr scheduler does before an eager step
            group["lr"] = lr
        result = step_fn(mbs, lr)
        out.append((float(result.loss), float(result.grad_norm)))
    return out


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


def param_tolerance(before: dict[str, torch.Tensor], after: torch.nn.Module) -> float:
    """The bound on |graph - eager| parameters after the steps that took `before` to `after`.

    The two steps compute the same AdamW math in a different op order, so their gradients differ
    by fp32 summation noise (~1e-6 relative); Adam's update is a ratio of gradient moments and
    inherits that relative error. The bound is 0.2 % of the largest single-element change, and at
    least 0.2 % of the lr (2e-6): in Adam's linear regime an element moves by at most ~lr a step,
    but after a perturbed moment (a resumed or edited state) an update can be far larger.
    """
    state = after.state_dict()
    moved = max((state[k].float() - before[k].float()).abs().max().item() for k in before)
    return 2e-3 * max(moved, LR)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def max_state_diff(oa: torch.optim.Optimizer, ob: torch.optim.Optimizer) -> float:
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    return max(
        (sa[i][k].float().cpu() - sb[i][k].float().cpu()).abs().max().item()
        for i in sa
        for k in ("exp_avg", "exp_avg_sq", "step")
    )


__all__ = [
    "PLAN",
    "build_model",
    "build_opt",
    "eager_step",
    "batches",
    "run",
    "max_param_diff",
    "max_state_diff",
    "small_args",
    "lr_at",
    "param_tolerance",
    "snapshot",
]
