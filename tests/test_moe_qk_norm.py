"""OLMoE's q/k norm over the whole projection: equal to an independent RMSNorm over the
flattened projection, and a TP=2 run (each rank holding half the heads, statistics all-reduced)
equals TP=1, forward and backward, alone and in a GPT model (gradients, the trainer's gradient
norm, a checkpoint)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import torch

from tests.conftest import DIST, run_torchrun

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
        up = torch.randn(5, 3, heads, 8)  # the gradient arriving from above
        local = heads // 2
        mine = slice(rank * local, (rank + 1) * local)
        full = cls(config(1), hidden_size=8, eps=1e-5)
        full.weight.data.copy_(w)
        x_full = x.clone().requires_grad_()
        want = full(x_full)
        (want * up).sum().backward()
        half = cls(config(2), hidden_size=8, eps=1e-5)
        assert half.weight.shape == (heads * 8,), half.weight.shape  # whole on every TP rank
        half.weight.data.copy_(w)
        x_half = x[:, :, mine].clone().requires_grad_()
        got = half(x_half)
        torch.testing.assert_close(got, want[:, :, mine], rtol=1e-6, atol=1e-7)
        # backward: this rank's heads get TP=1's input gradient (the statistics' gradient comes
        # back from every rank), and the weight gradients summed over TP ranks (what
        # megatron-core's finalize_model_grads does for q/k norms) are TP=1's
        (got * up[:, :, mine]).sum().backward()
        torch.testing.assert_close(x_half.grad, x_full.grad[:, :, mine], rtol=1e-5, atol=1e-6)
        weight_grad = half.weight.grad.clone()
        dist.all_reduce(weight_grad)
        torch.testing.assert_close(weight_grad, full.weight.grad, rtol=1e-5, atol=1e-6)
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


def test_gpt_projection_norm_tp2_gradients_equal_tp1(tmp_path: Path) -> None:
    """A GPT model with the projection q/k norms, one training forward/backward of the same batch
    through megatron-core's schedule, DDP and finalize_model_grads: at TP=2 every parameter's
    whole gradient and the optimizer adapter's global gradient norm (what the trainer logs and
    clips with) equal TP=1's (fp32: reductions in another order; measured 0 for the norm), and
    the trainer's checkpoint of the TP=2 run is written and reloads the same weights."""
    out = tmp_path / "grads.json"
    proc = run_torchrun(
        DIST / "qk_norm_tp_grads.py", 2, str(out), str(tmp_path / "ckpt"), check=False
    )
    got = json.loads(out.read_text())
    one, two = got["tp1"], got["tp2"]
    assert one["grad_squares"].keys() == two["grad_squares"].keys()
    wrong = {
        name: (a, two["grad_squares"][name])
        for name, a in one["grad_squares"].items()
        if abs(two["grad_squares"][name] - a) > 1e-5 * a
    }
    assert not wrong, f"squared gradient norms (TP=1, TP=2) differ: {wrong}"
    assert abs(two["grad_norm"] - one["grad_norm"]) <= 1e-6 * one["grad_norm"], (one, two)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert two["reloaded"] is True
