"""A run on the queue: its plan of tasks, the files they leave, the work of each task kind, the
worker that claims them (one rank or a group), the evaluation, and the fully synchronous
ablation."""
