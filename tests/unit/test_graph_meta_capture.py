"""The graph step captured on meta tensors (the recipe check's and the TPU compile's fake world)
is the graph a real device captures: composite ATen ops keep their autograd on meta.

torch registers its decompositions as Python `Meta` kernels, composite ops included
(`aten.nll_loss`, `aten.where.ScalarOther`, `aten.var`, ...), and under Dynamo's Python
dispatcher these shadow the composite kernel for `AutogradMeta`: their gradient was lost on meta
(None), and at tp 2 the plain loss's gradient reached DTensor's `Redistribute.backward` as a
plain tensor, so the capture of any TP step on a TPU target failed ("RuntimeError when making
fake tensor call"). `trainer.graph.capture.composite_autograd_on_meta` unshadows them while a
meta step is captured (docs/graph_trainer.md, "Capturing on meta tensors").
"""

from __future__ import annotations

import os
from collections import Counter

import torch
import torch.nn.functional as F

from trainer.graph.capture import CaptureBackend, capture_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _captured(device: str):
    """(gradient shapes, ATen op counts of the captured graph) of a step with three of the
    shadowed composites (cross entropy's `nll_loss`, `where` with a scalar, `var`) on `device`."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 16, device=device))
    b = torch.nn.Parameter(torch.randn(16, device=device))

    def step(x, y):
        h = torch.where(x @ w > 0, x @ w + b, 0.0)
        loss = F.cross_entropy(h.flatten(0, 1), y.flatten()) + h.var()
        return torch.autograd.grad(loss, [w, b], allow_unused=True)

    x = torch.randn(2, 4, 16, device=device)
    y = torch.randint(0, 16, (2, 4), device=device)
    backend = CaptureBackend(backend="aot_eager")
    torch._dynamo.reset()
    with capture_config(scan_ac_mode=None, meta=device == "meta"):
        grads = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)(x, y)
    torch._dynamo.reset()
    ops = Counter(str(n.target) for n in backend.graph_module.graph.nodes if n.op == "call_function")
    return [None if g is None else tuple(g.shape) for g in grads], ops


def test_meta_capture_is_the_cpu_capture():
    """The same ATen ops, the same number of times, and every gradient present (before the fix:
    both gradients None on meta, the backward missing from the graph)."""
    cpu_grads, cpu_ops = _captured("cpu")
    meta_grads, meta_ops = _captured("meta")
    assert cpu_grads == [(16, 16), (16,)]
    assert meta_grads == cpu_grads
    assert meta_ops == cpu_ops
    assert cpu_ops["aten.nll_loss_backward.default"] == 1  # the loss's backward is in the graph


def test_meta_kernels_are_restored_after_the_capture():
    """The unshadowing is scoped to the capture: torch's Python Meta kernels are back after it."""
    from torch._C import DispatchKey

    op = torch.ops.aten.nll_loss.default
    before = op.py_kernels.get(DispatchKey.Meta)
    with capture_config(scan_ac_mode=None, meta=True):
        assert DispatchKey.Meta not in op.py_kernels
    assert op.py_kernels.get(DispatchKey.Meta) is before


def test_tp_step_captures_on_a_tpu_targets_fake_world():
    """The recipe check of the Llama 3 debug model (1 layer) at fsdp 4 x tp 2 on a v6e-8 (graph mode, the
    plain loss: the fused one is refused with TP): the trainer's step captured on the target's
    fake world, TP collectives in it. Before the fix: TorchRuntimeError in the capture."""
    from tools.recipe_check import check_recipe

    r = check_recipe(
        os.path.join(ROOT, "configs", "llama3_debug.toml"),
        overrides=[
            ("job.target", "v6e-8"),
            ("compile.mode", "graph"),
            ("model.n_layers", "1"),
            ("parallelism.tensor_parallel_degree", "2"),
            ("training.local_batch_size", "1"),
            ("training.seq_len", "64"),
            ("validation.enable", "false"),
        ],
    )
    assert r.ok, r.error
    assert r.mesh == "fsdp 4 x tp 2", r.mesh
    assert "plain loss" in r.step, r.step
    assert "nodes" in r.capture, r.capture
