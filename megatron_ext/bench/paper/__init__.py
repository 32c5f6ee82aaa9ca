"""``megatron-ext bench paper STUDY``: a paper's own comparisons, with the paper's baselines, run
here and judged claim by claim.

Studies (one module each, ``megatron_ext.bench.paper.<study>``):

- ``optimizers``: the SOAP/Muon paper (``soap-muon-and-beyond.txt``): large-batch AdamW vs Muon vs
  KL-SOAP (and MOP) with and without the ramp, stale vs per-step eigenbasis refresh, KL vs plain
  Shampoo factors, eigh vs QR refresh;
- ``dipaco``: the DiPaCo paper (``dipaco-distributed-path-composition.txt``);
- ``soma``: the SOMA paper (``soma-scaling-zero-order-pretraining.txt``).

A study module defines ``PAPER`` (the paper's file), ``TITLE``, ``SIZES`` (the names of its
scales: ``quick`` and ``full``) and ``run_study(size, seeds, out) -> StudyResult``
(:mod:`.report`). Each comparison becomes a :class:`~.claims.Claim`: the paper's figure, ours per
seed, the precondition a run must meet to be informative, and a verdict from a 95% t-interval
over >= 3 seeds (:func:`~.claims.verdict`); comparisons that hold by construction are
:class:`~.claims.Fact` s. The report is written to ``OUT/paper_<study>.{json,md}`` beside the
study's PNGs. ``--quick`` runs every comparison on tiny settings with the same JSON shape: a
smoke run, "smoke run: no verdicts", every claim's verdict ``None``.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from types import ModuleType

from megatron_ext.errors import ConfigError

DESCRIPTION = (
    "a paper's comparisons (optimizers, dipaco, soma) with its baselines: claims + verdicts"
)
#: study name -> its module (imported when run: module top levels stay torch-free)
STUDIES = {
    "optimizers": "megatron_ext.bench.paper.optimizers",
    "dipaco": "megatron_ext.bench.paper.dipaco",
    "soma": "megatron_ext.bench.paper.soma",
}
QUICK = {"size": "quick"}
EXAMPLE = "megatron-ext bench paper optimizers --quick"
#: the baseline of every claim (``meta.anchor``)
ANCHOR = "each claim's baseline arm (its Q column), same seeds, data and tokens"
#: the JSON report's top-level keys (:func:`.report.payload`)
JSON_KEYS = (
    "study",
    "paper",
    "size",
    "seeds",
    "settings",
    "meta",
    "verdict_rule",
    "claims",
    "facts",
    "arms",
    "plots",
    "notes",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("study", choices=list(STUDIES), help="which paper's comparisons")
    p.add_argument(
        "--size",
        choices=("full", "quick"),
        default="full",
        help="full: the largest scale this machine finishes in the study's budget (see the "
        "study's docstring); quick: tiny settings, every comparison (--quick)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="seeds per arm (full: >= 3, default 3: the verdicts use a t-interval over them; "
        "quick: default 1, no verdicts)",
    )
    p.add_argument("--out", default=None, help="run folder (default runs/bench_paper/STUDY)")
    p.add_argument("--json", default=None, help="also write the JSON here")
    p.add_argument(
        "--from-runs",
        action="store_true",
        help="optimizers: launch nothing, rebuild the report from the finished runs under "
        "--out (a missing or unfinished run is an error)",
    )


def study_module(name: str) -> ModuleType:
    """The module of study ``name`` (``ConfigError`` naming the known ones)."""
    if name not in STUDIES:
        raise ConfigError(f"unknown study {name!r}; known: {', '.join(STUDIES)}")
    return importlib.import_module(STUDIES[name])


def run(args: argparse.Namespace) -> int:
    from megatron_ext.atomic import atomic_path
    from megatron_ext.bench.common import run_meta, write_json
    from megatron_ext.bench.paper.claims import MIN_SEEDS, SMOKE
    from megatron_ext.bench.paper.report import markdown, payload

    smoke = args.size == "quick"
    seeds_n = args.seeds if args.seeds is not None else (1 if smoke else MIN_SEEDS)
    if seeds_n < (1 if smoke else MIN_SEEDS):
        raise ConfigError(
            f"--seeds must be >= {MIN_SEEDS} for --size full (a verdict is decided by a "
            f"t-interval over the seeds), got {seeds_n}"
            if not smoke
            else f"--seeds must be >= 1, got {seeds_n}"
        )
    if smoke:
        print(f"[paper] {SMOKE} (--size quick: tiny settings, every comparison)", flush=True)
    module = study_module(args.study)
    out = Path(args.out or f"runs/bench_paper/{args.study}")
    out.mkdir(parents=True, exist_ok=True)
    seeds = list(range(1, seeds_n + 1))
    if args.from_runs and args.study != "optimizers":
        raise ConfigError(
            f"--from-runs: the {args.study} study trains in-process and keeps no run folders to "
            "read; only the optimizers study has them"
        )
    extra = {"from_runs": True} if args.from_runs else {}
    result = module.run_study(args.size, seeds, out, **extra)
    report = payload(args.study, module.PAPER, result, seeds, args.size, run_meta())
    page = markdown(report, module.TITLE)
    print(page)
    with atomic_path(out / f"paper_{args.study}.md") as tmp:
        tmp.write_text(page)
    print(f"wrote {out / f'paper_{args.study}.md'}")
    for path in filter(None, (str(out / f"paper_{args.study}.json"), args.json)):
        write_json(report, path)
    return 0
