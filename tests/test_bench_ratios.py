"""The optimizer benchmark's headline ratio: our fastest Muon mode among those whose
orthogonality error is not above Emerging-Optimizers' (the issue's "at equal or lower
orthogonality error"), with the like-for-like quintic ratio beside it."""

from __future__ import annotations

from megatron_ext.bench._optimizers_report import headline_ratios as _ratios


def _entry(seconds: float, error: float | None, state: int = 1) -> dict:
    return {"s_per_step": seconds, "ortho_error": error, "state_bytes": state}


def test_headline_muon_ratio_only_counts_modes_at_equal_or_lower_error():
    results = {
        "muon_quintic": _entry(1.0, 0.164),
        "muon_quintic_cubic": _entry(0.8, 0.087),
        "muon_too_rough": _entry(0.1, 0.4),  # fastest, but farther from the polar factor
        "mop": _entry(3.0, 1e-6),  # not Muon
        "emerging_muon": _entry(2.0, 0.164),
    }
    ratios = _ratios(results)
    assert ratios["muon_vs_emerging_mode"] == "muon_quintic_cubic"
    assert ratios["muon_vs_emerging"] == 0.4
    assert ratios["muon_quintic_vs_emerging"] == 0.5
    assert ratios["kl_soap_vs_emerging"] is None


def test_without_emerging_optimizers_there_is_no_headline_ratio():
    ratios = _ratios({"muon_quintic": _entry(1.0, 0.164)})
    assert ratios["muon_vs_emerging"] is None and ratios["muon_vs_emerging_mode"] is None


def test_newton_schulz_root_mode_is_reported_against_the_eigenbasis_mode():
    ratios = _ratios({"kl_soap_qr": _entry(2.0, None), "kl_soap_ns_root": _entry(3.0, None)})
    assert ratios["kl_soap_ns_root_vs_eigenbasis"] == 1.5
    assert _ratios({"kl_soap_qr": _entry(2.0, None)})["kl_soap_ns_root_vs_eigenbasis"] is None


def test_kl_soap_floor_is_its_flop_model_at_the_matmul_rate_against_emerging():
    """826 GFLOP at 162 GFLOP/s is 5.1 s, against their 13.6 s: 0.375 whatever our code does."""
    results = {
        "kl_soap_qr": {**_entry(6.9, None), "gflop_per_step": 826.0},
        "emerging_kl_soap": _entry(13.6, None),
    }
    assert abs(_ratios(results, 162.0)["kl_soap_floor_vs_emerging"] - 826 / 162 / 13.6) < 1e-12
    # no matmul rate or no Emerging-Optimizers run: no floor
    assert _ratios(results)["kl_soap_floor_vs_emerging"] is None
    del results["emerging_kl_soap"]
    assert _ratios(results, 162.0)["kl_soap_floor_vs_emerging"] is None
