"""scripts/search_skip.py and inference/skip_search.py: chain replay on hand-made matches, the predicted
greedy tau equals the tau of real decoding, the beam search, and the script end to end (its drafter
file loads through from_pretrained and decodes exactly as plain greedy decoding)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spechead.inference.drafters.layer_skip import LayerSkipDrafter, skip_view
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.skip_search import (
    Candidate,
    beam_search,
    chain_accept_lengths,
    draft_matches,
    linear_fit,
    pooled_tau,
)

ROOT = Path(__file__).resolve().parents[2]


def test_chain_replay_on_hand_made_matches():
    m = torch.tensor(
        [1, 1, 0, 1, 1, 1, 0, 0], dtype=torch.bool
    )  # 9 generated tokens, token 0 from the prefill
    # k=2: root 0 takes m0,m1 -> 3 tokens; root 3 takes m3,m4 -> 3; root 6: m6 fails -> 1; root 7: m7 fails -> 1
    assert chain_accept_lengths(m, 2) == [3, 3, 1, 1]
    assert chain_accept_lengths(m, 3) == [3, 4, 1]  # root 3: m3, m4, m5 -> 4; root 7: last token, clipped
    assert chain_accept_lengths(m, 1) == [2, 1, 2, 2, 1]
    assert chain_accept_lengths(torch.ones(5, dtype=torch.bool), 4) == [5]
    assert chain_accept_lengths(torch.zeros(0, dtype=torch.bool), 3) == []
    assert pooled_tau([m, torch.ones(3, dtype=torch.bool)], 2) == (8 + 3) / (4 + 1)  # pooled, not a mean
    assert linear_fit([1, 2, 3, 4], [2.0, 4.0, 6.0, 8.0]) == pytest.approx([2.0, 4.0, 6.0, 8.0])


def test_beam_search_finds_the_best_set():
    best = (3, 4)  # late layers: a beam that ignored scores (kept the first sets) would never reach it

    def evaluate(skip):  # a score peaked at skipping exactly layers 3 and 4
        return Candidate(skip, 1, 1.0, 2.0 - len(set(skip) ^ set(best)))

    seen = beam_search(evaluate, 5, beam=1)
    assert max(seen.values(), key=lambda c: c.speedup).skip == best
    assert all(len(s) <= 4 for s in seen) and len(seen) < 2**5 - 1  # a beam, not every subset
    assert max(len(s) for s in beam_search(evaluate, 5, beam=1, max_skip=2)) == 2


@pytest.mark.parametrize(("skip", "k"), [([1], 1), ([1, 2], 3), ([2, 3], 2)])
def test_predicted_tau_equals_decoded_tau(tiny_llama, chatml_tokenizer, skip, k):
    """One teacher-forced draft forward predicts the greedy chain decoder's accept lengths exactly."""
    model = tiny_llama(len(chatml_tokenizer), layers=4, hidden=32, seed=3)
    gen = SpeculativeGenerator(model, chatml_tokenizer, LayerSkipDrafter(model, skip, num_draft=k))
    gen.eos = set()
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(5, 300, (int(n),), generator=g).tolist()
        for n in torch.randint(2, 12, (8,), generator=g)
    ]
    sequences, lengths, decoded = [], [], []
    for prompt in prompts:
        result = gen.generate(input_ids=prompt, max_new_tokens=20)
        sequences.append(prompt + result.token_ids)
        lengths.append(len(prompt))
        decoded.append(result.stats.accept_lengths)
    matches = draft_matches(skip_view(model, skip), sequences, lengths, batch=3)
    assert [chain_accept_lengths(m, k) for m in matches] == decoded
    assert pooled_tau(matches, k) > 1.0


def test_script_end_to_end(script, tiny_target_dir, tmp_path, capsys):
    out = tmp_path / "skip.json"
    argv = ["--target", str(tiny_target_dir), "--prompts", "3", "--max-new-tokens", "10", "--max-draft", "2",
            "--beam", "2", "--out", str(out)]  # fmt: skip
    assert script("search_skip").main(argv) == 0
    printed = capsys.readouterr().out
    assert "| drafter spec |" in printed and "early_exit@layer=1" in printed and "equal to plain" in printed
    saved = json.loads(out.read_text())
    assert saved["drafter"] == "layer_skip" and saved["num_layers"] == 4 and saved["skip_layers"]
    assert saved["num_draft"] in (1, 2) and saved["decoded_tau"] == pytest.approx(saved["tau"])
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(out))
    assert list(gen.drafter.skip_layers) == saved["skip_layers"]
    plain = SpeculativeGenerator(gen.target, gen.tokenizer, None)
    assert (
        gen.generate("hello", max_new_tokens=8).token_ids
        == plain.generate("hello", max_new_tokens=8).token_ids
    )


def test_script_bad_input(script, tiny_target_dir, tmp_path, capsys):
    script = script("search_skip")
    with pytest.raises(SystemExit) as err:
        script.main(["--target", str(tiny_target_dir), "--out", str(tmp_path / "skip.txt")])
    assert err.value.code == 2 and "must end in .json" in capsys.readouterr().err
    assert script.main(["--target", str(tmp_path / "missing"), "--out", str(tmp_path / "s.json")]) == 2
    assert "error:" in capsys.readouterr().err
