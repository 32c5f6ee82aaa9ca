"""SOMA's data: held-out test documents, fixed-size byte windows of the other documents, one
training/validation shard per expert, and batches of random crops drawn from a counter-based
RNG.

    split = split_documents(["python-stdlib"], 0.01, seed=0)   # test: one window per held-out doc
    pool = np.arange(len(split.train))
    router, assignment = fit_router(window_texts(split.train.windows), RouterConfig(n_clusters=8))
    shards = expert_shards(assignment, pool, 8)                # 99/1 train/val per expert
    batch = sample_batch(ws.windows, shards[e].train, 16, 1024, key=(seed, e, update))

Every random choice is a pure function of a key (a seed plus counters), never of how many
draws came before: the same key gives the same permutation or batch in any process, so a
resumed run continues exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_ext.data.corpus import iter_documents
from megatron_ext.errors import ConfigError

WINDOW_BYTES = 1025  # 1,024 model inputs + 1 shifted target
DOC_SEPARATOR = b"\n\n"
# Smallest expert shard: 8 training windows (8 KiB of text) + 1 validation window. Below that an
# expert memorises a few passages instead of modelling its cluster.
MIN_EXPERT_WINDOWS = 9
# Stream ids: keep the held-out document permutation and the shard permutations independent of
# each other even when they share a seed.
_HOLDOUT_STREAM = 0
_SHARD_STREAM = 1


@dataclass
class WindowSet:
    """Non-overlapping byte windows of one corpus.

    ``windows``: (n, window_bytes) uint8, window i holds stream bytes
    ``[i * window_bytes, (i + 1) * window_bytes)``.
    """

    windows: np.ndarray
    window_bytes: int

    def __post_init__(self) -> None:
        if self.windows.dtype != np.uint8 or self.windows.ndim != 2:
            raise ValueError(
                f"windows must be 2-D uint8, got {self.windows.dtype}/{self.windows.ndim}-D"
            )
        if self.windows.shape[1] != self.window_bytes:
            raise ValueError(f"windows have {self.windows.shape[1]} bytes, not {self.window_bytes}")

    def __len__(self) -> int:
        return self.windows.shape[0]


def build_windows(
    inputs: Sequence[str], window_bytes: int = WINDOW_BYTES, max_bytes: int | None = None
) -> WindowSet:
    """Cut the corpus ``inputs`` (see :func:`megatron_ext.data.corpus.iter_documents`) into
    windows of ``window_bytes`` bytes.

    The documents, UTF-8 encoded and joined with ``DOC_SEPARATOR``, form one byte stream; its
    first ``max_bytes`` bytes (all when None) are cut into consecutive non-overlapping windows
    and the tail shorter than a window is dropped. A window may start or end inside a UTF-8
    character; the model sees bytes, the router decodes with errors ignored
    (:func:`window_texts`). Raises ``ConfigError`` when the stream holds no full window.
    """
    if window_bytes < 2:
        raise ConfigError(f"window_bytes={window_bytes}: a window needs at least 2 bytes")
    if max_bytes is not None and max_bytes < window_bytes:
        raise ConfigError(
            f"max_bytes={max_bytes} is smaller than one window ({window_bytes} bytes)"
        )
    chunks: list[bytes] = []
    total = 0
    for doc in iter_documents(inputs):
        piece = (DOC_SEPARATOR if chunks else b"") + doc.encode("utf-8")
        chunks.append(piece)
        total += len(piece)
        if max_bytes is not None and total >= max_bytes:
            break
    stream = b"".join(chunks)[:max_bytes]
    n = len(stream) // window_bytes
    if n == 0:
        raise ConfigError(
            f"corpus {', '.join(inputs)} holds {len(stream):,} bytes, less than one window of "
            f"{window_bytes:,} bytes: add text or use smaller windows"
        )
    flat = np.frombuffer(stream, dtype=np.uint8, count=n * window_bytes)
    return WindowSet(flat.reshape(n, window_bytes).copy(), window_bytes)


def window_texts(windows: np.ndarray, prefix_bytes: int | None = None) -> list[str]:
    """Text of each window of ``windows`` ((n, window_bytes) uint8), or of its first
    ``prefix_bytes`` bytes: UTF-8 with undecodable bytes (split characters) dropped."""
    rows = windows if prefix_bytes is None else windows[:, :prefix_bytes]
    return [row.tobytes().decode("utf-8", errors="ignore") for row in rows]


def _permutation(n: int, key: Sequence[int]) -> np.ndarray:
    """A permutation of ``range(n)`` that depends only on ``key``: the stable argsort of n raw
    Philox outputs (raw bit-generator output is fixed across numpy versions, unlike
    ``Generator`` methods)."""
    raw = np.random.Philox(np.random.SeedSequence(list(key))).random_raw(n)
    return np.argsort(raw, kind="stable")


def _split_count(n: int, fraction: float) -> int:
    """round(n * fraction), halves up, and at least 1 when fraction > 0."""
    count = int(n * fraction + 0.5)
    return max(count, 1) if fraction > 0 else count


@dataclass
class DocumentSplit:
    """A corpus split by DOCUMENT (paper: Table 1 / App. L: the test set is held-out documents,
    each contributing one window within its boundaries).

    ``train``: windows of the training stream (the kept documents only, joined);
    ``test``: (n_test, window_bytes) uint8, the first ``window_bytes`` bytes of each held-out
    document long enough to hold one, in corpus order; ``test_documents``: their indices among
    the corpus's documents; ``held_out``: every held-out document's index (a shorter one gives
    no test window but is still kept out of training)."""

    train: WindowSet
    test: np.ndarray
    test_documents: np.ndarray
    held_out: np.ndarray


def split_documents(
    inputs: Sequence[str],
    test_fraction: float,
    seed: int,
    window_bytes: int = WINDOW_BYTES,
    max_bytes: int | None = None,
) -> DocumentSplit:
    """Hold out round(n_docs · test_fraction) whole documents (at least 1), chosen by a
    permutation keyed by ``seed``; the others form the training stream (joined as
    :func:`build_windows` does, capped at ``max_bytes`` UTF-8 bytes of the corpus read). No byte
    of a held-out document reaches a training window. Raises ``ConfigError`` when the fraction
    is outside (0, 1), or when no held-out document holds a whole window."""
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction={test_fraction} must be in (0, 1)")
    docs: list[bytes] = []
    total = 0
    for doc in iter_documents(inputs):
        docs.append(doc.encode("utf-8"))
        total += len(docs[-1]) + len(DOC_SEPARATOR)
        if max_bytes is not None and total >= max_bytes:
            break
    n_test = _split_count(len(docs), test_fraction)
    if n_test >= len(docs):
        raise ConfigError(
            f"a test fraction of {test_fraction} of {len(docs)} documents leaves no training "
            "document"
        )
    held = np.sort(_permutation(len(docs), (seed, _HOLDOUT_STREAM))[:n_test]).astype(np.int64)
    held_set = set(held.tolist())
    long_enough = [i for i in held.tolist() if len(docs[i]) >= window_bytes]
    if not long_enough:
        raise ConfigError(
            f"none of the {n_test} held-out documents holds a whole {window_bytes}-byte window: "
            "raise soma.test_fraction, use smaller windows or longer documents"
        )
    test = np.stack([np.frombuffer(docs[i][:window_bytes], dtype=np.uint8) for i in long_enough])
    stream = DOC_SEPARATOR.join(d for i, d in enumerate(docs) if i not in held_set)
    n = len(stream) // window_bytes
    if n == 0:
        raise ConfigError(
            f"the training documents hold {len(stream):,} bytes, less than one "
            f"{window_bytes:,}-byte window"
        )
    flat = np.frombuffer(stream, dtype=np.uint8, count=n * window_bytes)
    train = WindowSet(flat.reshape(n, window_bytes).copy(), window_bytes)
    return DocumentSplit(train, test.copy(), np.asarray(long_enough, dtype=np.int64), held)


@dataclass
class ExpertShard:
    """Windows of one expert: ``train`` and ``val`` are sorted int64 indices into the full
    window array (disjoint)."""

    expert: int
    train: np.ndarray
    val: np.ndarray


def max_experts(n_windows: int, min_windows: int = MIN_EXPERT_WINDOWS) -> int:
    """Largest number of experts whose balanced clusters of ``n_windows`` training-pool windows
    (each at least floor(n_windows / N)) all hold ``min_windows`` windows."""
    return n_windows // min_windows


def check_expert_count(
    n_experts: int, n_windows: int, min_windows: int = MIN_EXPERT_WINDOWS
) -> None:
    """Raise ``ConfigError`` unless ``n_experts`` balanced clusters of a pool of ``n_windows``
    windows leave every expert ``min_windows`` windows. Call it before fitting the router."""
    if n_experts < 1:
        raise ConfigError(f"n_experts={n_experts}: need at least one expert")
    if n_experts > max_experts(n_windows, min_windows):
        raise ConfigError(
            f"N={n_experts} experts is too many for this corpus: its training pool holds "
            f"{n_windows:,} windows and every expert needs at least {min_windows} "
            f"({min_windows - 1} training + 1 validation); this corpus supports at most "
            f"N={max_experts(n_windows, min_windows)}. Use fewer experts or add text."
        )


def expert_shards(
    assignment: np.ndarray,
    pool_indices: np.ndarray,
    n_experts: int,
    val_fraction: float = 0.01,
    seed: int = 0,
    min_windows: int = MIN_EXPERT_WINDOWS,
) -> list[ExpertShard]:
    """One shard per expert: the pool windows of its cluster, split train/validation.

    ``assignment``: (n_pool,) cluster id of each pool window; ``pool_indices``: (n_pool,) the
    windows' indices in the full window array.
    Validation takes round(size * val_fraction) windows of each cluster, at least 1, chosen by a
    permutation keyed by (seed, expert). Raises ``ConfigError`` naming N, the pool size and the
    largest supported N (:func:`check_expert_count`) when N balanced clusters would be too
    small, and naming the cluster when an (unbalanced) assignment leaves one under
    ``min_windows`` windows.
    """
    assignment = np.asarray(assignment)
    pool_indices = np.asarray(pool_indices, dtype=np.int64)
    if assignment.shape != pool_indices.shape or assignment.ndim != 1:
        raise ValueError(
            f"assignment {assignment.shape} and pool_indices {pool_indices.shape} must be "
            "equal-length vectors"
        )
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction={val_fraction} must be in (0, 1)")
    n_pool = len(pool_indices)
    check_expert_count(n_experts, n_pool, min_windows)
    if n_pool and (assignment.min() < 0 or assignment.max() >= n_experts):
        raise ValueError(f"assignment holds cluster ids outside [0, {n_experts})")
    sizes = np.bincount(assignment, minlength=n_experts)
    if sizes.min() < min_windows:
        small = int(np.argmin(sizes))
        raise ConfigError(
            f"cluster {small} holds {sizes[small]} of the {n_pool:,} pool windows, fewer than "
            f"the {min_windows} an expert needs: the assignment is unbalanced; refit the router "
            "(fit_router balances cluster sizes)"
        )
    shards = []
    for expert in range(n_experts):
        members = pool_indices[assignment == expert]
        n_val = _split_count(len(members), val_fraction)
        order = _permutation(len(members), (seed, _SHARD_STREAM, expert))
        shards.append(
            ExpertShard(
                expert=expert,
                train=np.sort(members[order[n_val:]]),
                val=np.sort(members[order[:n_val]]),
            )
        )
    return shards


def sample_batch(
    windows: np.ndarray, train_idx: np.ndarray, batch: int, seq_len: int, key: Sequence[int]
) -> torch.Tensor:
    """A (batch, seq_len + 1) int64 tensor of byte crops: row b is ``seq_len + 1`` consecutive
    bytes of window ``train_idx[w_b]`` starting at offset ``o_b``.

    ``windows``: (n, window_bytes) uint8; ``train_idx``: indices of the windows to draw from;
    ``key``: non-negative ints, e.g. (seed, expert, update). (w_b, o_b) come from a Philox
    stream seeded by ``key`` alone (two raw 64-bit draws per row, reduced modulo the number of
    choices; the bias is below n / 2**64), so the batch of an update can be recomputed without
    replaying earlier ones.
    """
    window_bytes = windows.shape[1]
    if seq_len + 1 > window_bytes:
        raise ConfigError(
            f"seq_len={seq_len} + 1 target byte exceeds the {window_bytes}-byte windows"
        )
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch={batch} and seq_len={seq_len} must be positive")
    train_idx = np.asarray(train_idx, dtype=np.int64)
    if len(train_idx) == 0:
        raise ValueError("no training windows to sample from")
    raw = np.random.Philox(np.random.SeedSequence(list(key))).random_raw(2 * batch)
    rows = train_idx[raw[:batch] % np.uint64(len(train_idx))]
    offsets = (raw[batch:] % np.uint64(window_bytes - seq_len)).astype(np.int64)
    crops = windows[rows[:, None], offsets[:, None] + np.arange(seq_len + 1)]
    return torch.from_numpy(crops.astype(np.int64))
