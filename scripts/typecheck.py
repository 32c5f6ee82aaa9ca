"""Run mypy over the typed core: config/, run/, gpt/, optimizers/, distributed/ (``make lint``).

The folders ``optimizers/`` and ``launch/`` are installed as ``megatron_ext.optimizers`` and
``megatron_ext.launch`` (setup.py's ``package_dir``), which mypy cannot read from an editable
install. So the check runs on a tree of symbolic links under ``build/typecheck/`` that lays the
package out as it is installed, and mypy follows every import into it (types flow across the
packages; only the listed ones must be free of errors).

Usage: ``python scripts/typecheck.py`` (exit status: mypy's).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the packages that must type-check with zero errors (issue 40)
CHECKED = ("config", "run", "gpt", "optimizers", "distributed")
#: folder on disk -> its name inside megatron_ext (setup.py's NAMESPACE_MAP)
MAPPED = {"optimizers": "optimizers", "launch": "launch", "recipes": "recipes"}


def link_tree(dest: Path) -> Path:
    """``dest/megatron_ext``: links to every entry of megatron_ext/ and to the mapped folders."""
    pkg = dest / "megatron_ext"
    pkg.mkdir(parents=True, exist_ok=True)
    wanted = {p.name: p for p in (ROOT / "megatron_ext").iterdir() if p.name != "__pycache__"}
    wanted |= {name: ROOT / folder for folder, name in MAPPED.items()}
    for entry in pkg.iterdir():
        if entry.name not in wanted or entry.resolve() != wanted[entry.name].resolve():
            entry.unlink()
    for name, target in wanted.items():
        link = pkg / name
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(target, pkg))
    return dest


def main() -> int:
    tree = link_tree(ROOT / "build" / "typecheck")
    command = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "mypy.ini"),
        *[arg for name in CHECKED for arg in ("-p", f"megatron_ext.{name}")],
    ]
    env = {**os.environ, "MYPYPATH": str(tree)}
    return subprocess.call(command, cwd=tree, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
