"""OLMoE's q/k norm over the whole projection: equal to an independent RMSNorm over the
flattened projection, and a TP=2 run (each rank holding half the heads, statistics all-reduced)
equals TP=1."""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch

from tests.conftest import run_torchrun

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_ext.megatron.cpu_compat import apply_cpu_compat
    from megatron_ext.megatron.qk_norm import ProjectionKNorm, ProjectionQNorm

    dist.init_process_group("gloo")
    apply_cpu_compat()
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)

    def config(tp):
        return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                 num_query_groups=2, tensor_model_parallel_size=tp,
                                 use_cpu_initialization=True)

    torch.manual_seed(0)
    for cls, heads in ((ProjectionQNorm, 4), (ProjectionKNorm, 2)):
        x = torch.randn(5, 3, heads, 8) * 1e-2
        w = torch.rand(heads * 8) + 0.5
        full = cls(config(1), hidden_size=8, eps=1e-5)
        full.weight.data.copy_(w)
        want = full(x)
        half = cls(config(2), hidden_size=8, eps=1e-5)
        local = heads // 2
        half.weight.data.copy_(w.reshape(2, -1)[rank])
        got = half(x[:, :, rank * local:(rank + 1) * local])
        torch.testing.assert_close(got, want[:, :, rank * local:(rank + 1) * local],
                                   rtol=1e-6, atol=1e-7)
    print("tp2 == tp1", flush=True)
    """
)


def test_projection_norm_matches_independent_reference() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.megatron.qk_norm import ProjectionQNorm

    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True
    )
    norm = ProjectionQNorm(config, hidden_size=8, eps=1e-5)
    torch.manual_seed(0)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(5, 3, 4, 8) * 3e-3  # variance near the epsilon: the epsilon matters
    flat = x.reshape(5, 3, 32).double()
    ref = flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), ref.reshape(5, 3, 4, 8), rtol=1e-6, atol=1e-7)
    per_head = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert not torch.allclose(per_head.reshape(5, 3, 32), ref / norm.weight.double(), atol=1e-3)


def test_projection_norm_tp2_equals_tp1(tmp_path: Path) -> None:
    script = tmp_path / "qk_norm_tp.py"
    script.write_text(SCRIPT)
    proc = run_torchrun(script, 2)
    assert "tp2 == tp1" in proc.stdout
