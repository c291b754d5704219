"""Activation checkpointing: same gradients as no AC, what each mode recomputes, paths kept."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models.common.decoder import TransformerBlock
from models.errors import ConfigError
from parallelisms import ParallelDims, apply_ac, build_mesh, checkpoint_fn, parallelize_model
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

FP32 = dict(param_dtype=torch.float32, reduce_dtype=torch.float32)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _single_process(family: str, mode: str, state):
    cls, make_args, plan = FAMILIES[family]
    with torch.device("meta"):
        model = cls(make_args())
    parallelize_model(model, plan=plan, parallel_dims=ParallelDims(world_size=1), mesh=None, ac_mode=mode, **FP32)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    load_full_state(model, state)
    return model


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_modes_give_the_same_grads(family):
    state = reference_state(family)
    inputs, labels = batch(4096)
    grads, backward_ops = {}, {}
    for mode in ("none", "full", "selective", "full_save_attention"):
        model = _single_process(family, mode, state)
        loss = lm_loss(model(inputs), labels)
        with _OpCounter() as counter:
            loss.backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
        backward_ops[mode] = counter.counts
    for mode in ("full", "selective", "full_save_attention"):
        assert max(rel_diff(grads[mode][n], grads["none"][n]) for n in grads["none"]) < 1e-6
    layers, linears = 2, 7  # per block: wq wk wv wo w1 w2 w3
    # full AC re-runs each block's forward matmuls in backward (all but w2, the last one:
    # nothing saved depends on it, and recomputation stops early); selective keeps matmul
    # outputs and recomputes only the cheap ops (silu, norms, RoPE, ...).
    assert backward_ops["full"]["mm"] == backward_ops["none"]["mm"] + layers * (linears - 1)
    assert backward_ops["selective"]["mm"] == backward_ops["none"]["mm"]
    assert backward_ops["full"]["silu"] == backward_ops["selective"]["silu"] == layers
    assert backward_ops["none"]["silu"] == 0
    # The attention forward is SDPA's CPU flash op or, where it applies, the CPU kernel's attn_fwd.
    for attention_op in ("_scaled_dot_product_flash_attention_for_cpu", "attn_fwd"):
        assert attention_op not in backward_ops["selective"]
    assert (
        backward_ops["full"]["_scaled_dot_product_flash_attention_for_cpu"] + backward_ops["full"]["attn_fwd"]
    ) == layers
    # full_save_attention: full's recompute (the same matmuls: wo re-runs on the saved attention
    # output) without the attention forward, whose output and log-sum-exp were kept
    saved = backward_ops["full_save_attention"]
    assert saved["mm"] == backward_ops["full"]["mm"] and saved["silu"] == layers
    for attention_op in ("_scaled_dot_product_flash_attention_for_cpu", "attn_fwd"):
        assert attention_op not in saved


def test_paths_unchanged_and_applied_once():
    cls, make_args, plan = FAMILIES["llama3"]
    model = cls(make_args())
    before = [n for n, _ in model.named_modules()], list(model.state_dict())
    apply_ac(model, plan=plan, mode="selective")
    assert ([n for n, _ in model.named_modules()], list(model.state_dict())) == before
    assert type(model.layers["0"]).__name__ == "CheckpointedTransformerBlock"
    assert isinstance(model.layers["0"], TransformerBlock)
    with pytest.raises(AssertionError, match="twice"):
        apply_ac(model, plan=plan, mode="full")


def test_checkpoint_fn_for_graph_trainer():
    """The remat wrapper the graph trainer applies to a scanned block body."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def body(h, weight):
        return torch.nn.functional.silu(h @ weight).sum()

    body(x, w).backward()
    expected = w.grad.clone()
    for mode in ("none", "full", "selective", "full_save_attention"):
        w.grad = None
        checkpoint_fn(mode)(body, x, w).backward()
        assert torch.allclose(w.grad, expected)
    with pytest.raises(
        ConfigError, match="activation_checkpoint.mode: 'some'.*allowed: none, full, selective, full_save_attention"
    ):
        checkpoint_fn("some")


def test_selective_with_fsdp_and_tp():
    """SAC inside a 2-D (FSDP x TP) model: DTensor ops and collectives under the policy."""
    state = reference_state("llama3")
    inputs, labels = batch(4096)
    cls, make_args, plan = FAMILIES["llama3"]
    ref = cls(make_args())
    ref.load_state_dict(state, strict=False)
    lm_loss(ref(inputs), labels).backward()

    def rank_fn():
        dims = ParallelDims(dp_shard=2, tp=2, world_size=4)
        mesh = build_mesh(dims, "cpu")
        with torch.device("meta"):
            model = cls(make_args())
        parallelize_model(model, plan=plan, parallel_dims=dims, mesh=mesh, ac_mode="selective", **FP32)
        model.to_empty(device="cpu")
        with RNG_LOCK, torch.no_grad():
            model.init_weights()
        load_full_state(model, state)
        rank = dims.dp_rank(mesh)
        lm_loss(model(inputs.chunk(2)[rank]), labels.chunk(2)[rank]).backward()
        return max(rel_diff(full(p.grad), ref.get_parameter(n).grad) for n, p in model.named_parameters())

    assert max(run_threads(4, rank_fn)) < 1e-5
