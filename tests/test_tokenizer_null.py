"""Megatron-LM's ``--tokenizer-type NullTokenizer --vocab-size N`` as the ``null_ids`` tokenizer
kind: the converted recipe's tokenizer against the tokenizer Megatron-LM builds from the same
flags (its parser, then megatron-core's ``build_tokenizer``, padded vocabulary included), and a
converted recipe that trains on CPU from an indexed dataset of ids (the GPT trainer's own data
pipeline and model builder, in process)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_ext.config.load import recipe_from_dict
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.errors import ConfigError
from megatron_ext.megatron.from_megatron import convert
from megatron_ext.megatron.megatron_args import read_megatron_args

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 2 "
    "--train-iters 3 --lr 3e-3 --min-lr 3e-3 --data-path {data} "
    "--tokenizer-type NullTokenizer --vocab-size {vocab} "
)
#: ids as text, as Megatron-LM's NullTokenizer reads them; 0 and the top id included
TEXTS = ["0 1 2 3", "130 130 7", "130", "5 17 3 99 0 129 128"]


def test_null_ids_is_megatron_cores_null_tokenizer() -> None:
    """Vocabulary, end of document, pad, ids <-> text and the padded vocabulary at TP 4 equal
    those of the tokenizer Megatron-LM's ``build_tokenizer`` makes from the parsed flags."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as mlm_build

    from megatron_ext.megatron.from_megatron_parsed import megatron_words
    from megatron_ext.megatron.megatron_parse import parse_megatron
    from megatron_ext.megatron.model import padded_vocab_size

    # megatron-core asks for one CUDA connection under TP (validate_args), as scripts export
    flags = "export CUDA_DEVICE_MAX_CONNECTIONS=1\npretrain_gpt.py " + FLAGS.format(
        data="d", vocab=131
    )
    flags += "--tensor-model-parallel-size 4"
    args = read_megatron_args(flags)
    conversion = convert(args)
    assert conversion.model_changing == [] and conversion.recipe["data"]["tokenizer"] == "null_ids"
    recipe = recipe_from_dict(conversion.recipe)
    ours = build_tokenizer(
        recipe.data.tokenizer, recipe.data.tokenizer_model, recipe.model.vocab_size
    )

    parsed = parse_megatron(
        megatron_words(args), 4, environment={"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    )
    parsed.padded_vocab_size = None  # build_tokenizer sets it, as pretrain does
    theirs = mlm_build(parsed)
    assert (ours.vocab_size, ours.eod, ours.pad) == (theirs.vocab_size, theirs.eod, theirs.pad)
    assert (ours.vocab_size, ours.eod, ours.pad) == (131, 130, -1)
    for text in TEXTS:
        assert ours.tokenize(text) == theirs.tokenize(text)
        assert ours.detokenize(ours.tokenize(text)) == theirs.detokenize(theirs.tokenize(text))
    m = recipe.model
    padded = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 4)
    assert padded == parsed.padded_vocab_size == 512


def test_bad_input_is_one_clear_error(tmp_path: Path) -> None:
    """Text that is not ids, an id outside the vocabulary, no vocabulary; an end-of-document or
    pad id other than Megatron-LM's default is refused by the converter, the default mapped."""
    tokenizer = build_tokenizer("null_ids", "", 8)
    with pytest.raises(ConfigError, match="integers separated by single spaces"):
        tokenizer.tokenize("1  2")
    with pytest.raises(ConfigError, match=r"ids are in \[0, 8\).*got 8"):
        tokenizer.tokenize("1 8")
    with pytest.raises(ConfigError, match="needs its vocabulary size"):
        build_tokenizer("null_ids", "")
    recipe = recipe_from_dict(convert(read_megatron_args(FLAGS.format(data="d", vocab=8))).recipe)
    recipe.model.vocab_size = None
    with pytest.raises(ConfigError, match=r"data\.tokenizer=null_ids needs model\.vocab_size"):
        recipe.check()
    base = FLAGS.format(data="d", vocab=8)
    other = convert(read_megatron_args(base + "--null-tokenizer-eod-id 0"))
    assert other.model_changing == ["--null-tokenizer-eod-id 0"]
    default = convert(
        read_megatron_args(base + "--null-tokenizer-eod-id 7 --null-tokenizer-pad-id -1")
    )
    assert default.model_changing == [] and default.unmapped == []


def test_a_converted_null_tokenizer_recipe_trains_on_cpu(tmp_path: Path) -> None:
    """The recipe converted from the flags builds its dataset of ids (each document then eod),
    the GPT trainer's data pipeline reads it, and three Adam steps on its batches give finite
    losses."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.convert.parity import init_single_process
    from megatron_ext.data.indexed import build_indexed_dataset
    from megatron_ext.gpt.sections import ParallelConfig
    from megatron_ext.gpt.setup import build_data
    from megatron_ext.megatron.model import build_gpt_model
    from megatron_ext.schedules.plan import training_schedule

    prefix = tmp_path / "ids"
    conversion = convert(read_megatron_args(FLAGS.format(data=prefix, vocab=131)))
    recipe = recipe_from_dict(conversion.recipe)
    recipe.data.split = "100,0,0"
    recipe.training.eval_iters = 0
    recipe.check()
    text = tmp_path / "ids.txt"
    text.write_text("\n\n".join(TEXTS * 8) + "\n")
    tokenizer = build_tokenizer(recipe.data.tokenizer, "", recipe.model.vocab_size)
    build_indexed_dataset([str(text)], str(prefix), tokenizer)
    dataset = IndexedDataset(str(prefix))  # held: its documents are views of its mmap
    assert dataset[1].tolist() == [130, 130, 7, 130]

    init_single_process()
    torch.manual_seed(0)
    schedule = training_schedule(recipe.training, recipe.optimizer)
    train, _ = build_data(recipe, tokenizer, schedule)
    t = recipe.training
    model = build_gpt_model(recipe.model, ParallelConfig(), "fp32", tokenizer.vocab_size, 16)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(t.steps):
        batch = [train[step * 2 + i] for i in range(2)]
        tokens, labels, mask = (
            torch.stack([torch.as_tensor(s[k]) for s in batch]).long()
            for k in ("tokens", "labels", "loss_mask")
        )
        assert int(tokens.max()) < 131
        positions = torch.arange(16).expand(2, 16)
        loss = (model(tokens, positions, None, labels=labels) * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert t.steps == 3 and all(math.isfinite(x) for x in losses), losses
