"""Result files are named by date and commit, and every result a page cites exists (issue 52).

- Every file and folder under docs/results is `<name>_<YYYY-MM-DD>_<commit>[_<companion>].<ext>`
  (docs/results/README.md), so a figure quoted in a page can be traced to the code it measured;
  a work-period name (`_s14`) or an undated one fails here.
- Every `docs/results/<path>` cited in README.md, docs/, configs/, scripts/, tools/ and tests/
  exists (a glob `*` in a citation must match a file): a rename that leaves a page behind fails.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
DATED = r"[a-z0-9_]+_\d{4}-\d{2}-\d{2}_[0-9a-f]{7,}"
FILE_NAME = re.compile(rf"{DATED}(_[a-z0-9_]+)?\.[a-z]+")
FOLDER_NAME = re.compile(DATED)
EXEMPT = {"README.md", "scheduled_tier.json"}
"""Not measurements of one commit: this folder's README and the scheduled tier's rolling record."""
CITED = re.compile(r"docs/results/([\w*./<>-]*[\w*>])")
OUTPUT = re.compile(r'(--out |default=")$')
"""A path a command is told to write (`--out docs/results/...`, an `--out` default) is not a citation."""
CITING = ("README.md", "docs", "configs", "scripts", "tools", "tests", ".ci")


def test_result_files_are_named_by_date_and_commit():
    bad = []
    for path in sorted(RESULTS.rglob("*")):
        rel = path.relative_to(RESULTS)
        if path.is_dir():
            if not FOLDER_NAME.fullmatch(path.name):
                bad.append(f"{rel}/")
        elif str(rel) not in EXEMPT and not FILE_NAME.fullmatch(path.name):
            bad.append(str(rel))
    assert not bad, (
        f"docs/results names must be <name>_<YYYY-MM-DD>_<commit>[_<companion>].<ext> (docs/results/README.md): {bad}"
    )


def _citations() -> list[tuple[str, int, str]]:
    files = subprocess.run(
        ["git", "ls-files", "--", *CITING], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    out = []
    for rel in files:
        if rel.startswith("docs/results/") or not rel.endswith((".md", ".py", ".toml", ".sh", ".txt")):
            continue
        path = ROOT / rel
        if not path.is_file():
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            out += [(rel, i, m.group(1)) for m in CITED.finditer(line) if not OUTPUT.search(line[: m.start()])]
    return out


def test_cited_result_files_exist():
    missing = []
    for rel, line, cited in _citations():
        if "<" in cited or cited.rstrip("/") in EXEMPT:  # a template (`<recipe>`) or the rolling record
            continue
        pattern = cited.rstrip(".")
        if not (list(RESULTS.glob(pattern)) if "*" in pattern else (RESULTS / pattern).exists()):
            missing.append(f"{rel}:{line}: docs/results/{cited}")
    assert not missing, "cited result files that do not exist:\n" + "\n".join(missing)
