"""DiPaCo (Distributed Path Composition, Douillard et al. 2024): paths of shared megatron-core
modules trained with DiLoCo per module, coarse document routing, a task queue on a database.

- :mod:`.recipe`: the ``dipaco:`` section, its rules and the trainer registration (torch-free);
- :mod:`.layout`: levels x modules -> paths, and which parameter belongs to which module;
- :mod:`.queue`: the task queue (SQLite in WAL mode or PostgreSQL), leases and fencing tokens;
- :mod:`.outer`: the outer step of one module (DiLoCo's Nesterov SGD on the path deltas).

Nothing is imported here, so ``import megatron_ext.dipaco.recipe`` does not pay for torch.
"""
