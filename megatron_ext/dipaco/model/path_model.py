"""One path on a worker: megatron-core's GPTModel (the GPT trainer's builder, specs and CPU
compatibility), built once per worker; each task assigns its path's modules to it.

A path has the full depth of the model (one module per level), so a worker holds exactly one
path's parameters, never the mixture. Besides the language-model loss it gives the routing
features: the mean last-block hidden state over a span of each document.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_ext.config.schema import Recipe
from megatron_ext.megatron.model import build_gpt_model
from megatron_ext.megatron.parallel import set_seeds

__all__ = ["PathModel", "TextBatch", "lm_loss"]


@dataclass(frozen=True)
class TextBatch:
    """Documents padded to one length: ``tokens`` (n, T) int64, ``mask`` (n, T) bool (real
    tokens), ``lengths`` (n,)."""

    tokens: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss (nats/token) of a (b, s + 1) token batch."""
    tokens, labels = batch[:, :-1], batch[:, 1:]
    position = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, position, None, labels=labels).float().mean()


class PathModel:
    """The worker's GPTModel and what the tasks ask of it. ``init_state``: the parameters as
    built (the base run's initialisation, the same on every worker: seeds are set first)."""

    def __init__(self, recipe: Recipe, vocab_size: int) -> None:
        t = recipe.training
        set_seeds(recipe.seed)  # the same initialisation whatever this process did before
        self.model = build_gpt_model(
            recipe.model,
            recipe.parallel,
            t.precision,
            vocab_size=vocab_size,
            seq_length=t.seq_length,
        )
        self.init_state = self.state()
        self.hidden_size = recipe.model.hidden_size

    def state(self) -> dict[str, torch.Tensor]:
        """The current parameters (detached clones), by GPTModel name."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def _run(self, docs: TextBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-token losses (n, T - 1), last-block hidden states (n, T, h)) of ``docs``."""
        captured: dict[str, torch.Tensor] = {}

        def keep(_module, _inputs, output) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            captured["h"] = hidden.detach().transpose(0, 1).float()  # [s, b, h] -> [b, s, h]

        self.model.eval()
        hook = self.model.decoder.layers[-1].register_forward_hook(keep)
        try:
            tokens = docs.tokens
            position = torch.arange(tokens.shape[1]).expand_as(tokens)
            labels = torch.roll(tokens, -1, dims=1)
            losses = self.model(tokens, position, None, labels=labels).float()
        finally:
            hook.remove()
        return losses[:, :-1], captured["h"]

    def token_losses(self, docs: TextBatch, batch: int = 16) -> list[torch.Tensor]:
        """Each document's per-target losses (length - 1 values, target j = token j + 1)."""
        out = []
        for start in range(0, len(docs.lengths), batch):
            part = _rows(docs, start, start + batch)
            losses, _ = self._run(part)
            out += [row[: int(n) - 1].clone() for row, n in zip(losses, part.lengths, strict=True)]
        return out

    def span_features(
        self, docs: TextBatch, spans: Sequence[Sequence[tuple[int, int]]], batch: int = 16
    ) -> list[torch.Tensor]:
        """Mean last-block hidden state over each span ``[a, b)`` of token positions of each
        document: one (len(spans[i]), h) float32 tensor per document (causal, so a span's
        features see only tokens before its end)."""
        out = []
        for start in range(0, len(docs.lengths), batch):
            _, hidden = self._run(_rows(docs, start, start + batch))
            for row, doc_spans in zip(hidden, spans[start : start + batch], strict=True):
                out.append(torch.stack([row[a:b].mean(0) for a, b in doc_spans]))
        return out

    def prefix_features(self, docs: TextBatch, route_tokens: int) -> torch.Tensor:
        """(n, h) mean last-block hidden state over each document's first ``route_tokens``
        tokens (fewer when the document is shorter)."""
        spans = [[(0, min(route_tokens, int(n)))] for n in docs.lengths]
        return torch.cat(self.span_features(docs, spans))


def _rows(docs: TextBatch, start: int, end: int) -> TextBatch:
    lengths = docs.lengths[start:end]
    width = int(lengths.max())
    return TextBatch(docs.tokens[start:end, :width], docs.mask[start:end, :width], lengths)
