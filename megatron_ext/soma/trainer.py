"""The SOMA trainer: router → seed run → N experts trained independently with SPSA → routed eval.

Readable top to bottom:

1. :func:`prepare_corpus` — windows, test hold-out, router (fit once), per-expert shards;
2. seed run (N = 1): the body by SPSA, the tied embedding E by the exact decoder-path delta rule;
   its (batch, direction) units are split over all ranks (DDPP), so every rank ends with the same E;
3. experts: each copies the seed body, E frozen. ``fso``: expert e lives on rank e mod world and
   a rank never communicates while training; ``ddpp``: every rank works on every expert, holding
   a block of its accumulation batches and directions (paper: App. H.2), and the ranks exchange
   only scalar loss differences;
4. rank 0 evaluates the routed mixture on the held-out windows and writes ``summary.json``,
   ``soma/curves.csv`` and ``soma/curves.png``.

Checkpoints (per expert, atomic) are written every ``checkpoint.save_interval`` updates and at the
end of each phase; a restarted run continues from them exactly. A stop signal (or
``training.exit_duration_in_mins`` / ``exit_interval`` in updates, :mod:`megatron_ext.run.stopping`)
makes every rank finish its update, save its experts and stop (:class:`RunStopped`, exit 0):
agreed over the ranks where a phase communicates (the seed run, DDPP), decided by each rank
alone under FSO, which never communicates while training. Every validation check is one
record of the run's metrics logger (log line, ``metrics.jsonl``, TensorBoard), written by the
rank that writes that expert's checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_ext.config.schema import Recipe
from megatron_ext.run.distributed import init_process_group
from megatron_ext.run.metrics import MetricsLogger
from megatron_ext.run.stopping import RunStopped, StopPolicy
from megatron_ext.soma.corpus import SomaCorpus, prepare_corpus
from megatron_ext.soma.data import ExpertShard
from megatron_ext.soma.layout import BodyLayout, ExpertShape, init_body, init_embedding
from megatron_ext.soma.recipe import SomaConfig
from megatron_ext.soma.state import (
    SEED_EXPERT,
    ExpertState,
    expert_path,
    load_file,
    save_atomic,
)
from megatron_ext.soma.update import UpdateContext, head_update, spsa_update, validation_loss
from megatron_ext.zo.directions import DirectionSplit
from megatron_ext.zo.spsa import PlateauHalving, ZOAdam

__all__ = ["expert_shape", "train"]

# The router fit and the routed evaluation run on rank 0 alone while the others wait.
TIMEOUT = timedelta(minutes=30)
SCALARS = ("train_loss", "val_loss", "lr", "eps")  # TensorBoard: <seed|expert_NNNN>/<name>


def expert_shape(recipe: Recipe) -> ExpertShape:
    s = recipe.section(SomaConfig)
    return ExpertShape(d_embed=s.d_embed, d_model=s.d_model, num_blocks=s.num_blocks)


def new_state(recipe: Recipe, expert: int, theta: torch.Tensor) -> ExpertState:
    """A fresh state; the seed run starts at ``soma.seed_lr`` (paper: App. D, 0.0025), the
    experts at ``soma.lr``."""
    s = recipe.section(SomaConfig)
    seed_lr = s.seed_lr if s.seed_lr is not None else s.lr
    plateau = PlateauHalving(
        lr=seed_lr if expert == SEED_EXPERT else s.lr,
        eps=s.eps,
        patience=s.plateau_patience,
        min_delta=s.plateau_min_delta,
        floor=s.lr_floor,
    )
    layout = BodyLayout.from_shape(expert_shape(recipe))
    head = ZOAdam(theta.numel() - layout.spsa_numel) if layout.shape.wide else None
    return ExpertState(expert, theta.clone(), ZOAdam(layout.spsa_numel), plateau, head_adam=head)


def fso_experts(num_experts: int, rank: int, world: int) -> list[int]:
    """Experts trained by ``rank`` under FSO: e ≡ rank (mod world)."""
    return list(range(rank, num_experts, world))


def _resume(recipe: Recipe, state: ExpertState) -> dict | None:
    """Load the expert's checkpoint into ``state`` when resuming; returns the file's dict."""
    if recipe.checkpoint.load == "none":
        return None
    root = Path(recipe.run_dir if recipe.checkpoint.load == "auto" else recipe.checkpoint.load)
    path = expert_path(root, state.expert)
    if not path.is_file():
        return None
    sd = load_file(path)
    state.load_state_dict(sd["state"])
    return sd


def train_phase(
    recipe: Recipe,
    ctx: UpdateContext,
    states: Sequence[ExpertState],
    shards: Sequence[ExpertShard],
    total_updates: int,
    save: Callable[[], None],
    log: MetricsLogger,
    writer: bool,
    stop: StopPolicy,
    on_update: Callable[[int], None] | None = None,
) -> None:
    """Run ``states`` (all at the same update counter) up to ``total_updates``.

    ``on_update(u)`` runs after each update (the seed run's head step). Validation (and the
    plateau check) every ``soma.eval_interval`` updates, each check one record of ``log``;
    ``save()`` every ``checkpoint.save_interval`` updates and at the end. ``writer``: this rank
    writes these states' checkpoints and records (another rank holding the same states
    echoes its lines only). ``stop``: asked after each update; a stop saves and raises
    :class:`RunStopped`."""
    s, every = recipe.section(SomaConfig), recipe.checkpoint.save_interval
    if not states:
        return
    start = {st.update for st in states}
    if len(start) != 1:
        raise RuntimeError(f"experts of one phase resumed at different updates: {sorted(start)}")
    t0, tokens = time.perf_counter(), 0
    for u in range(start.pop(), total_updates):
        losses = spsa_update(ctx, states, shards)
        tokens += 2 * len(ctx.split.local()) * s.batch_size * s.seq_length  # units: (batch, dir)
        if on_update is not None:
            on_update(u)
        if (u + 1) % s.eval_interval == 0 or u + 1 == total_updates:
            rate = tokens * len(states) / (time.perf_counter() - t0)
            for st, shard, loss in zip(states, shards, losses, strict=True):
                _validate(ctx, st, shard, loss, rate, total_updates, log, writer)
        saved = bool(writer and every and (u + 1) % every == 0 and u + 1 < total_updates)
        if saved:
            save()
        # the seed run and DDPP split each update over the ranks: they stop together
        reason = (
            stop.check(u + 1, collective=ctx.split.world > 1) if u + 1 < total_updates else None
        )
        if reason:
            if writer and not saved:
                save()
            phase = "seed" if states[0].expert == SEED_EXPERT else "expert"
            experts = expert_path(Path(recipe.run_dir), states[0].expert).parent
            raise RunStopped(u + 1, total_updates, reason, experts, unit=f"{phase} update")
    if writer:
        save()


def _validate(
    ctx: UpdateContext,
    st: ExpertState,
    shard: ExpertShard,
    train_loss: float,
    rate: float,
    total_updates: int,
    log: MetricsLogger,
    writer: bool,
) -> None:
    """Validation loss -> plateau rule -> the expert's history (checkpointed) and one record.
    ``rate``: perturbed tokens per second of this phase so far."""
    val = validation_loss(ctx, st.theta, shard)
    st.plateau.observe(st.update, val)
    entry = {
        "update": st.update,
        "train_loss": train_loss,
        "val_loss": val,
        "lr": st.plateau.lr,
        "eps": st.plateau.eps,
    }
    st.history.append(entry)
    seed = st.expert == SEED_EXPERT
    name = "seed" if seed else f"expert {st.expert}"
    log.record(
        st.update,
        {
            "step": st.update,
            "expert": "seed" if seed else st.expert,
            **entry,
            "perturbed_tokens_per_s": rate,
        },
        line=f"{name} update {st.update}/{total_updates} train {train_loss:.4f} "
        f"val {val:.4f} nats/byte lr {st.plateau.lr:.2e} eps {st.plateau.eps:.2e} "
        f"({rate / 1e3:.1f} K perturbed tokens/s)",
        scalars=SCALARS,
        group="seed" if seed else f"expert_{st.expert:04d}",
        persist=writer,
    )


def _seed_run(
    recipe: Recipe,
    corpus: SomaCorpus,
    ctx: UpdateContext,
    rank: int,
    log: MetricsLogger,
    stop: StopPolicy,
) -> None:
    """Phase 2. Leaves the trained E in ``ctx.emb`` and the seed body in ``seed.pt``."""
    gen = torch.Generator().manual_seed(recipe.seed)
    shape = expert_shape(recipe)
    theta = init_body(shape, gen)
    ctx.emb.copy_(init_embedding(shape, gen))
    state = new_state(recipe, SEED_EXPERT, theta)
    head_adam = ZOAdam(ctx.emb.numel())
    sd = _resume(recipe, state)
    if sd is not None:
        ctx.emb.copy_(sd["emb"])
        head_adam.load_state_dict(sd["head_adam"])
    path = expert_path(Path(recipe.run_dir), SEED_EXPERT)

    def save() -> None:
        save_atomic(
            {"state": state.state_dict(), "emb": ctx.emb, "head_adam": head_adam.state_dict()},
            path,
        )

    def head_step(u: int) -> None:
        # narrow: the shared tied E; wide: the seed body's own tied head (E is not read)
        adam = state.head_adam if shape.wide else head_adam
        head_update(ctx, state, corpus.seed_shard, adam, u)

    train_phase(
        recipe,
        ctx,
        [state],
        [corpus.seed_shard],
        recipe.section(SomaConfig).seed_updates,
        save,
        log,
        writer=rank == 0,  # every rank holds the same seed state
        stop=stop,
        on_update=head_step,
    )


def _expert_run(
    recipe: Recipe,
    corpus: SomaCorpus,
    ctx: UpdateContext,
    experts: list[int],
    log: MetricsLogger,
    stop: StopPolicy,
) -> None:
    """Phase 3 for ``experts`` (this rank's, or all of them under DDPP)."""
    s = recipe.section(SomaConfig)
    seed = load_file(expert_path(Path(recipe.run_dir), SEED_EXPERT))
    ctx.emb.copy_(seed["emb"])
    states = []
    for e in experts:
        st = new_state(recipe, e, seed["state"]["theta"])
        _resume(recipe, st)
        states.append(st)
    shards = [corpus.shards[e] for e in experts]
    writer = ctx.split.rank == 0 or s.distribution == "fso"

    def save() -> None:
        for st in states:
            save_atomic({"state": st.state_dict()}, expert_path(Path(recipe.run_dir), st.expert))

    # Experts sit at different counters only if a crash hit between two expert files: each group
    # at one counter resumes on its own.
    for u in sorted({st.update for st in states}):
        group = [i for i, st in enumerate(states) if st.update == u]

        def heads(update: int, group: list[int] = group) -> None:
            """Wide experts: each its own head by the delta rule (paper: App. E, last para.)."""
            for i in group:
                head_update(ctx, states[i], shards[i], states[i].head_adam, update)

        train_phase(
            recipe,
            ctx,
            [states[i] for i in group],
            [shards[i] for i in group],
            s.expert_updates,
            save,
            log,
            writer,
            stop,
            on_update=heads if expert_shape(recipe).wide else None,
        )


def train(recipe: Recipe) -> None:
    """Per-rank entry point (``trainer: soma``); raises :class:`RunStopped` when stopped early."""
    stop = StopPolicy.from_training(recipe.training)
    s = recipe.section(SomaConfig)
    # CPU tensors and gloo; one process needs no group (FSO never communicates while training).
    env = init_process_group(
        "gloo",
        master_port=recipe.launch.master_port,
        timeout=timedelta(seconds=recipe.launch.collective_timeout_s)
        if recipe.launch.collective_timeout_s
        else TIMEOUT,
        device="cpu",
        single_rank_group=False,
    )
    rank, world = env.rank, env.world_size
    barrier = dist.barrier if world > 1 else (lambda: None)
    log = MetricsLogger(
        Path(recipe.run_dir),
        echo=True,  # each rank reports the experts it trains
        write=rank == 0 or s.distribution == "fso",
        tensorboard=recipe.logging.tensorboard,
        file="metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl",
        prefix=f"[soma rank {rank}] " if world > 1 else "[soma] ",
    )
    try:
        _train(recipe, rank, world, barrier, log, stop)
    finally:
        log.close()
        stop.uninstall()


def _train(
    recipe: Recipe,
    rank: int,
    world: int,
    barrier: Callable[[], None],
    log: MetricsLogger,
    stop: StopPolicy,
) -> None:
    torch.manual_seed(recipe.seed)
    corpus = prepare_corpus(recipe, rank, barrier, log.info)
    s = recipe.section(SomaConfig)
    shape = expert_shape(recipe)
    layout = BodyLayout.from_shape(shape)
    ctx = UpdateContext(
        cfg=s,
        layout=layout,
        emb=torch.zeros(shape.vocab, shape.d_embed),
        windows=corpus.windows,
        seed=recipe.seed,
        split=DirectionSplit(s.n_pert * s.accumulation, rank, world),  # (batch, direction) units
    )
    if rank == 0:
        log.info(
            f"{len(corpus.windows)} windows of {s.window_bytes} bytes "
            f"({len(corpus.test)} held out); body {layout.numel} parameters, "
            f"n_pert={s.n_pert} B={s.batch_size} T={s.seq_length} A={s.accumulation}"
        )
    _seed_run(recipe, corpus, ctx, rank, log, stop)
    barrier()
    if s.distribution == "fso":
        ctx.split = DirectionSplit(s.n_pert * s.accumulation)  # no communication while training
        experts = fso_experts(s.num_experts, rank, world)
    else:
        experts = list(range(s.num_experts))
    _expert_run(recipe, corpus, ctx, experts, log, stop)
    barrier()
    if rank == 0:
        from megatron_ext.soma.report import write_run_report

        write_run_report(recipe, corpus, ctx.emb, log)
    barrier()
