"""SOMA's part of a recipe: the ``soma:`` section, its cross-field rules, the registration.

No torch import: the launcher validates recipes before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_ext.config.fields import spec
from megatron_ext.config.schema import Recipe
from megatron_ext.config.trainers import TrainerSpec
from megatron_ext.errors import ConfigError
from megatron_ext.megatron.sections import DataConfig, TrainingConfig
from megatron_ext.run.stopping import check_stop_fields

__all__ = ["SomaConfig", "SomaRecipe", "check_soma"]


@dataclass
class SomaConfig:
    """SOMA: N byte-level LSTM experts trained by zero-order SPSA on tf-idf clusters.

    The corpus comes from ``data.source`` (nothing is downloaded); ``test_fraction`` of its
    DOCUMENTS is held out whole for the routed evaluation (one ``window_bytes`` window each, the
    paper's document-level test set), the other documents are cut into windows of
    ``window_bytes`` and clustered into ``num_experts`` shards (each split
    ``1 - val_fraction`` / ``val_fraction``).
    """

    num_experts: int = spec(4, ge=1, help="N experts = N tf-idf clusters")
    d_embed: int = spec(32, ge=1, help="width of the shared tied byte embedding E (256 x d_embed)")
    d_model: int = spec(32, ge=1, help="expert body width d_t; != d_embed adds projections + head")
    num_blocks: int = spec(2, ge=1, help="pre-norm LSTM+MLP blocks per expert")
    n_pert: int = spec(8, ge=1, help="SPSA probe directions per batch (2 losses each)")
    batch_size: int = spec(16, ge=1, help="sequences per batch (shared by all probes)")
    seq_length: int = spec(256, ge=1, help="bytes per training sequence (+1 target)")
    accumulation: int = spec(1, ge=1, help="A: independent batches+probes averaged per update")
    lr: float = spec(1e-3, gt=0.0, help="initial Adam lr (halved with eps on plateaus)")
    eps: float = spec(1e-3, gt=0.0, help="initial SPSA perturbation size")
    lr_floor: float = spec(1e-5, gt=0.0, help="lr and eps are never halved below this")
    weight_decay: float = spec(0.0, ge=0.0, help="coupled: lambda*theta added to the estimate")
    plateau_patience: int = spec(1000, ge=1, help="updates without improvement before halving")
    plateau_min_delta: float = spec(1e-8, ge=0.0, help="validation-loss improvement that counts")
    seed_updates: int = spec(200, ge=0, help="updates of the seed run (N = 1, E learned)")
    seed_lr: float | None = spec(
        None, gt=0.0, help="initial Adam lr of the seed run's body (paper: 0.0025); None = lr"
    )
    head_lr: float = spec(1e-2, gt=0.0, help="seed run: Adam lr of the tied head E (delta rule)")
    expert_updates: int = spec(400, ge=0, help="updates per expert after the seed run")
    eval_interval: int = spec(50, ge=1, help="validation loss (plateau check) every k updates")
    val_windows: int = spec(8, ge=1, help="validation windows scored per check (at most)")
    distribution: Literal["fso", "ddpp"] = spec(
        "fso",
        help="fso: each rank trains its own experts, no communication; "
        "ddpp: every expert's probe directions are split over all ranks",
    )
    loss_mode: Literal["independent", "summed"] = spec(
        "independent",
        help="summed: one finite difference of the sum of a rank's experts' losses (ablation)",
    )
    window_bytes: int = spec(1025, ge=2, help="corpus window: 1,024 inputs + 1 target")
    route_bytes: int = spec(256, ge=1, help="evaluation routes on this prefix of a window")
    score_bytes: int = spec(768, ge=1, help="evaluation scores this many targets after it")
    eval_topk: int | None = spec(None, ge=1, help="experts averaged per window; None = min(4, N)")
    test_fraction: float = spec(0.01, gt=0.0, le=0.5, help="documents held out for evaluation")
    val_fraction: float = spec(0.01, gt=0.0, le=0.5, help="per-expert validation share")
    router: str = spec("", help="router artifact path; '' = <run_dir>/router.pkl (fit if missing)")
    router_svd_dim: int = spec(128, ge=2)
    router_max_features: int | None = spec(None, ge=1, help="None = scaled to the corpus")
    router_min_df: int | None = spec(None, ge=1, help="None = scaled to the corpus")

    def topk(self) -> int:
        return self.eval_topk if self.eval_topk is not None else min(4, self.num_experts)


@dataclass(kw_only=True)
class SomaRecipe(Recipe):
    """A SOMA run: the core fields, the ``soma`` section, and what it reads of GPT's
    (``data.source``; the stop fields of ``training``)."""

    trainer: str = spec("soma", help="a registered trainer (megatron_ext.config.trainers)")
    soma: SomaConfig = field(default_factory=SomaConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)


def check_soma(recipe: SomaRecipe, world_size: int | None) -> None:
    """The ``soma:`` section against itself, the corpus and (given) the job size."""
    check_stop_fields(recipe.training)
    s = recipe.section(SomaConfig)
    if s.eval_topk is not None and s.eval_topk > s.num_experts:
        raise ConfigError(
            f"soma.eval_topk={s.eval_topk} exceeds soma.num_experts={s.num_experts}: "
            f"an evaluation window can be routed to at most N experts"
        )
    if s.route_bytes + s.score_bytes > s.window_bytes - 1:
        raise ConfigError(
            f"soma.route_bytes + soma.score_bytes = {s.route_bytes + s.score_bytes} exceeds "
            f"the {s.window_bytes - 1} targets of a soma.window_bytes={s.window_bytes} window"
        )
    if s.seq_length > s.window_bytes - 1:
        raise ConfigError(
            f"soma.seq_length={s.seq_length} exceeds the {s.window_bytes - 1} targets of a "
            f"soma.window_bytes={s.window_bytes} window"
        )
    for name in ("lr", "eps", "seed_lr"):
        if getattr(s, name) is None:
            continue
        if getattr(s, name) < s.lr_floor:
            raise ConfigError(f"soma.{name}={getattr(s, name)} is below soma.lr_floor={s.lr_floor}")
    if s.loss_mode == "summed" and s.distribution == "ddpp":
        raise ConfigError(
            "soma.loss_mode=summed needs soma.distribution=fso (the summed finite difference "
            "runs over the experts a rank holds)"
        )
    if not recipe.data.source:
        raise ConfigError("trainer=soma needs data.source (text files, folders or 'python-stdlib')")
    if world_size is not None and s.distribution == "fso" and s.num_experts < world_size:
        raise ConfigError(
            f"soma.distribution=fso gives each rank its own experts, but "
            f"soma.num_experts={s.num_experts} < {world_size} ranks: use at most "
            f"{s.num_experts} ranks, more experts, or soma.distribution=ddpp"
        )


#: The ``megatron_ext.trainers`` entry point ``soma`` (setup.py).
TRAINER = TrainerSpec(
    name="soma",
    train="megatron_ext.soma.trainer:train",
    check=check_soma,
    recipe=SomaRecipe,
    # the byte windows come from data.source; the stop rules from training
    reads={
        "data": ("source",),
        "training": ("exit_interval", "exit_duration_in_mins", "exit_signals"),
    },
)
