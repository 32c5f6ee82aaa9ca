"""The documentation's generated parts: ``megatron-ext docs results`` renders
``docs/results/*/*.md`` from the benchmarks' JSON (:mod:`.render`), and :mod:`.figures` checks
that every measured figure a page quotes is held by a results file. Torch-free."""
