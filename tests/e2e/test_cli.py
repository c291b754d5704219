"""The command-line manners every entry point shares (trainer/runtime/cli.py).

- `--help` prints the usage on stdout and exits 0, for every user command, benchmark and tool
  (`python -m trainer.train --help`, `scripts/train.sh --help` and `scripts/launch_pod.sh --help`
  were refused before);
- a flag nobody knows exits 2 with exactly one stderr line starting `error:` and no traceback
  (argparse printed its usage block, and some scripts a traceback);
- `scripts/estimate.py --config R` plans on the recipe's `[job] target` (it demanded `--target`),
  `--target` overrides it, and a bad recipe target names `job.target`, not the flag;
- Ctrl-C through the launcher stops every rank with one `interrupted` line each and exit 130
  (each rank printed a KeyboardInterrupt traceback, the launcher exited 1 after ~35 s).

The script cases run in one runner process that imports torch once and forks a child per case
(tests/support/contract_inputs.py, as the contract test does).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.support.trainer_runs import ENV, REPO

# Scripts that keep their own parser: none. The two that run in other venvs (the TorchTitan peer
# venv, a JAX-only host) import `trainer.runtime.cli`, which needs only the standard library.
OWN_PARSER: set[str] = set()


def _scripts() -> list[str]:
    """Every script under scripts/ with a command line (an ArgumentParser)."""
    out = []
    for root, _, files in os.walk(os.path.join(REPO, "scripts")):
        for name in sorted(files):
            path = os.path.join(root, name)
            if name.endswith(".py") and name not in OWN_PARSER and "ArgumentParser(" in open(path).read():
                out.append(os.path.relpath(path, REPO))
    return sorted(out)


ENTRY_POINTS = [*_scripts(), "-m trainer.train", "-m trainer.launch", "-m tools.tpu_smoke"]


def test_every_script_with_a_parser_uses_the_shared_one():
    """No script writes its own argparse error handling or `print("error: ...")` any more."""
    for rel in _scripts():
        text = open(os.path.join(REPO, rel)).read()
        assert "cli.ArgumentParser(" in text and "argparse.ArgumentParser(" not in text, rel
        assert not re.search(r"print\(f?\"error: ", text), rel
        assert "cli.run(main" in text, f"{rel}: its __main__ does not go through cli.run"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{(entry, 'help' | 'bad'): {rc, stdout, stderr}} for every entry point."""
    work = str(tmp_path_factory.mktemp("cli"))
    cases, keys = [], []
    for entry in ENTRY_POINTS:
        argv = entry.split()
        for kind, extra in (("help", ["--help"]), ("bad", ["--no-such-flag"])):
            cases.append({"argv": [*argv, *extra], "env": {}})
            keys.append((entry, kind))
    todo, done = os.path.join(work, "cases.json"), os.path.join(work, "results.json")
    with open(todo, "w") as f:
        json.dump(cases, f)
    env = {**ENV, "PYTHONPATH": REPO}
    subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "support", "contract_inputs.py"), todo, done, work],
        cwd=REPO,
        env=env,
        check=True,
        timeout=600,
    )
    with open(done) as f:
        return dict(zip(keys, json.load(f)))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_help_and_a_bad_flag(results, entry):
    helped = results[(entry, "help")]
    assert helped["rc"] == 0, helped["stderr"][-2000:]
    assert helped["stdout"].startswith("usage:") and helped["stderr"] == "", helped["stderr"][-2000:]
    bad = results[(entry, "bad")]
    lines = bad["stderr"].strip().splitlines()
    assert bad["rc"] == 2 and "Traceback" not in bad["stderr"], bad["stderr"][-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "--no-such-flag" in lines[0] or "required" in lines[0], lines  # argparse: missing ones first
    assert "usage:" not in bad["stdout"]


def test_train_sh_help_and_a_bad_flag():
    """train.sh answers --help itself (before making the environment); a bad flag reaches the trainer."""
    helped = subprocess.run(
        ["bash", "scripts/train.sh", "--help"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0 and helped.stdout.startswith("usage: scripts/train.sh"), helped.stderr
    assert "python -m trainer.train --help" in helped.stdout
    bad = subprocess.run(
        ["bash", "scripts/train.sh", "--no-such-flag"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**ENV, "TITAN_NO_INSTALL": "1", "TITAN_VENV": os.path.dirname(os.path.dirname(sys.executable))},
        timeout=300,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert bad.stderr.strip().splitlines() == [
        "error: unrecognized argument '--no-such-flag'; allowed: --config RECIPE.toml, --print-config or --section.key=value"
    ], bad.stderr


@pytest.mark.parametrize("script", ["scripts/launch_pod.sh", "scripts/tpu_smoke.sh"])
def test_shell_entry_points_answer_help(script):
    """The other shell commands: --help prints the usage (tpu_smoke.sh: its Python's, no venv needed)."""
    proc = subprocess.run(
        ["bash", script, "--help"],
        cwd=REPO,
        env={**ENV, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage:") and "Traceback" not in proc.stderr, proc.stderr
    bad = subprocess.run(
        ["bash", "scripts/launch_pod.sh", "--no-such-flag", "--", "--config", "x.toml"],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: launch_pod.sh: platform --no-such-flag; allowed: tpu-vm, qr, xpk, slurm, local, host"
    ]


def test_the_wrapper_imports_no_torch():
    """So that a light script's --help is instant and tools/tpu_smoke.py's --help runs without the venv."""
    code = "import sys, trainer.runtime.cli; sys.exit('torch' in sys.modules or 'models' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, timeout=60).returncode == 0


def test_trainer_help_keeps_overrides_working(capsys):
    """`--help` is answered before the command line is parsed; overrides still parse as before."""
    from trainer.config import split_cli
    from trainer.train import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--section.key=value" in out and "training" in out and "docs/config.md" in out
    assert split_cli(["--config", "r.toml", "--training.steps=3", "--model.n_layers", "2"]) == (
        "r.toml",
        False,
        [("training.steps", "3"), ("model.n_layers", "2")],
    )


# --- scripts/estimate.py: the target from the recipe --------------------------------------------


def test_estimate_reads_the_recipes_target(tmp_path, capsys):
    from scripts import estimate

    recipe = os.path.join(REPO, "configs", "llama3_70b_v6e.toml")  # [job] target = "v6e-256"
    assert estimate.main(["--config", recipe]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("llama3 70B on v6e-256:"), out[:300]
    estimate.main(["--config", recipe, "--target", "v6e-512"])  # the flag overrides the recipe
    assert capsys.readouterr().out.splitlines()[0].startswith("llama3 70B on v6e-512:")
    # a bad target from the recipe names the recipe key; a bad flag names the flag
    assert estimate.main(["--config", recipe, "--job.target=v9z-8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: job.target: unknown generation 'v9z'"), err
    assert estimate.main(["--config", recipe, "--target", "v9z-8"]) == 2
    assert capsys.readouterr().err.startswith("error: --target: unknown generation 'v9z'")
    # no target anywhere: one line saying both ways to give one
    assert estimate.main(["--config", os.path.join(REPO, "configs", "llama3_debug.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: job.target: ") and "sets no [job] target and no --target was given" in err


# --- Ctrl-C through the launcher ----------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_ctrl_c_through_the_launcher_stops_every_rank_without_a_traceback(tmp_path):
    """SIGINT to `python -m trainer.launch` (a terminal's Ctrl-C reaches the launcher; torchrun runs
    in its own session) while 2 CPU ranks train: each rank writes one `interrupted` line, the
    launcher one summary line and exits 130, in seconds (torchrun's 30 s kill is not needed)."""
    folder = tmp_path / "run"
    env = {k: v for k, v in ENV.items() if not k.startswith(("TPU_", "SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    args = [
        "--config",
        "configs/llama3_debug.toml",
        "--training.steps=10000",
        "--training.seq_len=32",
        "--model.n_layers=1",
        "--metrics.log_freq=1",
        "--validation.enable=false",
        "--metrics.enable_tensorboard=false",
        "--training.local_batch_size=1",
        "--parallelism.data_parallel_shard_degree=2",
        "--checkpoint.enable=false",
        f"--job.dump_folder={folder}",
    ]
    launch = [
        "--platform",
        "manual",
        "--device",
        "cpu",
        "--nnodes",
        "1",
        "--node-rank",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "--nproc-per-node",
        "2",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.launch", *launch, "--", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics, deadline = folder / "metrics.jsonl", time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the job ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    try:
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert sum(line.startswith("interrupted (Ctrl-C): stopped") for line in out.splitlines()) == 2, out[-3000:]
    assert (
        "launch: interrupted (Ctrl-C): torchrun stopped the workers (exit codes local rank 0: 130, local rank "
        "1: 130); exit 130" in out
    ), out[-3000:]
    assert time.monotonic() - sent < 25, "the ranks waited for torchrun's kill instead of stopping"
