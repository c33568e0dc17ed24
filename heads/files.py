"""Files as spechead writes them: readable as the umask says, whole or not at all, checked before a long run.

safetensors (0.8: a temporary file renamed into place) creates its files with mode 0600 whatever the
umask, so a head, checkpoint or export saved on a shared machine would be readable by its owner only;
`umask_mode` gives every file written there the mode a plain `open()` would have (0644 under umask 022).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def current_umask() -> int:
    """The process umask (from /proc on Linux, which reads it without changing it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: the classic set-and-restore (not atomic across threads)
    os.umask(mask)
    return mask


def umask_mode(path: str | Path) -> None:
    """Give the file `path`, or every file under the directory `path`, the mode the umask gives a new file."""
    path = Path(path)
    mode = 0o666 & ~current_umask()
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    for file in files:
        os.chmod(file, mode)


def nearest_existing(path: str | Path) -> Path:
    """`path` itself when it exists, else its closest existing ancestor."""
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def unwritable_reason(directory: str | Path) -> str | None:
    """Why the directory `directory` (which may not exist yet) cannot be written, or None when it can.

    Creates nothing: a temporary file is made (and removed at once) in the directory, or in its closest
    existing ancestor when it does not exist yet."""
    base = nearest_existing(directory)
    if not base.is_dir():
        return f"{base} is a file, not a directory"
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as err:
        return err.strerror or type(err).__name__
    return None


def free_bytes(directory: str | Path) -> int:
    """Free bytes on the file system that holds (or will hold) `directory`."""
    return shutil.disk_usage(nearest_existing(directory)).free


def replace_dir(written: Path, final: Path) -> None:
    """Put the completely written directory `written` at `final` (a sibling), replacing what is there.

    The old `final` stays whole until `written` is complete: it is renamed aside, then removed."""
    old = final.with_name(f".old-{final.name}")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    written.rename(final)
    if old.exists():
        shutil.rmtree(old)
