"""MedusaHead: shapes, zero-init identity, independent heads, shared lm_head, save/load round trip."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from spechead.heads import WEIGHTS_NAME, HeadError, MedusaConfig, MedusaHead, load_head

H, V, K = 32, 48, 3


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(V, layers=2, hidden=H)


@pytest.fixture(scope="module")
def final_hidden(target) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden (1, 6, H) after the final norm, target logits (1, 6, V))."""
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return out.hidden_states[-1], out.logits


def make_head(target, **kw) -> MedusaHead:
    torch.manual_seed(1)
    cfg = target.config
    config = MedusaConfig(
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        num_heads=K,
        target_num_layers=cfg.num_hidden_layers,
        **kw,
    )
    return MedusaHead(config)


def test_shapes_and_default_layer_is_the_final_normed_state(target) -> None:
    head = make_head(target, num_layers=2)
    assert head.config.target_layers == [2]  # L: what the target's lm_head sees
    logits = head(torch.randn(2, 5, H))
    assert len(logits) == K and all(x.shape == (2, 5, V) for x in logits)
    assert head.head_logits(1, torch.randn(2, 5, H)).shape == (2, 5, V)
    with pytest.raises(IndexError):
        head.head_logits(K, torch.randn(1, 1, H))


def test_fresh_head_initialised_from_lm_head_reproduces_target_logits(target, final_hidden) -> None:
    hidden, target_logits = final_hidden
    head = make_head(target, num_layers=2).init_from_lm_head_(target.lm_head.weight)
    head.check_target(target.config.hidden_size, target.config.vocab_size, target.config.num_hidden_layers)
    with torch.no_grad():
        for logits in head(hidden):
            assert torch.equal(logits, target_logits)


def test_heads_and_blocks_do_not_share_parameters(target) -> None:
    head = make_head(target, num_layers=2)
    params = list(head.parameters())
    assert len({p.data_ptr() for p in params}) == len(params) == K * (2 * 2 + 1)
    with torch.no_grad():
        head.heads[0][0].linear.weight.fill_(1.0)
    assert head.heads[0][1].linear.weight.abs().sum() == 0
    assert all(h[0].linear.weight.abs().sum() == 0 for h in head.heads[1:])


def test_shared_lm_head_uses_the_attached_target_module(target, final_hidden, tmp_path) -> None:
    hidden, target_logits = final_hidden
    head = make_head(target, share_lm_head=True)
    assert all(not isinstance(m, nn.Linear) or m.out_features == H for m in head.modules())
    with pytest.raises(HeadError, match="no target lm_head attached"):
        head(hidden)
    head.attach_target_modules(lm_head=target.lm_head)
    with torch.no_grad():
        assert all(torch.equal(x, target_logits) for x in head(hidden))
    head.save_pretrained(tmp_path)
    saved = load_file(tmp_path / WEIGHTS_NAME)
    assert all(t.shape != target.lm_head.weight.shape for t in saved.values())
    assert sum(t.numel() for t in saved.values()) == K * (H * H + H)


def test_save_load_round_trip_gives_identical_outputs(target, tmp_path) -> None:
    head = make_head(target).init_from_lm_head_(target.lm_head.weight)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.01 * torch.randn_like(p))
    head.save_pretrained(tmp_path)
    saved = load_file(tmp_path / WEIGHTS_NAME)
    assert set(saved) == set(head.state_dict()) and not any("lm_head" in key for key in saved)
    loaded = load_head(tmp_path)
    assert isinstance(loaded, MedusaHead) and loaded.config == head.config
    hidden = torch.randn(2, 4, H)
    with torch.no_grad():
        for a, b in zip(head(hidden), loaded(hidden)):
            assert torch.equal(a, b)


def test_init_from_lm_head_and_config_validation(target) -> None:
    with pytest.raises(HeadError, match=r"shape \(48, 16\) but the heads need \(48, 32\)"):
        make_head(target).init_from_lm_head_(torch.zeros(V, 16))
    with pytest.raises(HeadError, match="num_heads"):
        MedusaConfig(hidden_size=H, vocab_size=V, num_heads=0)
    with pytest.raises(HeadError, match="exactly one target layer"):
        MedusaConfig(hidden_size=H, vocab_size=V, target_layers=[1, 2])


def test_a_head_with_nothing_to_train_is_refused() -> None:
    with pytest.raises(HeadError, match="nothing to train"):
        MedusaConfig(hidden_size=8, vocab_size=16, num_layers=0, share_lm_head=True)
