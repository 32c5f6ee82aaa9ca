"""megatron-ext's writer of megatron-core's indexed dataset against megatron-core's own.

``megatron_ext.data.indexed`` writes ``<prefix>.bin/.idx`` without importing megatron-core (so
that ``megatron-ext data build`` does not pay its ~6 s import); megatron-core's
``IndexedDatasetBuilder`` is the peer: the same documents must give the same bytes, and
megatron-core's ``IndexedDataset`` must read ours back. The CLI's ``data build`` and
``data tokenizer`` are then run in a fresh process and must leave no ``megatron`` (nor torch)
module imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from megatron_ext.data.indexed import IndexWriter, token_dtype
from megatron_ext.data.tokenizers import SentencePieceTokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("vocab_size", [2, 258, 65499, 65500, 151_936])
def test_token_dtype_is_megatron_cores_choice(vocab_size: int) -> None:
    assert token_dtype(vocab_size) == np.dtype(DType.optimal_dtype(vocab_size))


@pytest.mark.parametrize("vocab_size", [258, 100_000])  # uint16 and int32 ids
def test_writer_bytes_equal_megatron_cores(tmp_path: Path, vocab_size: int) -> None:
    rng = np.random.default_rng(vocab_size)
    documents = [rng.integers(0, vocab_size, rng.integers(1, 300)) for _ in range(57)]
    dtype = token_dtype(vocab_size)

    ours = IndexWriter(str(tmp_path / "ours"), dtype)
    theirs = IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype.type)
    for ids in documents:
        ours.add_document(ids)
        theirs.add_document(ids, lengths=[len(ids)])
    ours.finalize()
    theirs.finalize(str(tmp_path / "theirs.idx"))

    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (
            tmp_path / f"theirs{suffix}"
        ).read_bytes()
    read = IndexedDataset(str(tmp_path / "ours"))
    assert read.index.dtype == dtype.type
    assert read.document_indices.tolist() == list(range(len(documents) + 1))
    for i, ids in enumerate(documents):
        np.testing.assert_array_equal(read[i], ids)


_NO_MEGATRON = """
import json, sys
from megatron_ext.launch.cli import main
root = sys.argv[1]
codes = [
    main(["data", "tokenizer", root + "/text", "--output", root + "/spm", "--vocab-size", "300"]),
    main(["data", "build", root + "/text", "--output", root + "/byte/ds"]),
    main(["data", "build", root + "/text", "--output", root + "/spm/ds",
          "--tokenizer", "sentencepiece", "--tokenizer-model", root + "/spm.model"]),
]
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("megatron", "torch"))
print(json.dumps({"codes": codes, "loaded": loaded}))
"""


def test_data_commands_run_without_megatron_core(tmp_path: Path) -> None:
    """``data tokenizer`` then ``data build`` (byte, SentencePiece) in a fresh process: no
    ``megatron.*`` or ``torch`` module imported, and megatron-core reads what was written."""
    words = ["alpha", "beta", "γάμμα", "délta", "😀", "epsilon"]
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(words, size=rng.integers(1, 30))) for _ in range(200)]
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("\n\n".join(docs[:100]) + "\n")
    (tmp_path / "text" / "b.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in docs[100:])
    )
    result = subprocess.run(
        [sys.executable, "-c", _NO_MEGATRON, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"codes": [0, 0, 0], "loaded": []}

    spm = SentencePieceTokenizer(tmp_path / "spm.model")
    for prefix, tokenize, eod in (
        (tmp_path / "byte" / "ds", lambda d: list(d.encode("utf-8")), 256),
        (tmp_path / "spm" / "ds", spm.tokenize, spm.eod),
    ):
        read = IndexedDataset(str(prefix))
        assert [read[i].tolist() for i in range(len(read))] == [[*tokenize(d), eod] for d in docs]
