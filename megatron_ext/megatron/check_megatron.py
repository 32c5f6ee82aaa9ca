"""``megatron-ext recipe check-megatron PATH``: convert every GPT/MoE pretraining config of a
Megatron-LM checkout and compare each recipe with what Megatron-LM builds from the same flags.

The configs (:func:`discover`): the shell scripts under ``examples/`` that launch
``pretrain_gpt.py``, and the functional tests' ``model_config.yaml`` files under
``tests/functional_tests/test_cases/{gpt,moe}/`` (``MODEL_ARGS``, turned into flags as
Megatron-LM's CI does in ``_run_training.sh``: ``true`` is the bare switch, an empty value is
left out, a list is its items; ``ENV_VARS`` exported; ``MODE: inference`` / ``rl`` and an
empty ``MODEL_ARGS`` skipped).

Scripts read their paths from positional arguments or variables such as ``${DATA_PATH}`` that
CI sets: ``--var NAME=VALUE`` sets a variable before the config is read (as the environment
would: the script's own assignments still win), and a path flag whose value is still an
unresolved variable -- or a missing ``--data-path`` -- gets a placeholder path
(:data:`PLACEHOLDERS`), which the result states. Nothing is read at those paths.

Each case is then (:func:`check_file`): **refused** -- the converter's one-line reason
(Megatron-LM's parser or validation, a required flag, a model-changing flag the recipe
cannot express) -- **differs** -- the fields of :func:`.megatron_compare.compare` that are not
Megatron-LM's -- or **agree**.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext.errors import ConfigError
from megatron_ext.megatron.megatron_args import Flag, MegatronArgs, read_megatron_args

__all__ = ["PLACEHOLDERS", "CaseResult", "check_file", "discover", "table"]

#: the path a path flag gets when its value is an unresolved variable (nothing is read there)
PLACEHOLDERS = {
    "data-path": "/placeholder/data/corpus_text_document",
    "tokenizer-model": "/placeholder/tokenizer/tokenizer.model",
    "vocab-file": "/placeholder/tokenizer/gpt2-vocab.json",
    "merge-file": "/placeholder/tokenizer/gpt2-merges.txt",
    "save": "/placeholder/checkpoints",
    "load": "/placeholder/checkpoints",
    "tensorboard-dir": "/placeholder/tensorboard",
    "data-cache-path": "/placeholder/data-cache",
    "wandb-save-dir": "/placeholder/wandb",
    "per-split-data-args-path": "/placeholder/data/splits.json",
    "data-args-path": "/placeholder/data/args.txt",
    "pretrained-checkpoint": "/placeholder/pretrained",
}
_UNRESOLVED = re.compile(r"\$\{?\w+")
_TEST_CASES = "tests/functional_tests/test_cases"


@dataclass
class CaseResult:
    """One config's outcome."""

    path: str  # relative to the checkout
    status: str  # "agree", "refused" or "differs"
    reason: str = ""  # why refused
    fields: dict[str, list[str]] = field(default_factory=dict)  # differing fields, by area
    placeholders: list[str] = field(default_factory=list)  # "--data-path /placeholder/..."

    def detail(self) -> str:
        if self.status == "refused":
            return self.reason
        if self.status == "differs":
            return "; ".join(f"{area}: {', '.join(d)}" for area, d in self.fields.items())
        return ""


def discover(root: Path) -> list[Path]:
    """The GPT/MoE pretraining configs of a Megatron-LM checkout at ``root``, sorted."""
    found: list[Path] = []
    for script in sorted((root / "examples").rglob("*.sh")):
        text = script.read_text(encoding="utf-8", errors="replace")
        if "pretrain_gpt.py" in text and any(
            s.rsplit("/", 1)[-1] == "pretrain_gpt.py"
            for s in read_megatron_args(text).entry_scripts
        ):
            found.append(script)
    for kind in ("gpt", "moe"):
        for config in sorted((root / _TEST_CASES / kind).glob("*/model_config.yaml")):
            if _yaml_mode(config) == "pretraining":
                found.append(config)
    return found


def _load_yaml(path: Path) -> dict[str, Any]:
    """The YAML with every scalar as written (yq prints them so: ``5.0e-4``, not 0.0005; ``true``;
    an empty value ``""``), anchors and merge keys (``<<: *BASE``) resolved."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def text(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> str:
        return str(loader.construct_scalar(node))

    for tag in ("bool", "int", "float", "null", "timestamp"):
        Loader.add_constructor(f"tag:yaml.org,2002:{tag}", text)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)
    except yaml.YAMLError as err:
        raise ConfigError(f"not valid YAML ({str(err).splitlines()[0]})") from None
    return data if isinstance(data, dict) else {}


def _yaml_mode(path: Path) -> str:
    try:
        data = _load_yaml(path)
    except ConfigError:
        return "pretraining"  # read and refused as a case
    # no MODEL_ARGS (or an empty one): a test that runs its own script, no Megatron-LM flags
    return str(data.get("MODE", "pretraining")) if data.get("MODEL_ARGS") else "none"


def yaml_script(path: Path) -> str:
    """A functional test's ``model_config.yaml`` as the launch line Megatron-LM's CI runs:
    ``ENV_VARS`` exported, ``MODEL_ARGS`` after ``pretrain_gpt.py`` (``true``: the switch; an
    empty value: left out; a list: its items)."""
    data = _load_yaml(path)
    lines = [f"export {k}={shlex.quote(str(v))}" for k, v in (data.get("ENV_VARS") or {}).items()]
    words = ["pretrain_gpt.py"]
    for key, value in (data.get("MODEL_ARGS") or {}).items():
        if value is None or value == "":
            continue
        words.append(str(key))
        if value == "true":  # the bare switch
            continue
        text = str(value)
        if isinstance(value, list):  # its items, each a word
            words += [f'"{v}"' for v in value]
        elif re.fullmatch(r"\[[^]]+\]", text):  # the CI strips the brackets: several words
            words.append(text[1:-1])
        else:  # quoted as the CI quotes it: a value with spaces stays one word
            words.append(f'"{text}"')
    return "\n".join([*lines, " \\\n  ".join(words)]) + "\n"


def read_case(path: Path, variables: dict[str, str]) -> tuple[MegatronArgs, list[str]]:
    """The flags of one config with ``variables`` set first, and the placeholders given."""
    text = yaml_script(path) if path.suffix == ".yaml" else path.read_text(encoding="utf-8")
    head = "".join(f"{k}={shlex.quote(v)}\n" for k, v in variables.items())
    args = read_megatron_args(head + text)
    given: list[str] = []
    flags: list[Flag] = []
    for flag in args.flags:
        key = flag.name.replace("_", "-")
        if key in PLACEHOLDERS and any(_UNRESOLVED.search(v) for v in flag.values):
            flag = dataclasses.replace(flag, values=(PLACEHOLDERS[key],))
            given.append(f"--{key} {PLACEHOLDERS[key]} (for {' '.join(args.last(key).values)})")  # type: ignore[union-attr]
        flags.append(flag)
    args.flags = flags
    if args.last("data-path") is None:  # e.g. --mock-data only: the recipe trains on a path
        line = flags[-1].line if flags else 1
        args.flags.append(Flag("data-path", (PLACEHOLDERS["data-path"],), line))
        given.append(f"--data-path {PLACEHOLDERS['data-path']} (the config has none)")
    return args, given


def check_file(
    path: Path, root: Path, variables: dict[str, str], world_size: int | None, gpu: str
) -> CaseResult:
    """Convert ``path`` and compare the recipe with Megatron-LM's run (module docstring)."""
    from megatron_ext.config.load import recipe_from_dict
    from megatron_ext.megatron.from_megatron import convert
    from megatron_ext.megatron.from_megatron_parsed import script_world_size
    from megatron_ext.megatron.megatron_compare import compare

    name = str(path.relative_to(root))
    try:
        args, given = read_case(path, variables)
        conversion = convert(args, world_size=world_size, gpu=gpu)
        if conversion.model_changing:
            dropped = "; ".join(
                f"{flag} ({reason})"
                for flag, reason in conversion.unmapped
                if flag in conversion.model_changing
            )
            raise ConfigError(f"model-changing flag(s) the recipe cannot express: {dropped}")
        recipe = recipe_from_dict(conversion.recipe)
        size = script_world_size(args, world_size)[0]
        recipe.check(size)
    except (ConfigError, UnicodeDecodeError) as err:
        return CaseResult(name, "refused", reason=_one_line(str(err)))
    differ = compare(recipe, conversion.megatron, size)
    return CaseResult(name, "differs" if differ else "agree", fields=differ, placeholders=given)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def totals(results: list[CaseResult]) -> dict[str, Any]:
    counts = {s: sum(r.status == s for r in results) for s in ("agree", "refused", "differs")}
    share = counts["agree"] / len(results) if results else 0.0
    return {"files": len(results), **counts, "agree_share": round(share, 4)}


def table(results: list[CaseResult]) -> str:
    """A Markdown table of the results and the total."""
    lines = ["| file | result | why / fields |", "|---|---|---|"]
    for r in results:
        detail = r.detail().replace("|", "\\|")
        lines.append(f"| `{r.path}` | {r.status} | {detail} |")
    t = totals(results)
    lines.append("")
    lines.append(
        f"{t['files']} files: {t['agree']} agree, {t['refused']} refused, {t['differs']} differ "
        f"({100 * t['agree_share']:.1f}% agree)"
    )
    return "\n".join(lines)


def as_json(results: list[CaseResult], root: Path, gpu: str) -> dict[str, Any]:
    return {
        "root": str(root),
        "gpu": gpu,
        "placeholders": PLACEHOLDERS,
        "cases": [dataclasses.asdict(r) for r in results],
        "total": totals(results),
    }
