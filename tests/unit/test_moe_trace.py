"""The Qwen 3 MoE step traces into one program: routing and dispatch read nothing on the host.

Expert counts stay device tensors end to end (`ops.grouped_mm` takes them as such), so:
- an eager forward + backward performs no device-to-host copy (what torchax/XLA lowering and
  CUDA graphs need), checked with a dispatch mode that fails on `_local_scalar_dense`;
- the graph step (trainer/graph, unrolled) captures one graph with
  `capture_scalar_outputs=False` (no data-dependent shapes), and matches the eager step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.qwen3 import FLAVORS, Transformer
from models.qwen3.plan import PLAN
from parallelisms.simple_fsdp import clip_grad_norm_, data_parallel
from tests.support.graph_common import batches, build_opt, max_param_diff, run
from tests.unit.test_ops import NoHostSync
from trainer.graph import build_graph_step
from trainer.step import EagerStep

ARGS = dataclasses.replace(
    FLAVORS["debugmodel_moe"],
    n_layers=2,
    dim=64,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    vocab_size=512,
    max_seq_len=32,
    moe_hidden_dim=32,
)


def _model(dtype=torch.float32) -> torch.nn.Module:
    with torch.device("meta"):
        model = Transformer(ARGS)
    data_parallel(model, mesh=None, param_dtype=dtype, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_forward_backward_has_no_host_sync(dtype):
    """float32 runs the masked expert fallback, bfloat16 torch._grouped_mm."""
    model = _model(dtype)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16))
    with NoHostSync():
        loss = model(tokens).float().logsumexp(-1).mean() + 0.01 * model.pop_aux_loss()
        loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_qwen3_moe_graph_step_is_one_graph_without_scalar_capture():
    ref_model, model = _model(), _model()
    ref_opt, opt = build_opt(ref_model), build_opt(model)
    eager = EagerStep(
        model=ref_model, optimizer=ref_opt, max_norm=1.0, aux_loss_coef=0.01, clip_grad_norm=clip_grad_norm_
    )
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=False):
        step = build_graph_step(
            model=model, optimizer=opt, max_norm=1.0, backend="aot_eager", aux_loss_coef=0.01, plan=PLAN
        )
        data = batches(3)
        ref = run(eager, ref_opt, data)
        got = run(step, opt, data)
    assert step.capture.num_graphs == 1
    for (l1, n1), (l2, n2) in zip(ref, got):
        assert abs(l1 - l2) <= 1e-5 * abs(l1) and abs(n1 - n2) <= 1e-5 * abs(n1), (ref, got)
    # Same tolerance as tests/unit/test_graph_step.py (a few ulps of AdamW over 3 steps).
    assert max_param_diff(ref_model, model) <= 2e-6
