"""measure_dflash_accuracy / measure_peagle_accuracy (tuning/accuracy.py): the top-k accuracy table by block
slot of a parallel head, as the family registers it; equal to the shares counted from the drafter's own
blocks anchor by anchor."""

from __future__ import annotations

import pytest
import torch

from spechead.heads.families import family_of
from spechead.inference.drafters.dflash import DFlashDrafter
from spechead.inference.drafters.peagle import PEagleDrafter
from spechead.inference.sampling import SamplingParams
from spechead.inference.tuning import accuracy as accuracy_module
from spechead.inference.tuning.accuracy import measure_dflash_accuracy, measure_peagle_accuracy

from ..test_batch import PROMPTS
from ..test_generator import plain_greedy
from .parallel_heads import BLOCK, dflash_head, peagle_head

# family: (head builder, drafter class, drafts a block, the registered measure)
KINDS = {
    "dflash": (dflash_head, DFlashDrafter, BLOCK - 1, measure_dflash_accuracy),
    "peagle": (peagle_head, PEagleDrafter, BLOCK, measure_peagle_accuracy),
}


def drafted_table(model, head, drafter_class, slots: int, sequences, topk: int, starts) -> torch.Tensor:
    """The table counted from the drafter's blocks: for each anchor c >= start - 1, a drafter started on
    positions 0..c rooted at token c + 1, its tree of every rank at every depth (along rank 0)."""
    choices = [[0] * d + [r] for d in range(slots) for r in range(topk)]  # depth d + 1, rank r
    hits, counts = torch.zeros(slots, topk), torch.zeros(slots)
    layers = head.config.target_layers
    for seq, start in zip(sequences, starts):
        with torch.no_grad():
            out = model(seq[None], output_hidden_states=True).hidden_states
        for c in range(max(start - 1, 0), len(seq) - 2):
            drafter = drafter_class(head, choices)
            drafter.start(
                [seq[: c + 1]], [{layer: out[layer][0, : c + 1] for layer in layers}], [int(seq[c + 1])]
            )
            draft = drafter.propose([int(seq[c + 1])], [SamplingParams()], [None]).tokens[0]
            tree = drafter.tree
            depth = torch.zeros(len(tree.parents), dtype=torch.long)
            for node in range(1, len(depth)):
                depth[node] = depth[tree.parents[node]] + 1
            rank = (tree.pick - (depth[1:] - 1) * tree.width).tolist()  # node i >= 1's rank
            for node in range(1, len(depth)):
                d = int(depth[node]) - 1
                if c + 2 + d < len(seq):
                    hits[d, rank[node - 1]] += float(draft[node] == seq[c + 2 + d])
            for d in range(slots):
                counts[d] += float(c + 2 + d < len(seq))
    return hits / counts.clamp(min=1)[:, None]


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_measured_table_counts_the_drafters_own_blocks(tiny_llama, chatml_tokenizer, monkeypatch, kind):
    build, drafter_class, slots, registered = KINDS[kind]
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    head = build(model, PROMPTS[:2], steps=60)
    sequences = [torch.tensor(p + plain_greedy(model, p, 10)) for p in PROMPTS[:3]]
    starts = [len(p) for p in PROMPTS[:3]]
    measure = family_of(head.config).load("accuracy")
    assert measure is registered
    table = measure(model, head, sequences, depth=None, topk=3, starts=starts)
    assert table.shape == (slots, 3)
    assert torch.equal(table, drafted_table(model, head, drafter_class, slots, sequences, 3, starts))
    assert table[0, 0] > 0.5  # fitted on two of the three: its first draft mostly right
    assert (table.sum(1) <= 1 + 1e-6).all()  # one rank at most is the token
    monkeypatch.setattr(accuracy_module, "LOGIT_ROWS", 2 * slots)  # two anchors per forward: the same
    assert torch.equal(measure(model, head, sequences, depth=None, topk=3, starts=starts), table)
    with pytest.raises(ValueError, match="too short"):  # the last slot has no generated reference
        measure(model, head, sequences, depth=None, topk=3, starts=[len(s) - slots for s in sequences])


def test_tune_tree_measures_and_chooses_a_dflash_tree(tiny_llama, chatml_tokenizer):
    """The measured table feeds tree tuning (tree.json's fields): a tree of rank paths over the block's
    block_size - 1 positions, which the family's drafter drafts and decodes losslessly."""
    from spechead.data.prompt_sets import EvalPrompt
    from spechead.inference.drafter_specs import drafter_for_head
    from spechead.inference.generator import SpeculativeGenerator
    from spechead.inference.tuning.tree_tuning import tune_tree

    model = tiny_llama(len(chatml_tokenizer))
    model.config.eos_token_id = chatml_tokenizer.convert_tokens_to_ids("<|im_end|>")
    head = dflash_head(model, None)
    prompts = [EvalPrompt("a", "qa", ["Hello there"]), EvalPrompt("b", "qa", ["Add 2 and 3."])]
    fields = tune_tree(model, chatml_tokenizer, head, prompts, max_new_tokens=12, depth=3, topk=3)
    choices = fields["choices"]
    assert choices and all(len(c) <= BLOCK - 1 and max(c) < 3 for c in choices)
    assert len(fields["accuracy"]) == BLOCK - 1 and fields["family"] == "dflash"
    drafter = drafter_for_head(head, None, tree=choices)
    assert isinstance(drafter, DFlashDrafter) and drafter.choices == choices
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter)
    gen.eos = set()
    ids = [5, 9, 14, 20]
    assert gen.generate(input_ids=ids, max_new_tokens=10).token_ids == plain_greedy(model, ids, 10)
