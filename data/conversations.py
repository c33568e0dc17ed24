"""Load raw chat data (local json/jsonl/parquet or a Hub dataset) as normalised conversations."""

from __future__ import annotations

import glob
import gzip
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

from spechead.data.errors import DataError

# Common role spellings in public chat datasets, lower-cased. `DataConfig.role_map` adds to these.
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "user": "user",
    "human": "user",
    "prompter": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "ai": "assistant",
    "bard": "assistant",
}
CANONICAL_ROLES = ("system", "user", "assistant")
FORMAT_FIELDS = {"messages": ("role", "content"), "sharegpt": ("from", "value")}
JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
# How many rows to look at when detecting the turn keys (enough to see optional keys, cheap to read).
SNIFF_ROWS = 100
HIDDEN_STATES = ("online", "offline")


@dataclass
class DataConfig:
    """Where the chat data is and how its turns are spelled."""

    name: str = "demo"  # preset name (for logs)
    path: str = (
        ""  # local file (.json/.jsonl/.parquet, also .gz json), a directory of such files, or a Hub id
    )
    subset: str | None = None  # Hub config name
    split: str = "train"
    format: str = "auto"  # auto | messages | sharegpt
    messages_field: str | None = None  # column holding the turns; default "messages" or "conversations"
    role_field: str | None = None  # default "role" (messages) / "from" (sharegpt)
    content_field: str | None = None  # default "content" / "value"
    role_map: dict[str, str] = field(default_factory=dict)  # extra role aliases -> system/user/assistant
    max_examples: int | None = None
    val_size: float = 0.05  # fraction (<1) or count (>=1) held out for validation
    num_proc: int = 1
    hidden_states: str = "online"  # online: run the target every step | offline: read a hidden-state cache
    cache_dir: str | None = None  # the cache of scripts/cache_hidden_states.py (offline, and where it builds)

    def __post_init__(self) -> None:
        if self.hidden_states not in HIDDEN_STATES:
            raise DataError(f"data.hidden_states={self.hidden_states!r}: use online or offline")
        if self.hidden_states == "offline" and not self.cache_dir:
            raise DataError(
                "data.hidden_states=offline needs data.cache_dir=DIR "
                "(build the cache first with scripts/cache_hidden_states.py data.cache_dir=DIR)"
            )


def load_conversations(cfg: DataConfig) -> datasets.Dataset:
    """Load `cfg.path` as a Dataset with one column `messages`: list of {"role", "content"} per row.

    Roles are normalised to system/user/assistant and contents to strings. The first
    `cfg.max_examples` rows are kept when it is set. Raises DataError for every bad input.
    """
    if cfg.format not in ("auto", *FORMAT_FIELDS):
        raise DataError(f"unknown data.format={cfg.format!r}: use auto, messages or sharegpt")
    if cfg.max_examples is not None and cfg.max_examples < 1:
        raise DataError(f"data.max_examples={cfg.max_examples} must be at least 1 (or null for all)")
    raw = _load_raw(cfg)
    if len(raw) == 0:
        raise DataError(
            f"dataset {cfg.path} is empty: point data.path at data with at least one conversation"
        )
    if cfg.max_examples is not None:
        raw = raw.select(range(min(cfg.max_examples, len(raw))))
    messages_field, role_field, content_field = _resolve_fields(cfg, raw)
    roles = {**ROLE_ALIASES, **{str(k).strip().lower(): v for k, v in (cfg.role_map or {}).items()}}
    bad = sorted({v for v in roles.values() if v not in CANONICAL_ROLES})
    if bad:
        raise DataError(f"data.role_map maps to {bad}: every role must map to one of {list(CANONICAL_ROLES)}")
    features = datasets.Features(
        {"messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")})}
    )
    return raw.map(
        _normalise,
        with_indices=True,
        fn_kwargs={
            "messages_field": messages_field,
            "role_field": role_field,
            "content_field": content_field,
            "roles": roles,
        },
        remove_columns=raw.column_names,
        features=features,
        num_proc=_num_proc(cfg.num_proc, len(raw)),
        desc="normalising conversations",
    )


def _num_proc(requested: int, rows: int) -> int | None:
    # datasets refuses more processes than rows; None means "in this process".
    n = min(max(requested, 1), max(rows, 1))
    return n if n > 1 else None


def _load_raw(cfg: DataConfig) -> datasets.Dataset:
    """The raw rows of `cfg.path`, from local files or the Hub."""
    path = cfg.path.strip()
    if not path:
        raise DataError(
            "data.path is empty: set data.path=<a .json/.jsonl/.parquet file, a directory, or a Hub id>"
        )
    if _looks_local(path):
        builder, files = _local_files(path)
        return _load_local(builder, files, cfg.split)
    try:
        return datasets.load_dataset(path, cfg.subset, split=cfg.split)
    except Exception as e:  # offline, unknown id, bad subset/split: all mean "cannot use this path"
        raise DataError(
            f"data.path={path} is neither an existing local file nor a reachable Hub dataset "
            f"({type(e).__name__}: {_first_line(e)}): fix data.path (or data.subset/data.split)"
        ) from e


def _looks_local(path: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything with a file suffix, a glob, or a path prefix is local.
    return (
        os.path.exists(path)
        or path.startswith(("/", ".", "~"))
        or path.endswith(JSON_SUFFIXES + PARQUET_SUFFIXES)
        or any(c in path for c in "*?[")
        or path.count("/") > 1
    )


def _local_files(path: str) -> tuple[str, list[str]]:
    """(datasets builder name, files) for a local file, directory or glob."""
    expanded = os.path.expanduser(path)
    if any(c in expanded for c in "*?["):
        files = sorted(f for f in glob.glob(expanded, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"no file matches data.path={path}: fix the pattern")
    elif os.path.isdir(expanded):
        files = sorted(str(p) for p in Path(expanded).rglob("*") if p.is_file() and _builder_for(str(p)))
        if not files:
            raise DataError(
                f"directory {path} has no {'/'.join(JSON_SUFFIXES + PARQUET_SUFFIXES)} files: fix data.path"
            )
    elif os.path.isfile(expanded):
        files = [expanded]
    else:
        raise DataError(f"data file {path} not found: set data.path=<an existing file, directory, or Hub id>")
    builders = {_builder_for(f) for f in files}
    if None in builders:
        raise DataError(
            f"cannot read {path}: data files must end in {', '.join(JSON_SUFFIXES + PARQUET_SUFFIXES)}"
        )
    if len(builders) > 1:
        raise DataError(f"{path} mixes json and parquet files: point data.path at one kind")
    if all(os.path.getsize(f) == 0 for f in files):
        raise DataError(f"dataset {path} is empty: every data file has 0 bytes")
    return builders.pop(), files


def _builder_for(file: str) -> str | None:
    if file.endswith(JSON_SUFFIXES):
        return "json"
    if file.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def _load_local(builder: str, files: list[str], split: str) -> datasets.Dataset:
    # Local files form one split; naming it after data.split lets "train_sft[:1000]"-style slices work.
    name = split.split("[", 1)[0] or "train"
    try:
        loaded = datasets.load_dataset(builder, data_files={name: files}, split=split)
    except Exception as e:  # malformed json, corrupt parquet, bad slice
        if "corresponds to no data" in str(e):  # datasets' way of saying the split has 0 rows
            raise DataError(f"dataset {files[0]} is empty (or data.split={split} selects no rows)") from e
        cause = e.__cause__ or e.__context__ or e
        raise DataError(
            f"could not read {files[0] if len(files) == 1 else f'{len(files)} files'} as {builder} "
            f"({type(cause).__name__}: {_first_line(cause)}): fix the file or data.split"
        ) from e
    if builder == "json":
        _check_utf8(loaded, files)
    return loaded


def _check_utf8(ds: datasets.Dataset, files: list[str]) -> None:
    """DataError naming the file and line of a byte that is not UTF-8: pyarrow's JSON reader keeps such
    strings and reading the row later raises UnicodeDecodeError. Arrow's full validation finds one in
    one pass over the table; only then are the files read again for its place."""
    try:
        ds.data.table.validate(full=True)
    except pa.ArrowInvalid as err:
        if "utf8" not in str(err).lower():
            raise
        for file in files:
            opener = gzip.open if file.endswith(".gz") else open
            with opener(file, "rb") as f:
                for number, line in enumerate(f, 1):
                    try:
                        line.decode("utf-8")
                    except UnicodeDecodeError as bad:
                        raise DataError(
                            f"{file} line {number} is not UTF-8 text (byte 0x{line[bad.start]:02x} at column "
                            f"{bad.start + 1}): re-save the file as UTF-8"
                        ) from None
        raise DataError(f"{files[0]} is not UTF-8 text: re-save it as UTF-8") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else "no details"


def _resolve_fields(cfg: DataConfig, raw: datasets.Dataset) -> tuple[str, str, str]:
    """(messages column, role key, content key), from the config or detected from the data."""
    columns = raw.column_names
    if cfg.messages_field is not None:
        messages_field = cfg.messages_field
        if messages_field not in columns:
            raise DataError(
                f"column {messages_field!r} not found (columns: {columns}): set data.messages_field to one of them"
            )
    else:
        found = [c for c in ("messages", "conversations") if c in columns]
        if not found:
            raise DataError(
                f"no 'messages' or 'conversations' column (columns: {columns}): "
                "set data.messages_field to the column holding the turns"
            )
        messages_field = found[0]
    keys = _turn_keys(raw, messages_field)
    fmt = cfg.format
    if fmt == "auto":
        # Prefer what the turns actually contain; fall back on the column name's usual format.
        fmt = next((f for f, (r, c) in FORMAT_FIELDS.items() if r in keys and c in keys), None)
        fmt = fmt or ("sharegpt" if messages_field == "conversations" else "messages")
    role_field = cfg.role_field or FORMAT_FIELDS[fmt][0]
    content_field = cfg.content_field or FORMAT_FIELDS[fmt][1]
    for key, setting in ((role_field, "data.role_field"), (content_field, "data.content_field")):
        if key not in keys:
            raise DataError(
                f"turns in column {messages_field!r} have no {key!r} key (keys: {sorted(keys)}): "
                f"set {setting} (or data.format=messages|sharegpt)"
            )
    return messages_field, role_field, content_field


def _turn_keys(raw: datasets.Dataset, messages_field: str) -> set[str]:
    """Union of the keys of the turns in the first rows; DataError if they are not lists of dicts."""
    keys: set[str] = set()
    sample = raw.select(range(min(SNIFF_ROWS, len(raw))))[messages_field]
    for i, turns in enumerate(sample):
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise DataError(
                f"row {i}: column {messages_field!r} holds {type(turns).__name__}, not a list of turns "
                "({role: ..., content: ...}): set data.messages_field to the column holding the turns"
            )
        for turn in turns:
            keys.update(turn)
    if not keys:
        raise DataError(
            f"column {messages_field!r} has no turns in its first {len(sample)} rows: check data.path"
        )
    return keys


def _normalise(
    example: dict[str, Any],
    idx: int,
    *,
    messages_field: str,
    role_field: str,
    content_field: str,
    roles: dict[str, str],
) -> dict[str, list[dict[str, str]]]:
    """One row -> {"messages": [{"role": system|user|assistant, "content": str}, ...]}."""
    turns = example[messages_field]
    if not isinstance(turns, list):
        raise DataError(
            f"row {idx}: column {messages_field!r} is {type(turns).__name__}, not a list of turns"
        )
    out = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"row {idx}, turn {j}: expected a dict with {role_field!r} and {content_field!r}")
        role, content = turn.get(role_field), turn.get(content_field)
        if not isinstance(role, str) or role.strip().lower() not in roles:
            raise DataError(
                f"row {idx}, turn {j}: unknown role {role!r}: map it with data.role_map "
                f"(e.g. data.role_map={{{role}: user}}); known roles: {sorted(roles)}"
            )
        if content is None:  # ShareGPT dumps have null turns; treat as empty text
            content = ""
        if not isinstance(content, str):
            raise DataError(
                f"row {idx}, turn {j}: {content_field!r} is {type(content).__name__}, expected text: "
                "set data.content_field to the key holding the turn's text"
            )
        out.append({"role": roles[role.strip().lower()], "content": content})
    return {"messages": out}
