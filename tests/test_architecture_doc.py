"""ARCHITECTURE.md names only files that exist (it went stale unnoticed before it existed;
a moved or renamed file must take the map along)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "ARCHITECTURE.md"

# a backticked path: a folder ending in "/" or a file with an extension, from the repository root
PATH = re.compile(r"`((?:src|tests|benchmarks|scripts|examples|docs)/[\w./-]*|[\w-]+\.(?:md|toml|sh))`")


def named_paths(text: str) -> list[str]:
    return PATH.findall(text)


def test_the_parser_finds_files_and_folders_and_skips_code() -> None:
    text = "see `src/egeria/engine.py`, `tests/helpers/` and `README.md`, not `eg.step()` or `egeria.Egeria`"
    assert named_paths(text) == ["src/egeria/engine.py", "tests/helpers/", "README.md"]


def test_every_file_architecture_md_names_exists() -> None:
    names = named_paths(DOC.read_text())
    assert len(names) > 50  # the map names the parts' files; a parser that finds none proves nothing
    missing = [name for name in names if not (ROOT / name).exists()]
    assert missing == [], f"ARCHITECTURE.md names files that do not exist: {missing}"
