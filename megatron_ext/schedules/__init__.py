"""Schedules driven by the optimizer step: the learning rate (WSD, cosine, ...), and the run's
schedule on consumed tokens (:func:`training_schedule`, :func:`run_steps`).

The public API, what a user's script (and ``megatron-ext bench``) may call, is ``__all__``
below, loaded on first use (:func:`megatron_ext.exports.load_export`); its modules are
internals.
"""

from typing import Any

from megatron_ext.exports import load_export

#: public name -> the submodule that defines it
_EXPORTS = {
    "DecayStyle": "lr",
    "LRSchedule": "lr",
    "run_steps": "plan",
    "training_schedule": "plan",
    "WsdDecayStyle": "lr",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return load_export(__name__, _EXPORTS, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
