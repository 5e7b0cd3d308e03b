"""docs/architecture.md stays true to the code: every module is in its module map, and every
module path the page names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "architecture.md").read_text()


def _modules() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT))
        for d in ("ckptkit", "cli")
        for p in (ROOT / d).rglob("*.py")
        if p.name != "__init__.py"
    )


def _named(module: str) -> bool:
    """Named in a map row, as `ckptkit/x/y.py`, `cli/y.py`, or as `x/y.py` after another path in the row."""
    short = module.removeprefix("ckptkit/")
    return f"`{module}`" in PAGE or f"`{short}`" in PAGE


def test_every_module_is_in_the_module_map():
    missing = [m for m in _modules() if not _named(m)]
    assert not missing, f"docs/architecture.md's module map lacks {missing}"


def test_every_module_the_page_names_exists():
    named = set(re.findall(r"`((?:ckptkit|cli)/[\w/]+\.py)`", PAGE))
    gone = sorted(m for m in named if not (ROOT / m).exists())
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"
