"""Context parallelism through the trainer for Qwen 3.5 (Gated DeltaNet + gated full attention).

The harness of tests/e2e/test_cp_train.py (`build_job` + the job's step + `LMTask.prepare` on gloo
processes against the same job at cp = 1 in one process; fp32, seq 64, global batch 4, 3 AdamW
steps) on the Qwen 3.5 debug recipe with its 4 blocks (3 Gated DeltaNet, 1 gated full attention)
and the delta rule in chunks of 16 (the one-process run scans 4 chunks, a cp 2 rank's chunks of 16
tokens one each): the job serves the Gated DeltaNet's ops for cp (`apply_cp` ->
parallelisms/context_parallel_linear.py), so the conv reads the preceding rank's tokens and the
delta rule's state is passed in sequence order.

Bounds: those of tests/e2e/test_cp_train.py (1e-5 relative for the losses and the gradient norm,
1e-5 of each tensor's max for the step-1 gradients), except the decay gate's parameters (`A_log`,
`dt_bias`, `in_proj_a`): 1e-3 of their max. Their gradients are sums over every token and channel of
nearly cancelling terms, and tiny (block 2's max |grad| 2.6e-6 to 7.4e-6, against ~1e-2 elsewhere),
so summation order alone moves them far more than 1e-5 of that max: one process with
`delta_chunk_size` 8 instead of 16 (no CP, only the op's chunking changed) differs from the
reference by 2.2e-4 (dt_bias), 2.9e-4 (A_log) and 9.4e-5 (in_proj_a) of their max, where cp 2
differs by 1.0e-4, 1.3e-4 and 3.1e-5. The cp run differs from one process by summation
order: the cp attention's, and the delta rule's carried state entering as a correction
`(Phi^T q)^T S` after the op and through a fold over the chunks instead of inside the op's scan
(bounded at 1e-5 of max|out| and measured at 2.6e-7 in tests/unit/test_cp_linear_attention.py,
where a control without the state passing misses by O(1)). Measured numbers: docs/context_parallel.md,
"Linear attention (Qwen 3.5)".
"""

import pytest

from tests.e2e.test_cp_train import _degrees, _run, short_documents

QWEN3_5 = "configs/qwen3_5_debug.toml"
QWEN3_5_MOE = ("--model.flavor=debugmodel_moe",)
SHAPE = ("--model.n_layers=4", "--model.delta_chunk_size=16")
NOISY = ("A_log", "dt_bias", "in_proj_a.weight")


def _compare(ref: dict, got: dict, what: str) -> dict:
    """As test_cp_train's `_compare`, with the decay gate's gradients at 1e-3 (module docstring)."""
    loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    norm = max(abs(a - b) / abs(b) for a, b in zip(got["norms"], ref["norms"]))
    weight = max((got["weights"][n] - w).abs().max().item() for n, w in ref["weights"].items())
    grads = {}
    if got["grads"] is not None:
        assert set(got["grads"]) == set(ref["grads"])
        grads = {
            n: ((got["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
            for n, g in ref["grads"].items()
        }
    plain = max((v for n, v in grads.items() if not n.endswith(NOISY)), default=None)
    noisy = max((v for n, v in grads.items() if n.endswith(NOISY)), default=None)
    print(
        f"{what}: loss {loss:.2e} rel, grad {plain if plain is None else f'{plain:.2e}'} rel-to-max "
        f"(decay gate {noisy if noisy is None else f'{noisy:.2e}'}), grad_norm {norm:.2e} rel, "
        f"weights {weight:.2e} abs"
    )
    assert loss <= 1e-5, (what, got["losses"], ref["losses"])
    assert norm <= 1e-5, (what, got["norms"], ref["norms"])
    for name, rel in grads.items():
        assert rel <= (1e-3 if name.endswith(NOISY) else 1e-5), (what, name, rel)
    return dict(loss=loss, grad=plain, noisy=noisy, norm=norm, weight=weight)


@pytest.fixture(scope="module")
def dense_reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("qwen3_5_ref"), QWEN3_5, 1, _degrees() + SHAPE)


EXHAUSTIVE = [pytest.mark.slow, pytest.mark.exhaustive]
MESHES = [
    pytest.param(2, dict(cp=2), (), id="cp2"),
    pytest.param(4, dict(cp=2, dp_shard=2), (), id="cp2xdp2", marks=EXHAUSTIVE),
    pytest.param(4, dict(cp=4), (), id="cp4", marks=EXHAUSTIVE),
    # per-block compile (aot_eager): each block compiled with the ops' gathers inside
    pytest.param(
        2, dict(cp=2), ("--compile.mode=compile", "--compile.backend=aot_eager"), id="cp2-compile", marks=EXHAUSTIVE
    ),
    # graph mode (aot_eager): the halo and state gathers captured with SimpleFSDP's collectives
    pytest.param(
        2, dict(cp=2), ("--compile.mode=graph", "--compile.backend=aot_eager"), id="cp2-graph", marks=EXHAUSTIVE
    ),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size, degrees, extra", MESHES)
def test_qwen3_5_cp_matches_single_process(tmp_path, dense_reference, world_size, degrees, extra):
    got = _run(tmp_path, QWEN3_5, world_size, _degrees(**degrees) + SHAPE + extra)
    assert got["shapes"] == [(4 // degrees.get("dp_shard", 1), 64 // degrees["cp"])] * 3
    _compare(dense_reference, got, f"qwen3_5 {degrees} {' '.join(extra) or 'eager'}")


@pytest.mark.multiprocess
@pytest.mark.exhaustive
@pytest.mark.slow
def test_qwen3_5_moe_cp2_ep2_matches_single_process(tmp_path):
    """The MoE flavor (shared expert, aux loss) with its experts split over the two cp ranks."""
    ref = _run(tmp_path / "ref", QWEN3_5, 1, _degrees() + SHAPE + QWEN3_5_MOE)
    got = _run(tmp_path / "cp", QWEN3_5, 2, _degrees(cp=2, ep=2) + SHAPE + QWEN3_5_MOE)
    _compare(ref, got, "qwen3_5 moe cp2 x ep2")


@pytest.mark.multiprocess
@pytest.mark.exhaustive
@pytest.mark.slow
def test_qwen3_5_document_mask_cp2_matches_single_process(tmp_path):
    """Packed short documents (restart positions): the delta rule's state is reset at every document
    start, including those on a cp chunk's first token (the start found against the preceding
    rank's last segment id), and the conv reads no token of another document across ranks."""
    data = short_documents(tmp_path)
    extra = SHAPE + (
        "--training.document_mask=true",
        "--training.document_positions=restart",
        f"--training.dataset={data}",
    )
    ref = _run(tmp_path / "ref", QWEN3_5, 1, _degrees() + extra)
    got = _run(tmp_path / "cp", QWEN3_5, 2, _degrees(cp=2) + extra)
    assert got["shapes"] == [(4, 32)] * 4  # inputs, labels, segment ids, positions
    assert got["boundaries"] >= 4, got["boundaries"]
    _compare(ref, got, "qwen3_5 document mask (restart positions) cp2")
