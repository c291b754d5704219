"""Bad inputs for the entry-point contract test (tests/e2e/test_contract.py), generated, not listed.

Every case starts from one valid input (a recipe, a config.json, a tokenizer.json, a data set
folder, a checkpoint, a command-line value) and applies one damage function of an input class:

| class          | what the damage does                                                          |
|----------------|-------------------------------------------------------------------------------|
| missing        | the file or folder does not exist                                             |
| unreadable     | a folder where a file is expected (root reads any file, so no chmod), or a    |
|                | file without read permission when not running as root                         |
| binary         | bytes that are not UTF-8 text                                                 |
| malformed      | not the format at all (JSON/TOML syntax, a safetensors or parquet header)     |
| truncated      | the file cut in half                                                          |
| wrong_type     | a key holding a value of another type (a string for a number, a list ...)     |
| non_finite     | nan or inf where a number is read                                             |
| out_of_range   | a number outside what the key allows (negative, zero)                         |
| inconsistent   | keys that are valid alone but contradict each other (two tokens, one id)      |
| occupied       | the destination the entry point writes already exists                        |

`damage_file` / `damage_json` / `damage_toml` / `damage_value` generate the cases of one input
for a list of keys; an entry point joins the table by one row that says which inputs it takes
(tests/e2e/test_contract.py, ROWS).

Run as a script, this module is the runner: it imports torch and the heavy libraries once and
then forks one child per case, which runs the entry point exactly as `python script.py ARGS`
(or `python -m module ARGS`) would, its stdout and stderr in files, its exit status the child's.
One process start instead of ~3 s of imports per case keeps the whole table in seconds.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CLASSES = (
    "missing",
    "unreadable",
    "binary",
    "malformed",
    "truncated",
    "wrong_type",
    "non_finite",
    "out_of_range",
    "inconsistent",
    "occupied",
)


@dataclass
class Case:
    """One bad input for one entry point: run `argv` in `cwd` with `env`; expect exit 2, one
    `error:` line containing `names` (any of them), and `watch` (paths) left as they were."""

    entry: str
    cls: str
    label: str
    argv: list[str]
    names: list[str]
    watch: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.entry}-{self.cls}-{self.label}"


# --------------------------------------------------------------------------------- damages


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def damage_file(path: str, *, fmt: str) -> Iterator[tuple[str, str, Callable[[], None]]]:
    """(class, label, apply) for the damages of a whole file of format `fmt` (json, toml,
    safetensors, parquet, text) at `path`; `apply` changes the file in place."""

    def missing():
        _remove(path)

    def unreadable():
        if os.geteuid() != 0:
            os.chmod(path, 0)
            return
        _remove(path)
        os.makedirs(path)

    def binary():
        with open(path, "wb") as f:
            f.write(b"\xff\xfe\x00\x81" * 16)

    def truncated():
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[: max(1, len(data) // 2)])

    def malformed():
        with open(path, "rb") as f:
            data = f.read()
        if fmt == "json":
            bad = b"{" + data.lstrip(b"{ \n")[:-1].replace(b":", b"=", 1)
        elif fmt == "toml":
            bad = b"[job\n" + data
        elif fmt == "safetensors":  # a header length far past the end of the file
            bad = (2**40).to_bytes(8, "little") + data[8:]
        elif fmt == "parquet":  # the footer magic gone
            bad = data[:-4] + b"XXXX"
        else:
            return
        with open(path, "wb") as f:
            f.write(bad)

    yield "missing", os.path.basename(path), missing
    yield "unreadable", os.path.basename(path), unreadable
    if fmt in ("json", "toml", "text"):
        yield "binary", os.path.basename(path), binary
    if fmt != "text":
        yield "malformed", os.path.basename(path), malformed
    if fmt not in ("text", "toml"):  # half a TOML file can be a valid, shorter recipe
        yield "truncated", os.path.basename(path), truncated


def _get(obj, keys: tuple):
    for k in keys:
        obj = obj[k]
    return obj


def _put(obj, keys: tuple, value) -> None:
    for k in keys[:-1]:
        obj = obj[k]
    obj[keys[-1]] = value


def value_damages(value) -> Iterator[tuple[str, str, object]]:
    """(class, label, bad value) for a valid `value` of a key: another type, nan and inf for a
    number, a negative number (and zero for a positive one)."""
    if isinstance(value, bool):
        yield "wrong_type", "str", "maybe"
        return
    if isinstance(value, int):
        yield "wrong_type", "str", "many"
        yield "out_of_range", "neg", -abs(value) - 1
        return
    if isinstance(value, float):  # nan passes `x < lo` and `x > hi` checks, inf passes `x > 0`
        yield "wrong_type", "str", "many"
        yield "non_finite", "nan", math.nan
        yield "non_finite", "inf", math.inf
        yield "out_of_range", "neg", -abs(value) - 1
        return
    if isinstance(value, str):
        yield "wrong_type", "list", [value]
        return
    if isinstance(value, (list, dict)):
        yield "wrong_type", "int", 7


def damage_data(data, keys: list, *, classes=CLASSES) -> Iterator[tuple[str, str, object]]:
    """(class, label, damaged copy of `data`) for each key in `keys` and each damage of its value
    (`value_damages`). A key is a path tuple, or (path, classes) to keep only those classes (a
    key where a negative number is valid), or (path, [(class, label, value), ...]) with its own
    bad values (an inconsistency that only that key can express)."""
    for entry in keys:
        path, only, own = entry, None, None
        if len(entry) == 2 and isinstance(entry[0], tuple):
            path, extra = entry
            if isinstance(extra, list):
                own = extra
            else:
                only = set(extra)
        bad_values = own if own is not None else list(value_damages(_get(data, path)))
        for cls, label, value in bad_values:
            if cls not in classes or (only is not None and cls not in only):
                continue
            copy = json.loads(json.dumps(data, allow_nan=True))
            _put(copy, path, value)
            yield cls, f"{'.'.join(map(str, path))}={label}", copy


# --------------------------------------------------------------------------------- writers


def write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, allow_nan=True)  # NaN / Infinity: what Python's json reads


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(v)


def write_toml(path: str, data: dict) -> None:
    """A recipe from {section: {key: value}} (scalars and lists only, what recipes hold)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for section, table in data.items():
        if not isinstance(table, dict):
            continue
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def snapshot(paths: list[str]) -> dict[str, object]:
    """What is at each path: None (nothing), or {relative path: (size, mtime_ns)} of a tree."""
    out: dict[str, object] = {}
    for p in paths:
        if not os.path.lexists(p):
            out[p] = None
        elif os.path.isdir(p):
            tree = {}
            for d, _, files in os.walk(p):
                tree[os.path.relpath(d, p)] = "dir"
                for name in files:
                    st = os.stat(os.path.join(d, name))
                    tree[os.path.relpath(os.path.join(d, name), p)] = (st.st_size, st.st_mtime_ns)
            out[p] = tree
        else:
            st = os.stat(p)
            out[p] = (st.st_size, st.st_mtime_ns)
    return out


# --------------------------------------------------------------------------------- runner

PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "numpy",
    "pyarrow.parquet",
    "safetensors.torch",
    "tiktoken",
    "transformers",
)


def _child(case: dict, out_dir: str) -> None:
    """In the forked child: become `python <argv>` and exit with its status."""
    import runpy
    import traceback
    import warnings

    os.chdir(case.get("cwd") or ROOT)
    os.environ.update(case.get("env") or {})
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(os.path.join(out_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    argv = case["argv"]
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")  # preloaded modules
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1]] + argv[2:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c"] + argv[2:]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            script = os.path.join(ROOT, argv[0])
            sys.argv = [script] + argv[1:]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:  # what the interpreter does with SystemExit("message")
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


TIMEOUT_S = 60
"""A case that has not exited by then is stopped (with its children) and reported: a bad input
let through would otherwise train, build or benchmark with it."""


def _kill_group(pgid: int) -> None:
    import signal

    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_cases(cases: list[dict], work: str) -> list[dict]:
    """Fork one child per case (sequentially); [{rc, stdout, stderr}] in order."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    results = []
    for i, case in enumerate(cases):
        out_dir = os.path.join(work, f"case{i}")
        os.makedirs(out_dir, exist_ok=True)
        pid = os.fork()
        if pid == 0:
            try:
                os.setpgid(0, 0)  # its own group: a timeout ends whatever it started too
                _child(case, out_dir)
            finally:
                os._exit(70)
        try:
            os.setpgid(pid, pid)  # also here: the child may not have run yet
        except OSError:
            pass
        deadline = time.monotonic() + float(case.get("timeout", TIMEOUT_S))
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                _kill_group(pid)
                os.waitpid(pid, 0)
                rc = "timeout"
                break
            time.sleep(0.02)
        _kill_group(pid)  # anything the case left running
        with open(os.path.join(out_dir, "stdout"), errors="replace") as f:
            stdout = f.read()
        with open(os.path.join(out_dir, "stderr"), errors="replace") as f:
            stderr = f.read()
        results.append({"rc": rc, "stdout": stdout, "stderr": stderr})
    return results


if __name__ == "__main__":
    # python tests/support/contract_inputs.py CASES.json RESULTS.json WORK_DIR
    with open(sys.argv[1]) as f:
        todo = json.load(f)
    done = run_cases(todo, sys.argv[3])
    with open(sys.argv[2], "w") as f:
        json.dump(done, f)
