"""megatron-core GPTModel + DDP on CPU/gloo through the compatibility module.

Reference: a 1-rank run on the whole global batch.  A 2-rank run (each rank one half) must give
the same synchronised gradients to fp32 tolerance, dense and MoE (4 experts, top-2, sigmoid
router with expert bias, alltoall dispatcher).
"""

from __future__ import annotations

import torch

import megatron_ext.megatron.cpu_compat as cpu_compat
from tests.conftest import DIST, run_torchrun


def _grads(tmp_path, kind: str, nproc: int) -> dict:
    out = tmp_path / f"{kind}_{nproc}.pt"
    run_torchrun(DIST / "ddp_grads.py", nproc, str(out), kind)
    saved = torch.load(out)
    assert saved["dp"] == nproc
    return saved["grads"]


def _compare(one: dict, two: dict) -> None:
    assert one.keys() == two.keys()
    for name, ref in one.items():
        # fp32 tolerance: the reductions are summed in a different order across ranks.
        scale = ref.abs().max().item()
        assert scale > 0, f"{name}: zero gradient, the test would prove nothing"
        err = (ref - two[name]).abs().max().item()
        assert err <= 1e-5 * scale + 1e-9, f"{name}: max |diff| {err:.3e} vs scale {scale:.3e}"


def test_dense_two_ranks_match_one(tmp_path):
    _compare(_grads(tmp_path, "dense", 1), _grads(tmp_path, "dense", 2))


def test_moe_two_ranks_match_one(tmp_path):
    grads = _grads(tmp_path, "moe", 1)
    assert any(".experts." in n for n in grads) and any("router" in n for n in grads)
    _compare(grads, _grads(tmp_path, "moe", 2))


def test_changes_nothing_when_cuda_present(monkeypatch):
    monkeypatch.setattr(cpu_compat.PATCHES, "applied", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = {name: getattr(torch.cuda, name) for name in ("current_device", "Stream", "Event")}
    assert cpu_compat.apply_cpu_compat() is False
    assert {name: getattr(torch.cuda, name) for name in before} == before
    assert cpu_compat.PATCHES.applied is False


def test_docstring_lists_every_replaced_call():
    doc = cpu_compat.__doc__
    for dotted in cpu_compat.replaced_calls():
        name = dotted.rsplit(".", 1)[-1]
        assert name in doc, f"{dotted} is replaced but not documented"


def test_moe_expert_parallel_matches_one_rank(tmp_path):
    """4 experts split over 2 ranks (alltoall dispatch through gloo) against all 4 on one rank,
    with every weight initialised from its global name in both runs."""
    for nproc, kind in ((1, "moe_ep2"), (2, "moe_ep2")):
        run_torchrun(DIST / "ddp_grads.py", nproc, str(tmp_path / f"ep{nproc}.pt"), kind)
    one = torch.load(tmp_path / "ep1.pt.rank0")["grads"]
    split = {
        **torch.load(tmp_path / "ep2.pt.rank0")["grads"],
        **torch.load(tmp_path / "ep2.pt.rank1")["grads"],
    }
    assert any("local_experts.3." in n for n in split)
    _compare(one, split)
