"""SOMA data: byte windows, hold-out split, expert shards, keyed batches."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_ext.data.corpus import iter_documents
from megatron_ext.errors import ConfigError
from megatron_ext.soma.data import (
    build_windows,
    check_expert_count,
    expert_shards,
    sample_batch,
    split_documents,
    window_texts,
)

DOCS = [
    "Première ligne — with UTF-8: naïve café, 日本語, emoji 🙂.",
    "second document " * 40,
    "x",
    "third\nwith an inner newline and trailing words " * 7,
] * 5


@pytest.fixture
def jsonl_corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
    return str(path)


def test_windows_tile_the_joined_stream(jsonl_corpus):
    stream = b"\n\n".join(d.encode("utf-8") for d in DOCS)
    for window in (2, 7, 64, 1025):
        ws = build_windows([jsonl_corpus], window_bytes=window)
        assert ws.windows.dtype == np.uint8
        assert ws.windows.shape == (len(stream) // window, window)
        assert ws.windows.tobytes() == stream[: len(stream) // window * window]
    capped = build_windows([jsonl_corpus], window_bytes=64, max_bytes=1000)
    assert capped.windows.shape == (15, 64)
    assert capped.windows.tobytes() == stream[:960]


def test_stdlib_windows_with_byte_cap():
    docs = []
    for doc in iter_documents(["python-stdlib"]):
        docs.append(doc.encode("utf-8"))
        if sum(map(len, docs)) > 20_000:
            break
    stream = b"\n\n".join(docs)[:20_000]
    ws = build_windows(["python-stdlib"], window_bytes=1025, max_bytes=20_000)
    assert ws.windows.tobytes() == stream[: 19 * 1025]


def test_window_errors(jsonl_corpus):
    with pytest.raises(ConfigError, match="less than one window"):
        build_windows([jsonl_corpus], window_bytes=10**6)
    with pytest.raises(ConfigError, match="at least 2 bytes"):
        build_windows([jsonl_corpus], window_bytes=1)


def test_window_texts_drop_split_characters():
    raw = "aé日b".encode()  # a, é (2 bytes), 日 (3 bytes), b
    windows = np.frombuffer(raw, dtype=np.uint8).reshape(1, -1)
    assert window_texts(windows) == ["aé日b"]
    assert window_texts(windows, prefix_bytes=2) == ["a"]  # half of é dropped
    assert window_texts(windows, prefix_bytes=3) == ["aé"]
    assert window_texts(windows[:, 4:]) == ["b"]  # tail of 日 dropped


def test_split_documents_partition(jsonl_corpus):
    """The held-out documents' first windows are the test set, the others joined are the
    training stream; the choice is keyed by the seed; bad fractions are refused."""
    split = split_documents([jsonl_corpus], 0.25, seed=3, window_bytes=64)
    held = split.test_documents.tolist()
    n_test = round(len(DOCS) * 0.25)
    long_docs = [i for i in range(len(DOCS)) if len(DOCS[i].encode()) >= 64]
    assert set(held) <= set(long_docs) and held == sorted(held)
    assert set(held) <= set(split.held_out.tolist()) and len(split.held_out) == 5
    kept = [d.encode() for i, d in enumerate(DOCS) if i not in set(split.held_out.tolist())]
    # every held-out document is absent from the training stream (n_test chosen, the long
    # ones give a window)
    again = split_documents([jsonl_corpus], 0.25, seed=3, window_bytes=64)
    assert np.array_equal(again.test, split.test)
    stream = b"\n\n".join(kept)
    assert split.train.windows.tobytes() == stream[: len(stream) // 64 * 64]
    assert len(kept) == len(DOCS) - n_test
    for row, i in zip(split.test, held, strict=True):
        assert row.tobytes() == DOCS[i].encode()[:64]
    other = split_documents([jsonl_corpus], 0.25, seed=4, window_bytes=64)
    assert not np.array_equal(other.test_documents, split.test_documents)
    for bad in (0.0, 1.0):
        with pytest.raises(ConfigError, match="test_fraction"):
            split_documents([jsonl_corpus], bad, seed=0)
    with pytest.raises(ConfigError, match="holds a whole"):
        split_documents([jsonl_corpus], 0.05, seed=0, window_bytes=10**5)


def test_expert_shards_partition_pool():
    rng = np.random.default_rng(0)
    pool = np.sort(rng.choice(5000, size=600, replace=False))
    sizes = {0: 149, 1: 151, 2: 300}  # round(size / 100): 1.49 → 1, 1.51 → 2, 3
    assignment = rng.permutation(np.repeat(list(sizes), list(sizes.values())))
    shards = expert_shards(assignment, pool, 3, val_fraction=0.01, seed=7)
    assert [len(s.val) for s in shards] == [1, 2, 3]
    assert [len(s.train) for s in shards] == [148, 149, 297]
    everything = np.concatenate([np.concatenate([s.train, s.val]) for s in shards])
    assert np.array_equal(np.sort(everything), pool)  # disjoint and covering
    for s in shards:
        members = set(pool[assignment == s.expert].tolist())
        assert set(s.train.tolist()) | set(s.val.tolist()) == members
    again = expert_shards(assignment, pool, 3, val_fraction=0.01, seed=7)
    assert all(np.array_equal(a.val, b.val) for a, b in zip(shards, again, strict=True))
    other = expert_shards(assignment, pool, 3, val_fraction=0.01, seed=8)
    assert any(not np.array_equal(a.val, b.val) for a, b in zip(shards, other, strict=True))


def test_too_many_experts_message():
    pool = np.arange(50)
    with pytest.raises(ConfigError) as err:
        expert_shards(np.arange(50) % 6, pool, 6)
    message = str(err.value)
    assert "N=6" in message and "50 windows" in message and "at most N=5" in message
    with pytest.raises(ConfigError, match="at most N=5"):
        check_expert_count(6, 50)
    check_expert_count(5, 45)
    smallest = expert_shards(np.arange(45) % 5, np.arange(45), 5)  # 9 windows each
    assert [(len(s.train), len(s.val)) for s in smallest] == [(8, 1)] * 5
    lopsided = np.where(np.arange(50) < 45, 0, 1)  # 45 + 5 windows
    with pytest.raises(ConfigError, match="cluster 1 holds 5"):
        expert_shards(lopsided, pool, 2)


def _distinct_windows(n: int, width: int) -> np.ndarray:
    return np.random.default_rng(1).integers(0, 256, size=(n, width), dtype=np.uint8)


def test_sample_batch_is_keyed():
    windows = _distinct_windows(20, 64)
    train = np.arange(0, 20, 2)
    a = sample_batch(windows, train, 8, 31, key=(5, 1, 100))
    assert a.dtype == torch.int64 and a.shape == (8, 32)
    assert torch.equal(a, sample_batch(windows, train, 8, 31, key=(5, 1, 100)))
    assert not torch.equal(a, sample_batch(windows, train, 8, 31, key=(5, 1, 101)))
    assert not torch.equal(a, sample_batch(windows, train, 8, 31, key=(5, 2, 100)))


def test_sample_batch_crops_lie_in_train_windows():
    width, seq_len = 40, 32
    windows = _distinct_windows(12, width)
    train = np.array([1, 4, 5, 9])
    seen_windows, seen_offsets = set(), set()
    for update in range(50):
        batch = sample_batch(windows, train, 16, seq_len, key=(0, 3, update)).numpy()
        for crop in batch.astype(np.uint8):
            hits = [
                (w, o)
                for w in range(len(windows))
                for o in range(width - seq_len)
                if windows[w, o : o + seq_len + 1].tobytes() == crop.tobytes()
            ]
            assert len(hits) == 1 and hits[0][0] in train
            seen_windows.add(hits[0][0])
            seen_offsets.add(hits[0][1])
    assert seen_windows == set(train.tolist())
    assert seen_offsets == set(range(width - seq_len))  # every offset 0..8 is reachable


def test_sample_batch_full_window_crop():
    windows = _distinct_windows(3, 1025)
    batch = sample_batch(windows, np.array([2]), 2, 1024, key=(0,))
    assert np.array_equal(batch.numpy(), windows[[2, 2]].astype(np.int64))
    with pytest.raises(ConfigError, match="exceeds"):
        sample_batch(windows, np.array([2]), 2, 1025, key=(0,))
