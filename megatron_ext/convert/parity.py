"""Logit and routing parity between an HF model and its megatron-core conversion (fp32).

:func:`compare` runs both models on the same token ids and reports the cosine, max abs
difference and argmax agreement of the logits, and per MoE layer the fraction of tokens whose
selected expert set is identical (router hooks on both sides).
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from megatron_ext.gpt.sections import ModelConfig, ParallelConfig


def init_single_process() -> None:
    """One-process gloo group and megatron-core's parallel state (idempotent)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ext.megatron.cpu_compat import apply_cpu_compat

    if not dist.is_initialized():
        store = tempfile.mktemp(prefix="megatron_ext_convert_")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        # groups megatron-core kept from an earlier, destroyed default group are not ours
        parallel_state.destroy_model_parallel()
    apply_cpu_compat()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)


def build_mcore(fields: dict[str, Any], state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A fp32 ``GPTModel`` with ``state`` loaded (every parameter must be covered)."""
    from megatron_ext.megatron.model import build_gpt_model

    init_single_process()
    model = ModelConfig(**fields)
    gpt = build_gpt_model(model, ParallelConfig(), "fp32", model.vocab_size, seq_length=4096)
    missing, unexpected = gpt.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"conversion left parameters out: {missing[:4]} / {unexpected[:4]}")
    return gpt.eval()


def mcore_logits(gpt: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s, vocab] logits of a megatron-core GPTModel (causal, positions 0..s-1)."""
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    with torch.no_grad():
        return gpt(tokens, positions, attention_mask=None).float()


def _hf_selections(hf: torch.nn.Module) -> tuple[list[list[torch.Tensor]], list[Any]]:
    """Forward hooks on each HF MoE router recording the chosen expert ids [tokens, k]."""
    got: list[list[torch.Tensor]] = []
    handles = []
    for layer in hf.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "top_k"):
            continue
        slot: list[torch.Tensor] = []
        got.append(slot)
        handles.append(
            gate.register_forward_hook(lambda _m, _i, out, slot=slot: slot.append(out[2]))
        )
    return got, handles


def _mcore_selections(gpt: torch.nn.Module) -> tuple[list[list[torch.Tensor]], list[Any]]:
    """Forward hooks on each megatron-core router recording its routing map [tokens, E]."""
    got: list[list[torch.Tensor]] = []
    handles = []
    for layer in gpt.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue
        slot: list[torch.Tensor] = []
        got.append(slot)
        handles.append(
            router.register_forward_hook(lambda _m, _i, out, slot=slot: slot.append(out[1]))
        )
    return got, handles


def compare(hf: torch.nn.Module, gpt: torch.nn.Module, tokens: torch.Tensor) -> dict[str, Any]:
    """Parity figures for ``tokens`` [b, s]: ``cosine``, ``max_abs_diff``, ``argmax_agreement``
    (fraction of positions), ``expert_selection_agreement`` (per MoE layer, fraction of tokens
    with the same expert set)."""
    hf_sel, h1 = _hf_selections(hf)
    mc_sel, h2 = _mcore_selections(gpt)
    try:
        with torch.no_grad():
            ref = hf(input_ids=tokens).logits.float()
        got = mcore_logits(gpt, tokens)[..., : ref.shape[-1]]
    finally:
        for h in [*h1, *h2]:
            h.remove()
    # megatron-core works in [s, b] order: its routing maps are over tokens s-major
    agreement = []
    for hf_ids, mc_map in zip(hf_sel, mc_sel, strict=True):
        ids = hf_ids[0].reshape(tokens.shape[0], tokens.shape[1], -1).transpose(0, 1)
        want = torch.zeros_like(mc_map[0]).reshape(tokens.shape[1], tokens.shape[0], -1)
        want.scatter_(-1, ids, True)
        same = (want.reshape(mc_map[0].shape) == mc_map[0]).all(dim=-1)
        agreement.append(float(same.float().mean()))
    a, b = ref.reshape(-1).double(), got.reshape(-1).double()
    return {
        "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
        "max_abs_diff": float((ref - got).abs().max()),
        "argmax_agreement": float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
        "expert_selection_agreement": agreement,
    }
