"""A DFlash export run by the REAL client library on CPU: speculators 0.9.0 loads the exported directory
the way a user does (`maybe_convert_external_checkpoint`, which `SpeculatorModel.from_pretrained(path,
verifier=...)` runs for a z-lab / SGLang DFlash checkpoint, then `DFlashDraftModel.from_pretrained`) and
its forward drafts the same blocks as our head: the same logits (fp32, 1e-5) and the same draft tokens,
from the target's own hidden states of the chosen layers.

speculators' forward is its training forward; it picks anchors at random (`select_anchors`), which the
test fixes. Its anchor a is our anchor c + 1 (block token 0 = x_a at position a, context positions < a)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from spechead.heads import DFlashConfig, DFlashHead
from spechead.heads.formats import export_head

V, H, L, MASK, BS = 64, 32, 8, 63, 4
LAYERS = [2, 4, 7]  # HF hidden-state indices (7: the output of the second-to-last target layer)
T = 24
ANCHORS = torch.tensor([[0, 5, 9, 14, 19]])  # ours: the last context position of each block (< T - BS)


def qwen3_target() -> PreTrainedModel:
    """A Qwen3 target whose head_dim (16) is not hidden / heads (8), with attention biases (its layer's)."""
    config = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=L,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=50000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True)  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval()


def llama_target() -> PreTrainedModel:
    """A Llama target with Llama-3 rope scaling: the default draft layer (qwen3) is sized from it."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # fmt: skip
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=L,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_theta=500000.0, rope_scaling=scaling, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def dflash_head(target: PreTrainedModel, draft_layer: str) -> DFlashHead:
    """A random DFlash head (2 layers) reading LAYERS, with the target's embedding and lm_head attached."""
    torch.manual_seed(1)
    config = DFlashConfig.from_target(
        target.config, draft_layer, block_size=BS, num_layers=2, mask_token_id=MASK, target_layers=LAYERS
    )
    head = DFlashHead(config)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    return head.eval()


def target_inputs(target: PreTrainedModel) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Token ids (1, T) and the target's HF hidden states (L + 1 of them, each (1, T, H))."""
    ids = torch.randint(0, MASK, (1, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return ids, target(ids, output_hidden_states=True).hidden_states


def ours(head: DFlashHead, ids: torch.Tensor, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Our blocks' logits (1, A, BS, V) from the states of OUR target_layers: block position 0 reads the
    token after the anchor, positions 1.. are masks."""
    with torch.no_grad():
        fused = head.fuse([states[i] for i in head.config.target_layers])  # (1, T, H)
        return head.logits(head.predict_blocks(fused, ids, ANCHORS))


def load_theirs(out, target_dir, tmp_path):
    """The export as a speculators user loads it (converted against the verifier), attention eager."""
    from speculators.convert.entrypoints import maybe_convert_external_checkpoint
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    converted = maybe_convert_external_checkpoint(
        out, verifier=str(target_dir), output_path=str(tmp_path / "c")
    )
    config = DFlashSpeculatorConfig.from_pretrained(converted)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a GPU compile
    return DFlashDraftModel.from_pretrained(converted, config=config).eval()


def theirs(model, ids, states, monkeypatch) -> torch.Tensor:
    """speculators' forward over the same anchors (its a = our c + 1) from the states of the layers ITS
    config names (as its data pipeline captures them); the lm_head outputs captured."""
    core = pytest.importorskip("speculators.models.dflash.core")
    from speculators.losses.utils import resolve_loss_config

    count = ANCHORS.shape[1]
    monkeypatch.setattr(
        core, "select_anchors", lambda *_: (ANCHORS[0] + 1, torch.ones(count, dtype=torch.bool))
    )
    logits = []
    hook = model.lm_head.register_forward_hook(lambda _m, _a, out: logits.append(out))
    with torch.no_grad():
        model(
            hidden_states=torch.cat([states[i] for i in model.config.aux_hidden_state_layer_ids], dim=-1),
            input_ids=ids,
            loss_mask=torch.ones(1, T),
            verifier_last_hidden_states=states[-1],  # (1, T, H): only its loss reads it
            document_ids=torch.zeros(1, T, dtype=torch.long),
            max_anchors=count,
            loss_config=resolve_loss_config("kl_div", "eager"),  # the fused loss needs Triton
        )
    hook.remove()
    return logits[0].view(1, count, BS, -1)  # (1, A * BS, V) -> (1, A, BS, V)


@pytest.mark.parametrize(
    ("make_target", "draft_layer"),
    [(qwen3_target, "target"), (llama_target, "qwen3")],
    ids=["qwen3-target", "llama3-rope-target-default-layer"],
)
def test_real_speculators_drafts_the_same_blocks(tmp_path, monkeypatch, make_target, draft_layer) -> None:
    pytest.importorskip("speculators.models.dflash", reason="speculators is not installed")
    from loguru import logger

    logger.disable("speculators")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    target = make_target()
    target.save_pretrained(tmp_path / "target")
    head = dflash_head(target, draft_layer)
    out = export_head(head, "sglang", tmp_path / "d")
    model = load_theirs(out, tmp_path / "target", tmp_path)
    ids, states = target_inputs(target)
    mine, other = ours(head, ids, states), theirs(model, ids, states, monkeypatch)
    assert mine.shape == other.shape == (1, ANCHORS.shape[1], BS, V)
    torch.testing.assert_close(mine, other, atol=1e-5, rtol=1e-5)
    assert torch.equal(mine.argmax(-1)[..., 1:], other.argmax(-1)[..., 1:])  # the drafts: positions 1..
    assert model.mask_token_id == MASK and model.block_size == BS and not model.use_draft_vocab
    assert model.config.aux_hidden_state_layer_ids == LAYERS
