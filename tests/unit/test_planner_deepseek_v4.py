"""The planner's DeepSeek-V4 activation terms (planner/deepseek_v4.py, docs/planner.md) against
what a real eager forward + loss of the debug flavor keeps for backward on the CPU.

The debug flavor has every kind of block (HCA + hash MoE, CSA + hash MoE, sliding + learned MoE,
CSA + learned MoE), 4 mHC streams and 20 Sinkhorn steps; its CSA / HCA attention is SDPA with a
window-blocked softmax in torch (`compressed_sink_attention`: float32 probabilities over [sink |
2 windows of keys | the entries] per query). Before these terms the
planner counted a one-stream decoder block with the op's attention: 58.5 % under the measured
bytes without AC, 23.7 % under with full AC (4 x 2 x 64 tokens).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import planner as P
from models import get_model_family
from planner.deepseek_v4 import v4_activation_bytes

V4 = get_model_family("deepseek_v4")


def _fn_fp32_extra(args, *, blocks: bool) -> int:
    """What the planner leaves out by design: the hyper-connections' `fn.float()` copies are fp32
    where the planner's kept weights count bf16 (2 bytes more per element); the blocks' only
    without AC (full AC recomputes them), `hc_head`'s always."""
    n, d = args.hc_mult, args.dim
    per_block = 2 * (2 + n) * n * n * d
    return 2 * (n * n * d + (2 * per_block * args.n_layers if blocks else 0))


@pytest.mark.parametrize("ac_mode, seq", [("none", 64), ("none", 128), ("full", 64)])
def test_v4_activation_model_matches_measured_saved_bytes(ac_mode, seq):
    """Planned activations + kept bf16 weights vs `measure_saved_bytes` of the debug flavor
    (bf16 weights under FSDP's mixed precision, one rank, 2 sequences). The formulas count every
    per-token, per-row and per-position tensor, so the difference is the per-block constants
    alone: the `fn` copies' extra 2 bytes per element (`_fn_fp32_extra`; measured 144,982 B under
    it without AC at 2 x 64, 4,102 with full AC) less the frozen indexer's weights, which the
    planner's kept weights count and which no linear keeps (no gradient). The bound is that extra
    plus 64 bytes a block (a few [E] vectors, the aux loss's scalars); it cannot hide a per-token
    term (the smallest, a 4-byte rsqrt, is 512 bytes here) or a per-row one (the k / v rows of
    a sequence: 2 x (seq + entries) x 32 bytes). Eager CPU at seq 128 checks the terms that grow
    with the entries (the probabilities over them, their mask) at a second length."""
    _check_measured(ac_mode, seq)


@pytest.mark.parametrize("seq", [64, 128])
def test_v4_trained_indexer_activations_match_measured_saved_bytes(seq):
    """With the indexer loss (`indexer_loss_weight` > 0) the two CSA blocks' indexers keep their
    scores, queries, keys and the KL's terms (`indexer_loss_bytes`): the planned increase over the
    frozen model equals the measured one (318,036 B at 2 x 64 tokens, 980,052 at 2 x 128: the
    per-entry terms grow with the entries, 16 and 32 a row) within 64 bytes a CSA block (the
    loss's scalars: measured 84 B in all), and each model passes the bound above. The smallest
    per-token term, the 1-byte row mask, is 128 bytes here."""
    frozen = _check_measured("none", seq)
    trained = _check_measured("none", seq, indexer_loss_weight=1.0)
    blocks = V4.flavors["debugmodel"].layer_kinds().count("c")
    planned, measured = trained[0] - frozen[0], trained[1] - frozen[1]
    assert planned > 0 and 0 <= measured - planned <= 64 * blocks, (planned, measured)


def _check_measured(ac_mode: str, seq: int, **overrides) -> tuple[int, int]:
    """(planned activations + kept weights, measured saved bytes) of the debug flavor, checked
    against the bound of the test above."""
    from trainer.step import lm_loss

    batch = 2
    args = dataclasses.replace(V4.flavors["debugmodel"], max_seq_len=seq, **overrides)
    shape = args.shape()
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    with P.fake_process_group(1):
        dims = P.make_parallel_dims(dp_replicate=1, dp_shard=-1, tp=1, ep=1, world_size=1, shape=shape, seq_len=seq)
        stats = P.shard_model(V4, args, dims)
        kw = dict(
            model="deepseek_v4",
            target=P.parse_target("v6e-4"),
            shape=shape,
            stats=stats,
            parallel_dims=dims,
            local_batch_size=batch,
            seq_len=seq,
            ac_mode=ac_mode,
            loss_parallel=False,
            flops_per_token=1.0,
        )
        acts = v4_activation_bytes(args, local_batch_size=batch, seq_len=seq, tp=1, ac_mode=ac_mode)
        est = P.estimate(**kw, activations=acts)
        stand_in = P.estimate(**kw)  # the decoder model the planner used before
        model = P.build_parallel_model(V4, args, dims, ac_mode=ac_mode)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        measured = P.measure_saved_bytes(model, tokens[:, :-1], tokens[:, 1:], loss_fn=lm_loss)
    predicted = est.activations.total + est.saved_weights
    bound = _fn_fp32_extra(args, blocks=ac_mode == "none") + 64 * args.n_layers
    assert 0 <= measured - predicted <= bound, (predicted, measured, bound)
    old = stand_in.activations.total + stand_in.saved_weights
    assert old < (0.45 if ac_mode == "none" else 0.8) * measured, (old, measured)
    return predicted, measured


def test_v4_blocks_are_counted_per_kind_and_refuse_tp_and_cp():
    """Flash at 4 x 4096: the CSA blocks keep the most (their compressor's two windows and
    1,024 entries a query scores where an HCA block's see 32: float32 probabilities over 1 + 256
    + 1,024 keys and their bf16 copies, 7.5 GiB of the block's 23.7); full AC keeps the 4 streams of every block's input;
    the stack sums the kinds. TP is refused here with one error line (the terms are tp = 1's); CP
    never reaches them (the rules refuse it for the family): an assertion here."""
    args = V4.flavors["flash"]
    kw = dict(local_batch_size=4, seq_len=4096, tp=1)
    none = v4_activation_bytes(args, ac_mode="none", **kw)
    full = v4_activation_bytes(args, ac_mode="full", **kw)
    tokens = 4 * 4096
    assert full.blocks == 43 * 2 * 4 * args.dim * tokens
    kinds = args.layer_kinds()
    assert kinds.count("c") == 20 and kinds.count("h") == 23
    assert none.per_block_none / 2**30 == pytest.approx(23.68, abs=0.01)
    assert 43 * 19.2 < none.blocks / 2**30 < 43 * none.per_block_none / 2**30
    from models.errors import ConfigError

    with pytest.raises(ConfigError, match="parallelism.tensor_parallel_degree: 2: .*allowed: 1"):
        v4_activation_bytes(args, ac_mode="full", **(kw | dict(tp=2)))
    with pytest.raises(AssertionError, match="cp = 1"):
        v4_activation_bytes(args, ac_mode="full", **(kw | dict(cp=2)))
