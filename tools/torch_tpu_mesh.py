"""torch-tpu's own mesh layout on stand-in devices of a TPU slice, with no TPU (run in the ttpu venv).

    .venv-ttpu/bin/python tools/torch_tpu_mesh.py < cases.json

stdin: {"cases": [{"generation": "v6e", "chips": [16, 16, 1], "devices_per_chip": 1,
"shape": [1, 64, 4, 1], "allow_split": false}, ...]}. For each case this loads torch-tpu's
`_internal/distributed/device_utils.py` by path (importing the `torch_tpu` package would load the
backend and change torch's globals), makes one stand-in device per TensorCore with the attributes
`create_device_mesh` reads (id, coords, core_on_chip, device_kind, platform; ids numbered core
fastest, then x, y, z, in the id order `topology_aware_mesh` sorts them into) and calls
`create_device_mesh(shape, devices, allow_split_physical_axes=...)`, as `topology_aware_mesh` does
on a single slice. Prints one JSON line: {"torch_tpu": version, "source": path, "results":
[{"ids": nested device ids} | {"error": "Type: message"}, ...]} in the order of the cases.
Used by tools/recipe_check.py (once per check run) and tests/xla/test_tpu_topology_ttpu.py.

Several slices: a case with `"dcn_shape": [2, 1, 1, 1]` (`ParallelDims.dcn_mesh_shape`) makes
`prod(dcn_shape)` copies of the slice, each stand-in carrying its `slice_index` (ids numbered
slice-major), and calls `create_hybrid_device_mesh(shape / dcn_shape, dcn_shape, devices)`, what
`topology_aware_mesh(shape, dcn_mesh_shape=dcn_shape)` runs on a multislice job; `shape` is the
whole job's mesh.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import json
import os
import sys

KINDS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite", "v7x": "TPU7x"}


class StandIn:
    """What create_device_mesh reads from a PJRT device."""

    platform = "tpu"

    def __init__(self, i: int, coords: tuple[int, int, int], core: int, kind: str, slice_index: int = 0):
        self.id, self.coords, self.core_on_chip, self.device_kind = i, coords, core, kind
        self.slice_index = slice_index


def load_device_utils():
    spec = importlib.util.find_spec("torch_tpu")  # a top-level find_spec does not import the package
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("torch_tpu is not installed in this environment")
    path = os.path.join(list(spec.submodule_search_locations)[0], "_internal", "distributed", "device_utils.py")
    mod_spec = importlib.util.spec_from_file_location("torch_tpu_device_utils", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module, path


def stand_ins(generation: str, chips, per_chip: int, slices: int = 1) -> list[StandIn]:
    x, y, z = chips
    out = []
    for s in range(slices):
        for (cz, cy, cx), core in itertools.product(itertools.product(range(z), range(y), range(x)), range(per_chip)):
            out.append(StandIn(len(out), (cx, cy, cz), core, KINDS[generation], s))
    return out


def main() -> int:
    request = json.load(sys.stdin)
    du, path = load_device_utils()
    results = []
    for case in request["cases"]:
        dcn = tuple(case.get("dcn_shape") or ())
        slices = 1
        for d in dcn:
            slices *= d
        devices = stand_ins(case["generation"], case["chips"], case.get("devices_per_chip", 1), slices)
        split = bool(case.get("allow_split"))
        try:
            if slices > 1:
                ici = tuple(m // d for m, d in zip(case["shape"], dcn))
                mesh = du.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=split)
            else:
                mesh = du.create_device_mesh(tuple(case["shape"]), devices=devices, allow_split_physical_axes=split)
            results.append({"ids": [int(d.id) for d in mesh.reshape(-1)], "shape": list(mesh.shape)})
        except Exception as e:  # noqa: BLE001  (every refusal is a result)
            results.append({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
    print(json.dumps({"torch_tpu": importlib.metadata.version("torch-tpu"), "source": path, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
