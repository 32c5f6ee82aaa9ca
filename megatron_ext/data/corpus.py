"""Text that is already on the machine, as a stream of documents (never downloaded).

Inputs, checked up front by :func:`resolve_inputs` (a bad one raises ``ConfigError``):

- ``python-stdlib``: the docstrings of the running interpreter's standard library (module,
  class and function docstrings, cleaned by ``ast.get_docstring``), one document each. Files are
  read in sorted path order, test packages and site-packages excluded, docstrings in source
  order; exact duplicates are dropped and the stream stops before the document that would pass
  :data:`STDLIB_MAX_BYTES`. The same interpreter build therefore always gives the same corpus
  (CPython 3.12: about 8k documents, 1.7 MB).
- ``python-docs``: English prose of the Python Language Reference as shipped with the running
  interpreter (``pydoc_data.topics``, the text ``help()`` shows: 79 topics, ~490 kB for
  CPython 3.12), one document per paragraph, topics in sorted order. A real English text that
  every Python installation carries, for runs that should not learn docstring boilerplate.
- ``*.txt``: UTF-8 text, one document per paragraph (blank-line separated, surrounding
  whitespace stripped). Paragraphs rather than whole files so that even a single file gives the
  many documents that megatron-core's train/valid/test split (which splits by document) needs.
- ``*.jsonl``: one JSON object per line; the document is its ``json_key`` field (a string).
- a folder: every ``.txt`` and ``.jsonl`` file under it, recursively, in sorted path order
  (other files are not corpus files and are left alone).

Documents that are empty or whitespace only are skipped.
"""

from __future__ import annotations

import ast
import json
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_ext.errors import ConfigError

PYTHON_STDLIB = "python-stdlib"
PYTHON_DOCS = "python-docs"
BUILTIN_SOURCES = (PYTHON_STDLIB, PYTHON_DOCS)
STDLIB_MAX_BYTES = 4 * 2**20  # UTF-8 bytes; CPython 3.12's docstrings (1.7 MB) fit whole
TEXT_SUFFIXES = (".txt", ".jsonl")
# stdlib folders that are not the library's own documentation
_STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages"})
_STATEMENT_NODES = (ast.stmt, ast.excepthandler, ast.match_case)

SourceKind = Literal["python-stdlib", "python-docs", "txt", "jsonl"]


@dataclass(frozen=True)
class Source:
    """One corpus file, or a corpus of the interpreter's own (``path`` is None)."""

    kind: SourceKind
    path: Path | None = None


def resolve_inputs(inputs: Sequence[str]) -> list[Source]:
    """Expand ``inputs`` (files, folders, ``python-stdlib``) into sources, in order.

    Raises ``ConfigError`` for no inputs, a missing path, an unsupported file type, or a folder
    without ``.txt``/``.jsonl`` files.
    """
    if not inputs:
        raise ConfigError(f"no inputs: give .txt/.jsonl files, folders, or {PYTHON_STDLIB!r}")
    sources: list[Source] = []
    for item in inputs:
        if item in BUILTIN_SOURCES:
            sources.append(Source(item))  # type: ignore[arg-type]
            continue
        path = Path(item)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
            if not files:
                raise ConfigError(f"folder {item!r} holds no .txt or .jsonl files")
            sources.extend(Source(_kind(p), p) for p in files)
        elif path.is_file():
            if path.suffix not in TEXT_SUFFIXES:
                raise ConfigError(
                    f"input {item!r} has an unsupported type {path.suffix!r}: use "
                    f".txt or .jsonl files, folders of them, {PYTHON_STDLIB!r} or {PYTHON_DOCS!r}"
                )
            sources.append(Source(_kind(path), path))
        else:
            raise ConfigError(
                f"input {item!r} not found (expected a .txt/.jsonl file, a "
                f"folder, {PYTHON_STDLIB!r} or {PYTHON_DOCS!r})"
            )
    return sources


def _kind(path: Path) -> SourceKind:
    return "txt" if path.suffix == ".txt" else "jsonl"


def iter_documents(inputs: Sequence[str], json_key: str = "text") -> Iterator[str]:
    """All documents of ``inputs`` in order (see the module docstring for each input type).

    Inputs are checked here, before any document is read; the returned iterator raises
    ``ConfigError`` when it ends without having produced a single document.
    """
    return _documents(resolve_inputs(inputs), json_key, ", ".join(inputs))


def _documents(sources: list[Source], json_key: str, label: str) -> Iterator[str]:
    count = 0
    for source in sources:
        if source.kind == "python-docs":
            documents = python_docs_documents()
        elif source.path is None:
            documents = python_stdlib_documents()
        elif source.kind == "txt":
            documents = txt_documents(source.path)
        else:
            documents = jsonl_documents(source.path, json_key)
        for doc in documents:
            count += 1
            yield doc
    if count == 0:
        raise ConfigError(f"no documents in {label}: the inputs hold no text")


def python_stdlib_documents(max_bytes: int = STDLIB_MAX_BYTES) -> Iterator[str]:
    """Docstrings of the running interpreter's standard library, deduplicated, in a fixed order.

    Stops before the first document that would bring the total past ``max_bytes`` UTF-8 bytes,
    so a smaller budget gives a prefix of the same stream (and parses fewer files).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not _STDLIB_SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
    seen: set[str] = set()
    total = 0
    for path in files:
        for doc in _docstrings(ast.parse(path.read_bytes(), filename=str(path))):
            if doc in seen or not doc.strip():
                continue
            size = len(doc.encode("utf-8"))
            if total + size > max_bytes:
                return
            seen.add(doc)
            total += size
            yield doc


def python_docs_documents() -> Iterator[str]:
    """Paragraphs of the interpreter's Language Reference topics (``pydoc_data.topics``),
    topics in sorted order, paragraphs blank-line separated and stripped."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield from _paragraphs(topics[name].splitlines(keepends=True))


def _docstrings(node: ast.AST) -> Iterator[str]:
    """Docstrings of ``node`` and everything nested in it, in source order."""
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield doc
    for child in ast.iter_child_nodes(node):
        # Definitions are statements; expressions (most of the tree) cannot hold docstrings.
        if isinstance(child, _STATEMENT_NODES):
            yield from _docstrings(child)


def txt_documents(path: Path) -> Iterator[str]:
    """Paragraphs of a UTF-8 text file (blank-line separated, stripped, empty ones skipped)."""
    return _paragraphs(_utf8_lines(path))


def _paragraphs(lines: Iterable[str]) -> Iterator[str]:
    paragraph: list[str] = []
    for line in lines:
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            yield "".join(paragraph).strip()
            paragraph = []
    if paragraph:
        yield "".join(paragraph).strip()


def jsonl_documents(path: Path, json_key: str) -> Iterator[str]:
    """The ``json_key`` string of each JSON line (blank lines and empty texts skipped)."""
    for number, line in enumerate(_utf8_lines(path), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not a JSON line ({exc.msg})") from exc
        if not isinstance(record, dict) or json_key not in record:
            keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            raise ConfigError(
                f"{where}: no {json_key!r} field (found: {keys}); set the field with --json-key"
            )
        text = record[json_key]
        if not isinstance(text, str):
            raise ConfigError(
                f"{where}: field {json_key!r} is a {type(text).__name__}, not a string"
            )
        if text.strip():
            yield text


def _utf8_lines(path: Path) -> Iterator[str]:
    """Lines of a UTF-8 file (universal newlines), read one at a time: memory stays bounded by
    the longest line, whatever the file size."""
    with path.open(encoding="utf-8") as stream:
        try:
            yield from stream
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path} is not UTF-8 text ({exc.reason})") from exc
