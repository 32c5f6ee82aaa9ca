"""The arms of ``megatron-ext bench paper dipaco``: each a DiPaCo-trainer run (the real tasks,
claimed from an SQLite queue by :func:`~megatron_ext.dipaco.run.worker.run_worker` in this process)
built as the paper defines its baselines, and the evaluations the claims read.

Every arm of one seed starts from the same dense base model (the first arm trains it, the others
read its ``model.pt`` through ``dipaco.base_checkpoint``) and the same document split; every path
takes ``phases · τ`` inner steps of the same batch size, so the arms are at equal steps, and
the P-path arms (DiPaCo, flat MoE, DiLoCo) at equal tokens and FLOPs (paper: Sec. 4, Table 1):

- ``dipaco_2x2`` / ``dipaco_4x4`` (discriminative: product k-means, then one discriminative
  re-shard halfway) and their ``_gen`` twins (product k-means only);
- ``dense``: one path holding every parameter, with the same outer optimizer as every other arm
  (the recipe's Nesterov step, lr 0.7, momentum 0.9: a one-worker DiLoCo), so no arm is ahead
  or behind by how hard its outer step extrapolates: the base model trained on, at equal steps
  (Fig. 8);
- ``diloco``: P = 4 workers sharing every parameter: a level of 4 empty modules that only
  splits the data (the product k-means shards of DiPaCo 2x2's level sizes are replaced by K = 4)
  and one module of everything used by all 4 paths; the outer step averages the 4 workers'
  deltas (DiLoCo's plain mean: no √P, no token weights; Douillard et al. 2023) (Table 1);
- ``flat_moe``: 4 independent paths (one level of K = 4 modules, nothing shared), discriminative
  routing as the paper's flat MoE (Sec. 2.6.3, Tables 1-2);
- ``path_specific``: DiPaCo 2x2 with blocks 0 and 3 path-specific (the paper: blocks 0, 5, 6, 11
  of 12 and the embedding, Sec. 4.2 / Fig. 9);
- ``full_sync``: DiPaCo 2x2 (generative shards) trained with per-step, per-module gradient
  aggregation (:mod:`megatron_ext.dipaco.run.full_sync`, Sec. 4.5).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

RECIPE = "dipaco_tiny"
LEVELS_2 = "dipaco.level_parts=['embedding 0-1', '2-3 final_layernorm output_layer']"
ALL_PARTS = "embedding 0-3 final_layernorm output_layer"

#: arm -> its overrides on top of the size's (see the module docstring)
ARMS: dict[str, list[str]] = {
    "dipaco_2x2": ["dipaco.modules_per_level=[2,2]", LEVELS_2],
    "dipaco_2x2_gen": ["dipaco.modules_per_level=[2,2]", LEVELS_2, "dipaco.routing=generative"],
    "dipaco_4x4": ["dipaco.modules_per_level=[4,4]", LEVELS_2],
    "dipaco_4x4_gen": ["dipaco.modules_per_level=[4,4]", LEVELS_2, "dipaco.routing=generative"],
    "dense": [
        "dipaco.modules_per_level=[1]",
        "dipaco.level_parts=[]",
        "dipaco.train_overlap=1",
        "dipaco.routing=generative",
    ],
    "diloco": [
        "dipaco.modules_per_level=[4,1]",
        f"dipaco.level_parts=['', '{ALL_PARTS}']",
        "dipaco.routing=generative",
        "dipaco.sqrt_p_scaling=false",
        "dipaco.alpha_weighting=false",
    ],
    "flat_moe": ["dipaco.modules_per_level=[4]", "dipaco.level_parts=[]"],
    "path_specific": [
        "dipaco.modules_per_level=[2,2]",
        "dipaco.level_parts=['embedding 1', '2 final_layernorm output_layer']",
        "dipaco.path_specific=0 3",
    ],
}

#: size -> overrides of dipaco_tiny (after measure.small_overrides' paths and queue timing)
SIZES: dict[str, list[str]] = {
    "quick": [
        "model.hidden_size=32",
        "model.num_attention_heads=2",
        "model.ffn_hidden_size=64",
        "training.seq_length=32",
        "training.micro_batch_size=4",
        "training.global_batch_size=4",
        "training.steps=2",
        "training.lr_warmup_steps=1",
        "dipaco.tau=1",
        "dipaco.phases=2",
        "dipaco.route_tokens=8",
        "dipaco.eval_every_tokens=[64,32,16]",
        "dipaco.eval_seq_length=136",
        "dipaco.eval_documents=8",
        "dipaco.router_fraction=0.05",
        "dipaco.tokenizer_vocab_size=400",
    ],
    "full": [
        "model.hidden_size=64",
        "model.num_attention_heads=4",
        "model.ffn_hidden_size=192",
        # 48 tokens × 4 sequences: 400 steps per path for 57 paths × 3 seeds in ~40 min
        "training.seq_length=48",
        "training.micro_batch_size=4",
        "training.global_batch_size=4",
        "training.steps=200",
        "training.lr_warmup_steps=20",
        "dipaco.tau=40",
        "dipaco.phases=10",
        "dipaco.route_tokens=16",
        "dipaco.eval_every_tokens=[64,32,16]",
        "dipaco.eval_seq_length=208",
        "dipaco.eval_documents=128",
        "dipaco.router_fraction=0.1",
        "dipaco.tokenizer_vocab_size=1024",
    ],
}
#: documents of the Python Language Reference each size trains on
CORPUS = {"quick": 200, "full": 1200}


def arm_overrides(
    arm: str, size: str, seed: int, data: Path, run_dir: Path, base: Path | None
) -> list[str]:
    """The overrides of ``dipaco_tiny`` for ``arm`` at ``size`` and ``seed``."""
    from megatron_ext.bench._dipaco_measure import small_overrides

    own = [o for o in small_overrides(data, run_dir) if o.split("=")[0] not in _SIZED]
    extra = [f"seed={seed}", *SIZES[size], *ARMS.get(arm, ARMS["dipaco_2x2_gen"])]
    if arm == "full_sync":
        extra.append("dipaco.reshards=0")
    if base is not None:
        extra.append(f"dipaco.base_checkpoint={base}")
    return [*own, *extra]


_SIZED = {o.split("=")[0] for o in SIZES["quick"]}


def run_arm(recipe: Any, kinds: tuple[str, ...] | None = None) -> None:
    """The run of ``recipe`` in this process to the end (or only the tasks of ``kinds``)."""
    from megatron_ext.dipaco import build_plan, run_worker

    wanted = [t.id for t in build_plan(recipe) if kinds is None or t.kind in kinds]
    report = run_worker(recipe, name="bench", max_tasks=len(wanted))
    if sorted(report.completed) != sorted(wanted):
        missing = sorted(set(wanted) - set(report.completed))
        raise RuntimeError(f"{recipe.run_dir}: tasks not done: {missing[:5]}")


def context(recipe: Any) -> tuple[Any, Any]:
    """(:class:`~megatron_ext.dipaco.run.store.RunFiles`,
    :class:`~megatron_ext.dipaco.run.tools.TaskTools`) over a finished run: its files, and a
    model and corpus to score with."""
    from megatron_ext.dipaco import RunFiles, TaskTools, open_run_queue

    files = RunFiles(recipe, open_run_queue(recipe, worker="bench-read"))
    return files, TaskTools(recipe, lambda: False)


def base_model(files: Any) -> Path:
    """The ``model.pt`` of the run's base task."""
    from megatron_ext.dipaco import BASE

    return files.done(BASE) / "model.pt"


def summary(recipe: Any) -> dict[str, Any]:
    return json.loads((Path(recipe.run_dir) / "summary.json").read_text())


def once_perplexity(
    recipe: Any, files: Any, tools: Any, compositions: list[list[dict]], route_phase: int
) -> float:
    """Perplexity on the evaluation documents (read to ``dipaco.eval_seq_length``) after the
    prefix, each document scored by one path: the top-1 of the router of ``route_phase`` on
    its prefix features; path p's parameters are ``compositions[p]`` (its modules, its own)."""
    from megatron_ext.dipaco import (
        DipacoConfig,
        Router,
        assign_params,
        document_batch,
        eval_tokens,
        routed_loss,
    )

    dataset = tools.dataset
    split, feats = files.split(), files.features()
    router = Router.from_arrays(files.router_arrays(route_phase))
    top = router.route(feats["eval"], 1)[:, 0]
    docs = document_batch(dataset, split["eval"], eval_tokens(recipe))
    pm, r = tools.path_model, recipe.section(DipacoConfig).route_tokens
    losses: list[Any] = [None] * len(compositions)
    for p in sorted({int(x) for x in top}):
        assign_params(pm.model, *compositions[p])
        losses[p] = pm.token_losses(docs)
    lengths = [int(n) for n in docs.lengths]
    spans = [[(0, min(r, n)), (min(r, n), n)] for n in lengths]
    nats, count = routed_loss(losses, [[int(p)] for p in top], spans)
    return float(np.exp(nats / max(count, 1)))


def early_stopping_perplexities(recipe: Any) -> dict[str, Any]:
    """Once-per-sequence perplexity of a finished run with each path at its early-stopping
    version (``on``: what the ``final`` task chose) and at its last version (``off``)."""
    from megatron_ext.dipaco import DipacoConfig, final_id, shard_phase

    files, tools = context(recipe)
    d, layout = recipe.section(DipacoConfig), files.layout
    best = [int(files.result(final_id(p))["best_version"]) for p in range(layout.num_paths)]
    route = shard_phase(recipe, d.phases - 1)
    on = [files.composition(v, p) for p, v in enumerate(best)]
    off = [files.composition(d.phases, p) for p in range(layout.num_paths)]
    return {
        "on": once_perplexity(recipe, files, tools, on, route),
        "off": once_perplexity(recipe, files, tools, off, route),
        "best_versions": best,
        "last_version": d.phases,
    }


def full_sync_perplexity(recipe: Any) -> dict[str, Any]:
    """Train ``recipe``'s paths fully synchronously (its prepare/base/route tasks run first)
    and return their once-per-sequence perplexity with the phase-0 router."""
    from megatron_ext.dipaco import full_sync_train

    run_arm(recipe, ("prepare", "base", "route"))
    files, tools = context(recipe)
    layout = files.layout
    base = {level: files.base_part(level) for level in (None, *range(layout.num_levels))}
    modules, own = full_sync_train(
        recipe, tools.path_model.model, tools.dataset, files.shards(0), base, tools.check_lease
    )
    compositions = [
        [*(modules[m] for m in layout.path_modules(p)), own[p]] for p in range(layout.num_paths)
    ]
    return {"once": once_perplexity(recipe, files, tools, compositions, 0)}


def unigram_entropy(recipe: Any) -> float:
    """Token-unigram cross-entropy (nats/token) of the scored evaluation targets under the
    training documents' token frequencies (add-one): the loss of a model that learned only the
    token frequencies, the reference of the study's precondition."""
    from megatron_ext.dipaco import DipacoConfig, document_batch, eval_tokens

    files, tools = context(recipe)
    split, r = files.split(), recipe.section(DipacoConfig).route_tokens
    train = document_batch(tools.dataset, split["train"], recipe.training.seq_length + 1)
    evals = document_batch(tools.dataset, split["eval"], eval_tokens(recipe))
    vocab = int(max(train.tokens.max(), evals.tokens.max())) + 1
    counts = np.zeros(vocab)
    for row, n in zip(train.tokens.numpy(), train.lengths, strict=True):
        counts += np.bincount(row[: int(n)], minlength=vocab)
    logp = np.log((counts + 1) / (counts.sum() + vocab))
    scored = [row[min(r, int(n)) : int(n)] for row, n in zip(evals.tokens.numpy(), evals.lengths,
                                                               strict=True)]  # fmt: skip
    return float(-np.mean(logp[np.concatenate(scored)]))


def routing_gain(recipe: Any) -> float:
    """Mean over the router documents of (mean over paths − best path) of the per-token loss
    after the routing prefix (nats/token), each path at its early-stopping version: what the
    best possible router gains over a random one. Zero when the paths have not specialised
    (the discriminative targets are then noise)."""
    from megatron_ext.dipaco import DipacoConfig, final_id, load_tensors

    files, _ = context(recipe)
    r = recipe.section(DipacoConfig).route_tokens
    per_path = [
        load_tensors(files.done(final_id(p)) / "router_losses.pt")["losses"]
        for p in range(files.layout.num_paths)
    ]
    # the targets after the routing prefix (target j predicts token j + 1)
    docs = np.asarray([[float(doc[r - 1 :].double().mean()) for doc in path] for path in per_path])
    return float(np.mean(docs.mean(axis=0) - docs.min(axis=0)))
