"""The converter's Megatron-LM step: the script's flags through Megatron-LM's own parser, and the
model section from Megatron-LM's own ``TransformerConfig``.

:func:`parse_script` hands the flags (the last occurrence of each, in source order, torchrun's
left out) to :func:`.megatron_parse.parse_megatron` at the script's world size (torchrun's
``--nproc-per-node`` × ``--nnodes``, else the one given, else the smallest the parallel sizes
allow: said in a note). :func:`apply_parsed` then takes what Megatron-LM derived: sequence
parallelism (off at TP=1), and every ``TransformerConfig`` field whose value differs from
megatron-core's default -- into the model section's named field of that name, or into
``model.transformer_config`` where the named fields derive another value. A flag the
converter's tables leave unmapped but whose effect is now carried (it changes Megatron-LM's
``TransformerConfig``) is mapped.
"""

from __future__ import annotations

import dataclasses
from argparse import Namespace
from typing import TYPE_CHECKING, Any

from megatron_ext.megatron.megatron_args import Flag, MegatronArgs
from megatron_ext.megatron.megatron_flags import TORCHRUN

if TYPE_CHECKING:
    from megatron_ext.megatron.from_megatron import Conversion

__all__ = ["apply_parsed", "megatron_words", "parse_script", "script_world_size"]


def megatron_words(args: MegatronArgs, without: str | None = None) -> list[str]:
    """The words Megatron-LM's parser gets: each flag's last occurrence in source order (the
    converter's reading of repeats), torchrun's own flags left out; ``without``: a flag key
    (dashes) left out too."""
    keys = dict.fromkeys(f.name.replace("_", "-") for f in args.flags)
    # --mock-data beside --data-path: the two branches of the script's `if` (the recipe trains
    # on data.path); Megatron-LM is given one data source, the path
    mock = "mock-data" if "data-path" in keys else None
    words: list[str] = []
    for key in keys:
        flag = args.last(key)
        if flag is None or key in TORCHRUN or key in (without, mock):
            continue
        words += [f"--{flag.name}", *flag.values]
    return words


def _int(flag: Flag | None, default: int) -> int | None:
    if flag is None:
        return default
    value = flag.values[0] if len(flag.values) == 1 else ""
    return int(value) if value.isdigit() else None


def script_world_size(args: MegatronArgs, given: int | None) -> tuple[int, str]:
    """The world size to validate at, and where it comes from (for the note)."""
    nproc, nodes = _int(args.last("nproc-per-node"), 1), _int(args.last("nnodes"), 1)
    if args.last("nproc-per-node") is not None and nproc and nodes:
        return nproc * nodes, f"the script's torchrun ({nproc} per node × {nodes} nodes)"
    if given is not None:
        return given, "--world-size"
    sizes = {
        k: _int(args.last(f"{k}-model-parallel-size"), 1) or 1
        for k in ("tensor", "pipeline", "expert")
    }
    cp = _int(args.last("context-parallel-size"), 1) or 1
    tp, ep = sizes["tensor"], sizes["expert"]
    # data parallel k: Megatron-LM needs (k * cp * tp) divisible by ep * tp (expert TP = TP)
    k = next(k for k in range(1, 1 << 16) if (k * cp * tp) % (ep * tp) == 0)
    size = tp * sizes["pipeline"] * cp * k
    return size, "the smallest the parallel sizes allow (no resolved --nproc-per-node)"


def parse_script(
    args: MegatronArgs, world_size: int | None, gpu: str
) -> tuple[Namespace, int, str]:
    """Megatron-LM's namespace for the script, the world size it was validated at and the
    note that says so."""
    from megatron_ext.megatron.megatron_parse import GPU_CAPABILITY, parse_megatron

    size, source = script_world_size(args, world_size)
    parsed = parse_megatron(megatron_words(args), size, gpu, args.variables)
    major, minor = GPU_CAPABILITY.get(gpu, (0, 0))
    note = (
        f"validated by Megatron-LM's parse_args + validate_args at world size {size} ({source}) "
        f"on a CPU host, its GPU queries answered for {gpu} (compute capability {major}.{minor}; "
        "--gpu to change) and its Transformer Engine version checks as passed (NGC container)"
    )
    return parsed, size, note


def apply_parsed(
    out: Conversion, args: MegatronArgs, parsed: Namespace, size: int, gpu: str
) -> None:
    """Megatron-LM's derived values into the recipe ``out`` (see the module docstring)."""
    from megatron_ext.megatron.megatron_parse import transformer_fields

    if parsed.sequence_parallel != bool(out.get("parallel.sequence_parallel", False)):
        out.notes.append(
            f"parallel.sequence_parallel: {parsed.sequence_parallel}, as Megatron-LM's "
            f"validate_args sets it (TP={parsed.tensor_model_parallel_size})"
        )
    out.set("parallel.sequence_parallel", bool(parsed.sequence_parallel))
    if parsed.first_last_layers_bf16:  # Megatron-LM reads the counts only with this switch
        out.set("training.num_layers_at_start_in_bf16", parsed.num_layers_at_start_in_bf16)
        out.set("training.num_layers_at_end_in_bf16", parsed.num_layers_at_end_in_bf16)
    _virtual_stages(out, parsed)
    _recompute(out, parsed)
    _decoupled_lr(out, parsed)
    _optimizer_fields(out, args, parsed)
    if parsed.rotary_percent != 1.0:
        out.set("model.rotary_percent", float(parsed.rotary_percent))
    fields = transformer_fields(parsed)
    written = _model_fields(out, fields, transformer_fields(parsed, every=True))
    _carried_flags(out, args, fields, written, size, gpu)


#: Megatron-LM's recomputation flags, as the recipe's parallel.recompute_* fields read them
RECOMPUTE_FLAGS: tuple[str, ...] = (
    "recompute-granularity",
    "recompute-method",
    "recompute-num-layers",
    "recompute-modules",
)


def _recompute(out: Conversion, parsed: Namespace) -> None:
    """``--recompute-granularity`` and the flags read with it, as Megatron-LM's parser left
    them, into ``parallel.recompute_*`` (megatron_ext.megatron.model.recompute_fields):
    selective with its modules (megatron-core's default ``core_attn``), full with its method
    and layer count. Without a granularity Megatron-LM ignores the others: they stay
    unmapped."""
    g = parsed.recompute_granularity
    if g is None:
        return
    out.set("parallel.recompute_granularity", g)
    if g == "selective":
        modules = list(parsed.recompute_modules or ["core_attn"])
        if modules != ["core_attn"]:
            out.set("parallel.recompute_modules", modules)
    else:
        if parsed.recompute_method not in (None, "uniform"):
            out.set("parallel.recompute_method", parsed.recompute_method)
        if parsed.recompute_num_layers not in (None, 1):
            out.set("parallel.recompute_num_layers", int(parsed.recompute_num_layers))
    _now_mapped(out, RECOMPUTE_FLAGS)


def _decoupled_lr(out: Conversion, parsed: Namespace) -> None:
    """``--decoupled-lr`` / ``--decoupled-min-lr`` as Megatron-LM's parser read them, into
    ``optimizer.decoupled_lr`` / ``decoupled_min_lr`` (megatron-core gives that peak and floor
    to the word embeddings and the output layer; the GPT trainer does the same)."""
    if parsed.decoupled_lr is None:
        return  # megatron-core ignores --decoupled-min-lr alone: it stays unmapped
    out.set("optimizer.decoupled_lr", float(parsed.decoupled_lr))
    if parsed.decoupled_min_lr is not None:
        out.set("optimizer.decoupled_min_lr", float(parsed.decoupled_min_lr))
    _now_mapped(out, ("decoupled-lr", "decoupled-min-lr"))


#: Megatron-LM's flags that set the virtual pipeline stages (validate_args derives the count)
VIRTUAL_STAGE_FLAGS = (
    "num-layers-per-virtual-pipeline-stage",
    "num-virtual-stages-per-pipeline-rank",
)


def _virtual_stages(out: Conversion, parsed: Namespace) -> None:
    """The virtual pipeline stages Megatron-LM's ``validate_args`` derived (from a per-stage
    layer count, a per-rank stage count or a pipeline layout; None for one) into
    ``parallel.virtual_pipeline_model_parallel_size``."""
    if not parsed.virtual_pipeline_model_parallel_size:
        return
    out.set(
        "parallel.virtual_pipeline_model_parallel_size",
        int(parsed.virtual_pipeline_model_parallel_size),
    )
    _now_mapped(out, VIRTUAL_STAGE_FLAGS)


def _now_mapped(out: Conversion, flags: tuple[str, ...]) -> None:
    """Move ``flags`` (names without ``--``) from the unmapped list to the mapped one."""
    for text, reason in list(out.unmapped):
        if text[2:].split(" ", 1)[0].replace("_", "-") in flags:
            out.unmapped.remove((text, reason))
            out.mapped.append(text)


def _optimizer_fields(out: Conversion, args: MegatronArgs, parsed: Namespace) -> None:
    """The optimizer section's fields named as megatron-core's ``OptimizerConfig`` names them
    (lr, min_lr, weight_decay, Adam's betas and eps, clip_grad), as Megatron-LM's parser read
    them: written where the script gives the flag or Megatron-LM's value (its default) differs
    from the recipe's; the flags (``--lr`` for ``lr``) are mapped. The decoupled pair is
    :func:`_decoupled_lr`'s (``--decoupled-min-lr`` alone stays unmapped); fp16's loss-scale
    flags are read with ``--fp16`` only (without it Megatron-LM ignores them: they stay
    unmapped, with that reason)."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

    from megatron_ext.config.optimizer import LOSS_SCALE_FIELDS, OptimizerConfig

    theirs = {f.name for f in dataclasses.fields(MegatronOptimizerConfig)}
    given = {f.name.replace("-", "_") for f in args.flags}
    names: set[str] = set()
    for f in dataclasses.fields(OptimizerConfig):
        if f.name not in theirs or f.name.startswith("decoupled_"):
            continue
        if f.name in LOSS_SCALE_FIELDS and not parsed.fp16:
            continue
        names.add(f.name)
        value = getattr(parsed, f.name)
        if f.type == "int" and isinstance(value, float) and value.is_integer():
            value = int(value)  # Megatron-LM parses --loss-scale-window as a float
        if f.name in given or value != f.default:
            out.set(f"optimizer.{f.name}", value)
    texts = {f.text for f in args.flags if f.name.replace("-", "_") in names}
    for text, reason in list(out.unmapped):
        if text in texts:
            out.unmapped.remove((text, reason))
            out.mapped.append(text)


def _model_fields(out: Conversion, megatron: dict[str, Any], every: dict[str, Any]) -> set[str]:
    """Megatron-LM's ``TransformerConfig`` fields into the model section: those that differ
    from megatron-core's default (``megatron``) or from what the recipe derives (of ``every``
    field), into a named field of the same name, or ``model.transformer_config``. Returns the
    names that changed the recipe."""
    import torch

    from megatron_ext.config.load import recipe_from_dict
    from megatron_ext.megatron.model import transformer_kwargs
    from megatron_ext.megatron.sections import ModelConfig, ParallelConfig, TrainingConfig
    from megatron_ext.megatron.transformer_fields import HOST_FIELDS, SECTION_FIELDS
    from megatron_ext.megatron.transformer_fields import activation_function as activation

    recipe = recipe_from_dict(out.recipe)
    # the host's layers do not change the fields compared (transformer_impl is skipped), and a
    # script asking for Transformer Engine converts on a host without it: refused at launch
    model = dataclasses.replace(recipe.section(ModelConfig), transformer_impl="local")
    training = recipe.section(TrainingConfig)
    derived = transformer_kwargs(
        model,
        recipe.section(ParallelConfig),
        training.precision,
        fp8_format=training.fp8_format,
        params_dtype=training.params_dtype,
    )
    named = {f.name for f in dataclasses.fields(ModelConfig)}
    extra: dict[str, Any] = {}
    changed: set[str] = set()
    for name, value in every.items():
        if name not in megatron and name not in derived:
            continue  # megatron-core's default, and the recipe does not set it
        if name in SECTION_FIELDS:
            continue  # the parallel / training sections' (the exactness test compares them)
        if name == "transformer_impl":
            continue  # --transformer-impl maps to model.transformer_impl; its default: auto
        if name in HOST_FIELDS:
            if name in megatron:
                extra[name] = value  # Megatron-LM's kernel choice, used where CUDA is
            continue
        mine = derived.get(name)
        if name == "activation_func":
            same = mine is activation(value)
        elif isinstance(mine, torch.dtype):
            same = str(mine).removeprefix("torch.") == value
        else:
            same = mine == value and (name in derived or value is None)
        if same:
            continue
        changed.add(name)
        if name in named:
            out.set(f"model.{name}", value)
        else:
            extra[name] = value
    if extra:
        out.set("model.transformer_config", extra)
    return changed


def _carried_flags(
    out: Conversion,
    args: MegatronArgs,
    fields: dict[str, Any],
    changed: set[str],
    size: int,
    gpu: str,
) -> None:
    """An unmapped flag whose effect the recipe now carries -- leaving it out changes Megatron-LM's
    ``TransformerConfig`` in a field the recipe took -- becomes mapped."""
    from megatron_ext.errors import ConfigError
    from megatron_ext.megatron.megatron_parse import parse_megatron, transformer_fields

    carried = set(changed) | {"rotary_percent"}
    if out.get("parallel.virtual_pipeline_model_parallel_size"):  # a layout's stage count
        carried.add("virtual_pipeline_model_parallel_size")
    written = out.get("model.transformer_config", {})
    for text, reason in list(out.unmapped):
        key = text[2:].split(" ", 1)[0].replace("_", "-")
        dest = key.replace("-", "_")
        if key == "rotary-percent":
            moved = True
        elif dest in written and written[dest] == fields.get(dest):
            moved = True  # the field of its name, with Megatron-LM's value (the flags it is
            # read with may not parse without it: the embedding counted as a layer)
        else:
            try:
                without = transformer_fields(
                    parse_megatron(megatron_words(args, key), size, gpu, args.variables)
                )
            except ConfigError:
                continue  # needed by another flag: its own reason stands
            diff = {n for n in fields.keys() | without.keys() if fields.get(n) != without.get(n)}
            moved = bool(diff) and diff <= carried | set(written)
        if moved:
            out.unmapped.remove((text, reason))
            if text in out.model_changing:
                out.model_changing.remove(text)
            out.mapped.append(text)
