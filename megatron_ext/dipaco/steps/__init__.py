"""The arithmetic of one step: inner steps (gradient or zero-order), the outer step of a module,
and the routers that send documents to paths."""
