"""The deviceless XLA:TPU compile of graph-mode PP across slices (docs/pipeline_parallel.md, "Across
slices"): the trainer's graph step for 2 slices of v6e-8 (`job.target = v6e-8x2`), PP 2 with the pp
axis over the DCN x FSDP 8 in each slice, a narrow Llama 3, over jax's compile-only topology with
`num_slices=2`, the optimized HLO dumped. It checks that the pipeline's permutes are the only
collectives of the stage ring and that they cross the slices: 4 `collective-permute`s (2 chunks, 2
stages: T - 1 = 2 forward, 2 backward) pairing each device with its twin on the other slice, which
XLA turns into MegaScale (DCN) send/recv pairs, and that the compiler's memory is within the
planner's band. About 3 minutes on a 2-vCPU VM."""

from __future__ import annotations

import glob
import os
import re

import pytest

from tests.xla.conftest import ROOT, xla_python

pytestmark = pytest.mark.xla

SMALL = [
    ("model.n_layers", "4"),
    ("model.dim", "512"),
    ("model.n_heads", "4"),
    ("model.n_kv_heads", "2"),
    ("model.vocab_size", "8192"),
    ("training.seq_len", "1024"),
    ("training.local_batch_size", "2"),
    ("validation.enable", "false"),
    ("job.target", "v6e-8x2"),
    ("parallelism.pipeline_parallel_degree", "2"),
    ("parallelism.pipeline_schedule", "GPipe"),
    ("parallelism.pipeline_microbatches", "2"),
    ("parallelism.pipeline_first_stage_less_layers", "0"),
    ("parallelism.pipeline_last_stage_less_layers", "0"),
]


def test_pp_over_two_slices_compiles_with_the_permutes_on_the_dcn(tmp_path):
    from tools.tpu_compile import compile_recipe

    dump = tmp_path / "hlo"
    r = compile_recipe(
        os.path.join(ROOT, "configs", "llama3_8b_v6e.toml"),
        overrides=SMALL,
        python=str(xla_python("ttpu")),
        timeout=1200,
        extra_env={"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"},
    )
    assert r.error is None and r.oom is None, r.error or r.oom
    assert r.topology == "v6e:2x4,slices=2" and r.mesh.startswith("2 slices: DCN (2, 1, 1, 1) x ICI (1, 8, 1, 1)")
    assert r.collectives.get("all_to_all_single") == 4, r.collectives  # the permutes as captured
    # at this toy size (0.1 GiB) the planner's fixed per-tensor terms dominate and it counts more than
    # the compiler (0.117 planned vs 0.082 compiled, 2026-12-06); it must never count less: at the 8B's
    # width (docs/results/pp_compile_llama3_8b_v6e8x2_2026-12-06_31b8cea.csv) the two agree within 5.3 %
    assert r.compiler_gib <= 1.15 * r.planned_gib, (r.compiler_gib, r.planned_gib)
    (before,) = glob.glob(str(dump / "*jit_per_device*.before_optimizations.txt"))
    pairs = re.findall(r"collective-permute\(.*?source_target_pairs=(\{[^ ]*\}\})", open(before).read())
    twins = "{" + ",".join(f"{{{i},{i + 8}}},{{{i + 8},{i}}}" for i in range(8)) + "}"
    assert pairs == [twins] * 4, pairs
    assert "all-to-all(" not in open(before).read()
    (after,) = glob.glob(str(dump / "*jit_per_device*.after_optimizations.txt"))
    dcn = set(re.findall(r'_xla_host_transfer_rendezvous="(ppermute[^"]*)"', open(after).read()))
    assert len(dcn) == 4, dcn  # each permute one MegaScale send/recv pair over the DCN
