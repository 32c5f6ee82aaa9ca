"""No source module over 450 lines (issue 40): a file that grows past it is split by concern
(DESIGN.md: "When a file grows past ~400 lines ... split or delete"). The package's three source
folders, as setup.py installs them."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).parents[1]
FOLDERS = ("megatron_ext", "optimizers", "launch")
MAX_LINES = 450


def test_no_source_file_is_over_450_lines() -> None:
    files = [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 100  # the walk found the package
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines()) for p in files
    }
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"split these by concern (at most {MAX_LINES} lines each): {over}"
