"""Read a Megatron-LM argument list: a file of flags, or a launch script in the style of its
``examples/*/train_*.sh`` (shell variables, arrays of flags, ``torchrun ... pretrain_gpt.py``;
the ``pretrain_*.py`` entry scripts it names are kept).

What is understood of the shell: line continuations, comments, ``NAME=value`` and
``export NAME=value`` (the last assignment wins), ``$NAME``, ``${NAME}``, ``${NAME:-default}``,
the positional ``$1 … $9`` (from ``script_args``), and quoted array elements holding several
words (``"--fp8-format hybrid"``). A flag is a token starting with ``--``; its values are the
tokens after it up to the next flag or shell syntax. Both branches of an ``if`` are read (the
flags of each appear; :class:`MegatronArgs` keeps every occurrence, the caller reports
repeats). Nothing is executed and the environment is not read: a variable the script does not
set keeps its ``${...:-default}`` or stays unresolved (``$NAME`` in the value).

No torch import.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Flag", "MegatronArgs", "read_megatron_args"]

_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_]\w*)(\+?)=(.*)$")
_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")
_ENTRY = re.compile(r"^[\w./-]*pretrain_\w+\.py$")  # Megatron-LM's entry scripts
# commands that wrap the launcher on its line; their options are theirs
_WRAPPERS = {"srun", "mpirun", "mpiexec", "nsys", "ncu", "numactl", "taskset", "nohup", "time"}
_LAUNCHERS = {"torchrun", "python", "python3"}
_OUTPUT_COMMANDS = {"echo", "printf"}
# a case label of the script's own option parser: --data) or -d|--data)
_LABEL = re.compile(r"^-{1,2}[\w-]+(\|-{1,2}[\w-]+)*\)$")
_SHELL_WORDS = {"(", ")", "\\", "then", "fi", "do", "done", "else", "]]", "]", ";", "&&", "||"}


@dataclass(frozen=True)
class Flag:
    """One ``--name value ...`` occurrence (name without the dashes, as written)."""

    name: str
    values: tuple[str, ...]
    line: int  # 1-based line of the source

    @property
    def text(self) -> str:
        return " ".join([f"--{self.name}", *self.values])


@dataclass
class MegatronArgs:
    """Every flag of the source in order, and the shell variables it set."""

    flags: list[Flag] = field(default_factory=list)
    variables: dict[str, str] = field(default_factory=dict)
    entry_scripts: list[str] = field(default_factory=list)  # pretrain_*.py words, in order
    # words of other commands on a launch line (srun, nsys, ...), by command: not Megatron's
    other_commands: list[tuple[str, str]] = field(default_factory=list)

    def last(self, name: str) -> Flag | None:
        """The last occurrence of ``--name`` (dashes or underscores alike), or None."""
        key = _key(name)
        found = [f for f in self.flags if _key(f.name) == key]
        return found[-1] if found else None

    def repeated(self) -> dict[str, list[Flag]]:
        """Flags given more than once (e.g. in both branches of an ``if``), by key."""
        seen: dict[str, list[Flag]] = {}
        for f in self.flags:
            seen.setdefault(_key(f.name), []).append(f)
        return {k: v for k, v in seen.items() if len(v) > 1}


def _key(name: str) -> str:
    return name.replace("_", "-")


def read_megatron_args(
    text: str, script_args: Sequence[str] = (), script_options: Sequence[str] = ()
) -> MegatronArgs:
    """Parse ``text`` (see the module docstring); ``script_args`` are ``$1``, ``$2``, ...;
    ``script_options`` the words given to the script's own option parser (``--data PATH``):
    inside its ``case`` block, the assignments of an option given take its value (``"$2"``) or
    their literal, those of an option not given are skipped, and its labels are no flags."""
    out = MegatronArgs(variables={str(i + 1): v for i, v in enumerate(script_args)})
    options = _given_options(script_options)
    labels: list[str] | None = None  # the case labels whose block this line is in
    for number, line in _logical_lines(text):
        stripped = line.strip()
        first = stripped.split(maxsplit=1)[0] if stripped else ""
        if _LABEL.match(first):
            labels = first[:-1].split("|")
            stripped = stripped[len(first) :].strip()
        if labels is not None:
            _case_statement(stripped, labels, options, out.variables)
            if stripped.endswith(";;") or first == "esac":
                labels = None
            continue
        match = _ASSIGN.match(stripped)
        if match and not match.group(3).startswith("("):
            words = _split(_expand(match.group(3), out.variables))
            out.variables[match.group(1)] = words[0] if words else ""
            continue
        if match:  # an array: its elements follow the "("
            stripped = match.group(3)[1:]
        words = _split(_expand(stripped, out.variables))
        if words and words[0] in _OUTPUT_COMMANDS:
            continue  # echo "  --data PATH   the data" is text
        words = _launch_words(words, out)
        out.entry_scripts += [w for w in words if _ENTRY.match(w)]
        out.flags.extend(_flags(words, number))
    return out


def _launch_words(words: list[str], out: MegatronArgs) -> list[str]:
    """``words`` from the launcher on (``torchrun``, ``python``): a command that wraps it
    (``srun --ntasks 8 torchrun ...``, ``nsys profile -t cuda python ...``) keeps its own
    options, recorded in ``out.other_commands``, not read as Megatron-LM's."""
    if not words or words[0] not in _WRAPPERS:
        return words
    start = next((i for i, w in enumerate(words) if w.rsplit("/", 1)[-1] in _LAUNCHERS), None)
    if start is None:
        start = next((i for i, w in enumerate(words) if _ENTRY.match(w)), len(words))
    out.other_commands.append((words[0], " ".join(words[1:start])))
    return words[start:]


def _given_options(words: Sequence[str]) -> dict[str, str | None]:
    """``--name value`` / ``--name`` words -> {name: value or None}."""
    given: dict[str, str | None] = {}
    for i, w in enumerate(words):
        if w.startswith("-"):
            value = (
                words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("-") else None
            )
            given[w] = value
    return given


def _case_statement(
    text: str, labels: list[str], options: dict[str, str | None], variables: dict[str, str]
) -> None:
    """One line of a ``case`` block of the script's option parser: its assignments, when one
    of ``labels`` was given (``"$2"``: the option's value; else the literal)."""
    given = [label for label in labels if label in options]
    if not given:
        return
    for part in text.rstrip(";").split(";"):
        match = _ASSIGN.match(part.strip())
        if not match:
            continue
        raw = match.group(3).strip().strip("\"'")
        value = options[given[0]] if raw in ("$2", "${2}") else raw
        if value is not None:
            variables[match.group(1)] = value


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Lines with backslash continuations joined, each with its first line's number."""
    lines, current, start = [], "", 1
    for number, raw in enumerate(text.splitlines(), start=1):
        if not current:
            start = number
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        lines.append((start, current + raw))
        current = ""
    if current:
        lines.append((start, current))
    return lines


def _expand(text: str, variables: dict[str, str]) -> str:
    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        if name in variables:
            return variables[name]
        if m.group(2) is not None:  # ${NAME:-default}
            return m.group(2).strip("\"'")
        return m.group(0)  # unresolved: left as written

    return _VAR.sub(value, text)


def _split(text: str) -> list[str]:
    """Shell words (comments dropped); an unbalanced quote falls back to whitespace."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        words = text.split("#", 1)[0].split()
    out: list[str] = []
    for w in words:  # a quoted array element "--flag value" is two words
        out.extend(shlex.split(w) if w.startswith("--") and " " in w else [w])
    return out


def _flags(words: list[str], line: int) -> list[Flag]:
    flags: list[Flag] = []
    name: str | None = None
    values: list[str] = []
    for w in [*words, ")"]:
        # a pattern value such as ([0]*3+[1]*5) is a value, not the end of an array; the entry
        # script (pretrain_gpt.py) ends the flags before it (torchrun's) and is no value
        closes = w.endswith(";") or (w.endswith(")") and "[" not in w)
        boundary = w.startswith("--") or w in _SHELL_WORDS or closes or bool(_ENTRY.match(w))
        if boundary and name is not None:
            flags.append(Flag(name, tuple(values), line))
            name, values = None, []
        if w.startswith("--") and len(w) > 2:
            name, eq, value = w[2:].partition("=")  # argparse's --flag=value
            if eq:
                values.append(value)
        elif name is not None and not boundary:
            values.append(w)
    return flags
