"""The tokenizer kinds a recipe and ``megatron-ext data build`` name, typed once (torch-free:
the recipe schema reads them; :mod:`.tokenizers` implements them)."""

from pathlib import PurePath
from typing import Literal

#: ``byte``: UTF-8 bytes; ``sentencepiece``: a ``.model`` file; ``huggingface``: a folder saved
#: by ``save_pretrained`` (its ``tokenizer.json``), read offline with the ``tokenizers`` library;
#: ``null_ids``: Megatron-LM's ``NullTokenizer`` (the text is its ids, space-separated; the
#: vocabulary is ``model.vocab_size``; not named ``null``, which YAML reads as None).
TokenizerKind = Literal["byte", "sentencepiece", "huggingface", "null_ids"]


def gpt2_files[P: PurePath](path: P) -> tuple[P, P]:
    """GPT-2's (vocab, merges) for a folder (``vocab.json``, ``merges.txt``) or a vocabulary
    file ``<prefix>vocab.json`` (its merges: ``<prefix>merges.txt`` beside it)."""
    if path.name.endswith("vocab.json"):
        return path, path.with_name(path.name[: -len("vocab.json")] + "merges.txt")
    return path / "vocab.json", path / "merges.txt"
