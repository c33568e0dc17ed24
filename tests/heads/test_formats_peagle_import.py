"""P-EAGLE heads in speculators' "peagle" layout imported through the public loader: our own export round
trips to the same logits, a checkpoint speculators 0.9.0 itself writes (its PEagleSpeculatorConfig and
PEagleDraftModel.save_pretrained) imports to a head drafting the same block as that model (with the
target's embedding, or a trained one the head keeps as its own), and what our head cannot represent (no
mask token, fc_norm) is refused in one line."""

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


OWN = {"own_embedding": True}  # the head's own embedding (random: far from the target's)


@pytest.mark.parametrize("options", [{}, EAGLE31, OWN], ids=["plain", "eagle3.1", "own-embedding"])
def test_export_then_import_gives_the_same_head(target, tmp_path, options) -> None:
    head = random_head(target, **options)
    out = export_head(head, "speculators", tmp_path / "p", mask_token_id=MASK)
    assert json.loads((out / "config.json").read_text())["embed_requires_grad"] is bool(
        options.get("own_embedding")
    )
    assert load_head(out).config.target_name_or_path == "org/tiny"  # the verifier it names
    back = imported(out, target)
    cfg, mine = back.config, head.config
    assert (cfg.block_size, cfg.target_layers, cfg.draft_vocab_size, cfg.target_num_layers) == (
        K,
        LAYERS,
        VD,
        L,
    )
    assert all(getattr(cfg, f) == getattr(mine, f) for f in (*EAGLE31, "own_embedding"))
    theirs_, ours_ = head.state_dict(), back.state_dict()
    assert theirs_.keys() == ours_.keys()
    if "embed_tokens.weight" in ours_:  # its mask row ships the mask embedding (a token inputs() never reads)
        assert torch.equal(ours_["embed_tokens.weight"][MASK], theirs_["mask_embedding"])
        table = ours_["embed_tokens.weight"].clone()  # (a copy: the state dict shares the head's storage)
        table[MASK] = theirs_["embed_tokens.weight"][MASK]
        ours_["embed_tokens.weight"] = table
    for name in theirs_.keys() - {"mask_hidden"}:  # d2t, t2d, mask_embedding and every weight: exact
        assert torch.equal(theirs_[name], ours_[name]), name
    torch.testing.assert_close(ours_["mask_hidden"], theirs_["mask_hidden"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours(back), ours(head), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("trained", [False, True, None], ids=["target-embedding", "trained", "flag-absent"])
def test_a_checkpoint_speculators_writes_drafts_the_same_block(
    target, tmp_path, monkeypatch, trained
) -> None:
    """Not our exporter: speculators' own config class and model write the directory. trained (True, or
    None: the flag left out, which speculators defaults to true): its embedding is the target's perturbed,
    and the head keeps it as its own; drafting with the target's instead would give other logits."""
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
        mask_token_id=MASK, embed_requires_grad=trained is not False, norm_before_fc=True,
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
        if trained is not False:  # trained away from the target's (its mask row too)
            model.embed_tokens.weight.add_(0.5 * torch.randn(V, H))
        model.t2d.copy_(torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True))
        model.d2t.copy_(ids - torch.arange(VD))
    model.save_pretrained(tmp_path / "spec")
    written = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert written["speculators_model_type"] == "peagle" and "norm_before_residual" in written
    if trained is None:
        del written["embed_requires_grad"]
        (tmp_path / "spec" / "config.json").write_text(json.dumps(written))
    head = imported(tmp_path / "spec", target)
    assert head.config.block_size == K and head.config.norm_before_fc and not head.config.norm_output
    assert head.config.own_embedding is (trained is not False)
    table = model.embed_tokens.weight.detach()
    torch.testing.assert_close(head.mask_embedding.detach(), table[MASK])
    if trained is not False:
        assert torch.equal(head.embed_tokens.weight, table) and not torch.allclose(
            table, target.get_input_embeddings().weight, atol=0.1
        )
    mine, other = ours(head), theirs(model, monkeypatch)
    assert mine.shape == other.shape == (1, len(ANCHORS), K, VD)
    torch.testing.assert_close(mine, other, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"mask_token_id": None}, "needs mask_token_id"),
        ({"speculators_config": {"algorithm": "peagle"}}, "no proposal with speculative_tokens >= 2"),
        ({"fc_norm": True}, "fc_norm=true"),
    ],
    ids=["no-mask-token", "no-block-size", "fc-norm"],
)
def test_what_the_head_cannot_represent_is_refused(target, tmp_path, edit, message) -> None:
    out = export_head(random_head(target), "speculators", tmp_path / "p", mask_token_id=MASK)
    config = json.loads((out / "config.json").read_text())
    config.update(edit)
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
