"""DiPaCo's part of a recipe: the ``dipaco:`` section, its cross-field rules, the registration.

The shared sections keep their meaning: ``model`` is the architecture of every path (a GPTModel),
``optimizer`` the inner optimizer (AdamW, Muon, KL-SOAP ... by name), ``training`` the *base*
run (the dense model trained first on all data: ``steps``, batch sizes, ``seq_length``, seed and
its LR schedule) and the batch of every inner step, ``data`` the corpus and tokenizer.

No torch import: the launcher validates recipes before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_ext.config.fields import spec
from megatron_ext.config.trainers import TrainerSpec
from megatron_ext.dipaco.model.layout import PathLayout
from megatron_ext.dipaco.queue.url import QueueURL, parse_queue_url
from megatron_ext.errors import ConfigError
from megatron_ext.gpt.recipe import GPTRecipe, check_gpt_sections
from megatron_ext.schedules.plan import lr_schedule

__all__ = [
    "DipacoConfig",
    "DipacoRecipe",
    "check_dipaco",
    "eval_tokens",
    "path_layout",
    "queue_url",
]


@dataclass
class DipacoConfig:
    """DiPaCo: L levels of K_l modules, P = prod K_l paths, DiLoCo per module, coarse routing.

    Phase t: every path trains ``tau`` inner steps from the current versions of its modules;
    then every module (l, e) takes one outer step over the paths that use it; the paths are
    re-routed (discriminatively) ``reshards`` times, evenly spaced (the paper: once).
    """

    # levels x modules (see megatron_ext.dipaco.model.layout for the part syntax)
    modules_per_level: list[int] = spec([2, 2], help="K_l per level; P = product")
    level_parts: list[str] = spec(
        [],
        help="parts of each level's modules, e.g. ['embedding 0-1', '2-3 final_layernorm "
        "output_layer']; [] = blocks split evenly, embedding first, head last",
    )
    path_specific: str = spec("", help="parts every path keeps to itself, e.g. 'embedding 0 5'")
    # DiLoCo
    phases: int = spec(2, ge=1, help="outer steps (each after tau inner steps per path)")
    tau: int = spec(150, ge=1, help="inner steps per path per phase")
    outer_lr: float = spec(0.7, gt=0.0, help="outer Nesterov SGD learning rate")
    outer_momentum: float = spec(0.9, ge=0.0, lt=1.0)
    outer_nesterov: bool = True
    sqrt_p_scaling: bool = spec(True, help="multiply a module's delta by sqrt(P_{l,e})")
    alpha_weighting: bool = spec(True, help="weigh path deltas by shard tokens (else uniform)")
    inner_warmup_steps: int = spec(0, ge=0, help="warm-up of the one cosine over phases*tau")
    inner: Literal["gradient", "spsa"] = spec(
        "gradient",
        help="gradient: optimizer.name on backprop gradients; spsa: zero-order SPSA estimates "
        "(the shared megatron_ext.zo step) with Adam, no backward pass",
    )
    spsa_n_pert: int = spec(8, ge=1, help="inner: spsa: probe directions per step")
    spsa_eps: float = spec(1e-3, gt=0.0, help="inner: spsa: perturbation size")
    # routing
    routing: Literal["generative", "discriminative"] = spec(
        "discriminative",
        help="generative: product k-means (one balanced k-means of K_l per level) on prefix "
        "features; discriminative: then "
        "logistic regression on each router document's best path, with a frequency bias",
    )
    route_tokens: int = spec(32, ge=1, help="documents are routed on this prefix (never scored)")
    train_overlap: int = spec(2, ge=1, help="each training document goes to its top-k paths")
    reshards: int = spec(
        1,
        ge=0,
        help="discriminative re-shards, evenly spaced over the phases (the paper: one, "
        "Sec. 2.4.2); 0 = never",
    )
    router_fraction: float = spec(0.1, gt=0.0, lt=0.5, help="documents held out to fit routers")
    router_max_iter: int = spec(200, ge=1, help="logistic regression iterations")
    kmeans_max_iter: int = spec(50, ge=1)
    # evaluation and early stopping
    eval_fraction: float = spec(0.05, gt=0.0, lt=0.5, help="held-out documents (perplexity)")
    val_fraction: float = spec(0.05, gt=0.0, lt=0.5, help="each shard's early-stopping slice")
    eval_every_tokens: list[int] = spec([16, 64], help="W: re-route every W tokens at eval")
    eval_documents: int = spec(256, ge=1, help="held-out documents scored at most")
    eval_seq_length: int = spec(
        0,
        ge=0,
        help="tokens of each evaluation document scored (its first ones); 0 = "
        "training.seq_length (the paper: 2,048 at evaluation, 1,024 in training, Sec. 4)",
    )
    tokenizer_vocab_size: int = spec(
        1024, ge=260, help="SentencePiece vocabulary when data.tokenizer_model must be trained"
    )
    # base model
    base_checkpoint: str = spec(
        "",
        help="the base model: a GPT run's checkpoint folder (run_dir/checkpoints/step_NNNNNN, "
        "or run_dir/checkpoints for its latest), or a state-dict file (model.pt of a DiPaCo "
        "base task); '' = train it here (training.steps)",
    )
    # task queue and workers
    queue: str = spec("", help="sqlite:///file.db or postgresql://...; '' = run_dir/queue.db")
    lease_seconds: float = spec(120.0, gt=0.0, help="a claimed task is re-leased after this")
    heartbeat_seconds: float = spec(10.0, gt=0.0, help="a worker renews its lease this often")
    max_attempts: int = spec(3, ge=1, help="claims of one task before the run stops")
    poll_seconds: float = spec(0.2, gt=0.0, help="idle workers look for tasks this often")
    ranks_per_worker: int = spec(
        1,
        ge=1,
        help="R consecutive ranks form one worker: its first rank claims, the R ranks train a "
        "path data-parallel (same modules bit for bit as one rank; megatron_ext.dipaco.run.group)",
    )


def path_layout(recipe: DipacoRecipe) -> PathLayout:
    """The recipe's levels x modules, checked against ``model.num_layers``."""
    d = recipe.section(DipacoConfig)
    return PathLayout.from_recipe(
        d.modules_per_level,
        d.level_parts,
        d.path_specific,
        recipe.model.num_layers,
        tied_output=not recipe.model.untie_embeddings_and_output_weights,
    )


def eval_tokens(recipe: DipacoRecipe) -> int:
    """Tokens read of each evaluation document: ``dipaco.eval_seq_length`` (else
    ``training.seq_length``) + 1, its last scored as a target only."""
    d = recipe.section(DipacoConfig)
    return (d.eval_seq_length or recipe.training.seq_length) + 1


def queue_url(recipe: DipacoRecipe) -> QueueURL:
    """The recipe's queue database (``dipaco.queue``; empty = ``run_dir/queue.db``)."""
    return parse_queue_url(recipe.section(DipacoConfig).queue, recipe.run_dir)


@dataclass(kw_only=True)
class DipacoRecipe(GPTRecipe):
    """A DiPaCo run: a GPT recipe (every path is a GPTModel trained on the GPT data pipeline)
    and the ``dipaco`` section."""

    trainer: str = spec("dipaco", help="a registered trainer (megatron_ext.config.trainers)")
    dipaco: DipacoConfig = field(default_factory=DipacoConfig)


def check_dipaco(recipe: DipacoRecipe, world_size: int | None) -> None:
    """The ``dipaco:`` section against itself, the model and the corpus (any job size: a rank
    is one worker, and workers cycle through the paths), after the GPT sections' own rules."""
    check_gpt_sections(recipe)
    d, m, t, p = recipe.section(DipacoConfig), recipe.model, recipe.training, recipe.parallel
    if t.precision == "fp16":
        raise ConfigError(
            "training.precision=fp16 needs loss scaling, which trainer=gpt does and DiPaCo's "
            "inner steps do not: use training.precision=bf16 or fp32"
        )
    if recipe.optimizer.decoupled_lr is not None:
        raise ConfigError(
            "optimizer.decoupled_lr is read by trainer=gpt only (DiPaCo's inner steps have one "
            "LR for every parameter): remove it"
        )
    layout = path_layout(recipe)
    queue_url(recipe)
    if not recipe.data.source and not recipe.data.path:
        raise ConfigError(
            "trainer=dipaco needs data.source (text files, folders, 'python-docs' or "
            "'python-stdlib') or data.path (an indexed dataset)"
        )
    if t.exit_interval is not None:
        raise ConfigError(
            "training.exit_interval counts the steps of one run; a DiPaCo worker has tasks: "
            "stop workers with a stop signal (training.exit_signals) or "
            "training.exit_duration_in_mins, and remove training.exit_interval"
        )
    if m.num_moe_experts:
        raise ConfigError(
            "trainer=dipaco paths are dense GPTs: set model.num_moe_experts=0 (the mixture is "
            "the paths)"
        )
    sizes = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.context_parallel_size,
        p.expert_model_parallel_size,
    )
    if sizes != (1, 1, 1, 1):
        raise ConfigError(
            "trainer=dipaco trains each path on one rank: set parallel.tensor/pipeline/context/"
            "expert_model_parallel_size to 1 (a rank is one worker)"
        )
    if d.routing == "discriminative" and d.reshards > d.phases - 1:
        raise ConfigError(
            f"dipaco.reshards={d.reshards}: {d.phases} phases leave room for at most "
            f"{d.phases - 1} re-shards (one before each phase after the first)"
        )
    if d.train_overlap > layout.num_paths:
        raise ConfigError(
            f"dipaco.train_overlap={d.train_overlap} exceeds the {layout.num_paths} paths"
        )
    if d.route_tokens >= t.seq_length:
        raise ConfigError(
            f"dipaco.route_tokens={d.route_tokens} must be below training.seq_length="
            f"{t.seq_length}: the tokens after the prefix are the ones scored"
        )
    if d.eval_seq_length and d.eval_seq_length <= d.route_tokens:
        raise ConfigError(
            f"dipaco.eval_seq_length={d.eval_seq_length} must exceed dipaco.route_tokens="
            f"{d.route_tokens}: the tokens after the prefix are the ones scored"
        )
    if d.eval_seq_length > t.seq_length and m.position_embedding_type == "learned_absolute":
        raise ConfigError(
            f"dipaco.eval_seq_length={d.eval_seq_length} exceeds training.seq_length="
            f"{t.seq_length}, which learned absolute positions cannot: use "
            f"model.position_embedding_type=rope or a shorter dipaco.eval_seq_length"
        )
    if not d.eval_every_tokens or any(w < 1 for w in d.eval_every_tokens):
        raise ConfigError(
            f"dipaco.eval_every_tokens={d.eval_every_tokens}: give at least one W >= 1"
        )
    if d.heartbeat_seconds >= d.lease_seconds:
        raise ConfigError(
            f"dipaco.heartbeat_seconds={d.heartbeat_seconds} must be below "
            f"dipaco.lease_seconds={d.lease_seconds}, or every lease expires between beats"
        )
    if d.inner_warmup_steps >= d.phases * d.tau:
        raise ConfigError(
            f"dipaco.inner_warmup_steps={d.inner_warmup_steps} must be below the "
            f"phases*tau = {d.phases * d.tau} inner steps of a path"
        )
    r = d.ranks_per_worker
    if r > 1 and d.inner != "gradient":
        raise ConfigError(
            f"dipaco.ranks_per_worker={r} splits micro-batches over ranks; dipaco.inner="
            f"{d.inner} has none: use dipaco.ranks_per_worker=1"
        )
    if r > 1 and (t.global_batch_size // max(t.micro_batch_size, 1)) % r:
        raise ConfigError(
            f"dipaco.ranks_per_worker={r} must divide the {t.global_batch_size} // "
            f"{t.micro_batch_size} micro-batches of an inner step (training.global_batch_size / "
            f"training.micro_batch_size)"
        )
    if world_size is not None and world_size % r:
        raise ConfigError(
            f"dipaco.ranks_per_worker={r} does not divide the job's {world_size} ranks: start "
            f"a multiple of {r} ranks"
        )
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size} is not a multiple of "
            f"training.micro_batch_size={t.micro_batch_size} (an inner step accumulates "
            f"global/micro micro-batches)"
        )
    if not d.base_checkpoint:
        lr_schedule(recipe.training, recipe.optimizer)  # the base run's schedule must be consistent


#: The ``megatron_ext.trainers`` entry point ``dipaco`` (setup.py).
TRAINER = TrainerSpec(
    name="dipaco",
    train="megatron_ext.dipaco.trainer:train",
    check=check_dipaco,
    recipe=DipacoRecipe,
    # a path is a GPT model trained by an inner optimizer on the GPT data pipeline; the
    # parallel sizes are read to refuse any other than 1 (a rank is one worker)
    reads=dict.fromkeys(("model", "optimizer", "data", "training", "parallel")),
    plan="outer",
    trains_tokenizer=True,  # the prepare task trains data.tokenizer_model on data.source
)
