"""``megatron-ext convert hf-to-mcore|mcore-to-hf|check``: HF <-> megatron-core checkpoints.

``mcore-to-hf CKPT OUT`` writes an HF directory ``AutoModelForCausalLM.from_pretrained`` loads.
``hf-to-mcore HF_DIR OUT`` writes ``OUT/model.json`` (the recipe's ``model:`` fields) and
``OUT/step_000000`` (the model's weights with megatron-core ``dist_checkpointing``) and
``OUT/recipe.yaml`` (a GPT recipe that continues training from them: :mod:`.recipe`), and says
which RMSNorm epsilon it used and where it came from. ``check HF_DIR MCORE_CKPT [--json FILE]`` runs
both models on the same token ids in fp32 and prints the parity figures. Inputs are checked
before torch is imported; a bad one is a ``ConfigError`` (one line, exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_ext.atomic import atomic_dir, write_json
from megatron_ext.commands import Command, fraction, positive_int
from megatron_ext.convert.inputs import read_json, reading_model
from megatron_ext.errors import ConfigError
from megatron_ext.progress import step

WEIGHTS = "step_000000"
FIELDS = "model.json"
INITIAL_LOOP = {"step": 0, "consumed_samples": 0}
#: ``convert check``'s thresholds: an fp32 conversion of the same weights agrees to ~1e-7 in
#: cosine; another model (OLMoE weights against a Llama checkpoint) scores ~0
DEFAULT_MIN_COSINE = 0.9999
DEFAULT_MIN_AGREEMENT = 0.95
HF_CONFIG = "hf_config.json"  # the HF config the weights came from: mcore-to-hf writes it back
HF_FIX = "give a Hugging Face model folder (config.json and its *.safetensors weights, whole)"
MCORE_FIX = "give a folder hf-to-mcore wrote, unchanged (or convert again)"
CHECK_FIX = "give the HF folder and the hf-to-mcore folder of the same model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hf-to-mcore`` and ``check``, each with its options."""
    sub = parser.add_subparsers(dest="convert_command", metavar="ACTION", required=True)
    a = sub.add_parser("hf-to-mcore", help="an HF model directory -> a megatron-core checkpoint")
    a.add_argument("hf_dir", type=Path)
    a.add_argument("out", type=Path)
    b = sub.add_parser(
        "mcore-to-hf",
        help="a hf-to-mcore folder, or a GPT-trainer checkpoint with --recipe -> an HF directory",
    )
    b.add_argument("mcore_ckpt", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument(
        "--recipe",
        nargs="+",
        default=None,
        metavar="RECIPE [key=value ...]",
        help="for a GPT-trainer checkpoint: the recipe that wrote it, and the run's overrides",
    )
    c = sub.add_parser("check", help="logit and routing parity of a conversion (fp32)")
    c.add_argument("hf_dir", type=Path)
    c.add_argument("mcore_ckpt", type=Path, help="the OUT folder hf-to-mcore wrote")
    c.add_argument("--json", type=Path, default=None, help="also write the figures here")
    c.add_argument(
        "--tokens", type=positive_int, default=64, help="token ids per sequence (2 sequences)"
    )
    c.add_argument("--seed", type=int, default=0)
    c.add_argument(
        "--min-cosine",
        type=fraction,
        default=DEFAULT_MIN_COSINE,
        help=f"the logits' cosine similarity must reach this (default {DEFAULT_MIN_COSINE})",
    )
    c.add_argument(
        "--min-argmax-agreement",
        type=fraction,
        default=DEFAULT_MIN_AGREEMENT,
        help=f"fraction of positions whose top token must agree (default {DEFAULT_MIN_AGREEMENT})",
    )
    c.add_argument(
        "--min-expert-agreement",
        type=fraction,
        default=DEFAULT_MIN_AGREEMENT,
        help="per MoE layer, fraction of tokens routed to the same experts "
        f"(default {DEFAULT_MIN_AGREEMENT})",
    )


def convert_main(args: argparse.Namespace) -> int:
    """Run ``megatron-ext convert ACTION``; returns the exit code."""
    # torch and the converters load only when a conversion runs (--help stays torch-free)
    with step("convert", "importing torch and megatron-core"):
        from megatron_ext.convert.hf import read_hf_config
    _quiet_loading()

    if args.convert_command == "mcore-to-hf":
        return _mcore_to_hf(args)
    if args.convert_command == "hf-to-mcore":
        _refuse_output(args.out)
    raw = read_hf_config(args.hf_dir)
    if args.convert_command == "hf-to-mcore":
        return _hf_to_mcore(args, raw)
    if args.convert_command == "check":
        return _check(args, raw)
    raise ConfigError(f"unknown convert action {args.convert_command!r}")


#: torch.distributed.checkpoint's warnings on every load of a checkpoint in one process
_DCP_WARNINGS = (
    (UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized"),
    (UserWarning, r"The argument order of load has been changed"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
)


def _quiet_loading() -> None:
    """Keep the loaders' noise off stderr unless ``--verbose``: torch's checkpoint-reader
    warnings (one process, no group: expected here) and transformers' "Loading weights" bar
    (shown only on a terminal, as :mod:`megatron_ext.progress`), so that a failing command's
    stderr is its one error line."""
    import warnings

    from megatron_ext.progress import on_terminal
    from megatron_ext.verbosity import is_verbose

    if is_verbose():
        return
    for category, message in _DCP_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    if not on_terminal():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def load_hf(hf_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    with step("convert", f"loading {hf_dir}"), reading_model(hf_dir, "the HF model", HF_FIX):
        return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def hf_fields(hf_dir: Path, raw: dict, eps: float) -> dict:
    """:func:`model_fields` of an HF config; a field it needs and lacks is the user's."""
    from megatron_ext.convert.hf import model_fields

    with reading_model(hf_dir / "config.json", "the model's fields", HF_FIX):
        return model_fields(raw, eps)


def _refuse_output(out: Path) -> None:
    """``out`` must be a new folder (or an empty one) in a folder that can hold it."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not empty; choose a new output folder")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{out}: {parent} is a file, not a folder; choose another output")


def _hf_to_mcore(args: argparse.Namespace, raw: dict) -> int:
    # torch and the converters load only when a conversion runs (--help stays torch-free)
    from megatron_ext.convert.hf import choose_epsilon

    eps = choose_epsilon(raw)
    fields = hf_fields(args.hf_dir, raw, eps.value)
    from megatron.core import dist_checkpointing

    from megatron_ext.convert.hf import hf_to_mcore_state
    from megatron_ext.convert.parity import build_mcore
    from megatron_ext.megatron.save_queue import fork_results_queue

    hf = load_hf(args.hf_dir)
    full = {**hf.config.to_dict(), **raw}  # the loaded config fills what the file leaves out
    fields = hf_fields(args.hf_dir, full, eps.value)
    with reading_model(args.hf_dir, "the Hugging Face weights", HF_FIX):
        state = hf_to_mcore_state(hf.state_dict(), fields)
    with step("convert", "building the megatron-core model"):
        gpt = build_mcore(fields, state)
    from megatron_ext.convert.recipe import RECIPE, continue_recipe, copy_tokenizer

    # all of OUT or nothing: written in a temporary folder beside it, renamed at the end; the
    # recipe names OUT, where the files will be
    with atomic_dir(args.out) as tmp, step("convert", f"writing {args.out}"):
        (tmp / WEIGHTS).mkdir()
        # A step-0 checkpoint: the GPT trainer starts from its weights alone (checkpoint.load=
        # OUT/step_000000). world 0 matches no run, so no RNG streams are asked of it.
        initial = {"model": gpt.sharded_state_dict(), "loop": INITIAL_LOOP, "world": 0}
        fork_results_queue()
        dist_checkpointing.save(initial, str(tmp / WEIGHTS))
        _write_manifest(tmp / WEIGHTS)
        (tmp / FIELDS).write_text(json.dumps(fields, indent=2) + "\n", encoding="utf-8")
        tokenizer = copy_tokenizer(args.hf_dir, tmp, named=args.out)
        recipe = continue_recipe(args.out, fields, raw["model_type"], WEIGHTS, tokenizer)
        (tmp / RECIPE).write_text(recipe, encoding="utf-8")
        hf_config = {**full, "rms_norm_eps": eps.value}
        (tmp / HF_CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
    print(
        f"wrote {args.out}/{WEIGHTS} and {args.out}/{FIELDS} ({raw['model_type']}, "
        f"{fields['num_layers']} layers); layernorm_epsilon={eps.value:g} from {eps.source}\n"
        f"continue training: megatron-ext launch {args.out / RECIPE} data.path=PREFIX "
        "optimizer.name=muon\n"
        + (
            f"tokenizer: {tokenizer['tokenizer']} from {tokenizer['tokenizer_model']} (the "
            "recipe's data.tokenizer)"
            if tokenizer is not None
            else "tokenizer: none came with the model; data.path must hold its tokenizer's ids"
        )
    )
    return 0


def _write_manifest(folder: Path) -> None:
    """The step-0 checkpoint's manifest, as the trainer writes one (``ckpt verify`` checks it
    like any other; one process wrote every file)."""
    from megatron_ext.ckpt.manifest import (
        build_manifest,
        checkpoint_files,
        hash_files,
        write_manifest,
    )

    layout = dict.fromkeys(
        (
            "world_size",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "data_parallel_size",
        ),
        1,
    )
    files = hash_files(folder, checkpoint_files(folder))
    write_manifest(folder, build_manifest(files, step=0, recipe_hash="", layout=layout))


def load_mcore(ckpt: Path):
    """The GPTModel ``hf-to-mcore`` wrote to ``ckpt``."""
    if not (ckpt / FIELDS).is_file() or not (ckpt / WEIGHTS).is_dir():
        raise ConfigError(f"{ckpt}: no {FIELDS} and {WEIGHTS}/ (write it with hf-to-mcore)")
    from megatron_ext.gpt.checkpoint import load_model_weights

    fields = read_json(ckpt / FIELDS, MCORE_FIX)
    with reading_model(ckpt / FIELDS, "the model it describes", MCORE_FIX):
        gpt = _empty_mcore(fields)
    with reading_model(ckpt / WEIGHTS, f"the weights of the model in {FIELDS}", MCORE_FIX):
        load_model_weights(ckpt / WEIGHTS, gpt)
    return gpt.eval()


def _mcore_to_hf(args: argparse.Namespace) -> int:
    _refuse_output(args.out)
    if (args.mcore_ckpt / HF_CONFIG).is_file():  # a hf-to-mcore folder: its own HF config
        fields = read_json(args.mcore_ckpt / FIELDS, MCORE_FIX)
        raw = read_json(args.mcore_ckpt / HF_CONFIG, MCORE_FIX)
        if "model_type" not in raw:
            raise ConfigError(f"{args.mcore_ckpt / HF_CONFIG} has no model_type: {MCORE_FIX}")
        gpt = load_mcore(args.mcore_ckpt)
    elif args.recipe is not None:  # a GPT-trainer checkpoint: the HF config from the recipe
        gpt, fields, raw = _trainer_checkpoint(args)
    else:
        raise ConfigError(
            f"{args.mcore_ckpt}: no {HF_CONFIG} (not a hf-to-mcore folder); for a GPT-trainer "
            "checkpoint (run_dir/checkpoints/step_N) give the recipe that wrote it: "
            "--recipe RECIPE [key=value ...]"
        )
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_ext.convert.to_hf import mcore_to_hf_state

    state = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    hf = AutoModelForCausalLM.from_config(config)
    with reading_model(args.mcore_ckpt, "the weights into the HF model", MCORE_FIX):
        hf.load_state_dict(mcore_to_hf_state(state, fields), strict=True)
    with atomic_dir(args.out) as tmp:
        hf.save_pretrained(tmp)
    print(f"wrote {args.out} ({config.model_type}, rms_norm_eps={config.rms_norm_eps:g})")
    return 0


def _trainer_checkpoint(args: argparse.Namespace) -> tuple[object, dict, dict]:
    """(model, mapping fields, HF config) of a GPT-trainer checkpoint and its recipe."""
    from megatron_ext.config.load import read_recipe
    from megatron_ext.config.trainers import get_trainer

    if not (args.mcore_ckpt / "metadata.json").is_file():
        raise ConfigError(
            f"{args.mcore_ckpt}: not a checkpoint folder (no metadata.json); name a step "
            "folder such as run_dir/checkpoints/step_000100"
        )
    recipe = read_recipe(args.recipe[0], args.recipe[1:])
    if not get_trainer(recipe.trainer).converts_hf:
        raise ConfigError(
            f"--recipe {args.recipe[0]} is a trainer={recipe.trainer} recipe: give the GPT "
            "recipe that wrote the checkpoint"
        )
    from megatron_ext.convert.from_trainer import hf_config_fields, hf_family, load_trainer_model

    hf_family(recipe.model)  # an unsupported family stops before the weights load
    fix = "give the recipe (and overrides) that wrote this checkpoint"
    with reading_model(args.mcore_ckpt, "the checkpoint with this --recipe's model", fix):
        gpt, fields = load_trainer_model(args.mcore_ckpt, recipe)
    model_type, raw = hf_config_fields(recipe, gpt.config, gpt.vocab_size)
    return gpt, fields, {"model_type": model_type, **raw}


def _empty_mcore(fields: dict):
    from megatron_ext.convert.parity import init_single_process
    from megatron_ext.gpt.sections import ModelConfig, ParallelConfig
    from megatron_ext.megatron.model import build_gpt_model

    init_single_process()
    model = ModelConfig(**fields)
    return build_gpt_model(model, ParallelConfig(), "fp32", model.vocab_size, seq_length=4096)


def _check(args: argparse.Namespace, raw: dict) -> int:
    import torch

    from megatron_ext.convert.parity import compare

    gpt = load_mcore(args.mcore_ckpt)
    hf = load_hf(args.hf_dir)
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, raw["vocab_size"], (2, args.tokens), generator=generator)
    comparable = reading_model(args.mcore_ckpt, f"a model comparable with {args.hf_dir}", CHECK_FIX)
    with comparable, step("convert", "running both models"):
        figures = compare(hf, gpt, tokens)
    print(json.dumps(figures))
    if args.json is not None:
        write_json(args.json, figures)
    failed = parity_failures(figures, args)
    if failed:
        print(
            f"megatron-ext: error: parity failed: {'; '.join(failed)} ({args.mcore_ckpt} is not "
            f"a conversion of {args.hf_dir}, or the conversion is wrong)",
            file=sys.stderr,
        )
        return 1
    return 0


def parity_failures(figures: dict, args: argparse.Namespace) -> list[str]:
    """The figures of ``convert check`` below their thresholds, each as ``name value < min``."""
    failed = []
    if not figures["cosine"] >= args.min_cosine:
        failed.append(f"cosine {figures['cosine']:.6f} < --min-cosine {args.min_cosine}")
    if not figures["argmax_agreement"] >= args.min_argmax_agreement:
        failed.append(
            f"argmax agreement {figures['argmax_agreement']:.4f} < --min-argmax-agreement "
            f"{args.min_argmax_agreement}"
        )
    for layer, agreement in enumerate(figures["expert_selection_agreement"]):
        if not agreement >= args.min_expert_agreement:
            failed.append(
                f"layer {layer} expert agreement {agreement:.4f} < --min-expert-agreement "
                f"{args.min_expert_agreement}"
            )
    return failed


from megatron_ext.convert.eps_cli import add_tools_arguments, tools_main  # noqa: E402

#: The ``megatron_ext.commands`` entry point ``tools`` (setup.py).
TOOLS = Command(
    name="tools",
    usage="eps-sweep ...",
    help="model diagnostics: the RMSNorm epsilon sensitivity sweep",
    add_arguments=add_tools_arguments,
    run=tools_main,
)

#: The ``megatron_ext.commands`` entry point ``convert`` (setup.py).
CONVERT = Command(
    name="convert",
    usage="hf-to-mcore|mcore-to-hf|check ...",
    help="Hugging Face <-> megatron-core checkpoints, and their logit parity",
    add_arguments=add_arguments,
    run=convert_main,
)
