"""Self-speculative drafter specs and files (drafter_specs.py, layer_skip.py) without decoding: which paths are drafter
files, inline options against keyword ones and the file's, and where a file may be written."""

from __future__ import annotations

import json

import pytest

from spechead.inference.drafter_specs import is_self_spec, make_drafter, make_self_drafter
from spechead.inference.drafters.layer_skip import LayerSkipDrafter, read_drafter_file, save_drafter_file


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(64, layers=4, hidden=32, seed=0)


def test_only_json_files_naming_a_self_speculative_drafter_are_drafter_files(tmp_path):
    body = json.dumps({"drafter": "layer_skip", "skip_layers": [1], "num_layers": 4})
    (tmp_path / "skip.json").write_text(body)
    (tmp_path / "skip.txt").write_text(body)  # the right content, not a .json file
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "head.json").write_text(json.dumps({"drafter": "eagle", "num_layers": 4}))  # another kind
    (tmp_path / "list.json").write_text(json.dumps(["layer_skip"]))
    assert read_drafter_file(tmp_path / "skip.json") == json.loads(body)
    for name in ("skip.txt", "broken.json", "head.json", "list.json", "missing.json"):
        assert read_drafter_file(tmp_path / name) is None, name
        assert not is_self_spec(str(tmp_path / name)), name
    assert is_self_spec(str(tmp_path / "skip.json")) and is_self_spec(f"{tmp_path / 'skip.json'}@num_draft=2")
    assert is_self_spec("early_exit@layer=1")


def test_keyword_options_override_inline_ones_which_override_the_files(target, tmp_path):
    file = tmp_path / "skip.json"
    file.write_text(json.dumps({"drafter": "layer_skip", "skip_layers": [1, 2], "num_layers": 4, "num_draft": 2,
                                "tau": 1.9}))  # fmt: skip
    from_file = make_self_drafter(str(file), target)
    assert from_file.skip_layers == (1, 2) and from_file.depth == 2  # the file's chain length, too

    def make(spec: str, **options) -> LayerSkipDrafter:  # as from_pretrained builds it: one spec string
        drafter = make_drafter(spec, target, device="cpu", dtype=None, **options)
        assert isinstance(drafter, LayerSkipDrafter)
        return drafter

    inline = make(f"{file}@skip=3, num_draft=5")  # (spaces around an option are fine)
    assert inline.skip_layers == (3,) and inline.depth == 5
    both = make("layer_skip@skip=1,num_draft=2", num_draft=3, skip_layers=[2])
    assert both.skip_layers == (2,) and both.depth == 3


def test_a_drafter_file_is_a_json_file_written_where_asked(target, tmp_path):
    drafter = LayerSkipDrafter(target, skip_layers=[1], num_draft=3)
    with pytest.raises(ValueError, match="ends in .json"):
        save_drafter_file(tmp_path / "skip.txt", drafter)
    file = save_drafter_file(tmp_path / "new" / "dir" / "skip.json", drafter, tau=2.5)  # folders made
    assert read_drafter_file(file) == {"drafter": "layer_skip", "skip_layers": [1], "num_layers": 4, "num_draft": 3,
                                      "tau": 2.5}  # fmt: skip
    again = make_self_drafter(str(file), target)
    assert again.skip_layers == (1,) and again.depth == 3
