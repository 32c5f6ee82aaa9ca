"""Schedules driven by the optimizer step: the learning rate (WSD, cosine, ...), and the run's
schedule on consumed tokens (:func:`training_schedule`, :func:`run_steps`).

The public API, what a user's script (and ``megatron-ext bench``) may call, is ``__all__``
below, loaded on first use (:func:`megatron_ext.exports.load_export`); its modules are
internals.
"""

from megatron_ext.exports import lazy_exports

#: public name -> the submodule that defines it
_EXPORTS = {
    "DecayStyle": "lr",
    "LRSchedule": "lr",
    "run_steps": "plan",
    "training_schedule": "plan",
    "WsdDecayStyle": "lr",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
