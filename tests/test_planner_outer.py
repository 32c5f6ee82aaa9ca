"""The DiPaCo outer-round bytes of the planner (megatron_ext.planner.outer) against a real run.

Each case predicts one phase's bytes from the recipe alone, then runs it small in this process
(``dipaco_tiny`` shrunk: a 4-block width-32 GPT, τ = 1, the real tasks claimed by
:func:`~megatron_ext.dipaco.run.worker.run_worker` from an SQLite queue) with the store's
``save_tensors`` / ``load_tensors`` wrapped where the DiPaCo modules call them: every tensor
payload (numel × element size, as saved and as loaded) is logged with the task doing it and the
file, and each module's figures -- workers' copies written, the outer executor's path copies,
global module and momentum read and module + momentum written, the versions the workers read --
equal the measured bytes exactly, in phase 1 and (writes, path copies) in phase 0:

- ``dipaco_2x1_bf16``: K = (2, 1), block 0 path-specific, bf16 on the local spec (bf16 matrices
  beside float32 norms), modules used by one path and by two;
- ``diloco_tied_fp32``: the trainer's DiLoCo (``modules_per_level: [1]``, one path), the output
  layer tied to the embedding, fp32.

Anything else a phase's train or outer task moves is ``state.pt`` (the path's own state, whose
path-specific parameters and their outer momentum are predicted too); a new file would fail the
test.
"""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.config import load_recipe
from megatron_ext.dipaco.model.layout import PathLayout
from megatron_ext.dipaco.recipe import path_layout
from megatron_ext.dipaco.run.plan import build_plan, outer_id, train_id
from megatron_ext.errors import ConfigError
from megatron_ext.planner.outer import OuterFigures, format_outer, plan_outer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = [
    "dipaco.reshards=0",  # no score/route tasks between the phases
    "training.steps=2",
    "dipaco.tau=1",
    "model.transformer_impl=local",  # what the CPU builds, said to the planner
]
CASES = {
    "dipaco_2x1_bf16": [
        "dipaco.modules_per_level=[2,1]",
        "dipaco.level_parts=[embedding 1, 2-3 final_layernorm output_layer]",
        "dipaco.path_specific=0",
        "training.precision=bf16",
    ],
    "diloco_tied_fp32": [
        "dipaco.modules_per_level=[1]",
        "dipaco.level_parts=[]",
        "dipaco.train_overlap=1",
        "model.untie_embeddings_and_output_weights=false",
    ],
}
FIGURES = (
    "workers_write",
    "outer_read_paths",
    "outer_read_global",
    "outer_read_momentum",
    "outer_write",
    "workers_read",
)


@dataclass
class Access:
    task: str  # the task whose code saved or loaded it
    op: str  # "write" or "read"
    source: str  # the task whose attempt folder holds the file
    file: str  # its name (l0.pt, module.pt, state.pt, ...)
    parts: dict[str, int]  # payload bytes by top-level key


@dataclass
class StoreLog:
    accesses: list[Access] = field(default_factory=list)
    current: list[str] = field(default_factory=lambda: [""])


def payload_bytes(obj: Any) -> int:
    """Tensor bytes (numel × element size) in a saved or loaded object, recursively."""
    import torch

    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return 0


@pytest.fixture(scope="module")
def store_log() -> Iterator[StoreLog]:
    """The store's save/load functions wrapped in every DiPaCo module that imported them, and
    the task runner wrapped to say which task is running."""
    import megatron_ext.dipaco
    import megatron_ext.dipaco.run.tasks as tasks
    from megatron_ext.dipaco.run import store

    prefix = "megatron_ext.dipaco."
    for info in pkgutil.walk_packages(megatron_ext.dipaco.__path__, prefix):  # every caller
        importlib.import_module(info.name)

    log = StoreLog()

    def record(op: str, path: Path, obj: Any) -> None:
        parts = {k: payload_bytes(v) for k, v in obj.items()} if isinstance(obj, dict) else {}
        folder = path.parent.parent.name  # tasks/<task, '/' -> '-'>/<token>/<file>
        log.accesses.append(Access(log.current[0], op, folder, path.name, parts))

    def save(path: Path, obj: Any) -> None:
        record("write", Path(path), obj)
        original_save(path, obj)

    def load(path: Path) -> Any:
        obj = original_load(path)
        record("read", Path(path), obj)
        return obj

    def run_task(recipe, files, tools, lease):
        log.current[0] = lease.task
        try:
            return original_run(recipe, files, tools, lease)
        finally:
            log.current[0] = ""

    original_save, original_load, original_run = (
        store.save_tensors,
        store.load_tensors,
        tasks.run_task,
    )
    patched = set()
    with pytest.MonkeyPatch.context() as mp:
        for name, module in list(sys.modules.items()):
            if not name.startswith("megatron_ext.dipaco."):
                continue
            for attr, original, wrapper in (
                ("save_tensors", original_save, save),
                ("load_tensors", original_load, load),
            ):
                if getattr(module, attr, None) is original:
                    mp.setattr(module, attr, wrapper)
                    patched.add(f"{name.rsplit('.', 1)[1]}.{attr}")
        assert {"tasks.save_tensors", "tasks.load_tensors", "store.load_tensors"} <= patched
        mp.setattr(tasks, "run_task", run_task)
        yield log


@dataclass
class Run:
    figures: OuterFigures
    layout: PathLayout
    accesses: list[Access]
    folders: dict[str, str]  # attempt-folder name -> task id


@pytest.fixture(scope="module")
def runs(store_log: StoreLog, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Each case predicted, then run through phase 1's outer tasks (prepare, base, route,
    two phases of train + outer: the run stops before the final and eval tasks)."""
    from megatron_ext.bench._dipaco_measure import small_overrides, write_small_corpus
    from megatron_ext.convert.parity import init_single_process
    from megatron_ext.dipaco.run.worker import run_worker

    init_single_process()
    data = write_small_corpus(tmp_path_factory.mktemp("outer_data"), documents=300)
    out = {}
    for name, extra in CASES.items():
        overrides = [*small_overrides(data, tmp_path_factory.mktemp(name) / "run"), *SMALL, *extra]
        figures = plan_outer("dipaco_tiny", overrides)  # before the run: from the recipe alone
        recipe = load_recipe("dipaco_tiny", overrides)
        plan = build_plan(recipe)
        wanted = [t.id for t in plan if t.kind in ("prepare", "base", "route", "train", "outer")]
        start = len(store_log.accesses)
        report = run_worker(recipe, name=name, max_tasks=len(wanted))
        assert sorted(report.completed) == sorted(wanted)
        folders = {t.id.replace("/", "-"): t.id for t in plan}
        out[name] = Run(figures, path_layout(recipe), store_log.accesses[start:], folders)
    return out


def measured(run: Run, phase: int) -> tuple[dict[str, dict[str, int]], list[Access]]:
    """Phase ``phase``'s bytes per module, by figure, from the log; and what else its train
    and outer tasks moved."""
    layout = run.layout
    out = {m.name: dict.fromkeys(FIGURES, 0) for m in layout.modules}
    trains = {train_id(phase, p): p for p in range(layout.num_paths)}
    outers = {outer_id(phase, m): m for m in layout.modules}
    before = {outer_id(phase - 1, m): m for m in layout.modules} if phase else {}
    rest = []
    for a in run.accesses:
        source = run.folders.get(a.source, a.source)
        total = sum(a.parts.values())
        level = int(a.file[1:-3]) if a.file.startswith("l") and a.file.endswith(".pt") else None
        if a.task in trains and a.op == "write" and level is not None:
            m = layout.path_modules(trains[a.task])[level]
            out[m.name]["workers_write"] += total
        elif a.task in trains and a.op == "read" and source in before and a.file == "module.pt":
            out[before[source].name]["workers_read"] += total
        elif a.task in outers and a.op == "read" and source in trains and level is not None:
            m = outers[a.task]
            assert layout.path_modules(trains[source])[level] == m  # its own users' copies
            out[m.name]["outer_read_paths"] += total
        elif a.task in outers and a.op == "read" and source in before and a.file == "module.pt":
            assert before[source] == outers[a.task]
            out[outers[a.task].name]["outer_read_global"] += a.parts["params"]
            out[outers[a.task].name]["outer_read_momentum"] += a.parts["momentum"]
        elif a.task in outers and a.op == "write" and a.file == "module.pt":
            out[outers[a.task].name]["outer_write"] += total
        elif a.task in trains or a.task in outers:
            rest.append(a)
    return out, rest


def predicted(figures: OuterFigures) -> dict[str, dict[str, int]]:
    return {m.module.name: {k: getattr(m, k) for k in FIGURES} for m in figures.modules}


@pytest.mark.parametrize("case", list(CASES))
def test_one_phase_moves_exactly_the_predicted_bytes(runs: dict[str, Run], case: str) -> None:
    run = runs[case]
    f = run.figures
    got, rest = measured(run, phase=1)
    assert got == predicted(f)
    assert all(v > 0 for m in got.values() for v in m.values())
    totals = {k: sum(m[k] for m in got.values()) for k in FIGURES}
    outer_read = totals["outer_read_paths"] + totals["outer_read_global"]
    outer_read += totals["outer_read_momentum"]
    assert (totals["workers_write"], outer_read) == (f.workers_write, f.outer_read)
    assert (totals["outer_write"], totals["workers_read"]) == (f.outer_write, f.workers_read)
    assert sum(totals.values()) == f.store_bytes
    # what else the phase moved: each path's own state file, read and written once by its
    # train task, whose path-specific parameters are what the plan says stay with the path
    assert {(a.file, a.op) for a in rest} == {("state.pt", "read"), ("state.pt", "write")}
    assert len(rest) == 2 * f.num_paths
    assert {a.parts["specific"] for a in rest} == {f.worker.path_specific_bytes}
    # the path-specific parts take their outer step on the worker: their momentum travels
    # with them (written by phase 0 and 1, read by phase 1)
    momentum = {a.parts["specific_momentum"] for a in rest}
    assert momentum == {f.worker.path_specific_momentum_bytes}
    # one worker: its train task writes its path's modules and reads their versions
    for p in range(f.num_paths):
        mine = [a for a in run.accesses if a.task == train_id(1, p)]
        writes = sum(
            sum(a.parts.values()) for a in mine if a.op == "write" and a.file != "state.pt"
        )
        reads = sum(sum(a.parts.values()) for a in mine if a.op == "read" and a.file != "state.pt")
        assert (writes, reads) == (f.worker.writes, f.worker.reads)


@pytest.mark.parametrize("case", list(CASES))
def test_phase_zero_writes_the_same_and_reads_no_module_file(
    runs: dict[str, Run], case: str
) -> None:
    """Phase 0's versions are the base model's: the same writes and path copies, no module.pt
    (no momentum) read."""
    run = runs[case]
    got, rest = measured(run, phase=0)
    want = predicted(run.figures)
    for name, figures in got.items():
        for key in ("workers_write", "outer_read_paths", "outer_write"):
            assert figures[key] == want[name][key]
        assert figures["outer_read_global"] == figures["outer_read_momentum"] == 0
        assert figures["workers_read"] == 0
    assert {(a.file, a.op) for a in rest} <= {("state.pt", "write"), ("model.pt", "read")}


def test_the_cases_cover_mixed_dtypes_shared_and_single_path_modules_and_diloco(
    runs: dict[str, Run],
) -> None:
    mixed = runs["dipaco_2x1_bf16"].figures
    assert all(set(m.elements) == {"bfloat16", "float32"} for m in mixed.modules)
    assert sorted(len(m.paths) for m in mixed.modules) == [1, 1, 2]
    assert mixed.worker.path_specific_bytes > 0 and not mixed.diloco
    # predicted before the prepare task trained the tokenizer, then from the tokenizer file
    assert mixed.vocab_source.startswith("dipaco.tokenizer_vocab_size")
    diloco = runs["diloco_tied_fp32"].figures
    assert diloco.diloco and diloco.num_paths == 1 and len(diloco.modules) == 1
    assert set(diloco.modules[0].elements) == {"float32"}
    assert diloco.vocab_source == "the sentencepiece tokenizer" and diloco.vocab == mixed.vocab
    assert diloco.modules[0].workers_write == diloco.modules[0].module_bytes  # one copy
    assert "DiLoCo" in format_outer(diloco)


def test_the_shipped_recipes_and_their_text() -> None:
    """dipaco_paper's own arithmetic (its comment: 117.0M in the blocks + 28.7M embedding =
    145.7M, the embedding and 4 blocks path-specific, 4 blocks per level) at a 32k vocabulary."""
    paper = plan_outer("dipaco_paper", ["model.vocab_size=32000"])
    level0, level1 = paper.modules[0], paper.modules[16]
    whole = level0.numel + level1.numel + paper.path_specific_numel
    assert round(whole / 1e5) == 1457 and paper.num_paths == 256
    assert len(level0.paths) == len(level1.paths) == 16
    assert level0.module_bytes == 2 * level0.numel  # bf16, TE norms (auto)
    assert paper.workers_write == 256 * paper.worker.writes
    text = format_outer(paper)
    assert "P = 256 paths" in text and f"{level1.numel:,}" in text
    # a worker writes its path's two modules (bf16): 2 × (39.0 M + 39.0 M) bytes = 156 MB
    assert paper.worker.writes == level0.module_bytes + level1.module_bytes
    assert f"writes {paper.worker.writes / 1e6:.0f} MB" in text
    tiny = plan_outer("dipaco_tiny")
    assert tiny.as_dict()["totals"]["store_bytes"] == tiny.store_bytes
    with pytest.raises(ConfigError, match="outer-step bytes are DiPaCo's"):
        plan_outer("tiny_cpu_gpt")


def test_the_outer_plan_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from megatron_ext.planner.outer import format_outer, plan_outer\n"
        "print(format_outer(plan_outer('dipaco_paper', ['model.vocab_size=32000'])))\n"
        "assert 'torch' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "DiPaCo outer round of dipaco_paper" in proc.stdout
