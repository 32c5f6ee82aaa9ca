"""Tokenizers, corpora, indexed-dataset building and megatron-core GPT datasets."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_ext.data.build import build_gpt_datasets
from megatron_ext.data.corpus import iter_documents, python_stdlib_documents, resolve_inputs
from megatron_ext.data.indexed import build_indexed_dataset
from megatron_ext.data.tokenizers import (
    ByteTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    train_sentencepiece,
)
from megatron_ext.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
MEGATRON_EXT = Path(sys.executable).parent / "megatron-ext"

UNICODE_SAMPLES = [
    "",
    "plain ASCII, with  two spaces and a tab\there",
    "lines\nand\r\nendings\n\n",
    "  leading and trailing whitespace  ",
    "Ünïcödé: naïve café, Straße, ελληνικά, русский, 日本語, 한국어, עברית, العربية",
    "emoji 😀🚀 and a ZWJ family 👨‍👩‍👧 and combining e\u0301",
    "NUL \x00 and other controls \x07\x1b",
]


# ---------------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("text", UNICODE_SAMPLES)
def test_byte_tokenizer_round_trip(text: str) -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.detokenize(ids) == text


def test_byte_tokenizer_specials() -> None:
    tokenizer = ByteTokenizer()
    assert isinstance(tokenizer, MegatronTokenizerBase)
    assert (tokenizer.eod, tokenizer.pad, tokenizer.vocab_size) == (256, 257, 258)
    assert len(tokenizer.vocab) == tokenizer.vocab_size
    # specials carry no text; a torn UTF-8 sequence decodes to U+FFFD instead of failing
    assert tokenizer.detokenize([104, 105, tokenizer.eod, 33, tokenizer.pad]) == "hi!"
    assert tokenizer.detokenize([0xE6, 0x97]) == "\ufffd"
    with pytest.raises(ValueError, match="outside"):
        tokenizer.detokenize([258])
    with pytest.raises(NotImplementedError, match="chat template"):
        tokenizer.apply_chat_template([])


@pytest.fixture(scope="module")
def stdlib_docs() -> list[str]:
    return list(python_stdlib_documents(max_bytes=300_000))


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory: pytest.TempPathFactory, stdlib_docs: list[str]) -> Path:
    # train on the first 80% of the documents; the rest are held out for the round trip
    train = stdlib_docs[: len(stdlib_docs) * 4 // 5]
    return train_sentencepiece(train, tmp_path_factory.mktemp("spm") / "stdlib", 1000, "bpe")


def test_sentencepiece_round_trip(spm_model: Path, stdlib_docs: list[str]) -> None:
    tokenizer = SentencePieceTokenizer(spm_model)
    held_out = stdlib_docs[len(stdlib_docs) * 4 // 5 :]
    assert len(held_out) > 50
    for text in held_out + UNICODE_SAMPLES:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    # it learned subwords: far fewer tokens than bytes on English prose
    n_bytes = sum(len(doc.encode()) for doc in held_out)
    assert sum(len(tokenizer.tokenize(doc)) for doc in held_out) < 0.6 * n_bytes


def test_sentencepiece_specials(spm_model: Path) -> None:
    tokenizer = build_tokenizer("sentencepiece", spm_model)
    assert isinstance(tokenizer, MegatronTokenizerBase)
    assert tokenizer.vocab_size == 1000
    assert (tokenizer.eod, tokenizer.pad) == (2, 3)
    assert tokenizer.eod not in tokenizer.tokenize("text\n\nwith </s> and <pad> spelled out")
    assert tokenizer.detokenize([*tokenizer.tokenize("end"), tokenizer.eod]) == "end"


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_train_sentencepiece_model_types(
    tmp_path: Path, stdlib_docs: list[str], model_type: str
) -> None:
    path = train_sentencepiece(stdlib_docs[:300], tmp_path / "m", 600, model_type)
    assert path == tmp_path / "m.model"
    assert [p.name for p in tmp_path.iterdir()] == ["m.model"]  # no temporary file left
    tokenizer = SentencePieceTokenizer(path)
    assert tokenizer.detokenize(tokenizer.tokenize(stdlib_docs[0])) == stdlib_docs[0]


def test_tokenizer_errors(tmp_path: Path, stdlib_docs: list[str]) -> None:
    with pytest.raises(ConfigError, match="not found"):
        build_tokenizer("sentencepiece", tmp_path / "missing.model")
    with pytest.raises(ConfigError, match=r"needs its \.model file"):
        build_tokenizer("sentencepiece")
    with pytest.raises(ConfigError, match="takes no model file"):
        build_tokenizer("byte", "x.model")
    with pytest.raises(ConfigError, match="vocab_size=100"):
        train_sentencepiece(stdlib_docs[:50], tmp_path / "small", 100)
    with pytest.raises(ConfigError, match="no text"):
        train_sentencepiece(["", "\n\n"], tmp_path / "empty", 500)
    assert list(tmp_path.iterdir()) == []


# -------------------------------------------------------------------------------------- corpus


def test_stdlib_corpus_is_bounded_deduplicated_and_reproducible(stdlib_docs: list[str]) -> None:
    assert len(stdlib_docs) > 500
    assert sum(len(doc.encode()) for doc in stdlib_docs) <= 300_000
    assert len(set(stdlib_docs)) == len(stdlib_docs)
    assert all(doc.strip() for doc in stdlib_docs)
    # a smaller budget is a prefix of the same stream
    smaller = list(python_stdlib_documents(max_bytes=100_000))
    assert smaller == stdlib_docs[: len(smaller)]
    assert "Record of phased-in incompatible language changes" in stdlib_docs[0]  # __future__


def test_python_docs_corpus_is_the_language_reference_in_paragraphs() -> None:
    """``python-docs``: every paragraph of pydoc's topics, in sorted topic order, so the same
    interpreter always gives the same corpus; English prose, not code."""
    from pydoc_data.topics import topics

    docs = list(iter_documents(["python-docs"]))
    assert docs == list(iter_documents(["python-docs"]))
    assert all(doc == doc.strip() and doc for doc in docs)
    assert len(docs) > 1000  # paragraphs, enough for a document-wise train/valid split
    joined = "\n\n".join(topics[name].strip() for name in sorted(topics))
    # nothing but whitespace between paragraphs is lost
    assert "".join(docs).replace("\n", "").replace(" ", "") == joined.replace("\n", "").replace(
        " ", ""
    )
    words = " ".join(docs).split()
    assert sum(w.lower() in ("the", "of", "is", "a", "to") for w in words) / len(words) > 0.1


def test_txt_paragraphs_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"First line\r\nsecond line\r\n\r\n \t\n\n  Two  \n\n\n")
    records = [{"body": "x\ny", "id": 1}, {"body": "  "}, {"body": "z"}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    docs = list(iter_documents([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], "body"))
    assert docs == ["First line\nsecond line", "Two", "x\ny", "z"]


def test_folder_inputs_are_recursive_and_sorted(tmp_path: Path) -> None:
    for name in ("b/2.txt", "b/1.jsonl", "a.txt", "notes.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps({"text": name}) if name.endswith("l") else name)
    sources = resolve_inputs([str(tmp_path), "python-stdlib"])
    assert [s.path.relative_to(tmp_path).as_posix() for s in sources[:-1]] == [
        "a.txt",
        "b/1.jsonl",
        "b/2.txt",
    ]
    assert sources[-1].kind == "python-stdlib" and sources[-1].path is None


@pytest.mark.parametrize(
    ("content", "suffix", "match"),
    [
        (None, ".txt", "not found"),
        ("text", ".csv", "unsupported type '.csv'"),
        ('{"text": "ok"}\n{"txt": "typo"}\n', ".jsonl", r"f\.jsonl:2: no 'text' field"),
        ('{"text": "ok"}\nnot json\n', ".jsonl", r"f\.jsonl:2: not a JSON line"),
        ('{"text": 3}\n', ".jsonl", "is a int, not a string"),
        ("\n\n  \n", ".txt", "no documents"),
    ],
)
def test_bad_inputs(tmp_path: Path, content: str | None, suffix: str, match: str) -> None:
    path = tmp_path / f"f{suffix}"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        list(iter_documents([str(path)]))


def test_bad_folders(tmp_path: Path) -> None:
    (tmp_path / "readme.md").write_text("no corpus here")
    with pytest.raises(ConfigError, match=r"holds no \.txt or \.jsonl files"):
        resolve_inputs([str(tmp_path)])
    with pytest.raises(ConfigError, match="no inputs"):
        resolve_inputs([])
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        list(iter_documents([str(tmp_path)]))


# -------------------------------------------------------------------------- indexed datasets


def _write_corpus(folder: Path, n_docs: int = 60, seed: int = 0) -> list[str]:
    """``n_docs`` documents of varied length: half in a .txt, half in a .jsonl file."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "γάμμα", "délta", "😀", "epsilon", "zeta\tη"]
    docs = [" ".join(rng.choice(words, size=rng.integers(1, 40))) for _ in range(n_docs)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text("\n\n".join(docs[: n_docs // 2]) + "\n")
    (folder / "b.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in docs[n_docs // 2 :])
    )
    return docs


def _read_back(prefix: Path) -> list[list[int]]:
    dataset = IndexedDataset(str(prefix))
    assert len(dataset.document_indices) == len(dataset) + 1  # one sequence per document
    return [dataset[i].tolist() for i in range(len(dataset))]


@pytest.mark.parametrize("kind", ["byte", "sentencepiece"])
def test_build_round_trip(tmp_path: Path, spm_model: Path, kind: str) -> None:
    docs = _write_corpus(tmp_path / "text")
    tokenizer = build_tokenizer(kind, spm_model if kind == "sentencepiece" else "")
    stats = build_indexed_dataset([str(tmp_path / "text")], tmp_path / "out" / "ds", tokenizer)
    want = [[*tokenizer.tokenize(doc), tokenizer.eod] for doc in docs]
    assert _read_back(tmp_path / "out" / "ds") == want
    assert IndexedDataset(str(tmp_path / "out" / "ds")).index.dtype == np.uint16
    assert (stats.documents, stats.tokens) == (len(docs), sum(map(len, want)))
    assert stats.text_bytes == sum(len(doc.encode()) for doc in docs)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ds.bin", "ds.idx"]


class _CrashingTokenizer(ByteTokenizer):
    """Fails on its ``crash_at``-th document, as a killed or failing build would."""

    def __init__(self, crash_at: int) -> None:
        super().__init__()
        self.crash_at, self.calls = crash_at, 0

    def tokenize(self, text: str) -> list[int]:
        self.calls += 1
        if self.calls == self.crash_at:
            raise KeyboardInterrupt("simulated crash")
        return super().tokenize(text)


def test_build_is_atomic(tmp_path: Path) -> None:
    docs = _write_corpus(tmp_path / "text")
    prefix = tmp_path / "out" / "ds"
    with pytest.raises(KeyboardInterrupt):
        build_indexed_dataset([str(tmp_path / "text")], prefix, _CrashingTokenizer(crash_at=20))
    assert list((tmp_path / "out").iterdir()) == []  # nothing under the prefix, no leftovers

    # A failed rebuild leaves the previous dataset as it was.
    build_indexed_dataset([str(tmp_path / "text")], prefix, ByteTokenizer())
    before = _read_back(prefix)
    assert len(before) == len(docs)
    _write_corpus(tmp_path / "other", n_docs=30, seed=1)
    with pytest.raises(KeyboardInterrupt):
        build_indexed_dataset([str(tmp_path / "other")], prefix, _CrashingTokenizer(crash_at=5))
    assert _read_back(prefix) == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ds.bin", "ds.idx"]


def test_build_rejects_empty_corpus_before_writing(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("\n   \n")
    with pytest.raises(ConfigError, match="no documents"):
        build_indexed_dataset(
            [str(tmp_path / "empty.txt")], tmp_path / "out" / "ds", ByteTokenizer()
        )
    assert list((tmp_path / "out").iterdir()) == []


# ------------------------------------------------------------------------------ GPT datasets


@pytest.fixture(scope="module")
def byte_dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A byte-level dataset of 60 documents and their token lists (eod included)."""
    root = tmp_path_factory.mktemp("gpt")
    docs = _write_corpus(root / "text")
    build_indexed_dataset([str(root / "text")], root / "ds", ByteTokenizer())
    return root / "ds", [[*ByteTokenizer().tokenize(d), 256] for d in docs]


def _is_window_of_documents(window: list[int], documents: list[list[int]]) -> bool:
    """Whether ``window`` = end of a document, whole documents, start of a document."""
    eod = 256
    pieces, start = [], 0
    for i, token in enumerate(window):
        if token == eod:
            pieces.append(window[start : i + 1])
            start = i + 1
    tail = window[start:]
    whole = {tuple(d) for d in documents}
    if len(pieces) == 0:  # inside a single document
        return any(
            tuple(tail) == tuple(d[j : j + len(tail)]) for d in documents for j in range(len(d))
        )
    first_ok = any(tuple(d[-len(pieces[0]) :]) == tuple(pieces[0]) for d in documents)
    return (
        first_ok
        and all(tuple(p) in whole for p in pieces[1:])
        and any(tuple(d[: len(tail)]) == tuple(tail) for d in documents)
    )


def test_gpt_samples(byte_dataset: tuple[Path, list[list[int]]]) -> None:
    prefix, documents = byte_dataset
    seq = 64
    train, valid, test = build_gpt_datasets(
        prefix,
        ByteTokenizer(),
        seq_length=seq,
        split="80,20,0",
        seed=7,
        num_samples=(200, 10, None),
    )
    assert test is None
    assert len(train) >= 200  # more epochs of the 48 train documents than one
    assert len(valid) >= 10
    for i in (0, 1, 100, 199):
        sample = train[i]
        assert sorted(sample) == ["labels", "loss_mask", "position_ids", "tokens"]
        tokens, labels = sample["tokens"], sample["labels"]
        assert tokens.shape == labels.shape == (seq,)
        assert tokens.dtype == labels.dtype == sample["position_ids"].dtype == torch.int64
        assert torch.equal(tokens[1:], labels[:-1])  # labels are the next tokens
        assert torch.equal(sample["position_ids"], torch.arange(seq))
        assert torch.equal(sample["loss_mask"], torch.ones(seq, dtype=torch.float32))
        window = [*tokens.tolist(), labels[-1].item()]
        assert _is_window_of_documents(window, documents[:48]), i  # train = first 80% of docs
    # a pure function of the index and the seed; another seed shuffles differently
    again, _, _ = build_gpt_datasets(prefix, ByteTokenizer(), seq, "80,20,0", 7, (200, 10, None))
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(200))
    other, _, _ = build_gpt_datasets(prefix, ByteTokenizer(), seq, "80,20,0", 8, (200, 10, None))
    assert not all(torch.equal(train[i]["tokens"], other[i]["tokens"]) for i in range(20))


def test_gpt_dataset_with_sentencepiece(tmp_path: Path, spm_model: Path) -> None:
    _write_corpus(tmp_path / "text")
    tokenizer = SentencePieceTokenizer(spm_model)
    build_indexed_dataset([str(tmp_path / "text")], tmp_path / "ds", tokenizer)
    train, _, _ = build_gpt_datasets(tmp_path / "ds", tokenizer, 16, "1,0,0", 1, (30, None, None))
    sample = train[3]
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert int(sample["tokens"].max()) < tokenizer.vocab_size


def test_gpt_indices_follow_a_rebuilt_dataset(tmp_path: Path) -> None:
    """A rebuilt dataset at the same prefix must not reuse the old dataset's cached indices."""
    tokenizer, prefix = ByteTokenizer(), tmp_path / "ds"
    (tmp_path / "one.txt").write_text("\n\n".join(["a" * 50] * 20))
    build_indexed_dataset([str(tmp_path / "one.txt")], prefix, tokenizer)
    old, _, _ = build_gpt_datasets(prefix, tokenizer, 32, "1,0,0", 1, (20, None, None))
    assert set(old[0]["tokens"].tolist()) <= {ord("a"), tokenizer.eod}
    # same document count, other lengths and tokens
    (tmp_path / "one.txt").write_text("\n\n".join(["b" * 10] * 20))
    build_indexed_dataset([str(tmp_path / "one.txt")], prefix, tokenizer)
    new, _, _ = build_gpt_datasets(prefix, tokenizer, 32, "1,0,0", 1, (20, None, None))
    assert all(set(new[i]["tokens"].tolist()) <= {ord("b"), tokenizer.eod} for i in range(20))
    assert all(new[i]["tokens"].tolist().count(tokenizer.eod) >= 2 for i in range(20))


def test_gpt_datasets_missing_prefix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="megatron-ext data build"):
        build_gpt_datasets(tmp_path / "nope", ByteTokenizer(), 16, "1,0,0", 1, (1, None, None))


def _gpt_samples_on_rank(rank: int, world_size: int, prefix: str, store: str, out: str) -> None:
    """One rank of a gloo group: build the GPT datasets and save its first samples."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size
    )
    try:
        train, _, _ = build_gpt_datasets(prefix, ByteTokenizer(), 32, "90,10,0", 5, (64, 8, None))
        torch.save(torch.stack([train[i]["tokens"] for i in range(64)]), f"{out}.{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_gpt_datasets_under_gloo(
    tmp_path: Path, byte_dataset: tuple[Path, list[list[int]]]
) -> None:
    """Two gloo ranks build the same datasets as one process (rank 0 writes the cache)."""
    prefix = tmp_path / "ds"
    for suffix in (".bin", ".idx"):  # a private copy: its cache starts empty
        shutil.copy(f"{byte_dataset[0]}{suffix}", f"{prefix}{suffix}")
    torch.multiprocessing.start_processes(
        _gpt_samples_on_rank,
        args=(2, str(prefix), str(tmp_path / "store"), str(tmp_path / "tokens")),
        nprocs=2,
        start_method="spawn",
    )
    ranks = [torch.load(tmp_path / f"tokens.{r}.pt") for r in range(2)]
    single, _, _ = build_gpt_datasets(
        byte_dataset[0], ByteTokenizer(), 32, "90,10,0", 5, (64, 8, None)
    )
    expected = torch.stack([single[i]["tokens"] for i in range(64)])
    assert torch.equal(ranks[0], expected) and torch.equal(ranks[1], expected)
    cache_files = list(Path(f"{prefix}.cache").rglob("*.npy"))
    assert len(cache_files) == 2 * 3  # train and valid: document, sample, shuffle indices


# ----------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (["missing.txt"], "input 'missing.txt' not found"),
        (["setup.py"], "unsupported type '.py'"),
    ],
)
def test_cli_bad_input_exits_2(tmp_path: Path, inputs: list[str], message: str) -> None:
    result = subprocess.run(
        [str(MEGATRON_EXT), "data", "build", *inputs, "--output", str(tmp_path / "x")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_cli_build_and_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], stdlib_docs: list[str]
) -> None:
    """In process (megatron-core is imported already): errors found while building, and the
    happy path of both actions."""
    from megatron_ext.launch.cli import main

    def data(*argv: str | Path) -> int:
        return main(["data", *map(str, argv)])

    (tmp_path / "empty.txt").write_text("\n")
    assert data("build", tmp_path / "empty.txt", "--output", tmp_path / "out" / "e") == 2
    assert "no documents" in capsys.readouterr().err
    assert data("tokenizer", tmp_path / "corpus.txt", "--output", tmp_path / "tok") == 2
    assert "not found" in capsys.readouterr().err

    (tmp_path / "corpus.txt").write_text("\n\n".join(stdlib_docs[:400]))
    model = tmp_path / "tok"
    assert data("tokenizer", tmp_path / "corpus.txt", "--output", model, "--vocab-size", "700") == 0
    assert "wrote" in capsys.readouterr().out
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"body": d}) + "\n" for d in stdlib_docs[:400]))
    spm = ("--tokenizer", "sentencepiece", "--tokenizer-model", f"{model}.model")
    assert (
        data("build", corpus, "--output", tmp_path / "out" / "ds", *spm, "--json-key", "body") == 0
    )
    summary = capsys.readouterr().out
    assert "400 documents" in summary and "vocabulary 700" in summary

    tokenizer = SentencePieceTokenizer(f"{model}.model")
    want = [[*tokenizer.tokenize(doc), tokenizer.eod] for doc in stdlib_docs[:400]]
    assert _read_back(tmp_path / "out" / "ds") == want
