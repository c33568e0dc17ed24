"""scripts/parallel_anchors.py: a parallel head's (DFlash, P-EAGLE) drafts at every anchor (the training path)
walked as decoding walks them give exactly the engine's decoded passes, and the figures come out of the real
run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from spechead.heads.directory import write_tree

from ..inference.drafters.parallel_heads import dflash_head, peagle_head

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 9, 14, 9, 5], [3, 3, 8, 21, 30, 2], [17, 4, 11]]


def script():
    spec = importlib.util.spec_from_file_location(
        "parallel_anchors", ROOT / "scripts" / "parallel_anchors.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_leading_right_and_the_decoding_walk():
    mod = script()
    seq = torch.tensor([0, 1, 2, 3, 4, 5, 6])
    drafts = torch.tensor([[3, 4, 9], [9, 5, 6], [5, 6, 7]])  # anchors 1, 2, 3: drafts x_{c+2} ..
    assert mod.leading_right(drafts, seq, torch.tensor([1, 2, 3])) == [2, 0, 2]  # x_7 is past the end
    # from anchor 1: 2 right -> next anchor 4; from 4: 0 right -> 5; ...
    assert mod.path({1: 2, 2: 0, 3: 2, 4: 0, 5: 1}, 1) == [3, 1, 2]


@pytest.fixture(scope="module")
def dirs(tiny_llama, chatml_tokenizer, tmp_path_factory):
    """The target, and a DFlash and a P-EAGLE head fitted to its greedy continuations (passes of several
    tokens)."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    root = tmp_path_factory.mktemp("anchors")
    model.save_pretrained(root / "target")
    chatml_tokenizer.save_pretrained(root / "target")
    dflash_head(model, PROMPTS).save_pretrained(root / "dflash")
    peagle_head(model, PROMPTS).save_pretrained(root / "peagle")
    for name in ("dflash", "peagle"):  # a tuned tree.json pins a shorter chain: the walk's is the whole block
        write_tree(root / name, [[0], [0, 0]])
    return root / "target", root / "dflash", root / "peagle"


@pytest.mark.parametrize("family", ["dflash", "peagle"])
def test_the_training_path_walked_is_the_decoded_passes(dirs, family):
    target, head = dirs[0], dirs[1 if family == "dflash" else 2]
    unfitted = [[40, 12, 33, 7], [28, 1, 19]]  # the head misses there too
    figures = script().analyse(str(target), str(head), PROMPTS + unfitted, max_new_tokens=20)
    assert figures["passes_equal"] == 1.0, figures  # decoding drafts what the training path measures
    assert figures["path_tau"] == figures["decoded_tau"] > 1.5, figures  # several tokens a pass
    assert figures["anchors"] == 5 * 19  # every anchor whose root is an answer token and x_{c+2} exists
    for key in ("all_anchor_tau", "depth1_after_miss", "depth1_after_hit", "root_reads"):
        assert figures[key] == figures[key], key  # not NaN: each had anchors to count


def test_cli_writes_the_figures(dirs, tmp_path, capsys):
    target, head = dirs[0], dirs[1]
    out = tmp_path / "anchors.json"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [t]}) for t in ["hi there", "what is two"]) + "\n")
    argv = ["--target", str(target), "--head", str(head), "--prompt-set", str(prompts), "--prompts", "2",
            "--max-new-tokens", "8", "--out", str(out)]  # fmt: skip
    assert script().main(argv) == 0
    assert json.loads(out.read_text())["prompts"] == 2
