"""The error boundary around every ``megatron-ext`` command, and its command-line parsing.

* **Parsing**: one-line argparse errors (``megatron-ext launch: error: ... (see megatron-ext
  launch --help)``, exit 2, no usage block), and ``key=value`` overrides accepted anywhere after
  the recipe, options before, between or after them (argparse alone takes a positional list
  only in one piece: ``launch R --dry-run run_dir=X`` would be "unrecognized arguments").
* **Errors**: a :class:`~megatron_ext.errors.ConfigError` (the user's mistake) is one stderr
  line and exit 2; an ``OSError`` on a named file the user pointed at (missing, not writable, a
  folder where a file belongs, a full disk) is the same one line; a broken pipe
  (``plan ... | head -1``) ends quietly; Ctrl-C is one line and 130. Anything else is an
  internal error and keeps its traceback. ``--verbose`` (anywhere on the command line, or
  ``MEGATRON_EXT_VERBOSE=1``) shows the traceback of the one-line errors too.

Torch-free, like the rest of the launcher.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from megatron_ext.errors import ConfigError
from megatron_ext.progress import QUIET_VAR
from megatron_ext.verbosity import VERBOSE_VAR, is_verbose

__all__ = ["OneLineParser", "guarded", "parse_command_line", "take_verbose_flag"]

#: exit codes: a user error, an interrupt (128 + SIGINT), a closed pipe (128 + SIGPIPE)
USER_ERROR, INTERRUPTED, BROKEN_PIPE = 2, 130, 141

#: the ``OSError``s that say something about a path the user gave, not about this program
_PATH_ERRNOS = {
    errno.ENOENT,
    errno.EACCES,
    errno.EPERM,
    errno.EISDIR,
    errno.ENOTDIR,
    errno.EEXIST,
    errno.ENOSPC,
    errno.EROFS,
    errno.ENAMETOOLONG,
    errno.ENOTEMPTY,
}


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line naming the command and where its options
    are listed (sub-parsers inherit the class: ``add_subparsers`` uses ``type(self)``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def take_verbose_flag(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--verbose`` and ``--quiet`` (both global, anywhere on the line): a
    given ``--verbose`` sets ``MEGATRON_EXT_VERBOSE=1`` for this process and the ranks it
    starts (their library noise is shown too); ``--quiet`` sets ``MEGATRON_EXT_QUIET=1`` (no
    progress bars or status lines, on a terminal too)."""
    flags = {"--verbose": VERBOSE_VAR, "--quiet": QUIET_VAR}
    for flag in set(argv) & flags.keys():
        os.environ[flags[flag]] = "1"
    return [a for a in argv if a not in flags]


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; ``key=value`` words argparse left over join the command's overrides (in
    the order given), anything else left over is an error."""
    args, extra = parser.parse_known_args(argv)
    if hasattr(args, "overrides"):
        words = [a for a in extra if "=" in a and not a.startswith("-")]
        args.overrides = [*(args.overrides or []), *words]
        extra = [a for a in extra if a not in words]
    if extra:
        prog = f"{parser.prog} {getattr(args, 'command', '')}".strip()
        hint = ""
        if not hasattr(args, "overrides") and any("=" in a for a in extra):
            hint = "; this command takes no key=value overrides"
        print(
            f"{prog}: error: unrecognized arguments: {' '.join(extra)}{hint} (see {prog} --help)",
            file=sys.stderr,
        )
        raise SystemExit(USER_ERROR)
    return args


def guarded(run: Callable[[], int]) -> int:
    """``run()``'s exit code, with the boundary's handling of errors (module docstring)."""
    try:
        code = run()
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's teardown
        return code
    except ConfigError as exc:
        return _one_line(str(exc), exc)
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except KeyboardInterrupt:
        print("megatron-ext: interrupted", file=sys.stderr)
        return INTERRUPTED
    except OSError as exc:
        if exc.errno not in _PATH_ERRNOS or not exc.filename:
            raise
        where = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 else "")
        return _one_line(
            f"{where}: {exc.strerror}: check the path and its permissions, or give another", exc
        )


def _one_line(message: str, exc: BaseException) -> int:
    if is_verbose():
        traceback.print_exception(exc)
    first, *rest = message.splitlines() or [""]
    text = " ".join([first, *(line.strip() for line in rest)])  # one line, whatever raised it
    print(f"megatron-ext: error: {text}", file=sys.stderr)
    return USER_ERROR


def _quiet_broken_pipe() -> int:
    """The reader went away: point stdout at /dev/null so the interpreter's final flush does
    not raise again, and end as a process killed by SIGPIPE would report."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured in-process)
        pass
    finally:
        os.close(devnull)
    return BROKEN_PIPE
