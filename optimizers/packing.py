"""Per-parameter optimizer state stored as views of one stacked tensor per shape group.

Batched matrix math wants ``(B, ...)`` tensors; ``torch.optim`` wants ``state[param][key]``.
:class:`StatePacker` gives both without copying every step: the first time a group of params is
seen (or whenever its state tensors are no longer the expected views — after
``load_state_dict``, say) their state is copied once into a stacked tensor and each
``state[param][key]`` is replaced by a view of it. ``state_dict()`` therefore still holds one
tensor per parameter (views share storage, which ``torch.save`` preserves).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["StatePacker"]


class StatePacker:
    """Keeps stacked state tensors for groups of same-shape parameters."""

    def __init__(self) -> None:
        self._packs: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def pack(
        self,
        state: dict[torch.Tensor, dict[str, torch.Tensor]],
        params: Sequence[torch.Tensor],
        key: str,
        matrix_shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        column_major: bool = False,
    ) -> torch.Tensor:
        """Stacked ``(total, *matrix_shape)`` tensor behind ``state[p][key]`` for ``params``.

        Each ``state[p][key]`` must hold a whole number of matrices of ``matrix_shape`` (one for a
        2-D weight, E for an ``(E, m, n)`` expert stack); the stack follows the order of
        ``params``. ``column_major``: each ``(a, b)`` matrix of the stack is stored column-major
        (strides ``(a·b, 1, a)``).
        """
        ident = (key, tuple(id(p) for p in params))
        packed = self._packs.get(ident)
        if packed is not None and self._is_packed(state, params, key, packed):
            return packed
        parts = [state[p][key].reshape(-1, *matrix_shape) for p in params]
        total = sum(part.shape[0] for part in parts)
        device = parts[0].device
        if column_major:
            rows, cols = matrix_shape
            packed = torch.empty(total, cols, rows, dtype=dtype, device=device).mT
        else:
            packed = torch.empty(total, *matrix_shape, dtype=dtype, device=device)
        offset = 0
        for p, part in zip(params, parts, strict=True):
            count = part.shape[0]
            view = packed[offset : offset + count]
            view.copy_(part)
            state[p][key] = view.view(state[p][key].shape)
            offset += count
        self._packs[ident] = packed
        return packed

    @staticmethod
    def _is_packed(
        state: dict[torch.Tensor, dict[str, torch.Tensor]],
        params: Sequence[torch.Tensor],
        key: str,
        packed: torch.Tensor,
    ) -> bool:
        offset = 0
        inner = packed.stride()[1:]
        for p in params:
            t = state[p][key]
            count = t.numel() // max(1, packed[0].numel())
            lead = t.stride()[: t.dim() - len(inner)]
            if (
                offset + count > packed.shape[0]
                or t.dtype != packed.dtype
                or t.stride()[len(lead) :] != inner
                or any(stride != packed.stride(0) for stride in lead)
                or t.data_ptr() != packed[offset].data_ptr()
                or t.numel() != count * packed[0].numel()
            ):
                return False
            offset += count
        return offset == packed.shape[0]
