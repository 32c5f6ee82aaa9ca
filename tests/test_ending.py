"""A rank's end (megatron_ext.run.ending.end_process): what Python's exit does, then os._exit."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from megatron_ext.run.ending import end_process

pool = ThreadPoolExecutor(2)          # idle workers: the interpreter's exit stops them first
pool.submit(time.sleep, 0.01).result()
worker = threading.Thread(target=lambda: (time.sleep(0.3), print("worker done")))
worker.start()                        # a non-daemon thread still running: waited for
atexit.register(lambda: print("atexit ran"))
sys.stdout.write("buffered, no newline")  # flushed before the process ends
end_process(3)
print("not reached")
"""


def test_end_process_joins_threads_runs_atexit_flushes_and_exits_with_the_code() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, no newlineworker done\natexit ran\n"
