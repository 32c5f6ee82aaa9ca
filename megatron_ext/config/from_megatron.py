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
(:mod:`.megatron_flags`; the drop-in optimizer uses them too).

Megatron-LM's own parser then reads the same flags (:mod:`.from_megatron_parsed`): its
refusals are the converter's, and what it derives (sequence parallelism at TP=1, the tokenizer
default, the whole ``TransformerConfig``) is taken from it. Torch is imported only there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_ext.config.megatron_args import Flag, MegatronArgs
from megatron_ext.config.megatron_flags import (
    CONSUMED,
    ENTRY_SCRIPTS,
    MEGATRON_DEFAULTS,
    MODEL_CHANGING,
    PLAIN,
    REASONS,
    REQUIRED,
    TORCHRUN,
    megatron_optimizers,
    optimizer_flag_defaults,
    optimizer_flags,
)
from megatron_ext.errors import ConfigError
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
    from megatron_ext.config.from_megatron_parsed import apply_parsed, parse_script

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
    for key, flag in flags.items():  # one field each first: the special ones read them
        if key in PLAIN and flag is not None:
            _plain(out, flag, *PLAIN[key])
    special = _special_flags(out, flags)
    for key, flag in flags.items():
        if key in special or key in PLAIN or flag is None:
            continue
        if key in TORCHRUN:
            out.launcher.append(flag.text)
            if key == "master-port" and _value(flag) and _value(flag).isdigit():  # type: ignore[union-attr]
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


def _flag_kind(path: str) -> Callable[[str], Any] | None:
    """How a flag's value is read for the recipe field ``path``: None for a switch (bool)."""

    from megatron_ext.config.optimizer import section_fields

    _, kind = section_fields()[path.removeprefix("optimizer.")]
    if kind is bool:
        return None
    return kind if kind in (int, float) else str


def _value(flag: Flag | None) -> str | None:
    return flag.values[0] if flag is not None and len(flag.values) == 1 else None


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
        out.set("model.num_query_groups", int(_value(groups) or 1))
    elif groups is not None:
        take("num-query-groups", "Megatron-LM ignores it without --group-query-attention")
    for key, value in (("bf16", "bf16"),):
        if take(key):
            out.set("training.precision", value)
    precision = out.get("training.precision", "fp32")
    if take("fp16"):  # written; the launcher refuses it (run/precision.py's FP16_REFUSAL)
        out.set("training.precision", "fp16")
        precision = "fp16"
    _low_precision(out, flags, take, precision)
    take("rotary-percent")  # model.rotary_percent: Megatron-LM's parsed value (apply_parsed)
    _moe_layer_freq(out, flags, take)
    take("no-position-embedding")  # validate_args refuses it without RoPE; with it, a no-op
    seq = _value(flags.get("seq-length"))
    positions = _value(flags.get("max-position-embeddings"))
    if positions is not None:
        same = seq is not None and int(positions) >= int(seq)
        take("max-position-embeddings", None if same else "must be >= --seq-length")
    init = _value(flags.get("lr-warmup-init"))
    if init is not None:
        take("lr-warmup-init", None if float(init) == 0.0 else "megatron-ext warms up from 0")
    name = _value(flags.get("optimizer"))
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
    for key, (_, path, table) in optimizer_flags().items():  # each optimizer spec's flags
        flag = flags.get(key)
        if flag is None:
            continue
        value = _value(flag)
        if table is None:  # one field: read as the plain flags are (_plain records it)
            handled.add(key)
            _plain(out, flag, path, _flag_kind(path))
        elif value is not None and value in table:
            take(key)
            out.set(path, table[value])
        elif value is not None:
            take(key, f"no counterpart; megatron-ext has {', '.join(table)}")
    if chosen is not None:  # Megatron-LM's defaults of the optimizer's flags where absent
        for path, value in optimizer_flag_defaults(chosen.name).items():
            if out.get(path) is None:
                out.set(path, value)
    _data(out, flags, take)
    _samples(out, flags, take)
    return handled


def _low_precision(
    out: Conversion, flags: dict[str, Flag | None], take: Callable[..., Any], base: str
) -> None:
    """``--fp8-format``/``--fp8-recipe`` (Megatron-LM's recipe default: delayed) or
    ``--fp4-format``/``--fp4-recipe`` (default nvfp4) as the one ``training.precision`` with
    those megatron-core fields (run/precision.py's table); a pair no precision has is refused
    like a model-changing flag."""
    from megatron_ext.run.precision import SPECS

    fp8, fp4 = _value(flags.get("fp8-format")), _value(flags.get("fp4-format"))
    if fp8 is None and fp4 is None:
        for key in ("fp8-recipe", "fp4-recipe"):
            take(key, "megatron-core reads it only with its format flag", changes_model=False)
        return
    if fp8 is not None:
        wanted = {"fp8": fp8, "fp8_recipe": _value(flags.get("fp8-recipe")) or "delayed"}
    else:
        wanted = {"fp4": fp4, "fp4_recipe": _value(flags.get("fp4-recipe")) or "nvfp4"}
    found = [s.name for s in SPECS.values() if all(getattr(s, k) == v for k, v in wanted.items())]
    keys = ("fp8-format", "fp8-recipe") if fp8 is not None else ("fp4-format", "fp4-recipe")
    if found and base == "bf16":
        for key in keys:
            take(key)
        out.set("training.precision", found[0])
        return
    shown = ", ".join(f"{k}={v}" for k, v in wanted.items())
    reason = (
        f"{shown} with {base} parameters is not one of megatron-ext's precisions "
        f"({', '.join(SPECS)}: run/precision.py)"
    )
    for key in keys:
        take(key, reason)


def _moe_layer_freq(
    out: Conversion, flags: dict[str, Flag | None], take: Callable[..., Any]
) -> None:
    """``--moe-layer-freq N`` (one MoE layer in N) or a pattern ``([0]*3+[1]*58)``, one 0/1
    per layer, as ``model.moe_layer_freq``."""
    flag = flags.get("moe-layer-freq")
    if flag is None:
        return
    text = " ".join(flag.values).strip("'\"")
    try:
        value = [int(text)] if text.isdigit() else layer_pattern(text)
    except ValueError as err:
        take("moe-layer-freq", f"not an integer or a list pattern ({err})")
        return
    take("moe-layer-freq")
    out.set("model.moe_layer_freq", value)


def layer_pattern(text: str) -> list[int]:
    """Megatron-LM's layer pattern (``([1]*3+[0]*2)*2``: lists of 0/1, ``+`` and ``*`` by an
    integer), evaluated without ``eval``; ValueError for anything else."""
    import ast

    def value(node: ast.AST) -> list[int] | int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            items = [value(e) for e in node.elts]
            if all(type(i) is int and i in (0, 1) for i in items):
                return items  # type: ignore[return-value]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
                return left + right
            if isinstance(node.op, ast.Mult) and isinstance(left, list) and type(right) is int:
                return left * right
            if isinstance(node.op, ast.Mult) and type(left) is int and isinstance(right, list):
                return right * left
        raise ValueError(f"unsupported: {ast.unparse(node)}")

    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as err:
        raise ValueError(str(err)) from None
    result = value(tree.body)
    if not isinstance(result, list):
        raise ValueError("not a list")
    return result


def _data(out: Conversion, flags: dict[str, Flag | None], take: Callable[..., Any]) -> None:
    data = flags.get("data-path")
    if data is not None and len(data.values) == 1:
        take("data-path")
        out.set("data.path", data.values[0])
    elif data is not None:
        take("data-path", "a blend of several prefixes: give one indexed-dataset prefix")
    # no --tokenizer-type: pretrain_gpt.py's args_defaults (GPT2BPETokenizer), as parsed
    kind = _value(flags.get("tokenizer-type")) or getattr(out.megatron, "tokenizer_type", None)
    model = _value(flags.get("tokenizer-model"))
    vocab, merges = _value(flags.get("vocab-file")), _value(flags.get("merge-file"))
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        take("tokenizer-type")
        out.set("data.tokenizer", "sentencepiece")
        if model is not None:
            take("tokenizer-model")
            out.set("data.tokenizer_model", model)
    elif kind == "HuggingFaceTokenizer" and model is not None:
        take("tokenizer-type")
        take("tokenizer-model")
        out.set("data.tokenizer", "huggingface")
        out.set("data.tokenizer_model", model)
        out.notes.append(
            f"--tokenizer-model {model}: megatron-ext reads it offline, so it must be a local "
            "folder saved by save_pretrained (a hub name is not downloaded)"
        )
    elif kind == "GPT2BPETokenizer" and vocab is not None and merges is not None:
        from pathlib import PurePosixPath

        from megatron_ext.data.kinds import gpt2_files

        expected = str(gpt2_files(PurePosixPath(vocab))[1])
        if merges != expected:
            take("tokenizer-type", MODEL_CHANGING["tokenizer-type"])
            take("vocab-file", f"its merges must be {expected} (next to it, same prefix)")
            take("merge-file", f"megatron-ext reads the merges at {expected}: rename it there")
        else:
            for key in ("tokenizer-type", "vocab-file", "merge-file"):
                take(key)
            out.set("data.tokenizer", "huggingface")
            out.set("data.tokenizer_model", vocab)
    elif kind is not None:
        take("tokenizer-type", MODEL_CHANGING["tokenizer-type"])
        take("tokenizer-model", f"the model of --tokenizer-type {kind}")
    load, save = _value(flags.get("load")), _value(flags.get("save"))
    if load is not None:
        reason = None if load == save else "megatron-ext resumes from run_dir/checkpoints"
        take("load", reason)
        if reason is None:
            out.set("checkpoint.load", "auto")


def _samples(out: Conversion, flags: dict[str, Flag | None], take: Callable[..., Any]) -> None:
    """Sample-counted flags: the run in steps (or tokens under a batch schedule), the LR
    positions as sample counts (``training.lr_*_samples``) and the warmup fraction as is."""
    from megatron_ext.config.load import recipe_from_dict
    from megatron_ext.gpt.sections import TrainingConfig

    seq = int(out.get("training.seq_length"))
    samples = _value(flags.get("train-samples"))
    batch = out.get("training.global_batch_size")
    if samples is not None and out.get("training.step_batch_size_schedule") is None and batch:
        # Megatron-LM's update_train_iters: train_samples // global_batch_size (rounded down)
        take("train-samples")
        out.set("training.steps", int(samples) // int(batch))
        if int(samples) % int(batch):
            out.notes.append(
                f"--train-samples {int(samples):,} is not a multiple of --global-batch-size "
                f"{batch}: {int(samples) // int(batch):,} steps, rounded down as Megatron-LM does"
            )
    elif samples is not None:  # a step schedule: steps until the samples are reached
        take("train-samples")
        out.set("training.train_tokens", int(samples) * seq)
    t = recipe_from_dict(out.recipe).section(TrainingConfig)
    # sample positions stay in samples (exact where they end inside a step): Megatron-LM's
    # scheduler counts consumed samples; without --lr-decay-samples its decay ends at
    # --train-samples
    decay = _value(flags.get("lr-decay-samples"))
    if decay is not None:
        take("lr-decay-samples")
    elif samples is not None and t.lr_decay_steps is None:
        decay = samples
    if decay is not None:
        t.lr_decay_samples = int(decay)
        out.set("training.lr_decay_samples", t.lr_decay_samples)
    warmup = _value(flags.get("lr-warmup-samples"))
    if warmup is not None and int(warmup) > 0:
        take("lr-warmup-samples")
        out.set("training.lr_warmup_samples", int(warmup))
    elif warmup is not None:
        take("lr-warmup-samples")
    window = _value(flags.get("lr-wsd-decay-samples"))
    if window is not None:  # a window of samples that ends where the decay ends
        take("lr-wsd-decay-samples")
        out.set("training.lr_wsd_decay_samples", int(window))
    fraction = _value(flags.get("lr-warmup-fraction"))
    if fraction is not None:  # Megatron-LM: a fraction of the decay, in samples
        take("lr-warmup-fraction")
        out.set("training.lr_warmup_fraction", float(fraction))
