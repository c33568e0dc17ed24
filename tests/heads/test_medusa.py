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


def test_each_head_computes_its_own_resblocks_then_projection(target) -> None:
    """Head k = x + SiLU(W_k x + b_k) per ResBlock, then its own projection (the reference Medusa math, so
    imported checkpoints compute what they did); forward's entry k is head k, not another head."""
    head = make_head(target, num_layers=2)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    hidden = torch.randn(2, 4, H)
    with torch.no_grad():
        outputs = head(hidden)
        for k, seq in enumerate(head.heads):
            x = hidden
            for block in seq[:2]:
                x = x + torch.nn.functional.silu(x @ block.linear.weight.T + block.linear.bias)
            expected = x @ seq[2].weight.T
            torch.testing.assert_close(outputs[k], expected)
            torch.testing.assert_close(head.head_logits(k, hidden), expected)
    assert not torch.allclose(outputs[0], outputs[1])


def test_shared_lm_head_runs_each_heads_blocks_and_returns_fp32(target) -> None:
    """share_lm_head: head k's own ResBlocks, then the frozen target lm_head (bf16 here, as a bf16 target
    keeps it), with fp32 logits for the loss and the drafter whatever the lm_head's dtype."""
    head = make_head(target, share_lm_head=True)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    lm_head = nn.Linear(H, V, bias=False).to(torch.bfloat16)
    head.attach_target_modules(lm_head=lm_head)
    hidden = torch.randn(1, 3, H)
    with torch.no_grad():
        outputs = head(hidden)
        for k in range(K):
            assert outputs[k].dtype == torch.float32
            expected = lm_head(head.heads[k](hidden).to(torch.bfloat16)).float()
            assert torch.equal(outputs[k], expected)
    assert not torch.equal(outputs[0], outputs[1])


def test_negative_head_indices_and_layer_counts_are_refused(target) -> None:
    """head_logits(-1) must not silently return the last head (k is a depth: token t+2+k); a negative
    ResBlock count is a config error."""
    head = make_head(target)
    with pytest.raises(IndexError):
        head.head_logits(-1, torch.randn(1, 1, H))
    with pytest.raises(HeadError, match="num_layers"):
        MedusaConfig(hidden_size=H, vocab_size=V, num_layers=-1)
