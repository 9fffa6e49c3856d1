"""Which runs stand behind each figure of the results page, and are its tables current?

Regenerates the tables of ``benchmarks/RESULTS.md`` from the committed run files, so that no
figure of a run is typed by hand: every block between ``<!-- runs: PATH ... -->`` and
``<!-- end runs -->`` is replaced by ``egeria.bench.report.summary_tables`` over the run
files (or folders of them) the marker names, paths from the repository root; every block
between ``<!-- frontier: DIR -->`` and ``<!-- end frontier -->`` by the speed-accuracy table
of ``DIR/frontier.json`` (``benchmarks/frontier.py report``). The prose around the blocks is
kept as it is.

    .venv/bin/python benchmarks/results_page.py            # rewrite benchmarks/RESULTS.md
    .venv/bin/python benchmarks/results_page.py --check    # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from egeria.bench.report import load_runs, summary_tables

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "benchmarks" / "RESULTS.md"
BLOCK = re.compile(r"(<!-- runs: (?P<paths>[^>]+?) -->\n)(?P<body>.*?)(<!-- end runs -->)", re.S)
FRONTIER = re.compile(r"(<!-- frontier: (?P<folder>[^>]+?) -->\n)(?P<body>.*?)(<!-- end frontier -->)", re.S)


def frontier_table(study: dict) -> str:
    """One row per run length and arm of a ``frontier.json``: seeds, mean speedup, mean points
    against plain of the same seed and against the worst plain seed of that length."""
    lines = ["| length | arm | seeds | speedup | vs own plain | vs worst plain |", "|---|---|---|---:|---:|---:|"]
    for row in sorted(study["summary"], key=lambda r: (r["scale"], r["arm"] != "plain", r["arm"])):
        lines.append(f"| {row['scale']}x | {row['arm']} | {', '.join(map(str, row['seeds']))} | {row['speedup']:.2f}x | "
                     f"{row['vs_own_plain']:+.2f} | {row['vs_worst_plain']:+.2f} |")
    return "\n".join(lines)


def refresh(text: str, root: Path = ROOT) -> str:
    """``text`` with every marked block's tables made again from the run files it names."""
    def tables(match: re.Match) -> str:
        paths = [str(root / p) for p in match["paths"].split()]
        return match.group(1) + "\n" + "\n".join(summary_tables(load_runs(paths))) + "\n\n" + match.group(4)
    def frontier(match: re.Match) -> str:
        study = json.loads((root / match["folder"] / "frontier.json").read_text())
        return match.group(1) + "\n" + frontier_table(study) + "\n\n" + match.group(4)
    return FRONTIER.sub(frontier, BLOCK.sub(tables, text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the page is current")
    parser.add_argument("--page", default=str(PAGE), help="the page (default: benchmarks/RESULTS.md)")
    args = parser.parse_args(argv)
    page = Path(args.page)
    text = page.read_text(encoding="utf-8")
    new = refresh(text)
    if args.check:
        if new != text:
            print(f"{page} is out of date: run benchmarks/results_page.py", file=sys.stderr)
            return 1
        return 0
    page.write_text(new, encoding="utf-8")
    print(f"wrote {page} ({len(BLOCK.findall(new))} blocks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
