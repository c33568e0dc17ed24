"""Loading local files as normalised conversations, and the DataError for each bad input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import datasets
import pytest

from spechead.data.conversations import DataConfig, load_conversations
from spechead.data.errors import DataError

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
]
SHAREGPT = [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "What is the capital of France?"},
    {"from": "gpt", "value": "Paris."},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(path: Path | str, **kw) -> datasets.Dataset:
    return load_conversations(DataConfig(path=str(path), **kw))


def test_messages_jsonl(tmp_path):
    rows = [{"id": i, "messages": MESSAGES, "source": "x"} for i in range(3)]
    ds = load(write_jsonl(tmp_path / "train.jsonl", rows))
    assert ds.column_names == ["messages"] and len(ds) == 3
    assert ds[0]["messages"] == MESSAGES


def test_sharegpt_json_with_nulls_and_extra_keys(tmp_path):
    turns = [*SHAREGPT, {"from": "human", "value": "Thanks!", "weight": 0}, {"from": "gpt", "value": None}]
    (tmp_path / "sg.json").write_text(json.dumps([{"id": "a", "conversations": turns}]))
    ds = load(tmp_path / "sg.json")
    assert ds[0]["messages"] == [
        *MESSAGES,
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": ""},
    ]


def test_parquet_gz_and_directory(tmp_path):
    expected = [{"messages": MESSAGES}] * 4
    datasets.Dataset.from_list(expected).to_parquet(str(tmp_path / "d.parquet"))
    assert load(tmp_path / "d.parquet").to_list() == expected
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in expected))
    assert load(tmp_path / "d.jsonl.gz").to_list() == expected
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "a.jsonl", expected[:2])
    write_jsonl(shards / "b.jsonl", expected[2:])
    (shards / "README.md").write_text("not data")
    assert load(shards).to_list() == expected


def test_custom_fields_and_role_map(tmp_path):
    turns = [
        {"speaker": "Customer", "text": "Where is my order?"},
        {"speaker": "agent", "text": "On its way."},
    ]
    path = write_jsonl(tmp_path / "c.jsonl", [{"dialog": turns}])
    ds = load(
        path,
        messages_field="dialog",
        role_field="speaker",
        content_field="text",
        role_map={"customer": "user", "Agent": "assistant"},
    )
    assert ds[0]["messages"] == [
        {"role": "user", "content": "Where is my order?"},
        {"role": "assistant", "content": "On its way."},
    ]


@pytest.mark.parametrize("alias", ["bot", "model", "chatgpt", "GPT", "Assistant "])
def test_role_aliases(tmp_path, alias):
    turns = [{"from": "Human", "value": "hi"}, {"from": alias, "value": "hello"}]
    ds = load(write_jsonl(tmp_path / "r.jsonl", [{"conversations": turns}]))
    assert [m["role"] for m in ds[0]["messages"]] == ["user", "assistant"]


def test_conversations_column_with_role_content_keys_is_detected(tmp_path):
    ds = load(write_jsonl(tmp_path / "x.jsonl", [{"conversations": MESSAGES}]))
    assert ds[0]["messages"] == MESSAGES


def test_role_map_overrides_a_built_in_alias(tmp_path):
    """data.role_map wins over the built-in aliases (e.g. a template without a system role)."""
    ds = load(write_jsonl(tmp_path / "s.jsonl", [{"messages": MESSAGES}]), role_map={"System": "user"})
    assert [m["role"] for m in ds[0]["messages"]] == ["user", "user", "assistant"]


def test_messages_column_is_preferred_over_conversations(tmp_path):
    """With both columns present, the turns come from `messages`."""
    other = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ds = load(write_jsonl(tmp_path / "b.jsonl", [{"conversations": other, "messages": MESSAGES}]))
    assert ds[0]["messages"] == MESSAGES


def test_undetected_format_falls_back_on_the_column_name(tmp_path):
    """Turns matching neither format fully: a `conversations` column reads as ShareGPT, so only the
    setting that differs needs to be given (here content_field; roles stay under `from`)."""
    turns = [{"from": "human", "text": "hi"}, {"from": "gpt", "text": "hello"}]
    ds = load(write_jsonl(tmp_path / "f.jsonl", [{"conversations": turns}]), content_field="text")
    assert ds[0]["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_max_examples_keeps_the_first_rows(tmp_path):
    rows = [{"messages": [{"role": "user", "content": str(i)}]} for i in range(10)]
    ds = load(write_jsonl(tmp_path / "m.jsonl", rows), max_examples=4, num_proc=2)
    assert [r["messages"][0]["content"] for r in ds] == ["0", "1", "2", "3"]


def write_bad_files(tmp: Path) -> None:
    """The malformed inputs BAD_INPUTS points at."""
    write_jsonl(tmp / "ok.jsonl", [{"messages": MESSAGES}])
    (tmp / "empty.jsonl").write_text("")
    (tmp / "empty_list.json").write_text("[]")
    (tmp / "broken.json").write_text("{not json")
    (tmp / "table.csv").write_text("a,b\n1,2\n")
    (tmp / "nodata").mkdir()
    write_jsonl(tmp / "text.jsonl", [{"text": "hello", "id": 1}])
    write_jsonl(tmp / "strings.jsonl", [{"messages": "user: hi"}])
    write_jsonl(tmp / "keys.jsonl", [{"messages": [{"speaker": "user", "text": "hi"}]}])
    write_jsonl(tmp / "tool.jsonl", [{"messages": [*MESSAGES, {"role": "tool", "content": "{}"}]}])
    write_jsonl(tmp / "parts.jsonl", [{"messages": [{"role": "user", "content": [1, 2]}]}])


# name -> (DataConfig kwargs, "{tmp}" standing for the folder of write_bad_files; regex for the message)
BAD_INPUTS = {
    "missing file": ({"path": "{tmp}/nope.jsonl"}, r"data file .*nope.jsonl not found: set data.path="),
    "empty path": ({"path": ""}, r"data.path is empty"),
    "offline hub id": ({"path": "someone/chat-data"}, r"neither an existing local file nor a reachable Hub"),
    "empty file": ({"path": "{tmp}/empty.jsonl"}, r"is empty"),
    "empty json list": ({"path": "{tmp}/empty_list.json"}, r"is empty"),
    "broken json": ({"path": "{tmp}/broken.json"}, r"could not read .*broken.json as json"),
    "unknown suffix": ({"path": "{tmp}/table.csv"}, r"must end in .json"),
    "dir without data": ({"path": "{tmp}/nodata"}, r"has no .*files"),
    "no turns column": ({"path": "{tmp}/text.jsonl"}, r"columns: \['text', 'id'\]\).*data.messages_field"),
    "wrong column": (
        {"path": "{tmp}/ok.jsonl", "messages_field": "chat"},
        r"'chat' not found \(columns: \['messages'\]\).*data.messages_field",
    ),
    "turns are strings": ({"path": "{tmp}/strings.jsonl"}, r"holds str, not a list of turns"),
    "wrong turn keys": (
        {"path": "{tmp}/keys.jsonl"},
        r"no 'role' key \(keys: \['speaker', 'text'\]\): set data.role_field",
    ),
    "unknown role": ({"path": "{tmp}/tool.jsonl"}, r"unknown role 'tool'.*data.role_map"),
    "non-text content": ({"path": "{tmp}/parts.jsonl"}, r"'content' is list, expected text"),
    "bad format": ({"path": "{tmp}/ok.jsonl", "format": "alpaca"}, r"unknown data.format='alpaca'"),
    "bad role_map": ({"path": "{tmp}/ok.jsonl", "role_map": {"tool": "function"}}, r"maps to \['function'\]"),
    "bad max_examples": ({"path": "{tmp}/ok.jsonl", "max_examples": 0}, r"max_examples=0 must be at least 1"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_data_error(tmp_path, case):
    write_bad_files(tmp_path)
    kwargs, pattern = BAD_INPUTS[case]
    kwargs = {**kwargs, "path": kwargs["path"].format(tmp=tmp_path)}
    with pytest.raises(DataError, match=pattern) as info:
        load_conversations(DataConfig(**kwargs))
    assert "\n" not in str(info.value)


def test_data_error_survives_worker_processes(tmp_path):
    rows = [{"messages": [*MESSAGES, {"role": "tool", "content": "{}"}]}] * 4
    with pytest.raises(DataError, match="unknown role 'tool'"):
        load(write_jsonl(tmp_path / "t.jsonl", rows), num_proc=2)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_a_byte_that_is_not_utf8_names_the_file_and_line(tmp_path, suffix):
    """pyarrow's JSON reader keeps the byte and reading that row raised UnicodeDecodeError (a traceback)."""
    good = "".join(json.dumps({"messages": MESSAGES}) + "\n" for _ in range(3)).encode()
    bad = (
        json.dumps({"messages": [{"role": "user", "content": "cafe"}]}).encode().replace(b"cafe", b"caf\xe9")
    )
    data = good + bad + b"\n" + good
    path = tmp_path / f"chats{suffix}"
    path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    with pytest.raises(DataError) as err:
        load(path)
    column = bad.index(b"\xe9") + 1
    assert str(err.value) == (
        f"{path} line 4 is not UTF-8 text (byte 0xe9 at column {column}): re-save the file as UTF-8"
    )
