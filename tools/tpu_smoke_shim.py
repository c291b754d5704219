"""Stands in for `python -m torch.tpu.distributed` under `tpu_smoke.sh --shim`: prints a made-up
single-host launch environment in torch-tpu 0.2.0's format (`_print_launch_env`: KEY="VALUE"
lines, WORLD_SIZE unquoted). `python -m tools.tpu_smoke_shim`.

TITAN_SMOKE_SHIM_DEVICES: devices on the fake host (default 1). TITAN_SMOKE_SHIM_FAIL=1: fail
the way torch-tpu does without a TPU (a traceback ending in ValueError, exit 1).
"""

import os
import sys


def main() -> int:
    if os.environ.get("TITAN_SMOKE_SHIM_FAIL") == "1":
        print(
            "Traceback (most recent call last):\n  ...\n"
            "ValueError: set_tpu_launch_env(): expected TPU devices, got none (fake TPU shim)",
            file=sys.stderr,
        )
        return 1
    devices = int(os.environ.get("TITAN_SMOKE_SHIM_DEVICES", "1"))
    print('TORCH_TPU_TOPOLOGY="fake-1x%d"' % devices)
    print('TORCH_TPU_SLICEBUILDER_ADDRESSES="%s"' % ",".join(f"localhost:{9000 + i}" for i in range(devices)))
    print('TORCH_TPU_XPROF_SESSION_ID=""')
    print(f"WORLD_SIZE={devices}")
    print('NODE_RANK="0"')
    return 0


if __name__ == "__main__":
    sys.exit(main())
