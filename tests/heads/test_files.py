"""heads/files.py: files written with the umask's mode (not safetensors' 0600), a probe that creates
nothing, a directory replaced only once its successor is whole."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from spechead.heads import MedusaConfig, MedusaHead
from spechead.heads.files import current_umask, replace_dir, unwritable_reason


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask():
    """Set the process umask for the test (restored after)."""
    saved = os.umask(0o022)

    def set_(value: int) -> None:
        os.umask(value)

    yield set_
    os.umask(saved)


@pytest.mark.parametrize(("mask", "expected"), [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_a_saved_head_has_the_umask_mode(tmp_path, umask, mask, expected):
    """Others on a shared machine can read a head as they can any file its owner writes (safetensors
    alone would leave the weights at 0600)."""
    umask(mask)
    assert current_umask() == mask
    head = MedusaHead(MedusaConfig(hidden_size=8, vocab_size=16, num_heads=1))
    saved = head.save_pretrained(tmp_path / "head")
    assert {p.name: mode(p) for p in saved.iterdir()} == {
        "config.json": expected,
        "model.safetensors": expected,
    }


def test_an_export_from_the_library_has_the_umask_mode(tmp_path, umask):
    """`export_head` itself (not only scripts/export.py) writes its files readable as the umask says."""
    from spechead.heads.formats import export_head

    umask(0o022)
    head = MedusaHead(MedusaConfig(hidden_size=8, vocab_size=16, num_heads=1))
    out = export_head(head, "medusa", tmp_path / "m")
    assert {mode(p) for p in Path(out).iterdir() if p.is_file()} == {0o644}


def test_unwritable_reason_creates_nothing(tmp_path):
    blocker = tmp_path / "file.txt"  # a regular file: nothing can be made under it, even as root
    blocker.write_text("x")
    assert "is a file, not a directory" in unwritable_reason(blocker / "out")
    assert unwritable_reason(tmp_path / "new" / "deeper") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_replace_dir_swaps_in_a_whole_directory(tmp_path):
    final, written = tmp_path / "head", tmp_path / ".tmp-head"
    for d, text in ((final, "old"), (written, "new")):
        d.mkdir()
        (d / "w").write_text(text)
    replace_dir(written, final)
    assert (final / "w").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["head"]
    written.mkdir()
    (written / "w").write_text("first")
    replace_dir(written, tmp_path / "fresh")  # nothing there before
    assert (tmp_path / "fresh" / "w").read_text() == "first"
