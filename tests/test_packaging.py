"""What ships is what is tested: the wheel built from this tree holds every module and recipe,
and every module imports from a plain (non-editable) install of it.

The editable install the tests run from cannot notice a folder that packaging leaves out: its
finder serves any ``megatron_ext.*`` module straight from the working tree.  So the wheel is
built from a copy of the source, installed with ``pip install --target`` into a scratch folder,
and imported by a ``python -I`` subprocess, started elsewhere, that has the editable finder and
the working tree removed from its import system (torch, megatron-core ... still come from the
venv's site-packages).  The expected module list is walked from the source folders and setup.py's
``NAMESPACE_MAP``, so a new module or trainer is covered without editing this file.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "megatron_ext"

# Runs first in every subprocess: argv = [ROOT, SITE, ...].  It drops setuptools' editable
# finder (meta path and path hook) and every sys.path entry in the working tree outside the
# venv, then puts the scratch install first.
_ISOLATE = """
import sys
from pathlib import Path

_root, _site = Path(sys.argv[1]), Path(sys.argv[2])
_venv = Path(sys.prefix).resolve()


def _editable(obj) -> bool:
    return getattr(obj, "__module__", "").startswith("__editable__")


def _in_tree(entry: str) -> bool:
    p = Path(entry or ".").resolve()
    return "__editable__" in entry or (p.is_relative_to(_root) and not p.is_relative_to(_venv))


sys.meta_path[:] = [f for f in sys.meta_path if not _editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not _editable(h)]
sys.path[:] = [str(_site)] + [p for p in sys.path if not _in_tree(p)]
sys.path_importer_cache.clear()
assert not any(m.split(".")[0] == "megatron_ext" for m in sys.modules), "imported too early"

import megatron_ext

assert Path(megatron_ext.__file__).resolve().is_relative_to(_site), megatron_ext.__file__
"""

# Imports every module file of the installed package; writes {"modules", "failures", "strays"}
# to argv[3].  Failures are collected, not raised, so one run names every broken module.
_IMPORT_ALL = """
import importlib
import json
import traceback

_pkg = _site / "megatron_ext"
modules = []
for f in sorted(_pkg.rglob("*.py")):
    parts = f.relative_to(_site).with_suffix("").parts
    modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
failures = {}
for name in modules:
    try:
        importlib.import_module(name)
    except BaseException as exc:  # SystemExit from a script-like module counts too
        failures[name] = "".join(traceback.format_exception_only(exc)).strip()


def _origins(mod):
    if getattr(mod, "__file__", None):
        return [mod.__file__]
    return list(getattr(mod, "__path__", []))


strays = {
    name: [str(p) for p in _origins(mod) if not Path(p).resolve().is_relative_to(_site)]
    for name, mod in list(sys.modules.items())
    if name.split(".")[0] == "megatron_ext"
}
strays = {k: v for k, v in strays.items() if v}
result = {"modules": modules, "failures": failures, "strays": strays}
Path(sys.argv[3]).write_text(json.dumps(result))
"""

_RECIPES = """
import json

from megatron_ext.config.load import load_recipe, shipped_recipes_dir

found = sorted(p.name for p in shipped_recipes_dir().glob("*.yaml"))
assert shipped_recipes_dir().resolve().is_relative_to(_site), shipped_recipes_dir()
for name in found:
    load_recipe(Path(name).stem)  # by name, as `megatron-ext launch gpt_8b` does
Path(sys.argv[3]).write_text(json.dumps(found))
"""

_CLI_HELP = """
import runpy

sys.argv = ["megatron-ext", "--help"]
runpy.run_module("megatron_ext.launch.cli", run_name="__main__", alter_sys=True)
"""


def namespace_map() -> dict[str, str]:
    """setup.py's ``NAMESPACE_MAP`` (folder -> installed package), read without running setup."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "NAMESPACE_MAP" for t in targets):
                return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no NAMESPACE_MAP")


def source_folders() -> dict[str, str]:
    """Every source folder that is installed, and its package: megatron_ext/ and the mapped ones."""
    return {PACKAGE: PACKAGE, **namespace_map()}


def _source_files(folder: Path, pattern: str) -> list[Path]:
    return sorted(p for p in folder.rglob(pattern) if "__pycache__" not in p.parts)


def expected_wheel_files() -> set[str]:
    """Paths the wheel must hold: every ``*.py`` of every installed folder, at its installed
    place, every C kernel source, and every shipped recipe (``recipes/*.yaml`` ->
    ``megatron_ext/recipes/``)."""
    expected = set()
    for folder, package in source_folders().items():
        dest = Path(*package.split("."))
        for f in _source_files(ROOT / folder, "*.py"):
            expected.add((dest / f.relative_to(ROOT / folder)).as_posix())
    for f in _source_files(ROOT / "megatron_ext", "*.c"):  # kernels compiled on first use
        expected.add(f.relative_to(ROOT).as_posix())
    recipes = Path(*namespace_map()["recipes"].split("."))
    for f in sorted((ROOT / "recipes").glob("*.yaml")):
        expected.add((recipes / f.name).as_posix())
    return expected


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel pip builds from a copy of the installed folders (as docker/Dockerfile copies
    them), so neither the working tree's build/ nor its egg-info is read or written."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for folder in source_folders():
        shutil.copytree(ROOT / folder, src / folder, ignore=skip)
    out = tmp / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    proc = subprocess.run([*cmd, "-w", str(out), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}"
    (built,) = out.glob("megatron_ext-*.whl")
    return built


@pytest.fixture(scope="module")
def site(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch folder holding the wheel's plain install (no dependencies, no editable finder)."""
    target = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target)]
    proc = subprocess.run([*cmd, str(wheel)], capture_output=True, text=True)
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"
    return target


def run_installed(
    code: str, site: Path, cwd: Path, *args: str, timeout: int = 300
) -> subprocess.CompletedProcess:
    """``code`` in ``python -I`` from ``cwd``, seeing megatron_ext only from ``site``."""
    cmd = [sys.executable, "-I", "-c", _ISOLATE + code, str(ROOT), str(site), *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_wheel_holds_every_module_and_recipe_of_the_source_tree(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        shipped = set(zf.namelist())
    missing = sorted(expected_wheel_files() - shipped)
    assert not missing, f"{len(missing)} source files are not in {wheel.name}: {missing}"
    assert "megatron_ext/gpt/trainer.py" in shipped  # the walk itself found the trainers


def test_every_module_imports_from_the_installed_wheel(site: Path, tmp_path: Path) -> None:
    report = tmp_path / "import_all.json"
    proc = run_installed(_IMPORT_ALL, site, tmp_path, str(report))
    assert proc.returncode == 0, f"isolated import failed:\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(report.read_text())
    failures = "\n".join(f"  {name}: {err}" for name, err in result["failures"].items())
    assert not failures, f"modules that do not import from the installed wheel:\n{failures}"
    assert not result["strays"], f"modules loaded from outside the install: {result['strays']}"
    # every module of the source tree was found installed and imported
    expected = {
        ".".join(p.removesuffix(".py").split("/")).removesuffix(".__init__")
        for p in expected_wheel_files()
        if p.endswith(".py")
    }
    assert not expected - set(result["modules"]), sorted(expected - set(result["modules"]))
    for trainer in ("megatron_ext.gpt.trainer", "megatron_ext.soma.trainer"):
        assert trainer in result["modules"]


def test_cli_help_runs_from_the_installed_wheel(site: Path, tmp_path: Path) -> None:
    proc = run_installed(_CLI_HELP, site, tmp_path)
    assert proc.returncode == 0, f"megatron-ext --help failed:\n{proc.stdout}\n{proc.stderr}"
    assert "usage: megatron-ext" in proc.stdout and "launch" in proc.stdout


def test_shipped_recipes_load_from_the_installed_wheel(site: Path, tmp_path: Path) -> None:
    report = tmp_path / "recipes.json"
    proc = run_installed(_RECIPES, site, tmp_path, str(report))
    assert proc.returncode == 0, f"shipped recipes failed:\n{proc.stdout}\n{proc.stderr}"
    source = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
    assert source, "recipes/ has no yaml"
    assert json.loads(report.read_text()) == source


def test_the_soma_kernel_builds_and_runs_from_the_installed_wheel(site: Path, tmp_path: Path):
    code = (
        "import os, sys, torch\n"
        "os.environ['MEGATRON_EXT_CACHE'] = sys.argv[3]\n"
        "from megatron_ext.soma import native\n"
        "ok, why = native.native_available()\n"
        "assert ok, why\n"
        "assert native.SOURCE.parent.parent == __import__('pathlib').Path(sys.argv[2]) / "
        "'megatron_ext', native.SOURCE\n"
        "g = torch.Generator().manual_seed(0)\n"
        "h, w = torch.randn(2, 5, 8, generator=g), torch.randn(1, 8, 11, generator=g)\n"
        "t = torch.randint(0, 11, (1, 5), generator=g)\n"
        "a = native.head_nll(h, w, t)\n"
        "z = (h @ w).reshape(-1, 11)\n"
        "b = torch.nn.functional.cross_entropy(z, t.expand(2, -1).reshape(-1), reduction='none')\n"
        "torch.testing.assert_close(a, b.view(2, 5), rtol=2e-6, atol=2e-6)\n"
    )
    from megatron_ext.soma.native import native_available

    if not native_available()[0]:
        pytest.skip(native_available()[1])
    proc = run_installed(code, site, tmp_path, str(tmp_path / "cache"))
    assert proc.returncode == 0, f"the installed kernel failed:\n{proc.stdout}\n{proc.stderr}"
    assert list((tmp_path / "cache" / "kernels").glob("soma_lstm_*.so"))
