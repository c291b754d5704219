"""The capacity-bounded dispatch through the trainer (`[moe] capacity_factor`, docs/moe.md#capacity-factor).

- 1 process vs torchrun 2 processes (gloo, FSDP 2 x EP 2): the same losses and the same copies
  dropped per step (`moe_dropped` in metrics.jsonl, > 0 at a factor of 1.0 on the debug model);
- graph mode with layer scan (the EP scan body's `forward_capacity`) gives eager's losses and drops;
- the rule table refuses a capacity with TP or CP, on a model without experts, and below 0.

Tolerance: fp32 (mixed_precision_param = float32); the same 1e-5 relative bound as the other
trainer parity tests (the paths differ in summation order only, see tests/unit/test_moe_capacity.py).
"""

from __future__ import annotations

import math
import re

import pytest

from models.errors import ConfigError
from tests.support.trainer_runs import MOE_SHORT_RUN, REPO, assert_losses_close, train
from trainer.config import build_config, parse_overrides
from trainer.job import plan_job

STEPS = 3  # MOE_SHORT_RUN's
ARGS = [*MOE_SHORT_RUN, "--moe.capacity_factor=1.0"]


def _curve(records: dict[int, dict]) -> tuple[list[float], list[int]]:
    assert sorted(records) == list(range(1, STEPS + 1))
    return [records[s]["loss"] for s in records], [records[s]["moe_dropped"] for s in records]


@pytest.mark.multiprocess
def test_capacity_1_process_equals_ep2(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    want_loss, want_dropped = _curve(train(tmp_path / "one", 1, {}, *ARGS))
    got_loss, got_dropped = _curve(train(tmp_path / "ep2", 2, dict(dp_shard=2, ep=2), *ARGS))
    assert sum(want_dropped) > 0  # copies really were dropped
    assert got_dropped == want_dropped
    assert_losses_close(got_loss, want_loss)


def test_capacity_scanned_graph_equals_eager(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    want_loss, want_dropped = _curve(train(tmp_path / "eager", 1, {}, *ARGS))
    graph = ["--compile.mode=graph", "--compile.scan_layers=true", "--compile.backend=aot_eager"]
    got_loss, got_dropped = _curve(train(tmp_path / "graph", 1, {}, *ARGS, *graph))
    assert got_dropped == want_dropped
    assert_losses_close(got_loss, want_loss)


@pytest.mark.parametrize(
    "recipe, overrides, refused",
    [
        ("qwen3_moe_debug", ["moe.capacity_factor=-1"], "-1.0; allowed: 0"),
        ("llama3_debug", ["moe.capacity_factor=1.25"], "this model has none"),
        ("qwen3_moe_debug", ["moe.capacity_factor=1.25", "parallelism.tensor_parallel_degree=2"], "tensor or context"),
        ("qwen3_moe_debug", ["moe.capacity_factor=1.25"], None),
        ("qwen3_moe_debug", ["moe.dispatch_chunks=2"], "2 splits the capacity"),
        ("qwen3_moe_debug", ["moe.capacity_factor=1.25", "moe.dispatch_chunks=2"], None),
    ],
)
def test_rules(recipe, overrides, refused):
    cfg = build_config(f"{REPO}/configs/{recipe}.toml", parse_overrides([f"--{o}" for o in overrides]))
    if refused is None:
        plan_job(cfg, world_size=2, device_type="cpu")
        return
    key = "moe.dispatch_chunks" if "splits the capacity" in refused else "moe.capacity_factor"
    with pytest.raises(ConfigError, match=f"^{key}: .*{refused}"):
        plan_job(cfg, world_size=2, device_type="cpu")


@pytest.mark.multiprocess
def test_dispatch_chunks_ep2_scanned_graph_equals_one_process(tmp_path, monkeypatch):
    """`[moe] dispatch_chunks = 2` under EP 2 in graph mode with layer scan (the scan body's
    chunk-major dispatch, two sequences per rank, one per chunk): the one-process eager losses and
    drops."""
    monkeypatch.chdir(REPO)
    want_loss, want_dropped = _curve(train(tmp_path / "one", 1, {}, *ARGS))
    graph = ["--compile.mode=graph", "--compile.scan_layers=true", "--compile.backend=aot_eager"]
    got_loss, got_dropped = _curve(
        train(tmp_path / "ep2", 2, dict(dp_shard=2, ep=2), *ARGS, *graph, "--moe.dispatch_chunks=2")
    )
    assert sum(want_dropped) > 0 and got_dropped == want_dropped
    assert_losses_close(got_loss, want_loss)


@pytest.mark.multiprocess
def test_full_ac_recompute_sends_nothing_back(tmp_path, monkeypatch):
    """Full AC over the scanned EP 2 graph with `[moe] dispatch_chunks = 2` (one sequence per chunk):
    the router weights are applied on the expert's rank (parallelisms/expert_parallel.py
    `capacity_all_to_all`), so the backward body recomputes the dispatch but not the combine. Per
    chunk the forward scan body sends the capacity buffer twice (dispatch, combine) and the
    backward body three times (the recompute's dispatch, the combine's and the dispatch's
    gradients), not four: 4 and 6 buffer-sized all-to-alls in the two bodies (8 with the weights
    applied on the token's rank). The losses are the one-process run's."""
    monkeypatch.chdir(REPO)
    args = [*MOE_SHORT_RUN, "--moe.capacity_factor=1.25", "--activation_checkpoint.mode=full"]
    want_loss, _ = _curve(train(tmp_path / "one", 1, {}, *args))
    graph = ["--compile.mode=graph", "--compile.scan_layers=true", "--compile.backend=aot_eager"]
    dump = tmp_path / "graph.txt"
    got_loss, _ = _curve(
        train(
            tmp_path / "ep2",
            2,
            dict(dp_shard=2, ep=2),
            *args,
            *graph,
            "--moe.dispatch_chunks=2",
            f"--compile.dump_graph={dump}",
        )
    )
    assert_losses_close(got_loss, want_loss)
    # qwen3_moe_debug: 8 experts, top-2, dim 256; seq 64 -> capacity ceil(1.25 x 64 x 2 / 8) = 20 rows
    # per expert and sequence: one chunk's buffer is [8 x 20, 256] (no parameter has that shape).
    rows = 8 * math.ceil(1.25 * 64 * 2 / 8)
    buffer = re.compile(rf'"f32\[{rows}, 256\]" = torch\.ops\._c10d_functional\.all_to_all_single')
    bodies = re.split(r"\n\s*class scan_combine_graph_\d+\(", dump.read_text())[1:]
    assert sorted(len(buffer.findall(body)) for body in bodies) == [4, 6]
