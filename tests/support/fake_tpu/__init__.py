"""A fake TPU for CI's run of scripts/tpu_smoke.sh (`--shim`): the launch-environment command."""
