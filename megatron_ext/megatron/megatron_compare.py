"""A converted recipe against what Megatron-LM builds from the same flags, field by field.

:func:`compare` puts the recipe beside Megatron-LM's namespace (``parse_args`` +
``validate_args``, :mod:`.megatron_parse`) in five areas and returns the fields that differ:

- ``transformer``: every init field of megatron-core's ``TransformerConfig`` (or
  ``MLATransformerConfig``) the GPT trainer builds from the recipe, against
  ``core_transformer_config_from_args`` -- both as passed, before megatron-core's
  ``__post_init__`` derives its fields from them (so a CPU host can compare a CUDA-only model).
  The host's kernel choices (:data:`~megatron_ext.megatron.transformer_fields.HOST_FIELDS`) and
  ``transformer_impl`` (the recipe's ``model.transformer_impl``, chosen at launch) are skipped.
- ``optimizer``: the optimizer, LR, weight decay, betas, epsilon, clipping, decoupled LR,
  weight-decay ramp, warmup start and Muon's fields as megatron-core's ``OptimizerConfig`` reads
  them from the namespace.
- ``lr``: the learning rate at chosen optimizer steps: megatron-core's
  ``OptimizerParamScheduler`` positioned as Megatron-LM's training loop positions it (iterations
  times the global batch, or consumed samples), against the recipe's
  :func:`~megatron_ext.schedules.plan.training_schedule`; relative tolerance 1e-9. With
  ``--decoupled-lr``, the embedding and output layer's group too (megatron-core's override).
- ``batch``: micro batch, sequence length, the run's steps (Megatron-LM's ``update_train_iters``)
  and the global batch at chosen steps (megatron-core's micro-batch calculator).
- ``parallel``: TP, PP, CP, EP, expert TP, sequence parallelism and the data-parallel size.

Imports torch and megatron: called by the converter's check only.
"""

from __future__ import annotations

import dataclasses
import functools
from argparse import Namespace
from typing import Any

from megatron_ext.megatron.megatron_flags import megatron_optimizers
from megatron_ext.optimizers.spec import BASE, registered_optimizers

__all__ = ["AREAS", "compare"]

#: read by megatron-core only with recompute_granularity set
_RECOMPUTE = ("recompute_method", "recompute_num_layers", "recompute_modules")
AREAS = ("transformer", "optimizer", "lr", "batch", "parallel")
#: relative tolerance of the LR comparison (both sides are float64 arithmetic)
LR_RTOL = 1e-9


def compare(recipe: Any, parsed: Namespace, world_size: int) -> dict[str, list[str]]:
    """{area: ["field: recipe's value != Megatron-LM's", ...]} for every area with a
    difference (empty: the recipe is Megatron-LM's run in all five areas)."""
    out = {
        "transformer": _transformer(recipe, parsed),
        "optimizer": _optimizer(recipe, parsed),
        "lr": _lr(recipe, parsed),
        "batch": _batch(recipe, parsed),
        "parallel": _parallel(recipe, parsed, world_size),
    }
    return {area: diffs for area, diffs in out.items() if diffs}


def _differ(pairs: list[tuple[str, Any, Any]]) -> list[str]:
    return [f"{name}: {mine!r} != {theirs!r}" for name, mine, theirs in pairs if mine != theirs]


def _comparable(value: Any) -> Any:
    """A value as compared: an init function by its function and arguments, an enum by its
    name (the recipe writes enums by name; megatron-core's ``__post_init__`` reads both)."""
    import enum

    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, list | tuple):
        return [_comparable(v) for v in value]
    if isinstance(value, functools.partial):
        return (value.func, value.args, tuple(sorted(value.keywords.items())))
    return value


def _transformer(recipe: Any, parsed: Namespace) -> list[str]:
    from unittest import mock

    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    from megatron_ext.megatron.megatron_parse import megatron_transformer_config
    from megatron_ext.megatron.model import transformer_config
    from megatron_ext.megatron.transformer_fields import HOST_FIELDS, NOT_BUILT

    theirs = megatron_transformer_config(parsed)  # before __post_init__
    bf16_layers = (0, 0)
    if parsed.first_last_layers_bf16:
        bf16_layers = (parsed.num_layers_at_start_in_bf16, parsed.num_layers_at_end_in_bf16)
    with (
        mock.patch.object(TransformerConfig, "__post_init__", lambda self: None),
        mock.patch.object(MLATransformerConfig, "__post_init__", lambda self: None),
        # what the GPT trainer refuses at launch (FP8 parameters) is still the recipe's
        # field, compared here
        mock.patch.dict(NOT_BUILT, clear=True),
    ):
        # the kernels' implementation is the host's (skipped below): a script asking for
        # Transformer Engine is compared on a host without it
        model = dataclasses.replace(recipe.model, transformer_impl="local")
        t = recipe.training
        mine = transformer_config(
            model, recipe.parallel, t.precision, bf16_layers, t.fp8_format, t.params_dtype
        )
    pairs = [("class", type(mine).__name__, type(theirs).__name__)]
    for f in dataclasses.fields(theirs):
        if not f.init or f.name in HOST_FIELDS or f.name == "transformer_impl":
            continue
        if f.name.startswith("num_layers_at_") and not parsed.first_last_layers_bf16:
            continue  # Megatron-LM reads the counts only with first_last_layers_bf16
        if f.name in _RECOMPUTE and theirs.recompute_granularity is None:
            continue  # megatron-core reads them only with a recompute granularity
        a = _comparable(getattr(mine, f.name, None))
        b = _comparable(getattr(theirs, f.name))
        pairs.append((f.name, a, b))
    return _differ(pairs)


def _optimizer(recipe: Any, parsed: Namespace) -> list[str]:
    o = recipe.optimizer
    name = megatron_optimizers().get(parsed.optimizer, parsed.optimizer)
    pairs: list[tuple[str, Any, Any]] = [
        ("optimizer", o.name, name),
        ("lr", o.lr, parsed.lr),
        ("min_lr", o.min_lr, parsed.min_lr),
        ("weight_decay", o.weight_decay, parsed.weight_decay),
        ("clip_grad", o.clip_grad, parsed.clip_grad),
        ("decoupled_lr", o.decoupled_lr, parsed.decoupled_lr),
        # megatron-core reads the floor only beside a decoupled LR
        ("decoupled_min_lr", o.decoupled_min_lr, parsed.decoupled_min_lr)
        if parsed.decoupled_lr is not None
        else ("decoupled_min_lr", None, None),
        # megatron-ext has a constant weight decay
        ("weight_decay_incr_style", "constant", parsed.weight_decay_incr_style),
        ("lr_warmup_init", recipe.training.lr_warmup_init, parsed.lr_warmup_init),
    ]
    pairs += _loss_scale(recipe, parsed)
    if name == BASE:
        pairs += [
            ("adam_beta1", o.adam_beta1, parsed.adam_beta1),
            ("adam_beta2", o.adam_beta2, parsed.adam_beta2),
            ("adam_eps", o.adam_eps, parsed.adam_eps),
        ]
    spec = registered_optimizers().get(name)
    if spec is not None:  # the optimizer's own flags (its spec's), as the converter maps them
        ours = o.flat()
        for flag, key in spec.megatron.flags.items():
            field = flag.replace("-", "_")
            table = spec.megatron.choices.get(field)
            value = getattr(parsed, field)
            pairs.append((field, ours[key], value if table is None else table.get(value)))
    return _differ(pairs)


def _loss_scale(recipe: Any, parsed: Namespace) -> list[tuple[str, Any, Any]]:
    """The precision flags of megatron-core's ``OptimizerConfig`` as the GPT trainer builds it
    (:func:`~megatron_ext.megatron.optimizer_factories.megatron_optimizer_config`), and with
    fp16 its loss scale, against Megatron-LM's parsed flags."""
    from megatron_ext.config.optimizer import LOSS_SCALE_FIELDS
    from megatron_ext.megatron.optimizer_factories import megatron_optimizer_config
    from megatron_ext.run.precision import params_dtype_name

    t = recipe.training
    dtype = params_dtype_name(t.precision, t.params_dtype)  # the trainer's config.bf16 / fp16
    ours = megatron_optimizer_config(recipe.optimizer, dtype == "bfloat16", dtype == "float16")
    names = ("fp16", "bf16", *(LOSS_SCALE_FIELDS if parsed.fp16 else ()))
    return [(n, getattr(ours, n), getattr(parsed, n)) for n in names]


class _Groups:
    """All of an optimizer that megatron-core's scheduler touches: its parameter groups, one
    of the run's LR and, with ``--decoupled-lr``, one of the embedding and output layer's with
    the ``max_lr`` / ``min_lr`` that megatron-core's ``_get_param_groups`` gives it (its
    defaults, the run's ``lr`` / ``min_lr``, under ``get_standard_config_overrides``'s override
    for parameters marked ``is_embedding_or_output_parameter``)."""

    def __init__(self, parsed: Namespace) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides

        self.param_groups: list[dict[str, Any]] = [{}]
        if parsed.decoupled_lr is None:
            return
        config = OptimizerConfig(
            lr=parsed.lr,
            min_lr=parsed.min_lr,
            decoupled_lr=parsed.decoupled_lr,
            decoupled_min_lr=parsed.decoupled_min_lr,
        )
        marked = _Marked()
        group = {"max_lr": config.lr, "min_lr": config.min_lr}
        for key, override in get_standard_config_overrides(config).items():
            if key.matches(marked, "embedding.word_embeddings.weight"):
                group.update(override)
        group["is_embedding_or_output_parameter"] = True
        self.param_groups.append(group)


class _Marked:
    """A 2-D parameter as megatron-core marks the word embeddings (for its override keys)."""

    shape = (2, 2)
    is_embedding_or_output_parameter = True


def megatron_scheduler(parsed: Namespace) -> Any:
    """megatron-core's ``OptimizerParamScheduler`` with the arguments Megatron-LM's
    ``get_optimizer_param_scheduler`` gives it (in samples: iterations times the global batch,
    or the sample counts), over a stand-in optimizer of one parameter group."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if parsed.train_iters:
        batch = parsed.global_batch_size
        decay = (parsed.lr_decay_iters or parsed.train_iters) * batch
        wsd = parsed.lr_wsd_decay_iters * batch if parsed.lr_wsd_decay_iters else None
        warmup = parsed.lr_warmup_iters * batch
        incr = parsed.train_iters * batch
    else:
        decay = parsed.lr_decay_samples or parsed.train_samples
        wsd, warmup, incr = (
            parsed.lr_wsd_decay_samples,
            parsed.lr_warmup_samples,
            parsed.train_samples,
        )
    if parsed.lr_warmup_fraction is not None:
        warmup = parsed.lr_warmup_fraction * decay
    return OptimizerParamScheduler(
        _Groups(parsed),
        init_lr=parsed.lr_warmup_init,
        max_lr=parsed.lr,
        min_lr=parsed.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=parsed.lr_decay_style,
        start_wd=parsed.start_weight_decay,
        end_wd=parsed.end_weight_decay,
        wd_incr_steps=incr,
        wd_incr_style=parsed.weight_decay_incr_style,
        wsd_decay_steps=wsd,
        lr_wsd_decay_style=parsed.lr_wsd_decay_style,
    )


def chosen_steps(recipe: Any) -> list[int]:
    """Optimizer steps to compare at: the start, around the warmup's end, inside and at the end
    of the decay (and its WSD window), the run's last step."""
    from megatron_ext.schedules.plan import lr_positions, run_steps

    t = recipe.training
    steps = run_steps(t)
    decay, warmup = lr_positions(t)
    points = {0, 1, warmup - 1, warmup, warmup + 1}
    points |= {decay // 3, decay // 2, decay - 1, decay, steps - 1}
    if t.lr_wsd_decay_steps:
        points |= {decay - t.lr_wsd_decay_steps, decay - t.lr_wsd_decay_steps // 2}
    return sorted(p for p in points if 0 <= p < steps)


def _calculator(parsed: Namespace) -> Any:
    """megatron-core's micro-batch calculator as Megatron-LM initialises it."""
    from megatron.core.num_microbatches_calculator import _build_num_microbatches_calculator

    return _build_num_microbatches_calculator(
        rank=1,  # not 0: it logs its table on rank 0
        global_batch_size=parsed.global_batch_size,
        micro_batch_size=parsed.micro_batch_size,
        data_parallel_size=parsed.data_parallel_size,
        decrease_batch_size_if_needed=parsed.decrease_batch_size_if_needed,
        step_batch_size_schedule=parsed.step_batch_size_schedule,
        seq_length=parsed.seq_length,
    )


def megatron_batches(parsed: Namespace, steps: list[int]) -> dict[int, tuple[int, int]]:
    """{step: (Megatron-LM's global batch of that step, samples consumed before it)} for
    ``steps`` (ascending). Its training loop updates the calculator with the consumed samples
    each step; the batch only changes where they cross a threshold of its schedule, so the
    walk jumps from threshold to threshold."""
    calc = _calculator(parsed)
    thresholds = [*sorted(t for t, _ in getattr(calc, "schedule", [])), float("inf")]
    out: dict[int, tuple[int, int]] = {}
    step, samples = 0, 0
    for wanted in steps:
        while True:
            calc.update(samples, consistency_check=False)
            batch = calc.get_current_global_batch_size()
            nxt = next(t for t in thresholds if t > samples)
            # steps at this batch before the consumed samples reach the next threshold
            until = -(-(nxt - samples) // batch) if nxt != float("inf") else None
            if until is None or step + until > wanted:
                samples += (wanted - step) * batch
                step = wanted
                calc.update(samples, consistency_check=False)
                out[wanted] = (calc.get_current_global_batch_size(), samples)
                break
            step, samples = step + until, samples + until * batch
    return out


def _megatron_train_iters(parsed: Namespace) -> int:
    """Megatron-LM's ``update_train_iters``: the run's iterations (a sample count: the steps
    until the consumed samples reach it, as its loop counts under a batch schedule)."""
    if parsed.train_iters:
        return int(parsed.train_iters)
    if parsed.step_batch_size_schedule is None:
        return int(parsed.train_samples // parsed.global_batch_size)
    calc = _calculator(parsed)
    thresholds = [*sorted(t for t, _ in calc.schedule), float("inf")]
    iterations, samples = 0, 0
    while samples < parsed.train_samples:
        calc.update(samples, consistency_check=False)
        batch = calc.get_current_global_batch_size()
        limit = min(next(t for t in thresholds if t > samples), parsed.train_samples)
        n = -(-(limit - samples) // batch)
        iterations, samples = iterations + n, samples + n * batch
    return iterations


def _lr(recipe: Any, parsed: Namespace) -> list[str]:
    from megatron_ext.schedules.plan import training_schedule

    schedule = training_schedule(recipe.training, recipe.optimizer)
    steps = chosen_steps(recipe)
    scheduler = megatron_scheduler(parsed)
    walk = megatron_batches(parsed, steps)
    groups = scheduler.optimizer.param_groups
    out = []
    for step in steps:
        scheduler.num_steps = 0
        scheduler.step(walk[step][1])
        for group in groups:  # the run's LR, then the embedding and output layer's
            decoupled = group.get("is_embedding_or_output_parameter", False)
            theirs = group["lr"]
            mine = schedule.lr_at(step, decoupled)
            if abs(mine - theirs) > LR_RTOL * max(abs(theirs), 1e-30):
                which = "decoupled lr" if decoupled else "lr"
                out.append(f"{which} at step {step:,}: {mine!r} != {theirs!r}")
    return out[:3]  # the first differences say it


def _batch(recipe: Any, parsed: Namespace) -> list[str]:
    from megatron_ext.schedules.plan import run_steps, training_schedule

    t = recipe.training
    pairs: list[tuple[str, Any, Any]] = [
        ("micro_batch_size", t.micro_batch_size, parsed.micro_batch_size),
        ("seq_length", t.seq_length, parsed.seq_length),
        ("steps", run_steps(recipe.training), _megatron_train_iters(parsed)),
    ]
    schedule = training_schedule(recipe.training, recipe.optimizer)
    steps = chosen_steps(recipe)
    walk = megatron_batches(parsed, steps)
    for step in steps:
        pairs.append((f"global batch at step {step:,}", schedule.global_batch(step), walk[step][0]))
    return _differ(pairs)[:4]


def _parallel(recipe: Any, parsed: Namespace, world_size: int) -> list[str]:
    p = recipe.parallel
    model = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    dp = world_size // (model * p.context_parallel_size)
    pairs = [
        (f"{name}_size", getattr(p, f"{name}_size"), getattr(parsed, f"{name}_size"))
        for name in (
            "tensor_model_parallel",
            "pipeline_model_parallel",
            "context_parallel",
            "expert_model_parallel",
        )
    ]
    pairs += [
        ("expert_tensor_parallel_size", _expert_tp(recipe), parsed.expert_tensor_parallel_size),
        ("sequence_parallel", p.sequence_parallel, parsed.sequence_parallel),
        (
            "virtual_pipeline_model_parallel_size",
            p.virtual_pipeline_model_parallel_size,
            parsed.virtual_pipeline_model_parallel_size,
        ),
        ("data_parallel_size", dp, parsed.data_parallel_size),
    ]
    return _differ(pairs)


def _expert_tp(recipe: Any) -> int:
    """The recipe's expert tensor-parallel size: megatron-core's, TP unless the model section
    gives another."""
    given = recipe.model.transformer_config.get("expert_tensor_parallel_size")
    return given if given is not None else recipe.parallel.tensor_model_parallel_size
