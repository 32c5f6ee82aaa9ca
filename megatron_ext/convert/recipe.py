"""The GPT recipe ``hf-to-mcore`` writes next to a converted checkpoint (``OUT/recipe.yaml``):
the converted model's fields and ``checkpoint.load`` at its weights, so that continuing
training is one command::

    megatron-ext launch OUT/recipe.yaml data.path=PREFIX optimizer.name=muon training.steps=N

Everything else (data, training, parallel layout, optimizer) is the schema's default, to be set
on the command line or by editing the file. The dataset must hold ids of the model's own
tokenizer (below ``model.vocab_size``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

RECIPE = "recipe.yaml"


def continue_recipe(out: Path, fields: dict[str, Any], model_type: str, weights: str) -> str:
    """The recipe text for the checkpoint folder ``out`` (``weights``: its step-0 folder)."""
    out = out.resolve()
    recipe = {
        "trainer": "gpt",
        "run_dir": str(out / "run"),
        "model": fields,
        "checkpoint": {"load": str(out / weights)},
    }
    header = (
        f"# Continue training the converted {model_type} model (megatron-ext convert "
        f"hf-to-mcore):\n#   megatron-ext launch {out / RECIPE} data.path=PREFIX "
        "optimizer.name=muon training.steps=N\n"
        "# data.path: an indexed dataset of the model's own tokenizer's ids (< vocab_size).\n"
    )
    return header + yaml.safe_dump(recipe, sort_keys=False)
