"""Write the scheduled tier's result (.ci/scheduled) as JSON: date, commit, exit status, counts,
failed tests, wall time, CPU model and load.

    python3 scripts/dev/scheduled_record.py JUNIT.xml STATUS START_EPOCH OUT.json

Standard library only (it runs after the suite, with whatever python3 is on PATH).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def summarize(junit: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures: list[str] = []
    if not junit.is_file():
        return {**counts, "failures": ["no junit file: pytest did not finish"]}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            counts["failed"] += 1
            failures.append(name)
        elif "error" in kinds:
            counts["errors"] += 1
            failures.append(name)
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("error: usage: scheduled_record.py JUNIT.xml STATUS START_EPOCH OUT.json", file=sys.stderr)
        return 2
    junit, status, start, out = Path(argv[0]), int(argv[1]), float(argv[2]), Path(argv[3])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit or "unknown",
        "exit_status": status,
        "wall_s": round(time.time() - start),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average_1min_at_end": round(os.getloadavg()[0], 1),
        **summarize(junit),
    }
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, out)
    print(
        f"scheduled tier: {record['passed']} passed, {record['failed']} failed, {record['errors']} errors, "
        f"{record['skipped']} skipped in {record['wall_s']} s -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
