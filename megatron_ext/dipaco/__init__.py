"""DiPaCo (Distributed Path Composition, Douillard et al. 2024): paths of shared megatron-core
modules trained with DiLoCo per module, coarse document routing, a task queue on a database.

- :mod:`.recipe`: the ``dipaco:`` section, its rules and the trainer registration (torch-free);
  :mod:`.trainer` (``trainer: dipaco``) and :mod:`.cli` (``megatron-ext dipaco worker|status``);
- :mod:`.queue` (torch-free): the task queue (SQLite in WAL mode or PostgreSQL), leases and
  fencing tokens, its database and URL, a worker's heartbeat, the run's status;
- :mod:`.model`: levels x modules -> paths, which parameter belongs to which module, the
  worker's GPTModel of one path, the base checkpoint;
- :mod:`.data`: the corpus, its split, each path's batches, the routing features;
- :mod:`.steps`: inner steps (gradient, zero-order), the outer step of one module (DiLoCo's
  Nesterov SGD on the path deltas), the routers;
- :mod:`.run`: the plan of tasks, the store, the work of each task, the worker, the evaluation.

Each sub-package imports only those listed before it (:mod:`.recipe` sits between
:mod:`.model` and :mod:`.data`).

The public API, what a user's script (and ``megatron-ext bench``) may call, is
``__all__`` below, loaded on first use (:func:`megatron_ext.exports.load_export`): importing
the package costs nothing; its modules are internals.
"""

from megatron_ext.exports import lazy_exports

#: public name -> the submodule that defines it
_EXPORTS = {
    "accumulate_delta": "steps.outer",
    "apply_outer_step": "steps.outer",
    "assign_params": "model.parts",
    "attempt_dir": "run.store",
    "BASE": "run.plan",
    "build_plan": "run.plan",
    "DipacoConfig": "recipe",
    "document_batch": "data.documents",
    "eval_tokens": "recipe",
    "final_id": "run.plan",
    "full_sync_train": "run.full_sync",
    "load_tensors": "run.store",
    "open_run_queue": "run.worker",
    "outer_id": "run.plan",
    "OuterConfig": "steps.outer",
    "parse_queue_url": "queue.url",
    "path_layout": "recipe",
    "queue_url": "recipe",
    "routed_loss": "run.evaluate",
    "Router": "steps.routing",
    "run_worker": "run.worker",
    "RunFiles": "run.store",
    "save_tensors": "run.store",
    "shard_phase": "run.plan",
    "TaskQueue": "queue.task_queue",
    "TaskSpec": "queue.task_queue",
    "TaskTools": "run.tools",
    "train": "trainer",
    "train_id": "run.plan",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
