"""EAGLE-3.1 norm options of the EAGLE-3 head (norm_before_fc, norm_before_residual, norm_output): off
by default (existing heads keep their tensors), each changes the computation, the training-time test
still equals step-by-step drafting, gradients reach the new norm, and drafting runs them (the fused
draft step, which knows only the plain EAGLE-3 layer, steps aside). Their exact meaning is checked
against speculators' own model in test_speculators_roundtrip.py."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from spechead.heads import load_head
from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.heads.fused import fused_logits, fused_step
from spechead.heads.unroll import ttt_forward
from spechead.inference.drafters.eagle import EagleDrafter

H, V, L, VD = 32, 48, 8, 20
FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")
ALL = dict.fromkeys(FLAGS, True)


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(V, layers=L, hidden=H).requires_grad_(False)


def make_head(target, **flags) -> Eagle3Head:
    """A head with random weights (norm weights too, so a norm is never the identity)."""
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(target.config, draft_vocab_size=VD, **flags))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    return head.eval()


def inputs(seq: int = 6) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [3 * torch.randn(1, seq, H, generator=g) for _ in range(3)], torch.randint(
        0, V, (1, seq), generator=g
    )


def two_steps(head: Eagle3Head) -> torch.Tensor:
    states, ids = inputs()
    with torch.no_grad():
        return head.logits(head.step(head.step(head.fuse(states), ids), ids.flip(1)))


def test_off_by_default_and_only_norm_before_fc_adds_a_tensor(target) -> None:
    plain = make_head(target)
    assert not any(getattr(plain.config, f) for f in FLAGS) and not hasattr(plain, "input_norm")
    head = make_head(target, **ALL)
    assert set(head.state_dict()) - set(plain.state_dict()) == {"input_norm.weight"}
    assert head.input_norm.weight.shape == (3 * H,)


@pytest.mark.parametrize("flag", FLAGS)
def test_each_option_changes_the_drafts(target, flag) -> None:
    """Same weights, one option on: other logits (an option the forward ignored would pass unseen)."""
    plain, changed = make_head(target), make_head(target, **{flag: True})
    changed.load_state_dict(plain.state_dict(), strict=False)  # norm_before_fc keeps its own input_norm
    assert not torch.allclose(two_steps(plain), two_steps(changed), atol=1e-3)


def test_norm_output_feeds_the_normed_state_and_logits_skip_the_second_norm(target) -> None:
    head = make_head(target, norm_output=True)
    states, ids = inputs()
    with torch.no_grad():
        out = head.step(head.fuse(states), ids)
        head.config.norm_output = False
        raw = head.step(head.fuse(states), ids)
        head.config.norm_output = True
        torch.testing.assert_close(out, head.norm(raw))
        torch.testing.assert_close(head.logits(out), head.lm_head(out))


def test_options_save_load_and_ttt_equals_chained_steps(target, tmp_path) -> None:
    """Saved and loaded with the options; TTT step 2 at t equals decoding's chain: a causal pass over
    0..t-2 into a cache, then two single-token steps each reading the previous (normed) output."""
    head = make_head(target, **ALL)
    head.save_pretrained(tmp_path)
    back = load_head(tmp_path)
    assert all(getattr(back.config, f) for f in FLAGS)
    back.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    torch.testing.assert_close(two_steps(back), two_steps(head), atol=0, rtol=0)
    states, ids = inputs(8)
    t, root = 6, 4
    with torch.no_grad():
        fused = head.fuse(states)
        outs = ttt_forward(head, fused, ids, None, 3)
        cache = DynamicCache()
        hidden = head.step(fused[:, : root + 1], ids[:, 1 : root + 2], past_key_values=cache)[:, -1:]
        for i in (1, 2):  # the default mask after a cache: every cached key and itself
            position = torch.tensor([[root + i]])
            hidden = head.step(hidden, ids[:, root + i + 1 : root + i + 2], None, position, cache)
    torch.testing.assert_close(outs[2][:, t], hidden[:, 0], atol=1e-5, rtol=1e-5)


def test_training_reaches_the_new_norms(target) -> None:
    head = make_head(target, **ALL).train()
    states, ids = inputs()
    outs = ttt_forward(head, head.fuse(states), ids, None, 3)
    (head.logits(outs[-1]) ** 2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())
    assert head.input_norm.weight.grad.abs().sum() > 0


def test_drafting_runs_the_options(target) -> None:
    """The drafter's step and logits compute what the head's own do (the fused draft step knows the plain
    EAGLE-3 layer only, so it steps aside for these heads)."""
    head = make_head(target, **ALL)
    assert fused_step(head) is None and fused_logits(head) is None
    drafter = EagleDrafter(head)
    states, ids = inputs()
    with torch.no_grad():
        hidden = head.fuse(states)
        torch.testing.assert_close(drafter.head_step(hidden, ids), head.step(hidden, ids), atol=0, rtol=0)
        torch.testing.assert_close(drafter.head_logits(hidden), head.logits(hidden), atol=0, rtol=0)
    assert fused_step(make_head(target)) is not None  # plain heads keep the fused step
