"""Start-up checks across ranks, on gloo, with processes spawned as a 2-host launch spawns them.

Each process gets the environment a launcher gives one process per host (RANK, WORLD_SIZE=2,
LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR/PORT), so the trainer sees a 2-host job. The
hosts' separate disks are simulated honestly: each process runs in its own working directory
and the checkpoint folder is the same relative path, so the same path names two different
folders, as a local path does on two machines.

- a local checkpoint folder that one "host" does not see is refused on every rank, one line
  naming checkpoint.folder and gs://; a folder both see (an absolute path) passes, and the
  nonce file is removed;
- a rank frozen between the process group and the run lock is named by rank 0 within
  training.startup_timeout_s (start_runtime's arrival barrier).
"""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.support.trainer_runs import ENV, REPO

pytestmark = pytest.mark.multiprocess

SHARED = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    from models.errors import ConfigError
    from trainer.runtime.storage import check_shared_folder
    dist.init_process_group("gloo")
    try:
        check_shared_folder(sys.argv[1], key="checkpoint.folder", timeout_s=60)
        print(f"rank {dist.get_rank()}: passed")
    except ConfigError as e:
        print(f"rank {dist.get_rank()}: error: {e}")
    sys.stdout.flush()
    dist.barrier()
    os._exit(0)
""")

FROZEN = textwrap.dedent("""
    import os, sys, time
    import trainer.job as job
    from trainer.config.load import build_config
    from trainer.runtime.watchdog import StartupTimeout
    cfg = build_config("configs/llama3_debug.toml", [("training.startup_timeout_s", "3"),
                                                      ("job.dump_folder", sys.argv[1])])
    real = job.init_distributed
    def frozen_after_init(device, **kw):
        info = real(device, **kw)
        if info.rank == 1:
            time.sleep(120)  # frozen between init_process_group and the first collective
        return info
    job.init_distributed = frozen_after_init
    t0 = time.monotonic()
    try:
        job.start_runtime(cfg, job.PURPOSES["train"], device_type=None)
        print("rank 0: started")
    except StartupTimeout as e:
        print(f"after {time.monotonic() - t0:.1f} s: {e}")
    sys.stdout.flush()
    os._exit(0)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_hosts(script, args, cwds, *, wait_rank0_only=False):
    port = _free_port()
    procs = []
    for rank, cwd in enumerate(cwds):
        env = {
            **ENV,
            "PYTHONPATH": REPO,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    for i, proc in enumerate(procs):
        if wait_rank0_only and i > 0:
            proc.kill()
            proc.wait()
            continue
        out, err = proc.communicate(timeout=300)
        outs.append(out + err[-2000:])
    return outs


def test_local_checkpoint_folder_not_seen_by_every_host_is_refused(tmp_path):
    script = tmp_path / "shared.py"
    script.write_text(SHARED)
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for h in hosts:
        h.mkdir()
    outs = _two_hosts(script, ["ckpt"], hosts)  # one path, a different folder on each "host"
    for rank, out in enumerate(outs):
        assert f"rank {rank}: error: checkpoint.folder: ckpt is a local folder that not every host" in out, out
        assert "shared file system" in out and "gs:// URL" in out, out
    assert os.listdir(hosts[0] / "ckpt") == [] and not (hosts[1] / "ckpt").exists()  # the nonce file removed

    shared = tmp_path / "shared_ckpt"
    outs = _two_hosts(script, [str(shared)], hosts)
    for rank, out in enumerate(outs):
        assert f"rank {rank}: passed" in out, out
    assert os.listdir(shared) == []


def test_a_rank_frozen_before_the_first_collective_is_named_within_startup_timeout(tmp_path):
    script = tmp_path / "frozen.py"
    script.write_text(FROZEN)
    outs = _two_hosts(script, [str(tmp_path / "dump")], [REPO, REPO], wait_rank0_only=True)
    out = outs[0]
    assert "start-up barrier 'process-group': ranks 1 of 2 did not arrive within 3 s" in out, out
    assert "rank 0: started" not in out
