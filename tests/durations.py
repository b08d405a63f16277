"""Writes tests/durations.json, each test file's seconds, from a pytest ``--junitxml`` report of a
suite run: ``python -m tests.durations report.xml`` (a partial run updates only its files; a
whole run's report keeps the figures comparable). tests/conftest.py starts the longest files
first, so that on several workers no long file starts last."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

OUT = Path(__file__).with_name("durations.json")
ROOT = Path(__file__).resolve().parents[1]


def file_seconds(junit: Path) -> dict[str, float]:
    """Seconds per test file (set-up, call and tear-down of each of its tests), from a JUnit XML report."""
    total: Counter[str] = Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        while len(parts) > 1 and not (ROOT / ("/".join(parts) + ".py")).exists():
            parts.pop()  # a test class's name after the module's
        total["/".join(parts) + ".py"] += float(case.get("time", 0.0))
    return {k: round(v, 1) for k, v in sorted(total.items())}


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m tests.durations REPORT.xml (from pytest --junitxml=REPORT.xml)")
    # A report of part of the suite updates its files' entries; files since deleted drop out.
    old = json.loads(OUT.read_text()) if OUT.exists() else {}
    seconds = {k: v for k, v in {**old, **file_seconds(Path(argv[0]))}.items() if (ROOT / k).exists()}
    OUT.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")
    print(f"wrote {OUT}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all")


if __name__ == "__main__":
    main(sys.argv[1:])
