"""Hugging Face <-> megatron-core checkpoints (OLMoE, Qwen3-MoE, Llama-style GPT).

The public API, what a user's script (and ``megatron-ext bench``) may call, is
``__all__`` below, loaded on first use (:func:`megatron_ext.exports.load_export`): importing
the package costs nothing; its modules are internals.
"""

from typing import Any

from megatron_ext.exports import load_export

#: public name -> the submodule that defines it
_EXPORTS = {
    "init_single_process": "parity",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return load_export(__name__, _EXPORTS, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
