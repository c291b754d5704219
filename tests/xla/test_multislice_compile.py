"""The deviceless XLA:TPU compile of a multislice program: the trainer's graph step for 2 slices of
v6e-8 (`job.target = v6e-8x2`, HSDP dp_replicate 2 x FSDP 8), over jax's compile-only topology with
`num_slices=2` (MegaScale devices carrying `slice_index`), the mesh laid out as torch-tpu's hybrid
mesh with the DCN split on dp_replicate (tools/tpu_compile.py `topology_devices`, `_lay_out`).
About 3 minutes on a 2-vCPU VM (2026-12-05: capture 42 s, compile 122 s)."""

from __future__ import annotations

import os

import pytest

from tests.xla.conftest import ROOT, xla_python

pytestmark = pytest.mark.xla

SMALL = [
    ("model.n_layers", "2"),
    ("model.dim", "512"),
    ("model.n_heads", "4"),
    ("model.n_kv_heads", "2"),
    ("model.vocab_size", "8192"),
    ("training.seq_len", "1024"),
]


def test_topology_name_of_a_multislice_target():
    import planner
    from tools.tpu_compile import topology_name

    assert topology_name(planner.parse_target("v6e-8x2")) == "v6e:2x4,slices=2"
    assert topology_name(planner.parse_target("v7x-512x4")) == "tpu7x:4x8x8,slices=4"
    assert topology_name(planner.parse_target("v6e-256")) == "v6e:16x16"


def test_two_slice_program_compiles_with_the_dcn_split_on_dp_replicate():
    from tools.tpu_compile import compile_recipe

    r = compile_recipe(
        os.path.join(ROOT, "configs", "llama3_8b_v6e.toml"),
        overrides=[*SMALL, ("job.target", "v6e-8x2"), ("parallelism.data_parallel_replicate_degree", "2")],
        python=str(xla_python("ttpu")),
        timeout=1200,
    )
    assert r.error is None and r.oom is None, r.error or r.oom
    assert r.topology == "v6e:2x4,slices=2" and r.mesh.startswith("2 slices: DCN (2, 1, 1, 1) x ICI (1, 8, 1, 1)")
    # FSDP inside a slice (gathers, reduce-scatters) and the cross-slice gradient all-reduce
    assert r.collectives.get("all_gather_into_tensor", 0) > 0 and r.collectives.get("reduce_scatter_tensor", 0) > 0
    assert r.collectives.get("all_reduce", 0) > 0
    assert abs(r.compiler_gib - r.planned_gib) / r.planned_gib < 0.15  # tools/tpu_compile.py BAND
