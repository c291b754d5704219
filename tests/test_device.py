"""The device layer's process group on the CPU: gloo with one worker thread (trainer/device.py).

With gloo's default two workers, 2-process graph-mode training crashed in 5 of 18 runs
(docs/parallelism.md, "CPU collectives"); the trainer, its side groups and the test harness
all create `cpu_backend()` groups. A crash that needs minutes of training to show is not a
unit test; what is checked here is that every CPU group the trainer makes has one worker.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.trainer_runs import ENV, REPO


def test_cpu_process_groups_run_gloo_on_one_worker_thread():
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from trainer.device import cpu_backend, init_distributed
        init_distributed(torch.device("cpu"))
        side = dist.new_group(backend=cpu_backend())  # as checkpoints / preemption make them
        for group in (dist.group.WORLD, side):
            gloo = group._get_backend(torch.device("cpu"))
            assert isinstance(gloo, dist.ProcessGroupGloo), type(gloo)
            print(dist.get_backend(group), gloo.options._threads)
        out = torch.empty(4)
        dist.all_gather_into_tensor(out, torch.arange(4.0))
        assert torch.equal(out, torch.arange(4.0))
        dist.destroy_process_group()
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:2] == ["gloo_serial 1", "gloo_serial 1"], r.stdout
