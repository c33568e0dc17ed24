"""Stopping: the EOS ids of a model and a tokenizer, and cutting emitted tokens at EOS or a budget."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn
from transformers import GenerationConfig

from spechead.inference.stops import eos_ids, until_stop


def model_with_eos(eos) -> nn.Module:
    model = nn.Module()
    model.generation_config = GenerationConfig(eos_token_id=eos)
    return model


def test_eos_ids_take_the_models_list_or_int_and_the_tokenizers():
    # Llama-3 style: a list in the generation config (end of text and end of turn)
    assert eos_ids(model_with_eos([128001, 128009])) == {128001, 128009}
    assert eos_ids(model_with_eos(2)) == {2}
    tokenizer = SimpleNamespace(eos_token_id=7)
    assert eos_ids(model_with_eos([3, 4]), tokenizer) == {3, 4, 7}
    assert eos_ids(model_with_eos(None), tokenizer) == {7}
    assert eos_ids(nn.Module()) == set()  # no generation config, no tokenizer: never stops at EOS


def test_until_stop_keeps_the_first_eos_and_at_most_room_tokens():
    assert until_stop([5, 6, 2, 7, 2], {2}) == [5, 6, 2]
    assert until_stop([5, 6, 2, 7], {2}, room=2) == [5, 6]
    assert until_stop([5, 6, 2, 7], {2}, room=3) == [5, 6, 2]
    assert until_stop([5, 6], set(), room=0) == []


def test_until_stop_keeps_nothing_when_the_budget_is_spent_or_overspent():
    assert until_stop([5, 6, 7], {2}, room=-1) == []  # not "all but the last"
    assert until_stop([5, 6, 7], {2}, room=-2) == []
    assert until_stop([5, 6, 7], set(), room=None) == [5, 6, 7]
