"""The fake TPU's launch-environment command, tools/tpu_smoke_shim.py (`tpu_smoke.sh --shim` runs
`python -m tools.tpu_smoke_shim`); kept importable here for the tests."""

import sys

from tools.tpu_smoke_shim import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
