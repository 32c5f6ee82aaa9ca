"""Imported at start-up by every process ``tests.conftest.run_torchrun`` starts (this folder leads
their PYTHONPATH). torchrun starts its ranks with ``python -u``, and unbuffered, ``print`` writes
a line's text and its newline with separate calls, so two ranks sharing one output file can
splice their lines (seen in CI: ``{"rank": 1, ...}{"rank": 0, ...}``). Line-buffered, each line
is one write -- what ``megatron-ext`` itself does first (``launch/cli.py::whole_lines``) for the
ranks it runs; the raw test scripts under torchrun get it here."""

import io
import sys

for stream in (sys.stdout, sys.stderr):
    if isinstance(stream, io.TextIOWrapper):
        stream.reconfigure(line_buffering=True, write_through=False)
