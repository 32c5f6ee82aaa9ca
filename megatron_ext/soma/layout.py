"""The SOMA expert's parameters: its shape, the order of its tensors in one flat body vector,
and their initialisation.

A body is ONE flat vector (float, ``numel`` long): block by block ``norm1.gain``, ``lstm.w_ih``
(4d, d), ``lstm.w_hh`` (4d, d), ``norm2.gain``, ``mlp.fc1`` (4d, d), ``mlp.fc2`` (d, 4d), then
``final_norm.gain`` and, for a wide body (d != d_E), ``in_proj``, ``out_proj`` and ``head``
(:class:`BodyLayout`). Checkpoints use this order; :mod:`.model` evaluates bodies.

The wide ``head`` (V, d_E) is the expert's own tied embedding/decoder (the paper's wide
N = 1, 2, 8 controls, App. C / App. I "Fixed-parameter SOMA recipes"): it embeds the inputs AND
decodes the hidden state, is updated by the decoder-path delta rule (App. E, Eq. 7) and is
never SPSA-perturbed. It is the last tensor, so the perturbed coordinates are the prefix
``theta[:spsa_numel]`` (probes and Adam moments cover only it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["BodyLayout", "ExpertShape", "LayoutEntry", "init_body", "init_embedding"]


@dataclass(frozen=True)
class ExpertShape:
    """Sizes of one expert: vocabulary ``vocab``, tied embedding width ``d_embed`` (d_E), body
    width ``d_model`` (d_t) and the number of LSTM+MLP blocks ``num_blocks`` (D)."""

    vocab: int = 256
    d_embed: int = 32
    d_model: int = 32
    num_blocks: int = 2

    def __post_init__(self) -> None:
        for name, low in (("vocab", 2), ("d_embed", 1), ("d_model", 1), ("num_blocks", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"ExpertShape.{name} must be an integer >= {low}, got {value!r}")

    @property
    def wide(self) -> bool:
        """True when the body width differs from the embedding width (projections + own head)."""
        return self.d_model != self.d_embed


@dataclass(frozen=True)
class LayoutEntry:
    """One named tensor inside the flat body: ``theta[offset : offset + numel]`` viewed as
    ``shape``; ``gain`` marks normalisation gains (probed with ±1 always, initialised to 1)."""

    name: str
    shape: tuple[int, ...]
    offset: int
    gain: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BodyLayout:
    """The order of an expert's tensors in its flat fp32 vector.

    Per block ``b``: ``blocks.b.norm1.gain (d)``, ``blocks.b.lstm.w_ih (4d, d)``,
    ``blocks.b.lstm.w_hh (4d, d)``, ``blocks.b.norm2.gain (d)``, ``blocks.b.mlp.fc1 (4d, d)``,
    ``blocks.b.mlp.fc2 (d, 4d)``; then ``final_norm.gain (d)``; when ``d != d_E`` also
    ``in_proj (d, d_E)``, ``out_proj (d_E, d)`` and ``head (V, d_E)`` (the expert's tied
    embedding/decoder, outside the SPSA prefix: :attr:`spsa_numel`). LSTM rows are in
    torch.nn.LSTM's gate order i, f, g, o.
    """

    shape: ExpertShape
    entries: tuple[LayoutEntry, ...]

    @classmethod
    def from_shape(cls, shape: ExpertShape) -> BodyLayout:
        d, e, v = shape.d_model, shape.d_embed, shape.vocab
        named: list[tuple[str, tuple[int, ...], bool]] = []
        for b in range(shape.num_blocks):
            p = f"blocks.{b}"
            named += [
                (f"{p}.norm1.gain", (d,), True),
                (f"{p}.lstm.w_ih", (4 * d, d), False),
                (f"{p}.lstm.w_hh", (4 * d, d), False),
                (f"{p}.norm2.gain", (d,), True),
                (f"{p}.mlp.fc1", (4 * d, d), False),
                (f"{p}.mlp.fc2", (d, 4 * d), False),
            ]
        named.append(("final_norm.gain", (d,), True))
        if shape.wide:
            named += [
                ("in_proj", (d, e), False),
                ("out_proj", (e, d), False),
                ("head", (v, e), False),
            ]
        entries, offset = [], 0
        for name, entry_shape, gain in named:
            entries.append(LayoutEntry(name, entry_shape, offset, gain))
            offset += math.prod(entry_shape)
        return cls(shape, tuple(entries))

    @property
    def numel(self) -> int:
        last = self.entries[-1]
        return last.offset + last.numel

    @property
    def spsa_numel(self) -> int:
        """Coordinates SPSA perturbs: the prefix before a wide body's ``head`` (all of a narrow
        body, whose decoder is the shared E outside the vector)."""
        return self.entry("head").offset if self.shape.wide else self.numel

    @property
    def gain_mask(self) -> torch.Tensor:
        """(numel,) bool: True on normalisation gains."""
        mask = torch.zeros(self.numel, dtype=torch.bool)
        for entry in self.entries:
            if entry.gain:
                mask[entry.offset : entry.offset + entry.numel] = True
        return mask

    def entry(self, name: str) -> LayoutEntry:
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise KeyError(f"no tensor {name!r} in the body layout")

    def views(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        """(P, numel) -> {name: (P, *shape)} views into ``theta`` (no copies)."""
        if theta.dim() != 2 or theta.shape[1] != self.numel:
            raise ValueError(
                f"expected bodies of shape (P, {self.numel}) for {self.shape}, got "
                f"{tuple(theta.shape)}"
            )
        return {
            e.name: theta[:, e.offset : e.offset + e.numel].unflatten(1, e.shape)
            for e in self.entries
        }


def init_body(
    shape: ExpertShape, generator: torch.Generator, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(numel,) a fresh body: gains 1, every matrix ``U(±1/√fan_in)`` (torch.nn.Linear's and
    torch.nn.LSTM's scale); the wide head ``N(0, 1/d_E)`` like :func:`init_embedding`."""
    layout = BodyLayout.from_shape(shape)
    theta = torch.empty(layout.numel, dtype=torch.float64)
    for e in layout.entries:
        part = theta[e.offset : e.offset + e.numel]
        if e.gain:
            part.fill_(1.0)
        elif e.name == "head":
            part.normal_(0.0, 1.0 / math.sqrt(shape.d_embed), generator=generator)
        else:
            bound = 1.0 / math.sqrt(e.shape[1])
            part.uniform_(-bound, bound, generator=generator)
    return theta.to(dtype)


def init_embedding(
    shape: ExpertShape, generator: torch.Generator, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(V, d_E) tied embedding ``N(0, 1/d_E)``: unit-norm rows, so a normalised hidden state
    gives logits of unit scale."""
    emb = torch.empty(shape.vocab, shape.d_embed, dtype=torch.float64)
    emb.normal_(0.0, 1.0 / math.sqrt(shape.d_embed), generator=generator)
    return emb.to(dtype)
