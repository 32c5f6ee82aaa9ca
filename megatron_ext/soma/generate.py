"""Sampling text from a routed SOMA mixture.

Routing policy for prompts: the prompt's first ``route_bytes`` (256) bytes are routed exactly as
an evaluation window's prefix is; a shorter prompt is routed on all of it (its tf-idf features
are just fewer words), and an empty prompt is refused (there is nothing to route on). The
selected experts then read the whole prompt from a zero state, and each new byte is drawn from
the average of their next-byte distributions (temperature-scaled; temperature 0 = argmax). The
``k`` experts run as one batch along the perturbation axis of the body forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megatron_ext.errors import ConfigError
from megatron_ext.soma.data import window_texts
from megatron_ext.soma.layout import BodyLayout
from megatron_ext.soma.model import log_probs
from megatron_ext.soma.router import Router


def route_prompt(prompt: bytes, router: Router, k: int, route_bytes: int = 256) -> list[int]:
    """The k experts a prompt is routed to, best first."""
    if not prompt:
        raise ConfigError("the prompt is empty: give at least one byte of text to route on")
    arr = np.frombuffer(prompt[:route_bytes], dtype=np.uint8)[None]
    return [int(e) for e in router.route(window_texts(arr), k)[0]]


def generate(
    prompt: bytes,
    n_bytes: int,
    router: Router,
    experts: Sequence[torch.Tensor],
    emb: torch.Tensor,
    layout: BodyLayout,
    k: int,
    temperature: float = 0.8,
    seed: int = 0,
    route_bytes: int = 256,
) -> tuple[bytes, list[int]]:
    """``n_bytes`` new bytes after ``prompt``, and the experts used.

    Each step re-reads the whole sequence (the model is evaluated exactly as in evaluation: one
    window from a zero state), so the cost per byte grows with the length; fine for the short
    samples this is meant for."""
    chosen = route_prompt(prompt, router, k, route_bytes)
    thetas = torch.stack([experts[e] for e in chosen])
    gen = torch.Generator().manual_seed(seed)
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(n_bytes):
            tokens = torch.tensor(seq, dtype=torch.long)[None]
            lp = log_probs(thetas, emb, tokens, layout)[:, 0, -1]  # (k, V)
            mix = lp.exp().mean(0)
            if temperature == 0:
                nxt = int(mix.argmax())
            else:
                logits = mix.log() / temperature
                nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            seq.append(nxt)
    return bytes(seq[len(prompt) :]), chosen
