"""Every ``megatron-ext`` command the README and ``docs/*.md`` show, run as written (issue 38).

The commands are read from the pages themselves: each line of a fenced code block that starts
with ``megatron-ext`` (or ``$ megatron-ext``; ``\\`` continues it), and each inline code span
that does. Each one is then, by what it is:

* **run as written**, in-process (:func:`megatron_ext.launch.cli.main`) in an empty folder:
  ``plan``, ``launch`` (with ``--dry-run`` added: the launch's every check, nothing started;
  a training run is no test), ``--help``, ``docs results --check``. It must exit 0, or, where
  the page shows the command's error under it (``megatron-ext: error: ...``), fail with that
  error;
* **its ``--help``**, where the command is written with placeholders (``RECIPE``, ``HF_DIR``,
  ``N``, ``a|b``, ``...``): the command and action it names must exist;
* **not run**, with the reason (a benchmark of minutes, a run that needs a trained model, the
  user's own corpus, ...): :data:`NOT_RUN` lists the reasons; each command gets one.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_cli_probes import run_in_process

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
INLINE = re.compile(r"`(megatron-ext(?: [^`]*)?)`")
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")

#: why a command is not run, by its sub-command (or first words)
NOT_RUN = {
    "make": "a make target: `make demo` trains for minutes, `make test` is the suite itself",
    "bench": "a benchmark (minutes on a CPU); tests/test_bench_*.py run each with --quick",
    "train": "a rank's entry point: torchrun starts it (tests/test_training.py)",
    "soma eval": "needs a trained soma_tiny run (tests/test_soma_inference.py trains one)",
    "soma generate": "needs a trained soma_tiny run (tests/test_soma_inference.py trains one)",
    "soma variance": "measures the estimator for minutes (tests/test_soma_variance.py)",
    "dipaco worker": "joins a running DiPaCo job (tests/test_dipaco_trainer.py)",
    "data": "builds from the user's corpus (tests/test_data.py builds small ones)",
    "recipe": "reads Megatron-LM's example script (tests/test_from_megatron.py converts it)",
    "docs results": "rewrites docs/results (make results); `docs results --check` is run",
}


#: commands with actions: ``megatron-ext ckpt upgrade`` alone names the action in prose
ACTIONS = ("ckpt", "data", "convert", "tools", "soma", "dipaco", "docs", "recipe", "bench")
#: commands the prose around them says are refused, and a word of the one-line error
REFUSED = {"megatron-ext launch soma_tiny optimizer.name=muon": "optimizer"}


@dataclass(frozen=True)
class Shown:
    """One command as a page shows it; ``error``: the error line the page shows under it."""

    page: str
    text: str
    error: str = ""

    def __str__(self) -> str:
        return f"{self.page}: {self.text}"


def shown_commands() -> list[Shown]:
    """Every command of the pages, in page order, duplicates kept once."""
    found: dict[str, Shown] = {}
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        name = str(page.relative_to(ROOT))
        for block in FENCE.findall(text):
            lines = block.replace("\\\n", " ").splitlines()
            for i, line in enumerate(lines):
                line = line.removeprefix("$ ").strip()
                if line.split(" ", 1)[0] not in ("megatron-ext", "make"):
                    continue
                after = lines[i + 1] if i + 1 < len(lines) else ""
                error = after if after.startswith("megatron-ext: error:") else ""
                found.setdefault(f"{name}:{line}", Shown(name, line, error))
        prose = re.sub(FENCE, "", text).replace("\n", " ")
        for span in INLINE.findall(prose):
            found.setdefault(f"{name}:{span}", Shown(name, span.strip()))
    return list(found.values())


def plan_for(shown: Shown) -> tuple[str, list[str]]:
    """("run", argv) / ("help", argv of its --help) / ("skip", [reason])."""
    try:
        words = shlex.split(shown.text, comments=True)
    except ValueError:  # an inline span cut at a quote (the prose's own `...`)
        words = shown.text.split()
    for stop in (">", "|"):  # a shell redirection: the output is captured here anyway
        if stop in words:
            words = words[: words.index(stop)]
    if words[0] == "make":
        return "skip", [NOT_RUN["make"]]
    argv = words[1:]
    head = argv[:2]
    for key in (" ".join(head), " ".join(head[:1])):
        if key in NOT_RUN and not (key == "docs results" and "--check" in argv):
            return "skip", [NOT_RUN[key]]
    placeholders = [w for w in argv if _has_placeholder(w)]
    reference = len(argv) <= 1 or (len(argv) == 2 and argv[0] in ACTIONS and argv[1] != "--help")
    if placeholders or reference:  # a command named in prose, or a synopsis
        named = [w for w in argv[:2] if not _has_placeholder(w) and not w.startswith("-")]
        return "help", [*named, "--help"]
    if argv[0] == "launch" and "--dry-run" not in argv:
        argv = [*argv, "--dry-run"]
    return "run", argv


def _has_placeholder(word: str) -> bool:
    if word in ("...", "[key=value", "...]") or "|" in word or word.startswith("["):
        return True
    return any(PLACEHOLDER.fullmatch(part) for part in re.split(r"[/=:,.]", word) if part)


SHOWN = shown_commands()


def test_the_pages_show_commands_of_every_kind() -> None:
    kinds = [plan_for(s)[0] for s in SHOWN]
    assert len(SHOWN) >= 50 and kinds.count("run") >= 8 and kinds.count("help") >= 10


@pytest.mark.parametrize("shown", SHOWN, ids=str)
def test_a_documented_command_runs_as_written(shown: Shown, tmp_path: Path) -> None:
    kind, argv = plan_for(shown)
    if kind == "skip":
        pytest.skip(f"not run: {argv[0]}")
    (tmp_path / "docs").symlink_to(ROOT / "docs")  # `docs results --check` reads docs/results
    code, out, err = run_in_process(argv, tmp_path)
    if shown.error:  # the page shows the command failing: it must fail with that error
        assert code == 2 and err.splitlines()[0][:60] == shown.error[:60], err
        return
    if shown.text in REFUSED:  # the prose says it is refused
        assert code == 2 and REFUSED[shown.text] in err, err
        return
    assert code == 0, f"{shown}\n{err}"
    if kind == "help":
        assert out.startswith("usage: megatron-ext"), out
    assert not list(tmp_path.glob("runs/*/checkpoints")), "a documented dry run trained"
