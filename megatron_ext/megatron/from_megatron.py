"""A megatron-ext recipe from Megatron-LM's flags (``megatron-ext recipe from-megatron-args``).

:func:`convert` maps the flags of Megatron-LM's pretraining scripts (read by
:mod:`.megatron_args`) onto the recipe: model shape, GQA, MoE, sequence, batch (including
``--step-batch-size-schedule``), run length, LR schedule (WSD too), precision, parallel sizes,
optimizer, data and tokenizer paths, logging, evaluation and checkpoint intervals. A field the
script does not set gets **Megatron-LM's default** where it differs from the recipe's (e.g.
LayerNorm, learned absolute positions, GeLU, biases, tied embeddings, dropout 0.1, linear decay,
``adam_beta2`` 0.999), so the recipe describes the run the script would have made.

Every flag ends up in exactly one list: mapped, for the launcher (torchrun's own flags: give
them to ``megatron-ext launch``), or **not mapped, with the reason** — none is dropped silently.
A required flag that is missing or whose value is an unresolved shell variable is a
ConfigError (exit 2). Sample counts become steps through the recipe's own batch stages
(:mod:`megatron_ext.schedules`), inexact ones are noted. Choice spellings that differ between
Megatron-LM (Emerging-Optimizers) and megatron-ext are translated once, here
(:mod:`.megatron_flags`; the drop-in optimizer uses them too). The flags read together (a
low-precision format and its recipe, the MoE layer pattern, data and tokenizer, sample counts)
are mapped by :mod:`.from_megatron_groups`.

Megatron-LM's own parser then reads the same flags (:mod:`.from_megatron_parsed`): its
refusals are the converter's, and what it derives (sequence parallelism at TP=1, the tokenizer
default, the whole ``TransformerConfig``) is taken from it. Torch is imported only there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_ext.errors import ConfigError
from megatron_ext.megatron.from_megatron_groups import (
    flag_value,
    map_data,
    map_low_precision,
    map_moe_layer_freq,
    map_samples,
)
from megatron_ext.megatron.megatron_args import Flag, MegatronArgs
from megatron_ext.megatron.megatron_flags import (
    CONSUMED,
    ENTRY_SCRIPTS,
    MEGATRON_DEFAULTS,
    MODEL_CHANGING,
    PLAIN,
    READ_TOGETHER,
    REASONS,
    REQUIRED,
    TORCHRUN,
    megatron_optimizers,
    optimizer_flag_defaults,
    optimizer_flags,
)
from megatron_ext.optimizers.spec import registered_optimizers

__all__ = ["Conversion", "convert", "translate"]


@dataclass
class Conversion:
    """A recipe (nested dict) and where every flag went."""

    recipe: dict[str, Any] = field(default_factory=dict)
    mapped: list[str] = field(default_factory=list)  # flags as written
    launcher: list[str] = field(default_factory=list)  # torchrun flags
    unmapped: list[tuple[str, str]] = field(default_factory=list)  # (flag, reason)
    notes: list[str] = field(default_factory=list)
    # unmapped flags that build another model (MODEL_CHANGING): refused unless allowed
    model_changing: list[str] = field(default_factory=list)
    megatron: Any = None  # Megatron-LM's namespace after parse_args + validate_args

    def drop(self, flag: Flag, reason: str, changes_model: bool | None = None) -> None:
        """``flag`` is not mapped, for ``reason``; a model-changing one (``changes_model``; None:
        a flag of :data:`MODEL_CHANGING`) is also recorded."""
        self.unmapped.append((flag.text, reason))
        if changes_model is None:
            changes_model = flag.name.replace("_", "-") in MODEL_CHANGING
        if changes_model:
            self.model_changing.append(flag.text)

    def set(self, path: str, value: Any) -> None:
        node = self.recipe
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    def get(self, path: str, default: Any = None) -> Any:
        node: Any = self.recipe
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node


def translate(table: dict[str, str], value: str, what: str) -> str:
    """Megatron-LM's spelling of a choice -> megatron-ext's; ConfigError when it has none."""
    if value not in table:
        raise ConfigError(
            f"{what}={value!r} has no counterpart in megatron-ext: use one of {', '.join(table)}"
        )
    return table[value]


def convert(args: MegatronArgs, world_size: int | None = None, gpu: str = "H100") -> Conversion:
    """The recipe for Megatron-LM flags ``args`` (see the module docstring), validated by
    Megatron-LM's own parser at the script's world size (else ``world_size``, else the
    smallest its parallel sizes allow) on a CPU host answering for ``gpu``."""
    from megatron_ext.megatron.from_megatron_parsed import apply_parsed, parse_script

    _check_entry_script(args)
    out = Conversion(recipe={"trainer": "gpt"})
    _check_required({k: args.last(k) for k in (*REQUIRED, *_RUN_LENGTH)})
    parsed, size, note = parse_script(args, world_size, gpu)
    out.megatron = parsed
    out.notes.append(note)
    for command, words in args.other_commands:
        out.notes.append(f"{command} {words}: {command}'s options, not Megatron-LM's: not read")
    for path, value in MEGATRON_DEFAULTS.items():
        out.set(path, value)
    keys = dict.fromkeys(f.name.replace("_", "-") for f in args.flags)  # source order
    flags = {key: args.last(key) for key in keys}
    for key, repeats in args.repeated().items():
        if len({f.values for f in repeats}) == 1:
            continue  # the same value each time
        shown = ", ".join(repr(" ".join(f.values)) for f in repeats)
        out.notes.append(f"--{key} is given {len(repeats)} times ({shown}): the last is used")
    plain = plain_flags()
    for key, flag in flags.items():  # one field each first: the special ones read them
        if key in plain and flag is not None:
            _plain(out, flag, *plain[key])
    special = _special_flags(out, flags)
    for key, flag in flags.items():
        if key in special or key in plain or flag is None:
            continue
        if key in TORCHRUN:
            out.launcher.append(flag.text)
            if key == "master-port" and flag_value(flag) and flag_value(flag).isdigit():  # type: ignore[union-attr]
                out.set("launch.master_port", int(flag.values[0]))
        elif key in CONSUMED:
            out.mapped.append(flag.text)
        else:
            reason = MODEL_CHANGING.get(key) or REASONS.get(key, "no megatron-ext counterpart")
            out.drop(flag, reason)
    apply_parsed(out, args, parsed, size, gpu)  # last: it maps flags the tables left out
    return out


def _check_entry_script(args: MegatronArgs) -> None:
    """A script that runs another of Megatron-LM's entry points than GPT pretraining is refused
    (a BERT, T5 or multimodal model is not what a GPT recipe describes)."""
    others = [s for s in args.entry_scripts if s.rsplit("/", 1)[-1] not in ENTRY_SCRIPTS]
    if others:
        raise ConfigError(
            f"the script runs {others[0]}, not Megatron-LM's GPT pretraining "
            f"({' or '.join(ENTRY_SCRIPTS)}): megatron-ext converts GPT-style models only"
        )


_RUN_LENGTH = ("train-iters", "train-samples", "global-batch-size", "step-batch-size-schedule")


def _check_required(flags: dict[str, Flag | None]) -> None:
    """What the recipe needs (Megatron-LM's parser runs after: its own rules are its)."""
    missing = [f"--{k}" for k in REQUIRED if flags.get(k) is None]
    if flags.get("train-iters") is None and flags.get("train-samples") is None:
        missing.append("--train-iters or --train-samples")
    if flags.get("global-batch-size") is None and flags.get("step-batch-size-schedule") is None:
        missing.append("--global-batch-size or --step-batch-size-schedule")
    if missing:
        raise ConfigError(f"required Megatron-LM flag(s) missing: {', '.join(missing)}")
    unresolved = [
        flags[k].text  # type: ignore[union-attr]
        for k in (*REQUIRED, "train-iters", "train-samples", "global-batch-size")
        if flags.get(k) is not None and any("$" in v for v in flags[k].values)  # type: ignore[union-attr]
    ]
    if unresolved:
        raise ConfigError(
            f"required flag value(s) are unresolved shell variables: {'; '.join(unresolved)} "
            f"(pass the script's positional arguments with --script-args, or edit the script)"
        )


def _plain(out: Conversion, flag: Flag, path: str, kind: Callable[[str], Any] | None) -> None:
    if kind is None:
        if flag.values:
            out.drop(flag, "a switch given a value")
            return
        out.set(path, True)
    elif len(flag.values) != 1 or "$" in flag.values[0]:
        out.drop(flag, "needs exactly one resolved value")
        return
    else:
        try:
            value = kind(flag.values[0])
        except ValueError:
            out.drop(flag, f"not a valid {kind.__name__}")
            return
        choices = _field_metadata(path).get("choices")
        if choices and value not in choices:
            out.drop(flag, f"megatron-ext has {', '.join(map(str, choices))}")
            return
        out.set(path, value)
    out.mapped.append(flag.text)


@functools.cache
def _field_metadata(path: str) -> Any:
    """The recipe field's validation metadata (choices, bounds)."""
    import dataclasses
    import typing

    from megatron_ext.config.fields import literal_options
    from megatron_ext.config.optimizer import OptimizerConfig, option_field
    from megatron_ext.config.schema import Recipe
    from megatron_ext.config.trainers import trainer_sections

    *parents, leaf = path.split(".")
    run = typing.get_type_hints(Recipe)  # the run sections, else a trainer's
    cls: Any = Recipe
    if parents:
        section = parents.pop(0)
        cls = run[section] if section in run else trainer_sections()[section]
    for part in parents:
        cls = typing.get_type_hints(cls)[part]
    own = option_field(leaf) if cls is OptimizerConfig else None
    if own is not None:  # an optimizer's option, written flat (optimizer.muon_momentum)
        found, kind = own
    else:
        found = {f.name: f for f in dataclasses.fields(cls)}[leaf]
        kind = typing.get_type_hints(cls)[leaf]
    meta = found.metadata
    options = literal_options(kind)
    return {**meta, "choices": options} if options is not None else meta


def plain_flags() -> dict[str, tuple[str, Callable[[str], Any] | None]]:
    """Flag -> (recipe field, how its value is read) for the flags that set one field each:
    :func:`same_name_flags`, :data:`PLAIN`, and each optimizer spec's flags that are not a
    choice to translate."""
    own = {
        flag: (path, _flag_kind(path))
        for flag, (_, path, table) in optimizer_flags().items()
        if table is None
    }
    return {**same_name_flags(), **PLAIN, **own}


#: the recipe's sections whose fields a Megatron-LM flag of the same name sets (the optimizer's
#: are read from the parsed namespace: from_megatron_parsed._optimizer_fields)
SAME_NAME_SECTIONS = ("model", "training", "parallel", "data", "logging", "checkpoint")


@functools.cache
def same_name_flags() -> dict[str, tuple[str, Callable[[str], Any] | None]]:
    """The flags whose Megatron-LM namespace attribute (its own parser's ``dest``) is named as a
    scalar field of :data:`SAME_NAME_SECTIONS` or the recipe's ``seed``: flag -> (that field,
    how its value is read: None for a switch), except :data:`READ_TOGETHER`. A switch sets a
    bool field, a value flag any other."""
    from megatron_ext.megatron.megatron_parse import megatron_flag_dests

    fields = _scalar_fields()
    out: dict[str, tuple[str, Callable[[str], Any] | None]] = {}
    for flag, (dest, switch) in megatron_flag_dests().items():
        if flag in READ_TOGETHER or dest not in fields:
            continue
        path, kind = fields[dest]
        if switch == (kind is None):
            out[flag] = (path, kind)
    return out


def _scalar_fields() -> dict[str, tuple[str, Callable[[str], Any] | None]]:
    """field name -> (its path, how a flag's value is read) for the scalar fields (bool, int,
    float, str or a choice of strings, optional or not) of :data:`SAME_NAME_SECTIONS` and the
    top-level ``seed``; a name in two sections would be ambiguous (an internal error)."""
    import dataclasses
    import types
    import typing

    from megatron_ext.config.schema import Recipe
    from megatron_ext.megatron import sections

    def kind(hint: Any) -> Callable[[str], Any] | str | None:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            return kind(args[0]) if len(args) == 1 else "other"
        if typing.get_origin(hint) is typing.Literal:
            return str if all(isinstance(a, str) for a in args) else "other"
        if hint is bool:
            return None
        return hint if hint in (int, float, str) else "other"

    core = typing.get_type_hints(Recipe)  # seed, logging, checkpoint; the GPT sections:
    classes = {
        "model": sections.ModelConfig,
        "training": sections.TrainingConfig,
        "parallel": sections.ParallelConfig,
        "data": sections.DataConfig,
        "logging": core["logging"],
        "checkpoint": core["checkpoint"],
    }
    out: dict[str, tuple[str, Callable[[str], Any] | None]] = {}
    places: list[tuple[str, str, Any]] = [("", "seed", core["seed"])]
    for section in SAME_NAME_SECTIONS:
        cls = classes[section]
        for name, hint in typing.get_type_hints(cls).items():
            if name in {f.name for f in dataclasses.fields(cls)}:
                places.append((section + ".", name, hint))
    for prefix, name, hint in places:
        how = kind(hint)
        if how == "other":
            continue
        if name in out:
            raise ValueError(f"recipe field {name!r} is in two sections: {out[name][0]}, {prefix}")
        out[name] = (prefix + name, how)  # type: ignore[assignment]
    return out


def _flag_kind(path: str) -> Callable[[str], Any] | None:
    """How a flag's value is read for the recipe field ``path``: None for a switch (bool)."""
    from megatron_ext.config.optimizer import section_fields

    _, kind = section_fields()[path.removeprefix("optimizer.")]
    if kind is bool:
        return None
    return kind if kind in (int, float) else str


def _special_flags(out: Conversion, flags: dict[str, Flag | None]) -> set[str]:
    """The flags that are not one field each; returns the keys handled."""
    handled: set[str] = set()

    def take(key: str, reason: str | None = None, changes_model: bool | None = None) -> Flag | None:
        flag = flags.get(key)
        if flag is not None:
            handled.add(key)
            if reason is None:
                out.mapped.append(flag.text)
            else:
                out.drop(flag, reason, changes_model)
        return flag

    if take("swiglu"):
        out.set("model.activation", "swiglu")
    if take("disable-bias-linear"):
        out.set("model.add_bias_linear", False)
    if take("add-bias-linear"):
        out.set("model.add_bias_linear", True)
    gqa, groups = flags.get("group-query-attention"), flags.get("num-query-groups")
    if gqa is not None:
        take("group-query-attention")
        take("num-query-groups")
        out.set("model.num_query_groups", int(flag_value(groups) or 1))
    elif groups is not None:
        take("num-query-groups", "Megatron-LM ignores it without --group-query-attention")
    for key, value in (("bf16", "bf16"),):
        if take(key):
            out.set("training.precision", value)
    precision = out.get("training.precision", "fp32")
    if take("fp16"):  # its loss-scale flags: from_megatron_parsed._optimizer_fields
        out.set("training.precision", "fp16")
        precision = "fp16"
    map_low_precision(out, flags, take, precision)
    take("rotary-percent")  # model.rotary_percent: Megatron-LM's parsed value (apply_parsed)
    map_moe_layer_freq(out, flags, take)
    take("no-position-embedding")  # validate_args refuses it without RoPE; with it, a no-op
    seq = flag_value(flags.get("seq-length"))
    positions = flag_value(flags.get("max-position-embeddings"))
    if positions is not None:
        same = seq is not None and int(positions) >= int(seq)
        take("max-position-embeddings", None if same else "must be >= --seq-length")
    name = flag_value(flags.get("optimizer"))
    optimizers = megatron_optimizers()
    if name is not None:
        if name in optimizers:
            take("optimizer")
            out.set("optimizer.name", optimizers[name])
        else:
            take("optimizer", f"megatron-ext has {', '.join(sorted(set(optimizers.values())))}")
    chosen = registered_optimizers().get(str(out.get("optimizer.name")))
    if chosen is not None and chosen.update_rms_kwarg is not None:  # Muon, MOP, Lion
        out.set("optimizer.match_update_rms", False)
        out.notes.append(
            "optimizer.match_update_rms: false keeps Megatron-LM's update scale (megatron-ext's "
            "default scales every update to AdamW's RMS, one LR for all: set it true for that)"
        )
    for key, (_, path, table) in optimizer_flags().items():  # the specs' choice flags
        flag = flags.get(key)
        if flag is None or table is None:  # table None: a plain flag (plain_flags)
            continue
        given = flag_value(flag)
        if given is not None and given in table:
            take(key)
            out.set(path, table[given])
        elif given is not None:
            take(key, f"no counterpart; megatron-ext has {', '.join(table)}")
    if chosen is not None:  # Megatron-LM's defaults of the optimizer's flags where absent
        for path, value in optimizer_flag_defaults(chosen.name).items():
            if out.get(path) is None:
                out.set(path, value)
    map_data(out, flags, take)
    map_samples(out, flags, take)
    return handled
