"""Workers' exit codes, for the launcher: torchrun reports them nowhere an orchestrator can read.

After a SIGTERM torchrun forwards it to its workers, waits for them and exits 1 (its
`SignalException`), whatever they did; when a worker exits non-zero first it stops the others
and exits 1 too (`ChildFailedError`). So `python -m trainer.launch` makes a folder, names it in
`TITAN_EXIT_STATUS_DIR` for the workers, and each `python -m trainer.train` writes its exit code
to `local{LOCAL_RANK}.exit` there just before it exits (`record_exit_status`). The launcher then
exits 75 only when every worker of its node wrote 75 (`launcher_exit_code`; docs/launch.md has
the table). Torch-free: the launcher imports this before torch.
"""

from __future__ import annotations

import os

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again"; a relaunch resumes from the checkpoint written
BAD_INPUT_EXIT_CODE = 2  # one `error:` line; fix the input, do not retry
EXIT_STATUS_ENV = "TITAN_EXIT_STATUS_DIR"


def record_exit_status(code: int, env=os.environ) -> None:
    """Write `code` to `$TITAN_EXIT_STATUS_DIR/local{LOCAL_RANK}.exit` if the launcher set the folder.
    Best effort: a failure to write leaves the file missing, which the launcher reads as "not preempted"."""
    folder = env.get(EXIT_STATUS_ENV)
    if not folder:
        return
    path = os.path.join(folder, f"local{env.get('LOCAL_RANK', '0')}.exit")
    from trainer.runtime.atomic import WriteFailed, atomic_file  # standard library only

    try:
        with atomic_file(path, what="exit status", mode="w") as f:
            f.write(f"{int(code)}\n")
    except (OSError, WriteFailed):
        pass


def read_exit_statuses(folder: str) -> dict[int, int]:
    """{local rank: exit code} of the workers that recorded one in `folder`."""
    codes = {}
    for name in os.listdir(folder):
        if name.startswith("local") and name.endswith(".exit") and name[5:-5].isdigit():
            try:
                with open(os.path.join(folder, name)) as f:
                    codes[int(name[5:-5])] = int(f.read().strip())
            except (OSError, ValueError):
                pass
    return codes


def launcher_exit_code(torchrun_code: int, worker_codes: dict[int, int], nproc: int) -> int:
    """The launcher's exit code from torchrun's and the workers' recorded codes ({local rank: code}).

    0 if torchrun succeeded; 75 only if every one of the node's `nproc` workers recorded 75 (all
    preempted, each wrote its checkpoint); 2 if the codes recorded are all 2 (bad input: torchrun
    kills the other workers as soon as the first exits, so they may record nothing); else
    torchrun's code as a shell gives it (128 + signal when it was killed), never 75: a crash, a
    worker killed before it recorded a code, or workers that disagree must not read as a preemption.
    """
    if torchrun_code == 0:
        return 0
    recorded = set(worker_codes.values())
    if recorded == {PREEMPTED_EXIT_CODE} and len(worker_codes) == nproc:
        return PREEMPTED_EXIT_CODE
    if recorded == {BAD_INPUT_EXIT_CODE}:
        return BAD_INPUT_EXIT_CODE
    code = 128 - torchrun_code if torchrun_code < 0 else torchrun_code
    return 1 if code in (0, PREEMPTED_EXIT_CODE) else code
