"""The command-line manners every entry point shares: scripts/, `python -m trainer.train`,
`python -m trainer.launch`.

- `error_line(msg)` writes `error: msg` to stderr in ONE write: the ranks of a torchrun job share
  one stderr pipe and `print()` writes the text and its newline separately, so two ranks' lines
  could interleave. `fail(msg)` is that line and exit 2.
- `ArgumentParser`: argparse whose usage errors (unknown flag, wrong type, bad choice, missing
  argument) raise `ConfigError` (through `run`: one `error:` line and exit 2), not argparse's
  usage block and its exit; `--help` prints the help on stdout and exits 0 as usual.
- `run(main)`: calls `main()` and gives the exit code: its return value; a `ConfigError` (bad
  input) is one `error:` line and 2; Ctrl-C (`KeyboardInterrupt`) is one `interrupted` line and
  130 (128 + SIGINT, what a shell reports), never a traceback. Use `sys.exit(run(main))`.

A usage error is a `ConfigError` like any other bad input, so a script's own handling of bad
input (a lock to release, a return code for an in-process caller) covers it too. This module
imports no torch (the `models` package does, so `ConfigError` is looked up when needed): a
script's `--help` answers at once, and `scripts/tpu_smoke.sh --help` works on a Python without
the venv (a bad flag there is still one `error:` line, exit 2).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

BAD_INPUT_EXIT_CODE = 2
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a process stopped by Ctrl-C


def stderr_line(text: str) -> None:
    """`text` and its newline in one write to stderr, then flushed (see the module docstring)."""
    sys.stderr.write(f"{text}\n")
    sys.stderr.flush()


def error_line(message: str) -> None:
    """The one `error: message` line of a refusal, in one write."""
    stderr_line(f"error: {message}")


def fail(message: str, code: int = BAD_INPUT_EXIT_CODE) -> NoReturn:
    """Write `error: message` and stop with `code` (default 2, bad input): raises SystemExit."""
    error_line(message)
    raise SystemExit(code)


def interrupted_line(what: str = "") -> None:
    stderr_line(f"interrupted (Ctrl-C){': ' + what if what else ''}")


def _config_error() -> type[Exception] | None:
    """`models.errors.ConfigError`, or None on a Python where `models` (torch) cannot be imported."""
    try:
        from models.errors import ConfigError
    except ImportError:
        return None
    return ConfigError


def is_bad_input(error: BaseException) -> bool:
    """True for a ConfigError (bad input). Without `models` imported nothing can have raised one."""
    errors = sys.modules.get("models.errors")
    return errors is not None and isinstance(error, errors.ConfigError)


def _typed_path(argv0: str) -> str:
    """A script's path relative to the working folder when it lies below it, else its name."""
    path = os.path.relpath(os.path.abspath(argv0)) if argv0 else ""
    return path if path and not path.startswith("..") else os.path.basename(argv0)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the contract's errors: a usage error raises ConfigError, which `run` writes
    as `error: NAME: MESSAGE; see PROG --help` (or `; allowed: HINT` with `hint=`), exit 2.

    `name` is how the line names the command (default: `prog`); `hint` replaces the `--help`
    pointer with what is allowed."""

    def __init__(self, *args, name: str | None = None, hint: str | None = None, **kwargs):
        if not args and "prog" not in kwargs:  # `scripts/estimate.py`, as typed, not argparse's `estimate.py`
            kwargs["prog"] = _typed_path(sys.argv[0])
        super().__init__(*args, **kwargs)
        self.error_name = name
        self.error_hint = hint

    def error(self, message: str):
        tail = f"; allowed: {self.error_hint}" if self.error_hint else f"; see {self.prog} --help"
        bad_input = _config_error()
        if bad_input is None:
            fail(f"{self.error_name or self.prog}: {message}{tail}")
        raise bad_input(f"{self.error_name or self.prog}: {message}{tail}")


def run(main: Callable[..., int | None], *args, interrupted: str = "", **kwargs) -> int:
    """`main(*args, **kwargs)`'s exit code with the contract's handling of bad input and Ctrl-C.

    None counts as 0; a ConfigError is one `error:` line and 2; Ctrl-C one `interrupted` line and
    130 (`interrupted` says what was left behind, e.g. "nothing was written"). A SystemExit
    (argparse's `--help`, `fail`) passes through."""
    try:
        code = main(*args, **kwargs)
    except Exception as e:
        if not is_bad_input(e):
            raise
        error_line(str(e))
        return BAD_INPUT_EXIT_CODE
    except KeyboardInterrupt:
        interrupted_line(interrupted)
        return INTERRUPTED_EXIT_CODE
    return 0 if code is None else int(code)
