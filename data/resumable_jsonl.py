"""A JSONL output written in chunks, with a state file beside it, so a killed job resumes where it stopped.

After every chunk the rows are flushed and fsynced, then `FILE.state.json` is replaced atomically with
the number of rows and bytes that are complete. On reopening, anything past those bytes (a partial
line, or a chunk whose state was never written) is cut off, so no row is duplicated or half-read.
The state also holds the settings `key` the file was written with: reopening with another key fails.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from spechead.data.errors import DataError

STATE_SUFFIX = ".state.json"
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


def chain_digest(digest: str, row: Any) -> str:
    """sha256 over the rows seen so far, one row at a time (independent of how rows were chunked)."""
    row_hash = hashlib.sha256(json.dumps(row, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return hashlib.sha256((digest + row_hash).encode()).hexdigest()


def flatten(key: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat: dict[str, Any] = {}
    for name, value in key.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


class ResumableJsonl:
    """Rows of one output file: `rows` complete so far, `info` (caller's JSON dict) saved with each chunk."""

    def __init__(self, path: Path, key: dict[str, Any], *, overwrite: bool = False):
        self.path = Path(path)
        self.state_path = self.path.with_name(self.path.name + STATE_SUFFIX)
        self.key = json.loads(json.dumps(key))  # as it reads back from the state file
        _check_writable(self.path)
        if overwrite:
            self.path.unlink(missing_ok=True)
            self.state_path.unlink(missing_ok=True)
        state = self._read_state()
        if state is None:
            if self.path.exists() and self.path.stat().st_size > 0:
                raise DataError(
                    f"{self.path} exists but has no {self.state_path.name}: it was not written by this tool "
                    "(or its state was deleted); pass --overwrite to replace it or choose a new --out"
                )
            self.rows, self.bytes, self.info = 0, 0, {}
            self.path.write_bytes(b"")
            self._write_state()
        else:
            self._check_key(state["key"])
            self.rows, self.bytes, self.info = state["rows"], state["bytes"], state["info"]
            self._cut_to_state()

    def append(self, rows: list[Any], info: dict[str, Any]) -> None:
        """Append rows (one JSON line each), make them durable, then record them and `info` in the state.

        A failed write (disk full) is a DataError: the rows written before stay, the chunk is cut off, and
        rerunning the same command continues from them."""
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
        try:
            with self.path.open("ab") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            self._write_state(self.rows + len(rows), self.bytes + len(data), info)
        except OSError as err:
            self._cut_to_state()  # (cutting never needs space)
            raise DataError(
                f"could not write {self.path} ({err.strerror or type(err).__name__}): its first {self.rows} "
                "rows are kept; free space (or choose another --out) and rerun the same command to continue"
            ) from None
        self.rows += len(rows)
        self.bytes += len(data)
        self.info = info

    def _read_state(self) -> dict[str, Any] | None:
        if not self.state_path.exists():
            return None
        try:
            state = json.loads(self.state_path.read_text())
            _ = state["key"], int(state["rows"]), int(state["bytes"]), dict(state["info"])
        except (ValueError, KeyError, TypeError) as err:
            raise DataError(
                f"{self.state_path} is unreadable ({type(err).__name__}): pass --overwrite to start over"
            ) from None
        return state

    def _check_key(self, saved: dict[str, Any]) -> None:
        old, new = flatten(saved), flatten(self.key)
        changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old.keys() | new.keys())
                   if old.get(k) != new.get(k)]  # fmt: skip
        if changed:
            raise DataError(
                f"{self.path} was written with other settings ({'; '.join(changed[:4])}): "
                "choose a new --out, or pass --overwrite to start over"
            )

    def _cut_to_state(self) -> None:
        size = self.path.stat().st_size if self.path.exists() else -1
        if size < self.bytes:
            raise DataError(
                f"{self.path} has {max(size, 0)} bytes but its state records {self.bytes}: the file was "
                "changed or removed; pass --overwrite to start over"
            )
        if size > self.bytes:  # a chunk (or part of a line) written after the last saved state
            with self.path.open("r+b") as f:
                f.truncate(self.bytes)
                os.fsync(f.fileno())

    def _write_state(
        self, rows: int | None = None, size: int | None = None, info: dict | None = None
    ) -> None:
        """Replace the state file atomically with these counts (default: the current ones)."""
        state = {"key": self.key, "rows": self.rows if rows is None else rows,
                 "bytes": self.bytes if size is None else size, "info": self.info if info is None else info}  # fmt: skip
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        try:
            with tmp.open("w") as f:
                json.dump(state, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.state_path)


def _check_writable(path: Path) -> None:
    parent = path.parent
    if path.is_dir():
        raise DataError(f"output {path} is a directory: pass a file path such as {path}/regenerated.jsonl")
    if not parent.is_dir():
        raise DataError(f"folder {parent} does not exist: create it or choose another --out")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise DataError(f"cannot write {path}: choose a writable --out")
