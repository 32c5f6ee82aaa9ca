"""What a worker brings to each task: the corpus, its GPTModel of one path (built once, after
``prepare``), its ranks (one, or R: :mod:`.group`) and the check that its lease still holds."""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING

from megatron_ext.config.schema import Recipe
from megatron_ext.dipaco.run.group import WorkerGroup

if TYPE_CHECKING:  # megatron-core's model and datasets load on first use, not on import
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.data.tokenizers import PretrainingTokenizer
    from megatron_ext.dipaco.model.path_model import PathModel

__all__ = ["LeaseLost", "TaskTools"]


class LeaseLost(Exception):
    """The worker's lease on its task was taken over: stop working on it."""


class TaskTools:
    """One worker's means; ``lost()`` says whether the current lease was lost (or the worker is
    asked to stop), ``group`` the ranks of this worker."""

    def __init__(
        self, recipe: Recipe, lost: Callable[[], bool], group: WorkerGroup | None = None
    ) -> None:
        self.lost = lost
        self.group = group or WorkerGroup.single()
        self._recipe = recipe  # what the corpus and the model are built from

    def check_lease(self) -> None:
        """Raise :class:`LeaseLost` when the lease was lost: the task stops at once."""
        if self.lost():
            raise LeaseLost()

    @cached_property
    def corpus(self) -> tuple[PretrainingTokenizer, IndexedDataset]:
        """(tokenizer, indexed dataset), once ``prepare`` made them."""
        from megatron_ext.dipaco.data.documents import open_corpus

        return open_corpus(self._recipe)

    @property
    def dataset(self) -> IndexedDataset:
        """The corpus's indexed dataset (one sequence per document)."""
        return self.corpus[1]

    @cached_property
    def path_model(self) -> PathModel:
        """This worker's GPTModel (built on first use, after ``prepare``)."""
        from megatron_ext.dipaco.model.path_model import PathModel

        return PathModel(self._recipe, self.corpus[0].vocab_size)
