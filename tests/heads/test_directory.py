"""heads/directory.py, the one owner of a head directory: config.json, tree.json, adapter/, and the set of
files loading reads (what publishing uploads)."""

from __future__ import annotations

import json

import pytest

from spechead.heads import HeadError, MedusaConfig, MedusaHead
from spechead.heads.directory import (
    ADAPTER_FILES,
    TREE_NAME,
    adapter_dir,
    loading_files,
    read_config,
    read_tree,
    tree_paths,
    write_tree,
)


@pytest.fixture
def head_dir(tmp_path):
    return MedusaHead(MedusaConfig(hidden_size=16, vocab_size=32)).save_pretrained(tmp_path / "head")


def test_tree_paths_are_checked_and_sorted_parents_first():
    assert tree_paths([[1], [0, 0], [0]]) == [(0,), (1,), (0, 0)]
    for bad, why in [
        ([[0], [0]], "duplicate"),
        ([[0], []], "empty path"),
        ([[0], [-1]], "ranks must be >= 0"),
        ([[0], [1, 0]], r"path \[1, 0\] has no parent path \[1\]"),
        ({"0": [0]}, "must be a list"),
    ]:
        with pytest.raises(ValueError, match=why):
            tree_paths(bad)


def test_tree_file_round_trip_and_broken_files(head_dir):
    assert read_tree(head_dir) is None
    path = write_tree(head_dir, [[0], [0, 0]], accuracy=[[0.5]], expected_accept_length=1.5)
    assert path.name == TREE_NAME
    tree = read_tree(head_dir)
    assert (
        tree["choices"] == [[0], [0, 0]]
        and tree["accuracy"] == [[0.5]]
        and tree["expected_accept_length"] == 1.5
    )
    with pytest.raises(ValueError, match="no parent path"):
        write_tree(head_dir, [[0, 1]])  # never written
    for broken in ({"choices": [[0, 1]]}, {"accuracy": []}, [[0]]):
        path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=f"{TREE_NAME} is not a valid tree file"):
            read_tree(head_dir)
    for accuracy, why in [
        ("high", "accuracy must be a table"),
        ({"0": [0.5]}, "accuracy must be a table"),
        ([0.5, 0.2], "accuracy must be a table"),
        ([[0.5, 0.1], [0.4]], "the same number of ranks"),
        ([[0.5, "x"]], "'x' is not a probability"),
        ([[1.5]], "1.5 is not a probability"),
        ([[True]], "True is not a probability"),
    ]:
        path.write_text(json.dumps({"choices": [[0]], "accuracy": accuracy}))
        with pytest.raises(ValueError, match=f"{TREE_NAME} is not a valid tree file .*{why}"):
            read_tree(head_dir)
    for none in (None, []):  # no measured table
        path.write_text(json.dumps({"choices": [[0]], "accuracy": none}))
        assert read_tree(head_dir)["choices"] == [[0]]


def test_saving_new_weights_drops_the_old_tree(head_dir):
    """tree.json holds a tree and accuracy measured on the weights it was built for: a head trained again
    into the same directory must not be calibrated from them (it was, after a demo re-run)."""
    write_tree(head_dir, [[0], [0, 0]], accuracy=[[0.9], [0.8]])
    MedusaHead(MedusaConfig(hidden_size=16, vocab_size=32)).save_pretrained(head_dir)
    assert read_tree(head_dir) is None and not (head_dir / TREE_NAME).exists()
    assert read_config(head_dir)["family"] == "medusa"  # the head itself is there


def test_config_and_adapter(head_dir, tmp_path):
    assert read_config(head_dir)["family"] == "medusa"
    assert adapter_dir(head_dir) is None
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(HeadError, match="has no 'family'"):
        read_config(tmp_path / "model")
    config = {**read_config(head_dir), "lora_adapter": "adapter"}
    with pytest.raises(HeadError, match=r"names the LoRA adapter 'adapter' but .* lacks adapter_config.json"):
        adapter_dir(head_dir, config)
    (head_dir / "adapter").mkdir()
    (head_dir / "adapter" / ADAPTER_FILES[0]).write_text("{}")
    with pytest.raises(HeadError, match="lacks adapter_model.safetensors$|lacks adapter_model.safetensors:"):
        adapter_dir(head_dir, config)
    (head_dir / "adapter" / ADAPTER_FILES[1]).write_bytes(b"")
    assert adapter_dir(head_dir, config) == head_dir / "adapter"


def test_loading_files_are_what_loading_reads(head_dir):
    assert sorted(loading_files(head_dir)) == ["config.json", "model.safetensors"]
    write_tree(head_dir, [[0]])
    (head_dir / "notes.txt").write_text("not read by loading")
    assert sorted(loading_files(head_dir)) == ["config.json", "model.safetensors", "tree.json"]
    config = json.loads((head_dir / "config.json").read_text())
    (head_dir / "config.json").write_text(json.dumps({**config, "lora_adapter": "adapter"}))
    with pytest.raises(HeadError, match="names the LoRA adapter"):
        loading_files(head_dir)
    (head_dir / "adapter").mkdir()
    for name in ADAPTER_FILES:
        (head_dir / "adapter" / name).write_text("{}")
    assert sorted(loading_files(head_dir))[:2] == [
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
    ]
    (head_dir / TREE_NAME).write_text("{")
    with pytest.raises(HeadError, match="not a valid tree file.*rebuild it with scripts/build_tree.py"):
        loading_files(head_dir)
    (head_dir / "model.safetensors").unlink()
    with pytest.raises(HeadError, match="has no model.safetensors"):
        loading_files(head_dir)


def test_read_tree_returns_the_paths_sorted_parents_first(head_dir):
    """A tree.json written by hand (or by an older build_tree) in any order reads back sorted by (depth,
    ranks), the order drafters build trees in (a child never before its parent)."""
    (head_dir / TREE_NAME).write_text(json.dumps({"choices": [[0, 0], [1], [0]], "accuracy": [[0.5]]}))
    assert read_tree(head_dir)["choices"] == [[0], [1], [0, 0]]
