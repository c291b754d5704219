"""The long files and long functions of the product and its periphery, read with `ast`.

Prints two tables: Python files over `--max-file` lines (800) and functions over `--max-function`
lines (80, counted from the `def` line to the last line of the body, docstring included). The
tree scanned is the product's packages plus scripts/ (and tests/ with `--tests`).

    .venv/bin/python scripts/dev/size_report.py [--max-file 800] [--max-function 80] [--tests]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from trainer.runtime import cli

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("models", "titan_kernels", "parallelisms", "trainer", "planner", "tools", "scripts")


def python_files(tops: tuple[str, ...]) -> list[Path]:
    return sorted(p for top in tops for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def long_files(paths: list[Path], limit: int) -> list[tuple[str, int]]:
    rows = [(str(p.relative_to(ROOT)), len(p.read_text().splitlines())) for p in paths]
    return sorted((r for r in rows if r[1] > limit), key=lambda r: -r[1])


def long_functions(paths: list[Path], limit: int) -> list[tuple[str, str, int]]:
    """(file:line, qualified name, lines) of each function or method longer than `limit` lines."""
    rows = []
    for path in paths:
        tree = ast.parse(path.read_text())
        stack = [(node, "") for node in tree.body]
        while stack:
            node, prefix = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{node.name}"
                stack.extend((child, f"{name}.") for child in node.body)
                if isinstance(node, ast.ClassDef):
                    continue
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    rows.append((f"{path.relative_to(ROOT)}:{node.lineno}", name, lines))
    return sorted(rows, key=lambda r: -r[2])


def main(argv: list[str] | None = None) -> None:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-file", type=int, default=800)
    parser.add_argument("--max-function", type=int, default=80)
    parser.add_argument("--tests", action="store_true", help="scan tests/ too")
    args = parser.parse_args(argv)
    paths = python_files(TOPS + (("tests",) if args.tests else ()))
    files = long_files(paths, args.max_file)
    functions = long_functions(paths, args.max_function)
    print(f"## Files over {args.max_file} lines: {len(files)}\n\n| File | Lines |\n|---|---:|")
    for path, lines in files:
        print(f"| `{path}` | {lines} |")
    print(
        f"\n## Functions over {args.max_function} lines: {len(functions)}\n\n| Where | Function | Lines |\n|---|---|---:|"
    )
    for where, name, lines in functions:
        print(f"| `{where}` | `{name}` | {lines} |")


if __name__ == "__main__":
    sys.exit(cli.run(main))
