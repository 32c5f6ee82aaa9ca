"""Tokenizers for pretraining: UTF-8 bytes, a SentencePiece model trained on local text, a
Hugging Face tokenizer saved in a local folder (a converted model's own), or Megatron-LM's
``NullTokenizer`` (text that is already ids).

All implement megatron-core's tokenizer interface (``MegatronTokenizerBase``, the type
``GPTDatasetConfig.tokenizer`` is declared with: ``path``, ``tokenize``, ``detokenize``,
``vocab``, ``vocab_size``, ``apply_chat_template``) without importing megatron-core, so that
``megatron-ext data build`` and ``data tokenizer`` run without it (megatron-core's import is
~6 s of a 1 MB build's ~8 s); :mod:`megatron_ext.data.build`, which hands them to
megatron-core, registers :class:`PretrainingTokenizer` as a virtual subclass of
``MegatronTokenizerBase``. They provide what megatron-core's datasets read from a tokenizer:

- ``eod``: the end-of-document id appended after every document when a dataset is built;
- ``pad``: an id that never occurs in a document (megatron-core pads short samples with it and
  masks their loss);
- ``vocab_size``: ids are in ``[0, vocab_size)``; it also picks the token dtype on disk;
- ``unique_identifiers``: a JSON-able description that enters the hash naming the GPT dataset's
  index cache.

Chat templates are out of scope for pretraining tokenizers: ``apply_chat_template`` (abstract in
megatron-core) raises ``NotImplementedError``.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, get_args

import sentencepiece

from megatron_ext.atomic import atomic_path
from megatron_ext.data.kinds import TokenizerKind, gpt2_files
from megatron_ext.errors import ConfigError

SentencePieceModelType = Literal["bpe", "unigram"]


class PretrainingTokenizer(ABC):
    """megatron-core's abstract tokenizer interface (``MegatronTokenizerBase``: ``path`` and the
    abstract methods below), plus ``eod`` and ``pad`` ids, and no chat template."""

    eod: int
    pad: int

    def __init__(self, path: str) -> None:
        self.path = path  # megatron-core's tokenizers name their model file or folder here

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """``text`` -> token ids."""

    @abstractmethod
    def detokenize(self, ids: Iterable[int]) -> str:
        """Token ids -> text."""

    @property
    @abstractmethod
    def vocab(self) -> dict[str, int]:
        """Token ids by name."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Ids are in ``[0, vocab_size)``."""

    @property
    @abstractmethod
    def unique_identifiers(self) -> dict[str, Any]:
        """A JSON-able description hashed into megatron-core's dataset cache names."""

    @property
    def eos(self) -> int:
        """Alias of ``eod``: megatron-core reads ``eos`` in places where it means end of text."""
        return self.eod

    @property
    def special_tokens_dict(self) -> dict[str, int]:
        """Special ids by role; megatron-core checks that ``pad`` collides with none of them."""
        return {"eod_token": self.eod, "pad_token": self.pad}

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} is a pretraining tokenizer; it has no chat template"
        )


class ByteTokenizer(PretrainingTokenizer):
    """UTF-8 bytes as ids 0..255, then ``eod`` = 256 and ``pad`` = 257 (``vocab_size`` = 258).

    Any string round-trips: ``detokenize(tokenize(s)) == s``. Decoding an arbitrary id sequence
    (a model's sample) replaces invalid UTF-8 with U+FFFD and drops the special ids.
    """

    eod = 256
    pad = 257

    def __init__(self) -> None:
        super().__init__(path="")

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def vocab(self) -> dict[str, int]:
        """Token names by id, in SentencePiece's spelling of byte pieces (``<0x41>``)."""
        names = {f"<0x{b:02X}>": b for b in range(256)}
        return {**names, "<eod>": self.eod, "<pad>": self.pad}

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        return {"class": "megatron_ext.ByteTokenizer", "vocab_size": self.vocab_size}

    def tokenize(self, text: str) -> list[int]:
        """``text`` -> its UTF-8 bytes as ids (one id per byte)."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Ids -> text; special ids carry no text and are dropped, others must be in range."""
        ids = list(ids)
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"ids outside [0, {self.vocab_size}) cannot be byte tokens")
        data = bytes(i for i in ids if i < 256)
        return data.decode("utf-8", errors="replace")


class SentencePieceTokenizer(PretrainingTokenizer):
    """A SentencePiece model (``.model`` file).

    ``eod`` is the model's ``eos`` piece, or else a piece named ``<eod>``; ``pad`` is the model's
    pad piece, or else -1 (megatron-core's own "no pad" value, which no token ever has).
    """

    def __init__(self, model_path: str | Path) -> None:
        path = Path(model_path)
        if not path.is_file():
            raise ConfigError(
                f"SentencePiece model {str(path)!r} not found (train one with "
                "`megatron-ext data tokenizer`)"
            )
        proto = path.read_bytes()
        super().__init__(path=str(path))
        try:
            self._model = sentencepiece.SentencePieceProcessor(model_proto=proto)
        except RuntimeError:
            raise ConfigError(
                f"{path} is not a SentencePiece model: give a .model file (`megatron-ext data "
                "tokenizer` trains one), or the tokenizer kind it is"
            ) from None
        self._sha256 = hashlib.sha256(proto).hexdigest()
        self.eod = self._find_eod(path)
        pad = self._model.pad_id()
        self.pad = pad if pad >= 0 else -1

    def _find_eod(self, path: Path) -> int:
        if self._model.eos_id() >= 0:
            return self._model.eos_id()
        eod = self._model.piece_to_id("<eod>")
        if eod != self._model.unk_id():
            return eod
        raise ConfigError(
            f"SentencePiece model {str(path)!r} has neither an eos piece nor an "
            "'<eod>' piece to end documents with; retrain it with eos_id >= 0"
        )

    @property
    def vocab_size(self) -> int:
        return self._model.vocab_size()

    @property
    def vocab(self) -> dict[str, int]:
        return {self._model.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        # The model's content, not its path: moving the file keeps caches, retraining drops them.
        return {"class": "megatron_ext.SentencePieceTokenizer", "model_sha256": self._sha256}

    def tokenize(self, text: str) -> list[int]:
        return self._model.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        """Ids -> text; control pieces (eos, pad, ...) carry no text and are dropped."""
        return self._model.decode(list(ids))


class HuggingFaceTokenizer(PretrainingTokenizer):
    """A Hugging Face tokenizer saved in a folder (``tokenizer.json``, and the
    ``tokenizer_config.json`` ``save_pretrained`` writes beside it), or GPT-2's byte-level BPE
    files (Megatron-LM's ``GPT2BPETokenizer``: ``<prefix>vocab.json`` given, its
    ``<prefix>merges.txt`` beside it; or a folder holding ``vocab.json`` and ``merges.txt``),
    read with the ``tokenizers`` library: no network, no ``transformers`` import.

    ``eod``: the config's ``eos_token``, else the first of ``<|endoftext|>``, ``</s>``,
    ``<|end_of_text|>``, ``<eos>`` in the vocabulary; ``pad``: the config's ``pad_token``, else
    -1. Text is encoded without special tokens (a document is its text; ``eod`` follows it).
    """

    EOD_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")

    def __init__(self, folder: str | Path) -> None:
        path = Path(folder)
        file = path / "tokenizer.json" if path.is_dir() else path
        gpt2 = gpt2_files(path)
        if file.is_file() and not file.name.endswith("vocab.json"):
            raw = file.read_bytes()
            self._tokenizer = _from_json(raw)
        elif all(f.is_file() for f in gpt2):
            raw = gpt2[0].read_bytes() + b"\0" + gpt2[1].read_bytes()
            self._tokenizer = _gpt2_bpe(*gpt2)
        else:
            raise ConfigError(
                f"Hugging Face tokenizer {str(path)!r} not found: give the folder "
                "save_pretrained wrote (it holds tokenizer.json), or one holding GPT-2's "
                "vocab.json and merges.txt"
            )
        super().__init__(path=str(path))
        self._sha256 = hashlib.sha256(raw).hexdigest()
        config_file = file.with_name("tokenizer_config.json")
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.eod = self._special(config.get("eos_token"), self.EOD_NAMES, path)
        pad = self._token_id(config.get("pad_token"))
        self.pad = pad if pad is not None else -1

    def _token_id(self, token: Any) -> int | None:
        if isinstance(token, dict):  # {"content": "</s>", ...} in older configs
            token = token.get("content")
        return None if token is None else self._tokenizer.token_to_id(str(token))

    def _special(self, configured: Any, names: tuple[str, ...], path: Path) -> int:
        found = self._token_id(configured)
        for name in names if found is None else ():
            found = self._tokenizer.token_to_id(name)
            if found is not None:
                break
        if found is None:
            raise ConfigError(
                f"Hugging Face tokenizer {str(path)!r} names no end-of-text token "
                f"(eos_token in tokenizer_config.json, or one of {', '.join(names)}) to end "
                "documents with"
            )
        return found

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        return {"class": "megatron_ext.HuggingFaceTokenizer", "tokenizer_sha256": self._sha256}

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        """Ids -> text; special tokens carry no text and are dropped."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)


def _from_json(raw: bytes) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(raw.decode("utf-8"))


def _gpt2_bpe(vocab: Path, merges: Path) -> Any:
    """GPT-2's tokenizer from its two files: byte-level BPE after GPT-2's pre-tokenizing regex."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def build_tokenizer(
    kind: TokenizerKind, model_path: str | Path = "", vocab_size: int | None = None
) -> PretrainingTokenizer:
    """The tokenizer a recipe or the CLI names: ``byte``, ``sentencepiece`` with its model
    file, ``huggingface`` with its folder, or ``null_ids`` with its ``vocab_size`` (the recipe's
    ``model.vocab_size``; the other kinds take their vocabulary from their files and ignore it)."""
    if kind == "byte":
        if model_path:
            raise ConfigError(
                "the byte tokenizer takes no model file; drop --tokenizer-model "
                "(data.tokenizer_model) or use --tokenizer sentencepiece"
            )
        return ByteTokenizer()
    if kind == "sentencepiece":
        if not model_path:
            raise ConfigError(
                "the sentencepiece tokenizer needs its .model file "
                "(--tokenizer-model / data.tokenizer_model)"
            )
        return SentencePieceTokenizer(model_path)
    if kind == "huggingface":
        if not model_path:
            raise ConfigError(
                "the huggingface tokenizer needs its folder (--tokenizer-model / "
                "data.tokenizer_model: the folder save_pretrained wrote)"
            )
        return HuggingFaceTokenizer(model_path)
    if kind == "null_ids":
        if model_path:
            raise ConfigError(
                "the null_ids tokenizer takes no model file; drop --tokenizer-model "
                "(data.tokenizer_model)"
            )
        if vocab_size is None:
            raise ConfigError(
                "the null_ids tokenizer needs its vocabulary size: set model.vocab_size "
                "(--vocab-size for `data build`; Megatron-LM's --vocab-size)"
            )
        from megatron_ext.data.null_ids import NullIdsTokenizer

        return NullIdsTokenizer(vocab_size)
    raise ConfigError(f"unknown tokenizer {kind!r}; choose {' or '.join(get_args(TokenizerKind))}")


def train_sentencepiece(
    documents: Iterable[str],
    output_prefix: str | Path,
    vocab_size: int,
    model_type: SentencePieceModelType = "bpe",
) -> Path:
    """Train a SentencePiece model on ``documents``; write ``<output_prefix>.model``.

    The model is made to round-trip text: no normalisation (identity rule, whitespace kept, no
    dummy prefix), newline as a piece of its own, and byte fallback so any character outside
    the learned pieces (rare ones are left out: SentencePiece's default 99.95% character
    coverage) still encodes, as its UTF-8 bytes. The 256 byte pieces count towards
    ``vocab_size``. Ids: unk 0, bos 1, eos 2 (the tokenizer's ``eod``), pad 3.

    The ``.model`` file is written to a temporary name and renamed, so a failed run leaves no
    model behind. Returns the model's path.
    """
    # The trainer reads sentences, not documents: feed it lines (newline is a piece of its own).
    # SentencePiece holds all its input in memory anyway, so a list costs nothing extra and
    # keeps errors of the document stream out of the C++ trainer.
    lines = [line for doc in documents for line in doc.split("\n") if line]
    if not lines:
        raise ConfigError("no text to train a SentencePiece model on")
    output = Path(f"{output_prefix}.model")
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            byte_fallback=True,
            user_defined_symbols=["\n"],
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=3,
            minloglevel=2,
        )
    except RuntimeError as exc:  # e.g. a vocabulary too large or too small for the corpus
        most = re.search(r"Please set it to a value <= (\d+)", str(exc))
        if most:
            raise ConfigError(
                f"--vocab-size {vocab_size} is more pieces than this text makes (at most "
                f"{most.group(1)}): give --vocab-size {most.group(1)} or less, or more text"
            ) from None
        raise ConfigError(
            f"SentencePiece training (vocab_size={vocab_size}, {model_type}) failed: "
            f"{str(exc).strip().splitlines()[0]}"
        ) from None
    with atomic_path(output) as tmp:
        tmp.write_bytes(model.getvalue())
    return output
