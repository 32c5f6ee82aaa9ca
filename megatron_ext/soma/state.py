"""Per-expert training state and its atomic checkpoint file.

One file per expert (``<run_dir>/soma/experts/expert_0003.pt``) and one for the seed run
(``seed.pt``, which also holds the tied embedding E). A file holds everything the next update
depends on: the body, the Adam moments, the plateau state (lr, ε, best loss, last improvement)
and the update counter. The probes and the data position need no state of their own: both are
counter-based, keyed by (seed, expert, update, batch[, direction]), so the counter is the position
and a resumed run draws exactly the batches and probes the uninterrupted run would have drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_ext.atomic import atomic_path
from megatron_ext.errors import ConfigError
from megatron_ext.zo.spsa import PlateauHalving, ZOAdam

FORMAT_VERSION = 2  # 2: Adam over the SPSA prefix only; a wide expert's head Adam
SEED_EXPERT = -1  # the seed run's id in probe/data keys and file names


@dataclass
class ExpertState:
    """Everything one expert's next update depends on.

    ``theta``: (numel,) fp32 body. ``adam``: moments of the SPSA prefix
    ``theta[:layout.spsa_numel]``. ``head_adam``: a wide expert's delta-rule Adam of its own
    head (None for a narrow one). ``history``: one dict per validation check (``update``,
    ``val_loss`` in nats/byte, ``train_loss``, ``lr``, ``eps``).
    """

    expert: int
    theta: torch.Tensor
    adam: ZOAdam
    plateau: PlateauHalving
    update: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    head_adam: ZOAdam | None = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "expert": self.expert,
            "theta": self.theta.clone(),
            "adam": self.adam.state_dict(),
            "plateau": self.plateau.state_dict(),
            "update": self.update,
            "history": list(self.history),
            "head_adam": None if self.head_adam is None else self.head_adam.state_dict(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("format_version") != FORMAT_VERSION or sd.get("expert") != self.expert:
            raise ConfigError(
                f"checkpoint for expert {sd.get('expert')} (format {sd.get('format_version')}) "
                f"does not match expert {self.expert} (format {FORMAT_VERSION})"
            )
        if sd["theta"].shape != self.theta.shape:
            raise ConfigError(
                f"expert {self.expert}: checkpoint body has {sd['theta'].numel()} parameters, "
                f"the recipe's body has {self.theta.numel()}: the soma.* model sizes changed"
            )
        self.theta.copy_(sd["theta"])
        self.adam.load_state_dict(sd["adam"])
        self.plateau.load_state_dict(sd["plateau"])
        self.update = int(sd["update"])
        self.history = list(sd["history"])
        if (sd["head_adam"] is None) != (self.head_adam is None):
            raise ConfigError(
                f"expert {self.expert}: checkpoint and recipe disagree on a wide head"
            )
        if self.head_adam is not None:
            self.head_adam.load_state_dict(sd["head_adam"])


def expert_path(run_dir: Path, expert: int) -> Path:
    if expert == SEED_EXPERT:
        return run_dir / "soma" / "seed.pt"
    return run_dir / "soma" / "experts" / f"expert_{expert:04d}.pt"


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file in the same folder, then rename: a crash leaves the old
    file (or none), never a truncated one."""
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def load_file(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise ConfigError(f"SOMA checkpoint {path} is missing: train the run first") from None
    except Exception as exc:  # a truncated or foreign file
        raise ConfigError(f"SOMA checkpoint {path} cannot be read ({exc}); delete it") from None
