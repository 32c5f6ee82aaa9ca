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
:mod:`.model` and :mod:`.data`). Nothing is imported here, so ``import
megatron_ext.dipaco.recipe`` does not pay for torch.
"""
