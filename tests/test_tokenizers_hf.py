"""Hugging Face tokenizers from a local folder (``data.tokenizer: huggingface``), and GPT-2's
vocab + merges files (Megatron-LM's ``GPT2BPETokenizer``), against Hugging Face transformers'
own tokenizers on the same files: both trained here on the python-docs corpus and saved as the
Hugging Face libraries save them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ext.data.corpus import iter_documents
from megatron_ext.data.tokenizers import HuggingFaceTokenizer, build_tokenizer
from megatron_ext.errors import ConfigError
from megatron_ext.megatron.from_megatron import convert
from megatron_ext.megatron.megatron_args import read_megatron_args

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def documents() -> list[str]:
    return list(iter_documents(["python-docs"]))[:400]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, documents) -> Path:
    """A BPE tokenizer trained here, saved with ``save_pretrained`` (tokenizer.json and
    tokenizer_config.json), its end of text ``<|endoftext|>`` and pad ``<pad>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<|endoftext|>", "<pad>"]
    )
    tok.train_from_iterator(documents, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>", unk_token="<unk>"
    )
    folder = tmp_path_factory.mktemp("hf_tokenizer")
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gpt2_vocab(tmp_path_factory, documents) -> Path:
    """GPT-2-style byte-level BPE files, ``gpt2-vocab.json`` and ``gpt2-merges.txt``."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(documents, vocab_size=700, special_tokens=["<|endoftext|>"])
    folder = tmp_path_factory.mktemp("gpt2")
    bpe.save_model(str(folder), "gpt2")
    return folder / "gpt2-vocab.json"


def test_a_saved_tokenizer_tokenizes_as_transformers_does(hf_folder, documents) -> None:
    ours = build_tokenizer("huggingface", hf_folder)
    theirs = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
    for doc in documents[:50]:
        assert ours.tokenize(doc) == theirs(doc, add_special_tokens=False)["input_ids"]
    assert (ours.eod, ours.pad) == (theirs.eos_token_id, theirs.pad_token_id)
    assert ours.vocab_size == len(theirs)
    ids = ours.tokenize(documents[0])
    assert ours.detokenize([*ids, ours.eod]) == theirs.decode(ids, skip_special_tokens=True)


def test_gpt2_vocab_and_merges_tokenize_as_transformers_gpt2(gpt2_vocab, documents) -> None:
    """Megatron-LM's GPT2BPETokenizer files: byte-level BPE after GPT-2's regex, as
    transformers' (slow, pure-Python) GPT2Tokenizer reads them."""
    ours = HuggingFaceTokenizer(gpt2_vocab)
    theirs = transformers.GPT2Tokenizer(
        str(gpt2_vocab), str(gpt2_vocab.with_name("gpt2-merges.txt"))
    )
    for doc in documents[:50]:
        assert ours.tokenize(doc) == theirs(doc, add_special_tokens=False)["input_ids"]
    assert ours.eod == theirs.convert_tokens_to_ids("<|endoftext|>")
    assert ours.detokenize(ours.tokenize(documents[1])) == documents[1]


def test_a_dataset_built_with_it_holds_its_ids_then_eod(hf_folder, tmp_path, documents) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.data.indexed import build_indexed_dataset

    text = tmp_path / "docs.jsonl"
    import json

    text.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents[:20]))
    tokenizer = build_tokenizer("huggingface", hf_folder)
    build_indexed_dataset([str(text)], tmp_path / "ds", tokenizer)
    dataset = IndexedDataset(str(tmp_path / "ds"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
    for i in (0, 7, 19):
        expected = [
            *theirs(documents[i], add_special_tokens=False)["input_ids"],
            theirs.eos_token_id,
        ]
        assert dataset[i].tolist() == expected


def test_a_folder_without_a_tokenizer_is_one_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not found: give the folder save_pretrained wrote"):
        build_tokenizer("huggingface", tmp_path)
    with pytest.raises(ConfigError, match="needs its folder"):
        build_tokenizer("huggingface", "")


BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
    "--max-position-embeddings 128 "
    "--micro-batch-size 1 --global-batch-size 8 --train-iters 10 --lr 1e-3 --data-path d "
)


def test_megatron_lms_hf_and_gpt2_tokenizers_map_to_the_recipe() -> None:
    hf = convert(
        read_megatron_args(BASE + "--tokenizer-type HuggingFaceTokenizer --tokenizer-model tok/")
    )
    assert hf.recipe["data"]["tokenizer"] == "huggingface" and hf.model_changing == []
    assert hf.recipe["data"]["tokenizer_model"] == "tok/"
    gpt2 = "--tokenizer-type GPT2BPETokenizer --vocab-file g/gpt2-vocab.json "
    same = convert(read_megatron_args(BASE + gpt2 + "--merge-file g/gpt2-merges.txt"))
    assert (same.recipe["data"]["tokenizer"], same.recipe["data"]["tokenizer_model"]) == (
        "huggingface",
        "g/gpt2-vocab.json",
    )
    apart = convert(read_megatron_args(BASE + gpt2 + "--merge-file other/merges.txt"))
    assert "--merge-file other/merges.txt" in apart.model_changing
