"""One registry for trainers, optimizers, commands and benchmarks, fed by entry points
(megatron_ext/registry.py).

* the registry itself, its shipped entries in code and plugins' from distributions made up here
  (a dist-info folder on ``sys.path`` is what an installed distribution is to
  ``importlib.metadata``): order, names, every failure named;
* what ships is what registers: every trainer, optimizer spec, command and benchmark module in
  the source is a shipped entry of its registry, and every shipped entry is one;
* a throwaway package (tests/plugin), installed with pip into a temporary folder, adds an
  optimizer and a trainer with zero edits here: both run from a recipe through ``megatron-ext
  launch``, and the optimizer is selected by Megatron-LM's ``--megatron-ext-optimizer``, timed by
  ``bench optimizers --modes`` and counted by ``plan``.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from megatron_ext.errors import ConfigError
from megatron_ext.registry import DISTRIBUTION, Registry, UnknownName

ROOT = Path(__file__).resolve().parents[1]
MEGATRON_EXT = Path(sys.executable).with_name("megatron-ext")
GROUP = "megatron_ext.test_things"


@dataclass(frozen=True)
class Thing:
    name: str


THING_A = Thing("a")
THING_B = Thing("b")
ANOTHER_A = Thing("a")
ANOTHER_B = Thing("b")
NOT_A_THING = object()


PLUGIN = "aaa-plugin"


def things() -> Registry[Thing]:
    return Registry(
        "thing", GROUP, of=Thing, key="thing", shipped={"a": "tests.test_registry:THING_A"}
    )


def install_fake(folder: Path, name: str, entries: list[str], group: str = GROUP) -> None:
    """A distribution ``name`` in ``folder`` declaring ``entries`` (``name = value``)."""
    info = folder / f"{name.replace('-', '_')}-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n" + "\n".join(entries) + "\n")


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """A folder first on sys.path: a fake megatron-ext there shadows the installed one."""
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_entries_load_by_their_names_the_shipped_ones_first(site) -> None:
    install_fake(site / "a", PLUGIN, ["b = tests.test_registry:THING_B"])
    # an install older than the code: its metadata's own entry points are not read
    install_fake(site / "b", DISTRIBUTION, ["stale = tests.test_registry:ANOTHER_A"])
    for sub in ("a", "b"):
        sys.path.insert(0, str(site / sub))
    try:
        registry = things()
        assert list(registry.items()) == ["a", "b"]  # megatron-ext's before the plugin's
        assert registry.get("b") is THING_B and "a" in registry
        with pytest.raises(UnknownName, match=r"^thing='c' is not a registered thing; .*a, b$"):
            registry.get("c")
        with pytest.raises(ConfigError, match=r"\(did you mean 'a'\?\)"):
            registry.get("aa")
        # in-process: the same object again is no second registration, another one is refused
        registry.register(THING_A)
        with pytest.raises(
            ValueError, match=r"two things are named 'a': a = .*THING_A \(shipped\)"
        ):
            registry.register(Thing("a"))
    finally:
        for sub in ("a", "b"):
            sys.path.remove(str(site / sub))


@pytest.mark.parametrize(
    ("entries", "error", "message"),
    [
        (["c = tests.test_registry:THING_A"], ValueError, "registered as 'c' but named 'a'"),
        (
            ["a = tests.test_registry:ANOTHER_A"],
            ValueError,
            r"two things are named 'a': a = tests.test_registry:THING_A \(shipped\) and entry",
        ),
        (["a = tests.no_such_module:X"], RuntimeError, "a = tests.no_such_module:X .* failed"),
        (
            ["x = tests.test_registry:NOT_A_THING"],
            TypeError,
            "NOT_A_THING .*: a thing must be a Thing, not <class 'object'>",
        ),
        (
            ["b = tests.test_registry:THING_B", "b = tests.test_registry:ANOTHER_B"],
            ValueError,
            "two things are named 'b'",
        ),
    ],
    ids=["name-mismatch", "shipped-name-taken", "import-fails", "wrong-type", "two-of-one-name"],
)
def test_a_bad_entry_is_an_error_naming_it(site, entries, error, message) -> None:
    install_fake(site, PLUGIN, entries)
    with pytest.raises(error, match=message):
        things().items()


#: set by ``slow_thing`` (written by the test below) while its import holds the registry's load
IMPORTING, RELEASE = threading.Event(), threading.Event()


def test_a_second_thread_waits_for_the_whole_load(site) -> None:
    """Two threads reading one registry first: the second sees every entry, not the part the
    first thread's load has registered so far (seen when a benchmark built two runs at once)."""
    (site / "slow_thing.py").write_text(
        "from tests import test_registry as t\n"
        "t.IMPORTING.set()\n"
        "assert t.RELEASE.wait(30)\n"
        "THING = t.Thing('s')\n"
    )
    install_fake(site, PLUGIN, ["s = slow_thing:THING"])
    registry, seen = things(), {}

    def read(key: str) -> None:
        seen[key] = list(registry.items())

    first = threading.Thread(target=read, args=("first",))
    first.start()
    assert IMPORTING.wait(30)  # the first thread is inside the load, at the slow entry
    second = threading.Thread(target=read, args=("second",))
    second.start()
    second.join(0.5)  # the old registry answered here with the entries loaded so far
    RELEASE.set()
    first.join(30)
    second.join(30)
    assert seen == {"first": ["a", "s"], "second": ["a", "s"]}


def test_shipped_entries_need_no_metadata(site, monkeypatch) -> None:
    """A source checkout whose metadata lists none of the group (never installed, or installed
    before the entry was added) still sees every shipped entry: they register in code."""
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    assert list(things().items()) == ["a"]
    broken = Registry("thing", GROUP, of=Thing, shipped={"z": "tests.no_such_module:Z"})
    with pytest.raises(RuntimeError, match=r"thing z = tests.no_such_module:Z \(shipped\) failed"):
        broken.items()


# --------------------------------------------------------------------------- shipped = declared


def _in_source() -> set[tuple[str, str, str]]:
    """(group, name, value) of every trainer, command, benchmark and optimizer in the source."""
    from megatron_ext.bench import INTERFACE
    from megatron_ext.commands import Command
    from megatron_ext.config.trainers import TrainerSpec
    from megatron_ext.optimizers.spec import OptimizerSpec

    found = set()
    for path in sorted((ROOT / "megatron_ext").glob("*/recipe.py")):
        module = f"megatron_ext.{path.parent.name}.recipe"
        spec = getattr(importlib.import_module(module), "TRAINER", None)
        if isinstance(spec, TrainerSpec):
            found.add(("megatron_ext.trainers", spec.name, f"{module}:TRAINER"))
    cli_modules = [  # a package's command: <package>/cli.py or <package>/<name>_cli.py
        f"megatron_ext.{p.parent.name}.{p.stem}"
        for pattern in ("*/cli.py", "*/*_cli.py")
        for p in (ROOT / "megatron_ext").glob(pattern)
    ]
    for module in [*cli_modules, "megatron_ext.launch.cli"]:
        for attr, value in vars(importlib.import_module(module)).items():
            if isinstance(value, Command):
                found.add(("megatron_ext.commands", value.name, f"{module}:{attr}"))
    bench = ROOT / "megatron_ext" / "bench"
    # a benchmark is a module (bench/NAME.py) or a package (bench/NAME/__init__.py)
    names = [p.stem for p in bench.glob("*.py")] + [
        p.parent.name for p in bench.glob("*/__init__.py")
    ]
    for name in sorted(names):
        module = importlib.import_module(f"megatron_ext.bench.{name}")
        if not name.startswith("_") and all(hasattr(module, a) for a in INTERFACE):
            found.add(("megatron_ext.benchmarks", name, module.__name__))
    for path in sorted((ROOT / "optimizers").glob("*_spec.py")):
        module = f"megatron_ext.optimizers.{path.stem}"
        spec = getattr(importlib.import_module(module), "SPEC", None)
        if isinstance(spec, OptimizerSpec):
            found.add(("megatron_ext.optimizers", spec.name, f"{module}:SPEC"))
    return found


def test_every_shipped_extension_registers_and_every_shipped_entry_exists() -> None:
    """A new trainer, optimizer, command or benchmark in the source but not in its registry's
    ``shipped`` (or a shipped entry with no such object) fails here."""
    from megatron_ext.bench import BENCHMARKS
    from megatron_ext.commands import COMMANDS
    from megatron_ext.config.trainers import TRAINERS
    from megatron_ext.optimizers.spec import OPTIMIZERS

    registries = (TRAINERS, OPTIMIZERS, COMMANDS, BENCHMARKS)
    declared = {(r.group, name, value) for r in registries for name, value in r.shipped.items()}
    found = _in_source()
    assert declared - found == set(), "shipped by a registry but no such object in the source"
    assert found - declared == set(), "in the source but not in its registry's shipped entries"
    assert {g for g, _, _ in found} == {r.group for r in registries}


# --------------------------------------------------------------------------- a real plugin


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> Path:
    """tests/plugin installed by pip into a temporary folder (its source copied first, so the
    build leaves nothing in the repository)."""
    tmp = tmp_path_factory.mktemp("plugin")
    shutil.copytree(ROOT / "tests" / "plugin", tmp / "src")
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"),
            *("--no-build-isolation", "--target", str(tmp / "site"), str(tmp / "src")),
        ],
        check=True,
        capture_output=True,
    )
    assert (tmp / "site" / "mx_plugin-0.0.1.dist-info" / "entry_points.txt").is_file()
    return tmp / "site"


def _launch(plugin: Path, *args: str, log: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHONPATH=str(plugin), CUDA_VISIBLE_DEVICES="")
    if log is not None:
        env["MX_PLUGIN_LOG"] = str(log)
    return subprocess.run(
        [str(MEGATRON_EXT), "launch", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture
def plugin_here(plugin, monkeypatch) -> None:
    """The plugin's entries in this process's registries for one test: its folder on
    ``sys.path`` and the trainer and optimizer registries loaded afresh (restored after)."""
    from megatron_ext.config.trainers import TRAINERS
    from megatron_ext.optimizers.spec import OPTIMIZERS

    monkeypatch.syspath_prepend(str(plugin))
    for registry in (TRAINERS, OPTIMIZERS):
        monkeypatch.setattr(registry, "_items", {})
        monkeypatch.setattr(registry, "_origin", {})
        monkeypatch.setattr(registry, "_loaded", False)


def test_a_plugin_trainer_runs_from_a_recipe_with_its_own_section(
    plugin, plugin_here, tmp_path, capsys
) -> None:
    recipe = tmp_path / "countdown.yaml"
    run_dir = tmp_path / "run"
    recipe.write_text(
        yaml.safe_dump({"trainer": "countdown", "run_dir": str(run_dir), "countdown": {"start": 5}})
    )
    proc = _launch(plugin, str(recipe), "seed=7", "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks == [
        {"trainer": "countdown", "seed": 7, "numbers": [5, 3, 1]},
        {"trainer": "countdown", "seed": 7, "numbers": [4, 2]},
    ]
    # its section is the schema's like any shipped one: typos, ranges, its rule, what it reads
    refused = {
        "countdown.strat=3": "unknown key countdown.'strat'; did you mean countdown.'start'",
        "countdown.start=0": "countdown.start=0 is out of range",
        "countdown.start=1": "countdown.start=1 < 2 ranks",
        "optimizer.lr=1": "trainer=countdown does not read optimizer; it reads countdown, "
        "and run_dir, seed",
    }
    from megatron_ext.launch.cli import main

    for override, message in refused.items():  # the dry run, in this process
        code = main(["launch", str(recipe), override, "--nproc-per-node", "2", "--dry-run"])
        err = capsys.readouterr().err
        assert code == 2 and message in err, (override, err)


def test_a_plugin_optimizer_trains_the_gpt_with_its_own_recipe_field(plugin, tmp_path) -> None:
    """``optimizer.name=sign_descent`` and its field ``optimizer.sign_descent_shrink`` reach the
    plugin's class: it steps every step on every rank with the LR the run logs."""
    log, run_dir = tmp_path / "steps.jsonl", tmp_path / "run"
    proc = _launch(
        plugin,
        "tiny_cpu_gpt",
        f"run_dir={run_dir}",
        "training.steps=3",
        "training.lr_warmup_steps=1",
        "training.lr_decay_style=cosine",
        "checkpoint.save_interval=0",
        f"data.path={tmp_path / 'data' / 'docs'}",
        "data.source=[python-docs]",
        "optimizer.name=sign_descent",
        "optimizer.sign_descent_shrink=0.5",
        log=log,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "optimizer sign_descent" in proc.stdout
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    rows = map(json.loads, (run_dir / "metrics.jsonl").open())
    logged = {r["step"]: r["lr"] for r in rows if "lr" in r}
    assert sorted(s["step"] for s in steps) == [1, 1, 2, 2, 3, 3]  # two ranks, three steps
    for s in steps:
        assert s["shrink"] == 0.5 and s["lr"] == pytest.approx(logged[s["step"]], rel=1e-12)
    assert len({s["n"] for s in steps}) == 1 and steps[0]["n"] > 0  # the same matrices each step


def _plugin_env(plugin: Path, log: Path | None = None) -> dict[str, str]:
    env = {"PYTHONPATH": os.pathsep.join([str(plugin), str(ROOT)]), "CUDA_VISIBLE_DEVICES": ""}
    if log is not None:
        env["MX_PLUGIN_LOG"] = str(log)
    return env


def test_megatron_lms_flag_selects_the_plugin_optimizer(plugin, tmp_path) -> None:
    """Megatron-LM's own ``pretrain`` (tests/dist/megatron_lm_pretrain.py under the zero-edit
    runner) with ``--megatron-ext-optimizer sign_descent`` and the option flag the plugin's
    spec gives it: the plugin's class steps every iteration with Megatron-LM's learning rate."""
    from tests.conftest import DIST, run_torchrun
    from tests.test_megatron_lm_pretrain import COMMON

    common = [a if a != "10" else "3" for a in COMMON]  # 3 iterations (the LR schedule too)
    flags = [
        "--megatron-ext-optimizer",
        "sign_descent",
        "--megatron-ext-sign-descent-shrink",
        "0.5",
    ]
    plan, out, log = tmp_path / "plan.json", tmp_path / "out.json", tmp_path / "steps.jsonl"
    plan.write_text(json.dumps({"common": common, "runs": {"plugin": flags}}))
    run_torchrun(
        "megatron_ext.megatron.run_pretrain",
        1,
        str(DIST / "megatron_lm_pretrain.py"),
        str(plan),
        str(out),
        module=True,
        env=_plugin_env(plugin, log),
    )
    run = json.loads(out.read_text())["plugin"]
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert run["iterations"] == [1, 2, 3] and all(math.isfinite(x) for x in run["loss"])
    # the layer-wise optimizer's matrices (AdamW takes the rest): three steps, shrink 0.5
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert {s["shrink"] for s in steps} == {0.5} and steps[0]["n"] > 0
    # Megatron-LM's scheduler: a linear warmup from 0 over 2 iterations to the peak 1e-3
    assert [s["lr"] for s in steps] == pytest.approx([0.0, 5e-4, 1e-3])


def test_bench_and_plan_take_the_plugin_optimizer(plugin, tmp_path) -> None:
    """``bench optimizers --modes sign_descent`` times it; ``plan`` counts its state from its
    spec (4 bytes per element, as Lion's: the same matrices, the same bytes)."""
    script = (
        "import contextlib, io, json, sys\n"
        "from megatron_ext.launch.cli import main\n"
        "bench = ['bench', 'optimizers', '--quick', '--modes', 'sign_descent', 'lion',\n"
        "         '--json', sys.argv[1]]\n"
        "assert main(bench) == 0\n"
        "plans = {}\n"
        "for name in ('sign_descent', 'lion'):\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        code = main(['plan', 'tiny_cpu_gpt', f'optimizer.name={name}', '--json',\n"
        "                     '--gpus-per-node', '2'])\n"
        "    assert code == 0, code\n"
        "    plans[name] = json.loads(out.getvalue())\n"
        "json.dump(plans, open(sys.argv[2], 'w'))\n"
    )
    bench, plans = tmp_path / "bench.json", tmp_path / "plans.json"
    env = {**os.environ, **_plugin_env(plugin)}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(bench), str(plans)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    timed = json.loads(bench.read_text())["results"]["sign_descent"]
    assert timed["s_per_step"] > 0
    ours, lion = (json.loads(plans.read_text())[n] for n in ("sign_descent", "lion"))
    state = ours["stages"][0]["memory"]["optimizer_state"]
    reference = lion["stages"][0]["memory"]["optimizer_state"]
    assert state["sign_descent"] == reference["lion"] > 0
    assert state["adamw"] == reference["adamw"]
