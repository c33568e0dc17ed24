"""P-EAGLE heads in speculators' "peagle" layout imported through the public loader: our own export round
trips to the same logits, a checkpoint speculators 0.9.0 itself writes (its PEagleSpeculatorConfig and
PEagleDraftModel.save_pretrained) imports to a head drafting the same block as that model, and what our
head cannot represent (a trained embedding, no mask token) is refused in one line."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from spechead.heads import HeadError, load_head
from spechead.heads.formats import export_head
from spechead.heads.formats.detect import layout_of_config
from spechead.heads.peagle import PEagleHead

from .test_formats_peagle import ANCHORS, EAGLE31, LAYERS, MASK, VD, H, K, L, V, ours, random_head, theirs


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(V, layers=L, hidden=H).requires_grad_(False)


def imported(path, target) -> PEagleHead:
    head = load_head(path, target_config=target.config)
    assert isinstance(head, PEagleHead)
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    return head


@pytest.mark.parametrize("options", [{}, EAGLE31], ids=["plain", "eagle3.1"])
def test_export_then_import_gives_the_same_head(target, tmp_path, options) -> None:
    head = random_head(target, **options)
    out = export_head(head, "speculators", tmp_path / "p", mask_token_id=MASK)
    assert load_head(out).config.target_name_or_path == "org/tiny"  # the verifier it names
    back = imported(out, target)
    cfg, mine = back.config, head.config
    assert (cfg.block_size, cfg.target_layers, cfg.draft_vocab_size, cfg.target_num_layers) == (
        K,
        LAYERS,
        VD,
        L,
    )
    assert all(getattr(cfg, f) == getattr(mine, f) for f in EAGLE31)
    theirs_, ours_ = head.state_dict(), back.state_dict()
    assert theirs_.keys() == ours_.keys()
    for name in theirs_.keys() - {"mask_hidden"}:  # d2t, t2d, mask_embedding and every weight: exact
        assert torch.equal(theirs_[name], ours_[name]), name
    torch.testing.assert_close(ours_["mask_hidden"], theirs_["mask_hidden"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours(back), ours(head), atol=1e-6, rtol=1e-5)


def test_a_checkpoint_speculators_writes_drafts_the_same_block(target, tmp_path, monkeypatch) -> None:
    """Not our exporter: speculators' own config class and model write the directory."""
    peagle = pytest.importorskip("speculators.models.peagle", reason="speculators is not installed")
    from loguru import logger
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    logger.disable("speculators")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    layer = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    proposal = GreedyTokenProposalConfig(speculative_tokens=K)
    verifier = VerifierConfig(name_or_path="org/tiny", architectures=["LlamaForCausalLM"])
    config = peagle.PEagleSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=VD, eagle_aux_hidden_state_layer_ids=LAYERS,
        mask_token_id=MASK, embed_requires_grad=False, norm_before_fc=True,
        speculators_config=SpeculatorsConfig(algorithm="peagle", proposal_methods=[proposal],
                                             default_proposal_method="greedy", verifier=verifier),
    )  # fmt: skip
    config.transformer_layer_config._attn_implementation = "eager"
    torch.manual_seed(3)
    model = peagle.PEagleDraftModel(config).eval()
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(4))[:VD].sort().values
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)  # frozen: the target's
        model.t2d.copy_(torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True))
        model.d2t.copy_(ids - torch.arange(VD))
    model.save_pretrained(tmp_path / "spec")
    written = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert written["speculators_model_type"] == "peagle" and "norm_before_residual" in written
    head = imported(tmp_path / "spec", target)
    assert head.config.block_size == K and head.config.norm_before_fc and not head.config.norm_output
    torch.testing.assert_close(head.mask_embedding.detach(), target.get_input_embeddings().weight[MASK])
    mine, other = ours(head), theirs(model, monkeypatch)
    assert mine.shape == other.shape == (1, len(ANCHORS), K, VD)
    torch.testing.assert_close(mine, other, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"mask_token_id": None}, "needs mask_token_id"),
        ({"embed_requires_grad": True}, "trained its own embedding"),
        ({"embed_requires_grad": "absent"}, "omitted where speculators defaults it to true"),
        ({"speculators_config": {"algorithm": "peagle"}}, "no proposal with speculative_tokens >= 2"),
        ({"fc_norm": True}, "fc_norm=true"),
    ],
    ids=["no-mask-token", "trained-embedding", "embedding-flag-absent", "no-block-size", "fc-norm"],
)
def test_what_the_head_cannot_represent_is_refused(target, tmp_path, edit, message) -> None:
    out = export_head(random_head(target), "speculators", tmp_path / "p", mask_token_id=MASK)
    config = json.loads((out / "config.json").read_text())
    config.update(edit)
    if edit.get("embed_requires_grad") == "absent":
        del config["embed_requires_grad"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadError, match=message):
        load_head(out, target_config=target.config)


def test_a_checkpoint_without_its_mask_embedding_row_is_refused(target, tmp_path) -> None:
    out = export_head(random_head(target), "speculators", tmp_path / "p", mask_token_id=MASK)
    tensors = load_file(out / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "embed_tokens.weight"}, out / "model.safetensors")
    with pytest.raises(HeadError, match=f"ships no embed_tokens.weight row {MASK}"):
        load_head(out, target_config=target.config)


def test_speculators_kinds_each_find_their_importer() -> None:
    assert layout_of_config({"speculators_model_type": "peagle"}) == "speculators-peagle"
    assert layout_of_config({"speculators_model_type": "eagle3"}) == "speculators"
    assert layout_of_config({"speculators_model_type": "mlp"}) == "speculators"  # refused there, by name
