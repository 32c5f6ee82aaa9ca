"""The converter's flag groups: Megatron-LM flags that are read together into recipe fields
(:func:`megatron_ext.megatron.from_megatron.convert` calls each with the script's flags and its
``take(key, reason=None, changes_model=None)``, which marks a flag mapped, or not mapped with the
reason): the low-precision format and recipe, the MoE layer pattern, the data path and
tokenizer, and the sample counts (the run's length, the LR positions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron_ext.megatron.megatron_args import Flag
from megatron_ext.megatron.megatron_flags import MODEL_CHANGING

if TYPE_CHECKING:
    from megatron_ext.megatron.from_megatron import Conversion

__all__ = [
    "flag_value",
    "layer_pattern",
    "map_data",
    "map_low_precision",
    "map_moe_layer_freq",
    "map_null_tokenizer",
    "map_samples",
]


def flag_value(flag: Flag | None) -> str | None:
    """The flag's one value as written; None when absent or given no value or several."""
    return flag.values[0] if flag is not None and len(flag.values) == 1 else None


def map_low_precision(
    out: Conversion, flags: dict[str, Flag | None], take: Callable[..., Any], base: str
) -> None:
    """``--fp8-format``/``--fp8-recipe`` (Megatron-LM's recipe default: delayed) or
    ``--fp4-format``/``--fp4-recipe`` (default nvfp4) as the one ``training.precision`` with
    those megatron-core fields (run/precision.py's table); an FP8 format other than the
    precision's goes to ``training.fp8_format`` (megatron-core takes any format with any FP8
    recipe); FP8/FP4 without ``--bf16`` (fp32 parameters) sets ``training.params_dtype:
    float32``; a pair no precision has, or FP8/FP4 over fp16 parameters, is refused like a
    model-changing flag."""
    from megatron_ext.run.precision import SPECS

    fp8, fp4 = flag_value(flags.get("fp8-format")), flag_value(flags.get("fp4-format"))
    if fp8 is None and fp4 is None:
        for key in ("fp8-recipe", "fp4-recipe"):
            take(key, "megatron-core reads it only with its format flag", changes_model=False)
        return
    wanted: dict[str, str | None]
    if fp8 is not None:
        wanted = {"fp8": fp8, "fp8_recipe": flag_value(flags.get("fp8-recipe")) or "delayed"}
    else:
        wanted = {"fp4": fp4, "fp4_recipe": flag_value(flags.get("fp4-recipe")) or "nvfp4"}
    matched = {k: v for k, v in wanted.items() if k != "fp8"}  # the format: fp8_format below
    found = [s for s in SPECS.values() if all(getattr(s, k) == v for k, v in matched.items())]
    keys = ("fp8-format", "fp8-recipe") if fp8 is not None else ("fp4-format", "fp4-recipe")
    if found and base in ("bf16", "fp32") and (fp8 is None or fp8 in ("e4m3", "hybrid")):
        for key in keys:
            take(key)
        out.set("training.precision", found[0].name)
        if base == "fp32":
            out.set("training.params_dtype", "float32")
        if fp8 is not None and fp8 != found[0].fp8:
            out.set("training.fp8_format", fp8)
        return
    shown = ", ".join(f"{k}={v}" for k, v in wanted.items())
    reason = (
        f"{shown} with {base} parameters is not one of megatron-ext's precisions "
        f"({', '.join(SPECS)}: run/precision.py)"
    )
    for key in keys:
        take(key, reason)


def map_moe_layer_freq(
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


def map_data(out: Conversion, flags: dict[str, Flag | None], take: Callable[..., Any]) -> None:
    data = flags.get("data-path")
    if data is not None and len(data.values) == 1:
        take("data-path")
        out.set("data.path", data.values[0])
    elif data is not None:
        take("data-path", "a blend of several prefixes: give one indexed-dataset prefix")
    # no --tokenizer-type: pretrain_gpt.py's args_defaults (GPT2BPETokenizer), as parsed
    kind = flag_value(flags.get("tokenizer-type")) or getattr(out.megatron, "tokenizer_type", None)
    model = flag_value(flags.get("tokenizer-model"))
    vocab, merges = flag_value(flags.get("vocab-file")), flag_value(flags.get("merge-file"))
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
    elif kind == "NullTokenizer":
        map_null_tokenizer(out, flags, take)
    elif kind is not None:
        take("tokenizer-type", MODEL_CHANGING["tokenizer-type"])
        take("tokenizer-model", f"the model of --tokenizer-type {kind}")
    load, save = flag_value(flags.get("load")), flag_value(flags.get("save"))
    if load is not None:
        reason = None if load == save else "megatron-ext resumes from run_dir/checkpoints"
        take("load", reason)
        if reason is None:
            out.set("checkpoint.load", "auto")


def map_null_tokenizer(
    out: Conversion, flags: dict[str, Flag | None], take: Callable[..., Any]
) -> None:
    """``--tokenizer-type NullTokenizer`` as ``data.tokenizer: null_ids``: its vocabulary is
    ``--vocab-size`` (already ``model.vocab_size``), its end of document the last id and no pad
    id, as megatron-core's NullTokenizer; ``--null-tokenizer-eod-id``/``-pad-id`` at other ids
    are refused (the null_ids tokenizer has Megatron-LM's defaults only)."""
    vocab = flag_value(flags.get("vocab-size"))
    if vocab is None:
        take("tokenizer-type", "NullTokenizer needs --vocab-size (its ids are [0, vocab-size))")
        return
    take("tokenizer-type")
    out.set("data.tokenizer", "null_ids")
    defaults = {"null-tokenizer-eod-id": int(vocab) - 1, "null-tokenizer-pad-id": -1}
    for key, default in defaults.items():
        value = flag_value(flags.get(key))
        if value is None or int(value) == default:
            take(key)  # absent flags are skipped by take
        else:
            role = key.split("-")[2]  # eod or pad
            reason = f"the null_ids tokenizer's {role} id is {default} (Megatron-LM's default)"
            take(key, reason, changes_model=True)


def map_samples(out: Conversion, flags: dict[str, Flag | None], take: Callable[..., Any]) -> None:
    """Sample-counted flags: the run in steps (or tokens under a batch schedule), the LR
    positions as sample counts (``training.lr_*_samples``) and the warmup fraction as is."""
    from megatron_ext.config.load import recipe_from_dict
    from megatron_ext.megatron.sections import TrainingConfig

    seq = int(out.get("training.seq_length"))
    samples = flag_value(flags.get("train-samples"))
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
    decay = flag_value(flags.get("lr-decay-samples"))
    if decay is not None:
        take("lr-decay-samples")
    elif samples is not None and t.lr_decay_steps is None:
        decay = samples
    if decay is not None:
        t.lr_decay_samples = int(decay)
        out.set("training.lr_decay_samples", t.lr_decay_samples)
    warmup = flag_value(flags.get("lr-warmup-samples"))
    if warmup is not None and int(warmup) > 0:
        take("lr-warmup-samples")
        out.set("training.lr_warmup_samples", int(warmup))
    elif warmup is not None:
        take("lr-warmup-samples")
    window = flag_value(flags.get("lr-wsd-decay-samples"))
    if window is not None:  # a window of samples that ends where the decay ends
        take("lr-wsd-decay-samples")
        out.set("training.lr_wsd_decay_samples", int(window))
    fraction = flag_value(flags.get("lr-warmup-fraction"))
    if fraction is not None:  # Megatron-LM: a fraction of the decay, in samples
        take("lr-warmup-fraction")
        out.set("training.lr_warmup_fraction", float(fraction))
