"""torch-tpu 0.2.0's own multislice mesh (`create_hybrid_device_mesh`, what `topology_aware_mesh`
runs with `dcn_mesh_shape` on several slices) takes the trainer's DCN split
(`ParallelDims.dcn_mesh_shape`) on stand-in devices of 2 and 4 slices (tools/torch_tpu_mesh.py, the
ttpu venv): the mesh comes back with every `dp_replicate` row inside one slice, slice-major, as the
launcher's global node ranks (slice id x hosts per slice + worker id) number them; the inner
(ICI) part of each slice is the single-slice layout of that slice."""

from __future__ import annotations

import json
import subprocess

import numpy as np

from parallelisms.parallel_dims import ParallelDims
from tests.xla.conftest import ROOT, _probe_env, xla_python


def _torch_tpu(cases: list[dict]) -> list[dict]:
    out = subprocess.run(
        [str(xla_python("ttpu")), str(ROOT / "tools" / "torch_tpu_mesh.py")],
        input=json.dumps({"cases": cases}),
        capture_output=True,
        text=True,
        env=_probe_env(),
        cwd=ROOT,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["results"]


def test_torch_tpu_hybrid_mesh_takes_the_dcn_split_on_dp_replicate():
    v6e = dict(generation="v6e", chips=[4, 4, 1], devices_per_chip=1)  # v6e-16 slices
    v7x = dict(generation="v7x", chips=[2, 2, 1], devices_per_chip=2)  # tpu7x-8 slices
    jobs = [
        (v6e, ParallelDims(dp_replicate=2, dp_shard=-1, num_slices=2, world_size=32)),
        (v6e, ParallelDims(dp_replicate=4, dp_shard=-1, tp=2, num_slices=2, world_size=32)),
        (v7x, ParallelDims(dp_replicate=4, dp_shard=-1, num_slices=4, world_size=32)),
    ]
    # allow_split as the trainer retries (tp 2 on a 4x4 slice needs it)
    cases = [dict(**g, shape=list(d.mesh_shape), dcn_shape=list(d.dcn_mesh_shape), allow_split=True) for g, d in jobs]
    single = [dict(**g, shape=list(d.ici_mesh_shape), allow_split=True) for g, d in jobs]
    results = _torch_tpu(cases + single)
    for (g, dims), got, one in zip(jobs, results[: len(jobs)], results[len(jobs) :]):
        assert "error" not in got and "error" not in one, (got, one)
        ids = np.asarray(got["ids"]).reshape(dims.mesh_shape)
        per_slice = dims.world_size // dims.num_slices
        slice_of = ids // per_slice
        rows = dims.dp_replicate // dims.num_slices  # replicate rows per slice
        for r in range(dims.dp_replicate):
            assert (slice_of[r] == r // rows).all(), (dims, r)  # a replicate row never leaves its slice
        # inside slice 0 the layout is torch-tpu's single-slice one for the slice's mesh
        inner = ids[:rows].reshape(-1)
        assert inner.tolist() == one["ids"], dims
