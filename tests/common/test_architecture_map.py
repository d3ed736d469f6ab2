"""docs/ARCHITECTURE.md's walk of a chat request names real files: every ``*.py`` in "A chat request, file by
file" exists (a full path from the repository root, or a name relative to the package of the path before it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def _walk() -> str:
    text = DOC.read_text()
    start = text.index("**A chat request, file by file")
    return text[start:text.index("\n\n", start)]


def _missing(walk: str) -> list[str]:
    """Names that are no file: a full path must exist; a short name must exist in the directory of some full
    path named before it (the walk names a step's files relative to the package it is in)."""
    missing: list[str] = []
    bases: list[Path] = []
    for name in re.findall(r"`([\w/.]+\.py)`", walk):
        if name.startswith("services/"):
            path = ROOT / name
            bases.append(path.parent)
            if not path.is_file():
                missing.append(name)
        elif not any((b / name).is_file() for b in bases):
            missing.append(name)
    return missing


def test_every_file_the_walk_names_exists() -> None:
    walk = _walk()
    assert len(re.findall(r"\.py`", walk)) >= 20, "the walk names fewer files than a request touches"
    assert not _missing(walk), f"docs/ARCHITECTURE.md names files that do not exist: {_missing(walk)}"


def test_the_check_sees_a_missing_file() -> None:
    assert _missing("1. `services/router/openai_http.py` then `no_such_module.py`") == ["no_such_module.py"]
