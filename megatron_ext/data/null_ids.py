"""Megatron-LM's ``NullTokenizer`` as the ``null_ids`` tokenizer kind: text that is already
token ids (Megatron-LM's memory and speed tests train on it, with ``--mock-data``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from megatron_ext.data.tokenizers import PretrainingTokenizer
from megatron_ext.errors import ConfigError

__all__ = ["NullIdsTokenizer"]


class NullIdsTokenizer(PretrainingTokenizer):
    """Megatron-LM's ``NullTokenizer`` (``--tokenizer-type NullTokenizer --vocab-size N``,
    megatron-core's ``tokenizers/text/libraries/null_tokenizer.py``): a document's text is its
    ids written as decimal integers separated by single spaces (``"5 17 3"``); ``vocab_size`` is
    ``N``, ``eod`` is ``N - 1`` (Megatron-LM's default: the last id doubles as end of document,
    it is not an extra id), ``pad`` is -1 (no pad id). The model's vocabulary is ``N`` padded
    as for any tokenizer (``make_vocab_size_divisible_by`` x TP).

    Megatron-LM does not range-check ids; an id outside ``[0, N)`` would index past the
    embedding (or wrap in the dataset's token dtype), so it is refused here.
    """

    pad = -1

    def __init__(self, vocab_size: int) -> None:
        super().__init__(path="")
        if vocab_size < 1:
            raise ConfigError(
                f"the null_ids tokenizer's vocabulary must be >= 1 ids, got {vocab_size}: "
                "set model.vocab_size (Megatron-LM's --vocab-size)"
            )
        self._vocab_size = int(vocab_size)
        self.eod = self._vocab_size - 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> dict[str, int]:
        """Ids have no names (megatron-core's NullTokenizer raises here too)."""
        raise NotImplementedError("the null_ids tokenizer has no vocabulary of names")

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        return {
            "class": "megatron_ext.NullIdsTokenizer",
            "vocab_size": self._vocab_size,
            "eod_id": self.eod,
            "pad_id": self.pad,
        }

    def tokenize(self, text: str) -> list[int]:
        """``"5 17 3"`` -> ``[5, 17, 3]``: split on single spaces as Megatron-LM does (so two
        spaces in a row, or a newline, are not a separator and are refused)."""
        try:
            ids = [int(x) for x in text.split(" ")]
        except ValueError:
            raise ConfigError(
                f"the null_ids tokenizer reads integers separated by single spaces; got "
                f"{text[:60]!r}: write each document as its ids, e.g. '5 17 3'"
            ) from None
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise ConfigError(
                f"the null_ids tokenizer's ids are in [0, {self._vocab_size}) "
                f"(model.vocab_size); got {bad[0]}: raise model.vocab_size or fix the data"
            )
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        """Ids -> ``"5 17 3"`` (Megatron-LM's ``ids_to_text``; ``eod`` is written like any id)."""
        return " ".join(str(int(i)) for i in ids)
