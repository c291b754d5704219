"""Every command block of README.md runs on a fresh clone, as written (issue 29, item 7).

The blocks are the README's ```bash fences; a trailing backslash joins lines and a `#` starts a
comment. Each command needs a row in PLAN, the documented mapping from README to this test:
run as written, run with arguments appended (a long run shortened: later `--section.key=value`
overrides win), or skipped with the reason (a TPU, 8 devices, files that are not shipped). A
command without a row, or a row that matches no command, fails `test_every_readme_command_has_a_row`,
so a new README command cannot go untested by accident.

The blocks run in one `git clone` of this checkout (the committed tree, nothing else), each
after its `outputs/` is removed, in a shell like a new user's: the venv is not on PATH, no
PYTHONPATH. One clone, and its own TORCH_EXTENSIONS_DIR, because the CPU attention kernel's
build is keyed by its source path: it builds once (~20-50 s), and the checkout's own build in
~/.cache/torch_extensions is left alone. The clone reuses the venv that runs these tests
instead of making its own: `TITAN_VENV` points at it and the clone's `.venv` is a link to it
(so `.venv/bin/python`, as written, works), and `TITAN_NO_INSTALL=1` makes scripts/env.sh
refuse rather than install into it when it is not set up from this pyproject.toml (then the
runs are skipped, naming why; scripts/test.sh, and so CI, sets it up). The FLUX data set comes
from the titan-tpu cache (TITAN_CACHE, default ~/.cache/titan-tpu), built once per machine by
whichever run needs it first (tests/e2e/test_flux_train.py uses the same one), as for a user.

Measured (2 shared cores, load ~7): the blocks that are not slow 3.3 min, of which 1-2 min is
the kernel build in the first block; the NPROC block 1.3 min.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS2 = "--training.steps=2"  # a debug run shortened to 2 steps (it still saves its last step)

# (regex on the README command, action): None = as written; a string = arguments appended;
# ("skip", reason).
PLAN: list[tuple[str, object]] = [
    (r"^scripts/train\.sh$", STEPS2),  # the Llama 3 debug recipe: 200 steps
    (r"^scripts/test\.sh$", "-n 0 tests/unit/test_parallel_dims.py"),  # the whole suite is what runs this test
    (r"^scripts/train\.sh configs/flux_debug\.toml$", STEPS2),  # 300 steps; builds or reuses the data set
    (r"^\.venv/bin/python scripts/sample\.py --run outputs/flux_debug ", "--steps 2"),  # 20 Euler steps
    (r"^scripts/train\.sh configs/llama3_debug\.toml --training\.steps=50 ", STEPS2),
    (r"^\.venv/bin/python -m trainer\.train .*--print-config$", None),
    (r"^scripts/train\.sh configs/qwen3_moe_debug\.toml$", STEPS2),
    (
        r"^torchrun --nproc_per_node=8 ",
        ("skip", "8 devices (a v6e host), Meta's tokenizer.model and the C4 stream from the Hub"),
    ),
    (r"^source scripts/env\.sh tpu$", ("skip", "a TPU VM: installs torch-tpu into .venv-tpu (Python 3.11)")),
    (r"^scripts/tpu_smoke\.sh$", ("skip", "a TPU")),
    (r"^NPROC=4 scripts/train\.sh configs/llama3_debug\.toml ", STEPS2),
    (r"^NPROC=2 scripts/train\.sh configs/qwen3_moe_debug\.toml ", STEPS2),
]


def readme_blocks(text: str) -> list[list[str]]:
    """The commands of each ```bash block, continuation lines joined, comments dropped."""
    blocks = []
    for body in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        commands, line = [], ""
        for raw in body.splitlines():
            line += raw
            if line.endswith("\\"):
                line = line[:-1]
                continue
            command = _strip_comment(line).strip()
            if command:
                commands.append(" ".join(command.split()))
            line = ""
        blocks.append(commands)
    return blocks


def _strip_comment(line: str) -> str:
    """`line` up to its first `#` that starts a word outside quotes (as bash reads it)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def plan_for(command: str):
    rows = [action for pattern, action in PLAN if re.search(pattern, command)]
    assert len(rows) == 1, f"README command {command!r} matches {len(rows)} rows of PLAN (want 1)"
    return rows[0]


BLOCKS = readme_blocks((ROOT / "README.md").read_text(encoding="utf-8"))


def test_every_readme_command_has_a_row():
    commands = [c for block in BLOCKS for c in block]
    assert len(BLOCKS) >= 5 and len(commands) >= 10, BLOCKS  # the parser found the blocks
    for command in commands:
        plan_for(command)
    unused = [p for p, _ in PLAN if not any(re.search(p, c) for c in commands)]
    assert not unused, f"PLAN rows that match no README command (remove them): {unused}"
    assert not any(c.endswith("\\") for c in commands)


def _venv() -> Path:
    return Path(os.environ.get("TITAN_VENV") or sys.prefix).resolve()


def _fresh_shell_env(venv: Path) -> dict[str, str]:
    """The environment of a new user's shell: no venv on PATH, no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() != venv / "bin"
    )
    env.update(
        TITAN_VENV=str(venv),
        TITAN_NO_INSTALL="1",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("readme")
    clone = base / "titan-tpu"
    subprocess.run(
        ["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(clone)], check=True, capture_output=True, timeout=120
    )
    (clone / ".venv").symlink_to(_venv(), target_is_directory=True)
    (base / "torch_extensions").mkdir()
    return clone


def _block_id(block: list[str]) -> str:
    return re.sub(r"[^\w.=-]+", "_", block[0])[:48] if block else "empty"


def _param(i: int, block: list[str]):
    """Blocks that start several processes are `multiprocess` and `slow` (~1.5-3 min on 2 shared cores)."""
    marks = [pytest.mark.multiprocess, pytest.mark.slow] if any(c.startswith("NPROC=") for c in block) else []
    return pytest.param(block, id=f"{i}-{_block_id(block)}", marks=marks)


@pytest.mark.parametrize("block", [_param(i, b) for i, b in enumerate(BLOCKS)])
def test_readme_block_runs_on_a_fresh_clone(block, clone):
    """The block's commands in order, in the fresh clone without outputs/; each must exit 0."""
    plans = [plan_for(c) for c in block]
    runnable = [(c, p) for c, p in zip(block, plans) if not (isinstance(p, tuple) and p[0] == "skip")]
    if not runnable:
        pytest.skip("; ".join(f"{c!r}: needs {p[1]}" for c, p in zip(block, plans)))
    shutil.rmtree(clone / "outputs", ignore_errors=True)
    env = _fresh_shell_env(_venv())
    env["TORCH_EXTENSIONS_DIR"] = str(clone.parent / "torch_extensions")
    ready = subprocess.run(
        ["bash", "-c", "source scripts/env.sh dev"], cwd=clone, env=env, capture_output=True, text=True, timeout=60
    )
    if ready.returncode:
        pytest.skip(f"the venv is not set up from this pyproject.toml: {ready.stderr.strip()}")
    for command, plan in zip(block, plans):
        if isinstance(plan, tuple):
            print(f"SKIP  {command}  (needs {plan[1]})")
            continue
        line = command if plan is None else f"{command} {plan}"
        start = time.monotonic()
        proc = subprocess.run(["bash", "-c", line], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
        print(f"rc={proc.returncode} {time.monotonic() - start:5.1f}s  {line}")
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
