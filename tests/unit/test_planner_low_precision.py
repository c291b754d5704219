"""The planner's low-precision term (planner/low_precision.py): the quantized operand copies and
fp32 scales of one linear's backward, counted by hand for every recipe, and the term in a plan:
Llama 3 8B at FSDP 16 x TP 4 quantizes TP-local weights, its largest linear sets the term, and
the filtered head and the small linears add nothing."""

from __future__ import annotations

import planner as P
from models import get_model_family
from parallelisms.quantize import QuantizePlan
from planner.low_precision import linear_backward_bytes, quantize_transient_bytes, quantized_linear_shapes

LLAMA = get_model_family("llama3")

# One linear, w [N, K] = [4096, 1024], M = 512 tokens. The backward quantizes dy [512, 4096] and
# w^T [1024, 4096] along N (the input gradient), dy^T [4096, 512] and x^T [1024, 512] along M
# (the weight gradient): 1 byte per element, 4 per fp32 scale.
N, K, M = 4096, 1024, 512
ELEMENTS = M * N + K * N + N * M + K * M  # 2,097,152 + 4,194,304 + 2,097,152 + 524,288


def _estimate_8b(args, stats, dims, quantize, *, loss_parallel):
    """The planner's estimate of Llama 3 8B on v6e-64 at seq 8192, batch 1, full AC."""
    return P.estimate(
        model="8B",
        target=P.parse_target("v6e-64"),
        shape=args.shape(),
        stats=stats,
        parallel_dims=dims,
        local_batch_size=1,
        seq_len=8192,
        ac_mode="full",
        loss_parallel=loss_parallel,
        flops_per_token=1.0,
        quantize=quantize,
    )


def test_one_linear_backward_by_hand():
    assert ELEMENTS == 8_912_896
    # tensorwise: one scale per operand
    assert linear_backward_bytes(N, K, M, "float8_tensorwise") == ELEMENTS + 4 * 4
    # rowwise: one scale per row of each operand: 512 + 1024 + 4096 + 1024 rows
    assert linear_backward_bytes(N, K, M, "float8_rowwise") == ELEMENTS + 4 * 6656 == 8_939_520
    # blockwise: dy 1x128 tiles (512 x 32), w^T 128x128 blocks (8 x 32), dy^T tiles (4096 x 4),
    # x^T tiles (1024 x 4)
    assert linear_backward_bytes(N, K, M, "float8_blockwise") == ELEMENTS + 4 * (16384 + 256 + 16384 + 4096)
    # int8: the weight gradient stays bf16, so only dy and w^T, one scale per row each
    assert linear_backward_bytes(N, K, M, "int8") == M * N + K * N + 4 * (512 + 1024) == 6_297_600
    # a partial edge: K = 1000 rows of w^T, 8 row blocks of 128 (the last partial), N = 4096: 32
    assert linear_backward_bytes(N, 1000, M, "float8_blockwise") == (
        M * N + 1000 * N + N * M + 1000 * M + 4 * (512 * 32 + 8 * 32 + 4096 * 4 + 1000 * 4)
    )
    assert quantize_transient_bytes([(N, K), (K, N)], tokens=M, recipe="none") == 0
    # the largest of the linears: w [1024, 4096] holds fewer (dy is [512, 1024])
    assert quantize_transient_bytes([(N, K), (K, N)], tokens=M, recipe="float8_rowwise") == 8_939_520


def test_a_plan_counts_its_largest_quantized_linear_after_tp():
    """Llama 3 8B, FSDP 16 x TP 4, 1 x 8192 tokens: w2 is [4096, 14336] whole and [4096, 3584]
    on a TP rank; its backward (N = 4096, K = 3584, M = 8192) is the largest:
    2 x 8192 x 4096 + 3584 x 4096 + 3584 x 8192 = 111,149,056 elements and rows 8192 + 3584 + 4096
    + 3584 = 19,456 scales (77,824 bytes) under float8_rowwise."""
    args = LLAMA.flavors["8B"]
    dims = P.make_parallel_dims(
        dp_replicate=1, dp_shard=16, tp=4, ep=1, world_size=64, shape=args.shape(), seq_len=8192
    )
    with P.fake_process_group(64):
        stats = P.shard_model(LLAMA, args, dims, probe=True)
    assert stats.linear_shapes["layers.0.feed_forward.w2"] == ((4096, 14336), (4096, 3584))
    assert stats.linear_shapes["layers.0.attention.wq"] == ((4096, 4096), (1024, 4096))
    rowwise = QuantizePlan("float8_rowwise")
    shapes = quantized_linear_shapes(stats.linear_shapes, rowwise)
    assert len(shapes) == 7  # the block's 7 linears; the output head is filtered
    assert (128256 // 4, 4096) not in shapes and stats.linear_shapes["output"][0] == (128256, 4096)

    def plan(quantize):
        return _estimate_8b(args, stats, dims, quantize, loss_parallel=True)

    bf16, fp8 = plan(None), plan(rowwise)
    assert fp8.quantize_transient == 111_149_056 + 77_824
    assert fp8.transient_block - bf16.transient_block == fp8.quantize_transient
    assert fp8.saved_weights == bf16.saved_weights and fp8.activations == bf16.activations  # nothing more saved
    assert fp8.params + fp8.grads + fp8.optimizer == bf16.params + bf16.grads + bf16.optimizer
    # int8: dy [8192, 4096] and w^T [3584, 4096] along N only
    int8 = plan(QuantizePlan("int8"))
    assert int8.quantize_transient == 8192 * 4096 + 3584 * 4096 + 4 * (8192 + 3584)
    # min_dim above every width: nothing quantized, nothing added
    assert plan(QuantizePlan("float8_rowwise", min_dim=1 << 20)).quantize_transient == 0


def test_float8_all_gather_halves_the_quantized_weights_gather_bytes():
    """Llama 3 8B at FSDP 64 (no TP): a block gathers wq, wo [4096, 4096], wk, wv [1024, 4096],
    w1, w3 [14336, 4096], w2 [4096, 14336] and two norms [4096]: 218,112,000 elements, 436,224,000
    bytes in bf16. With `fsdp_float8_all_gather` the 7 weights (218,103,808 elements) move 1 byte
    each: 218,120,192 bytes, ratio 0.500019; the FSDP-hiding threshold scales with it. Other
    recipes, or the option off, change nothing."""
    from planner.low_precision import block_gather_ratio, fsdp_gather_bytes

    args = LLAMA.flavors["8B"]
    dims = P.make_parallel_dims(
        dp_replicate=1, dp_shard=64, tp=1, ep=1, world_size=64, shape=args.shape(), seq_len=8192
    )
    with P.fake_process_group(64):
        stats = P.shard_model(LLAMA, args, dims, probe=True)
    assert stats.block_gathered_numel == 218_112_000
    on = QuantizePlan("float8_tensorwise", fsdp_float8_all_gather=True)
    weights = quantized_linear_shapes(stats.linear_shapes, on)
    assert sum(n * k for n, k in weights) == 218_103_808
    assert fsdp_gather_bytes(218_112_000, weights, float8_all_gather=False) == 436_224_000
    assert fsdp_gather_bytes(218_112_000, weights, float8_all_gather=True) == 218_120_192
    ratio = block_gather_ratio(stats.linear_shapes, stats.block_gathered_numel, on)
    assert ratio == 218_120_192 / 436_224_000
    for off in (QuantizePlan("float8_tensorwise"), QuantizePlan("float8_rowwise", fsdp_float8_all_gather=True)):
        assert block_gather_ratio(stats.linear_shapes, stats.block_gathered_numel, off) == 1.0

    def plan(quantize):
        return _estimate_8b(args, stats, dims, quantize, loss_parallel=False)

    bf16, fp8 = plan(QuantizePlan("float8_tensorwise")), plan(on)
    assert fp8.fsdp_gather_ratio == ratio and bf16.fsdp_gather_ratio == 1.0
    assert fp8.fsdp_min_tokens == int(bf16.fsdp_min_tokens * ratio)


def test_a_float8_gathered_weight_adds_no_weight_copy():
    """With the float8 all-gather the op reads the gathered float8 weight as it is: the backward's
    copies are dy and x only (float8_tensorwise: one scale each), w^T's N K + 4 bytes are not
    there. w [N, K] = [53248, 16384] at M = 8192 (the 405B's w1): dy [M, N] along N, dy^T [N, M]
    and x^T [K, M] along M."""
    n, k, m = 53248, 16384, 8192
    full = linear_backward_bytes(n, k, m, "float8_tensorwise")
    assert full == (m * n + 4) + (k * n + 4) + (n * m + 4) + (k * m + 4)
    assert linear_backward_bytes(n, k, m, "float8_tensorwise", float8_weight=True) == full - (k * n + 4)
    assert quantize_transient_bytes([(n, k)], tokens=m, recipe="float8_tensorwise", float8_weights=True) == (
        2 * m * n + k * m + 12
    )


def test_routed_experts_copies_by_hand():
    """Qwen3-235B-A22B (dim 4096, moe_hidden 1536, 128 experts) under float8_rowwise at EP 16: 8
    local experts, 327,680 rows (8 x 4096 tokens x top 8 x capacity 1.25). The larger of the two
    expert matmuls' backward is w2's ([4096, 1536]): dy [R, 4096] along its rows' N, the 8 experts'
    w^T [1536, 4096] along N, dy^T [4096, R] and x^T [1536, R] along R, 1 byte per element and a
    4-byte scale per row. "experts" in filter_fqns, or widths under min_dim, add nothing."""
    from models import get_model_family
    from planner.low_precision import experts_transient_bytes

    shape = get_model_family("qwen3").flavors["235B-A22B"].shape()
    r, d, h = 327_680, 4096, 1536
    w1 = (r * h + 4 * r) + 8 * (d * h + 4 * d) + (h * r + 4 * h) + (d * r + 4 * d)
    w2 = (r * d + 4 * r) + 8 * (h * d + 4 * h) + (d * r + 4 * d) + (h * r + 4 * h)
    plan = QuantizePlan("float8_rowwise")
    assert experts_transient_bytes(shape, plan, rows=r, ep=16) == max(w1, w2) == w2
    assert experts_transient_bytes(shape, QuantizePlan("float8_rowwise", filter_fqns=("experts",)), rows=r, ep=16) == 0
    assert experts_transient_bytes(shape, QuantizePlan("float8_rowwise", min_dim=2048), rows=r, ep=16) == 0
