"""The project's modules by dotted name, read from the source tree (pyproject's package-dir)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"elasticd": REPO / "elasticd", "elasticd.agent": REPO / "agent"}  # pyproject's package-dir


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for prefix, root in ROOTS.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            found[".".join((prefix, *rel))] = path
    return found
