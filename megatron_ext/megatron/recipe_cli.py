"""``megatron-ext recipe from-megatron-args ARGS_FILE_OR_SCRIPT -o recipe.yaml``: a recipe from a
Megatron-LM argument list or launch script (:mod:`megatron_ext.megatron.from_megatron`).

The flags go through Megatron-LM's own ``parse_args`` + ``validate_args``
(:mod:`megatron_ext.megatron.megatron_parse`) at the script's world size (``--world-size``
otherwise), its GPU queries answered for ``--gpu`` (default H100). The recipe it writes starts
with comments naming every flag it could not map (with the reason), the torchrun flags (as
``megatron-ext launch`` options) and its notes; the same lists go to stderr. Megatron-LM's
refusal (an unknown flag, a bad combination), a missing required flag, a recipe that does not
validate, a flag that builds another model than the recipe can describe (fp16 with loss
scaling, a tokenizer megatron-ext does not read, ...:
:data:`~megatron_ext.megatron.megatron_flags.MODEL_CHANGING`) without ``--allow-unmapped``, an
unreadable source or an unwritable output is one line and exit code 2 (nothing written). Torch
and Megatron-LM are imported only to convert.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from megatron_ext.atomic import atomic_path, check_output_path
from megatron_ext.commands import Command
from megatron_ext.config.load import recipe_from_dict
from megatron_ext.errors import ConfigError
from megatron_ext.megatron.from_megatron import Conversion, convert
from megatron_ext.megatron.megatron_args import read_megatron_args

__all__ = ["add_arguments", "recipe_main", "render"]

# torchrun flag -> megatron-ext launch option (master_addr/port: the rendezvous endpoint)
LAUNCH_OPTIONS = {"nproc-per-node": "--nproc-per-node", "nnodes": "--nnodes"}
LAUNCH_OPTIONS |= {"node-rank": "--node-rank", "rdzv-id": "--rdzv-id"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="recipe_command", metavar="ACTION", required=True)
    p = sub.add_parser(
        "from-megatron-args",
        help="write a recipe from a Megatron-LM argument list or launch script",
        description="Map Megatron-LM flags (model, MoE, batch and step schedule, LR schedule, "
        "precision, parallel sizes, optimizer, data) onto a recipe; every flag it cannot map is "
        "listed with the reason.",
    )
    p.add_argument("source", help="a file of Megatron-LM flags, or a launch script (.sh)")
    p.add_argument("-o", "--output", required=True, help="the recipe YAML to write")
    p.add_argument(
        "--script-args",
        nargs="*",
        default=[],
        metavar="ARG",
        help="the script's positional arguments ($1, $2, ...), e.g. checkpoint and data paths",
    )
    p.add_argument(
        "--script-options",
        default="",
        metavar="'OPTIONS'",
        help="the options of a script that parses its own (a while/case over $1), as one "
        "quoted string: --script-options '--data data/doc --tokenizer tok/'",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="ranks to validate the flags at when the script's torchrun sizes are not resolved "
        "(default: the smallest the parallel sizes allow)",
    )
    p.add_argument(
        "--gpu",
        default="H100",
        help="the GPU the script targets: Megatron-LM's GPU queries are answered for it on a "
        "CPU host (default H100)",
    )
    p.add_argument(
        "--allow-unmapped",
        action="store_true",
        help="write the recipe even when a flag that changes the model cannot be expressed "
        "(each such flag is a comment in the recipe): the run then trains another model",
    )
    _add_check_arguments(sub)


def _add_check_arguments(sub: Any) -> None:
    c = sub.add_parser(
        "check-megatron",
        help="convert every GPT/MoE pretraining config of a Megatron-LM checkout and compare "
        "each recipe with what Megatron-LM builds from the same flags",
        description="Per file: agree, refused (why) or differs (the fields), and the total. "
        "Compared: the TransformerConfig, optimizer config, LR at chosen steps, batch stages and "
        "parallel sizes. Exit 0 when no file differs, 1 when one does, 2 on bad input.",
    )
    c.add_argument("path", help="the root of a Megatron-LM checkout (examples/, tests/)")
    c.add_argument(
        "--var",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a variable the configs read (${DATA_PATH}), set before each is read; a path flag "
        "still unresolved gets a placeholder path, stated per file",
    )
    c.add_argument("--json", action="store_true", help="print the results as JSON")
    c.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="ranks to validate at where a config's torchrun sizes are not resolved",
    )
    c.add_argument("--gpu", default="H100", help="the GPU the configs target (default H100)")


def recipe_main(args: argparse.Namespace) -> int:
    if args.recipe_command == "check-megatron":
        return check_main(args)
    source = Path(args.source)
    if not source.is_file():
        raise ConfigError(f"{source}: no such file (give a file of Megatron-LM flags or a script)")
    text = _read_text(source)
    # before the conversion (seconds: Megatron-LM's parser), so nothing is written when it cannot be
    output = check_output_path(args.output, "-o")
    if not output.parent.is_dir():
        raise ConfigError(
            f"-o {output}: the folder {output.parent} does not exist (create it first)"
        )
    options = shlex.split(args.script_options)
    try:
        conversion = convert(
            read_megatron_args(text, args.script_args, options),
            world_size=args.world_size,
            gpu=args.gpu,
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if conversion.model_changing and not args.allow_unmapped:
        dropped = "; ".join(
            f"{flag} ({reason})"
            for flag, reason in conversion.unmapped
            if flag in conversion.model_changing
        )
        raise ConfigError(
            f"the script trains a model, or reads data, that megatron-ext cannot express: "
            f"{dropped}; nothing written (pass "
            f"--allow-unmapped to write the recipe without them, as comments in it)"
        )
    recipe = recipe_from_dict(conversion.recipe)  # a bad value stops here, nothing written
    recipe.check()
    text = render(conversion, str(source))
    with atomic_path(args.output) as tmp:
        tmp.write_text(text, encoding="utf-8")
    summary = [
        f"wrote {args.output}: {len(conversion.mapped)} flags mapped, "
        f"{len(conversion.launcher)} for the launcher, {len(conversion.unmapped)} not mapped",
        *(line[2:] for line in _comments(conversion)),
    ]
    print("\n".join(summary), file=sys.stderr)
    return 0


def check_main(args: argparse.Namespace) -> int:
    """``recipe check-megatron``: the table (or JSON) on stdout, one line per file on stderr
    as it goes."""
    import json

    from megatron_ext.megatron.check_megatron import as_json, check_file, discover, table

    root = Path(args.path)
    if not root.is_dir():
        raise ConfigError(f"{root}: not a folder (give the root of a Megatron-LM checkout)")
    variables = {}
    for item in args.var:
        name, eq, value = item.partition("=")
        if not eq or not name.isidentifier():
            raise ConfigError(f"--var {item}: give NAME=VALUE (e.g. --var DATA_PATH=/data)")
        variables[name] = value
    configs = discover(root)
    if not configs:
        raise ConfigError(
            f"{root}: no GPT/MoE pretraining config under examples/ or "
            "tests/functional_tests/test_cases/{gpt,moe}/ (give a Megatron-LM checkout's root)"
        )
    results = []
    for i, path in enumerate(configs, start=1):
        result = check_file(path, root, variables, args.world_size, args.gpu)
        print(f"[{i}/{len(configs)}] {result.path}: {result.status}", file=sys.stderr)
        results.append(result)
    if args.json:
        print(json.dumps(as_json(results, root, args.gpu), indent=1))
    else:
        print(table(results))
    return 1 if any(r.status == "differs" for r in results) else 0


def _read_text(source: Path) -> str:
    """The script's text; an unreadable or binary file is a ConfigError."""
    try:
        data = source.read_bytes()
    except OSError as err:
        raise ConfigError(f"{source}: cannot be read ({err.strerror})") from None
    if b"\0" in data:
        raise ConfigError(f"{source}: a binary file, not a launch script or a list of flags")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not UTF-8 text, not a launch script") from None


def launch_options(conversion: Conversion) -> list[str]:
    """torchrun's flags as ``megatron-ext launch`` options."""
    values = {}
    for text in conversion.launcher:
        name, *rest = text[2:].split(" ", 1)
        values[name.replace("_", "-")] = rest[0] if rest else ""
    options = [f"{LAUNCH_OPTIONS[k]} {v}" for k, v in values.items() if k in LAUNCH_OPTIONS]
    if "master-addr" in values:
        port = values.get("master-port", "29500")
        options.append(f"--rdzv-endpoint {values['master-addr']}:{port}")
    return options


def _comments(conversion: Conversion) -> list[str]:
    lines = []
    if conversion.launcher:
        lines.append(
            f"# launcher flags: megatron-ext launch RECIPE {' '.join(launch_options(conversion))}"
        )
    lines.append(f"# not mapped ({len(conversion.unmapped)}):")
    lines += [
        f"#   {flag}: {reason}"
        + (
            " -- DROPPED: the recipe trains another model"
            if flag in conversion.model_changing
            else ""
        )
        for flag, reason in conversion.unmapped
    ]
    lines += [f"# note: {note}" for note in conversion.notes]
    return lines


def render(conversion: Conversion, source: str) -> str:
    """The recipe YAML with its comment header."""
    head = [f"# from {source} by `megatron-ext recipe from-megatron-args`", *_comments(conversion)]
    body = yaml.safe_dump(_schema_order(conversion.recipe), sort_keys=False)
    return "\n".join(head) + "\n" + body


def _schema_order(recipe: dict[str, Any]) -> dict[str, Any]:
    """Sections and their keys in the schema's order (as a recipe file reads): the run fields,
    then the trainer's sections in its registration's order."""
    import dataclasses
    import typing

    from megatron_ext.config.optimizer import option_keys
    from megatron_ext.config.schema import Recipe
    from megatron_ext.config.trainers import get_trainer, recipe_sections

    hints = typing.get_type_hints(Recipe)
    kinds = {f.name: hints[f.name] for f in dataclasses.fields(Recipe)}
    kinds |= recipe_sections(get_trainer(recipe.get("trainer", "gpt")))
    out: dict[str, Any] = {}
    for name, kind in kinds.items():
        if name not in recipe:
            continue
        value = recipe[name]
        if isinstance(value, dict) and dataclasses.is_dataclass(kind):
            order = [g.name for g in dataclasses.fields(kind)]
            if "options" in order:  # the optimizer section writes its options flat
                order = [*order, *option_keys()]
            value = {k: value[k] for k in sorted(value, key=order.index)}
        out[name] = value
    return out


#: The ``megatron_ext.commands`` entry point ``recipe`` (setup.py).
COMMAND = Command(
    name="recipe",
    usage="from-megatron-args ... | check-megatron PATH",
    help="recipes from Megatron-LM argument lists; check them against a Megatron-LM checkout",
    add_arguments=add_arguments,
    run=recipe_main,
)
