"""Every package's exported names stay the objects they document once all submodules are loaded.

The trap this guards: a package that exports a name lazily (``__getattr__``) which equals one of
its submodules' names returns the *submodule* as soon as that submodule has been imported
anywhere, since importing ``pkg.x`` binds ``pkg.x`` to the module (seen:
``from megatron_ext.optimizers import newton_schulz`` gave the module, and ``bench optimizers``
crashed with "'module' object is not callable").
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import types

import pytest

import megatron_ext

# setup.py's NAMESPACE_MAP: folders beside megatron_ext/ installed inside it, which a walk of
# megatron_ext/ on disk does not see
MAPPED = ("megatron_ext.optimizers", "megatron_ext.launch", "megatron_ext.recipes")


def _all_module_names() -> list[str]:
    names = set(MAPPED)
    for package in [megatron_ext, *map(importlib.import_module, MAPPED)]:
        prefix = package.__name__ + "."
        names |= {info.name for info in pkgutil.walk_packages(package.__path__, prefix=prefix)}
    return sorted(names)


def _packages_with_exports() -> list[types.ModuleType]:
    packages = []
    for name in ["megatron_ext", *_all_module_names()]:
        module = importlib.import_module(name)
        if hasattr(module, "__path__") and getattr(module, "__all__", None):
            packages.append(module)
    return packages


def test_no_exported_name_is_also_a_submodule_name():
    clashes = [
        f"{package.__name__}.{name}"
        for package in _packages_with_exports()
        for name in package.__all__
        if importlib.util.find_spec(f"{package.__name__}.{name}") is not None
    ]
    assert clashes == [], f"exported names that are also submodules: {clashes}"


def test_every_exported_name_is_what_its_module_defines_after_importing_everything():
    for name in _all_module_names():  # binds every submodule as its package's attribute
        importlib.import_module(name)
    checked = set()
    for package in _packages_with_exports():
        for name in package.__all__:
            value = getattr(package, name)
            assert not isinstance(value, types.ModuleType), f"{package.__name__}.{name} is a module"
            home = getattr(value, "__module__", None)
            if home and home.startswith(package.__name__ + "."):
                assert getattr(importlib.import_module(home), name) is value, (
                    f"{package.__name__}.{name} is not {home}.{name}"
                )
            checked.add(package.__name__)
    assert {"megatron_ext.optimizers", "megatron_ext.data"} <= checked


@pytest.mark.usefixtures("one_torch_thread")
def test_the_exported_newton_schulz_orthogonalises_after_its_module_is_loaded():
    import torch

    importlib.import_module("megatron_ext.optimizers.ns_iteration")
    from megatron_ext.optimizers import newton_schulz

    x = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(0))
    q = newton_schulz(x, num_steps=8).double()
    sv = torch.linalg.svdvals(q[0])
    assert sv.min() > 0.6 and sv.max() < 1.3  # the quintic's band around 1, not a module
