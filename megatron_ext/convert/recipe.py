"""The GPT recipe ``hf-to-mcore`` writes next to a converted checkpoint (``OUT/recipe.yaml``):
the converted model's fields and ``checkpoint.load`` at its weights, so that continuing
training is one command::

    megatron-ext launch OUT/recipe.yaml data.path=PREFIX optimizer.name=muon training.steps=N

The model's tokenizer files (``tokenizer.json`` and its config, GPT-2's ``vocab.json`` +
``merges.txt``, or a SentencePiece ``tokenizer.model``) are copied to ``OUT/tokenizer/`` and the
recipe's ``data.tokenizer`` reads them (:func:`copy_tokenizer`), so a dataset built by the run
(``data.source``) holds the model's own ids. Without tokenizer files the recipe keeps the byte
tokenizer and says that the dataset must hold ids of the model's own tokenizer. Everything else
(data, training, parallel layout, optimizer) is the schema's default, to be set on the command
line or by editing the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

RECIPE = "recipe.yaml"
TOKENIZER = "tokenizer"
#: a Hugging Face model folder's tokenizer files (the first set found is copied)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
GPT2_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
SENTENCEPIECE_FILE = "tokenizer.model"


def copy_tokenizer(hf_dir: Path, out: Path, named: Path | None = None) -> dict[str, str] | None:
    """Copy the model's tokenizer from ``hf_dir`` to ``out/tokenizer/``; the recipe's ``data``
    fields that read it (None when ``hf_dir`` holds no tokenizer), with paths under ``named``
    (default ``out``: a folder written under a temporary name names its final one)."""
    import shutil

    folder = out / TOKENIZER
    final = (named or out) / TOKENIZER
    if (hf_dir / "tokenizer.json").is_file() or (hf_dir / "vocab.json").is_file():
        folder.mkdir()
        for name in {*HF_TOKENIZER_FILES, *GPT2_FILES}:
            if (hf_dir / name).is_file():
                shutil.copy2(hf_dir / name, folder / name)
        return {"tokenizer": "huggingface", "tokenizer_model": str(final.resolve())}
    if (hf_dir / SENTENCEPIECE_FILE).is_file():
        folder.mkdir()
        shutil.copy2(hf_dir / SENTENCEPIECE_FILE, folder / SENTENCEPIECE_FILE)
        return {
            "tokenizer": "sentencepiece",
            "tokenizer_model": str((final / SENTENCEPIECE_FILE).resolve()),
        }
    return None


def continue_recipe(
    out: Path,
    fields: dict[str, Any],
    model_type: str,
    weights: str,
    tokenizer: dict[str, str] | None = None,
) -> str:
    """The recipe text for the checkpoint folder ``out`` (``weights``: its step-0 folder;
    ``tokenizer``: the ``data`` fields of the copied tokenizer, :func:`copy_tokenizer`)."""
    out = out.resolve()
    recipe: dict[str, Any] = {
        "trainer": "gpt",
        "run_dir": str(out / "run"),
        "model": fields,
        "checkpoint": {"load": str(out / weights)},
    }
    if tokenizer is not None:
        recipe["data"] = dict(tokenizer)
    data_note = (
        f"# data: the model's own tokenizer ({out / TOKENIZER}); data.source builds a dataset "
        "with it.\n"
        if tokenizer is not None
        else "# data.path: an indexed dataset of the model's own tokenizer's ids (< vocab_size): "
        "no tokenizer files came with the model.\n"
    )
    header = (
        f"# Continue training the converted {model_type} model (megatron-ext convert "
        f"hf-to-mcore):\n#   megatron-ext launch {out / RECIPE} data.path=PREFIX "
        "optimizer.name=muon training.steps=N\n" + data_note
    )
    return header + yaml.safe_dump(recipe, sort_keys=False)
