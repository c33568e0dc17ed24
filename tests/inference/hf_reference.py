"""The target's own answers from transformers, the references lossless decoding is held to."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def hf_greedy(target_dir, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy answer (transformers' generate, no EOS): n tokens after `prompt`."""
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def decodes_as_references(gen, prompts: list[list[int]], refs: list[list[int]], n: int) -> tuple[int, int]:
    """Decode each prompt greedily (n tokens) with `gen`, asserting each answer equals its reference;
    the tokens drafted and accepted over all of them."""
    drafted = accepted = 0
    for prompt, ref in zip(prompts, refs):
        result = gen.generate(input_ids=prompt, max_new_tokens=n)
        assert result.token_ids == ref
        drafted, accepted = drafted + result.stats.drafted_tokens, accepted + result.stats.accepted_tokens
    return drafted, accepted
