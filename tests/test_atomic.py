"""Atomic file replacement: a finished write replaces the file; a failed one leaves it alone."""

from __future__ import annotations

import pytest

from megatron_ext.atomic import atomic_path


def test_finished_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "sub" / "report.json"
    with atomic_path(target) as tmp:
        assert tmp.parent == target.parent and tmp.suffix == ".json" and tmp != target
        tmp.write_text("new")
        assert not target.exists()  # nothing visible until the write is done
    assert target.read_text() == "new"
    assert [p.name for p in target.parent.iterdir()] == ["report.json"]


def test_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "state.pt"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="disk full"), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


def test_write_json_is_indented_with_one_newline_and_atomic(tmp_path):
    from megatron_ext.atomic import write_json

    target = tmp_path / "summary.json"
    write_json(target, {"loss": 1.5, "steps": [1, 2]})
    assert target.read_text() == '{\n  "loss": 1.5,\n  "steps": [\n    1,\n    2\n  ]\n}\n'
    target.write_text("old")
    with pytest.raises(TypeError):
        write_json(target, {"bad": object()})  # not serialisable: the old file stays
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
