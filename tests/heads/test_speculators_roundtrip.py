"""EAGLE-3 heads computed the same by spechead and by the REAL `speculators` library (vLLM's EAGLE-3
format, pure Python): (a) a spechead head exported as `speculators` and loaded by speculators' own
Eagle3DraftModel drafts the same logits and tokens; (b) a head built and saved by speculators' own code
(its trainer's defaults: EAGLE-3.1 norms on, Llama or Qwen3 layer) imports into spechead with the same
logits; (c) the SGLang layout goes through speculators' converter (given the layer ids it drops).

speculators 0.9 pins transformers <= 5.19 while spechead needs >= 5.24, so it is not a package dependency:
the README's set-up command installs it with --no-deps from requirements-speculators.txt (with what its
import needs). Without it this module is skipped, and CI fails (tests/test_packaging.py). vLLM and SGLang themselves need a GPU build and do not run here.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from spechead.heads import HeadError, load_head
from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.heads.formats import export_head
from spechead.heads.unroll import ttt_forward

speculators = pytest.importorskip(
    "speculators.models.eagle3",
    reason="speculators is not installed (see this module's docstring: it needs --no-deps)",
)
Eagle3DraftModel, Eagle3SpeculatorConfig = speculators.Eagle3DraftModel, speculators.Eagle3SpeculatorConfig

H, V, L, VD = 32, 48, 8, 20
LAYERS = [1, 4, 6]
T = 65  # positions per sequence: step 0 drafts at 65, step 1 at 64 -> 129 draft tokens compared
EAGLE31 = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}


@pytest.fixture(scope="module", autouse=True)
def quiet_speculators():
    from loguru import logger

    logger.disable("speculators")  # its INFO lines on every load
    logging.getLogger("transformers").setLevel(logging.ERROR)
    yield
    logger.enable("speculators")


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(V, layers=L, hidden=H).requires_grad_(False)


@pytest.fixture(scope="module")
def target_dir(target, tmp_path_factory):
    """The target saved: speculators reads its verifier's config (depth) and weights from a path."""
    path = tmp_path_factory.mktemp("verifier")
    target.save_pretrained(path)
    return path


def draft_vocab() -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a scattered draft vocabulary of VD tokens."""
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(5))[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(VD), t2d


def inputs() -> tuple[list[torch.Tensor], torch.Tensor]:
    """Three target states (1, T, H) each and tokens x_0..x_{T-1}."""
    g = torch.Generator().manual_seed(1)
    return [2 * torch.randn(1, T, H, generator=g) for _ in range(3)], torch.randint(0, V, (1, T), generator=g)


def ours(head: Eagle3Head) -> list[torch.Tensor]:
    """spechead's training-time test, 2 steps: step j at t predicts x_{t+2+j}; (1, T, Vd) each."""
    states, ids = inputs()
    with torch.no_grad():
        return [head.logits(o) for o in ttt_forward(head, head.fuse(states), ids, None, 2)]


def theirs(model) -> list[torch.Tensor]:
    """speculators' own forward (2 TTT steps) on the same inputs, its lm_head outputs captured.

    Its step 0 at t reads x_{t+1} (passed shifted; spechead pads the last with 0, so do we); its step 1 at
    t is spechead's step 1 at t + 1 (the same tree node: parent output at t, token x_{t+2})."""
    states, ids = inputs()
    shifted = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    logits = []
    hook = model.lm_head.register_forward_hook(lambda _m, _a, out: logits.append(out))
    with torch.no_grad():
        model(
            hidden_states=torch.cat(states, dim=-1),
            input_ids=shifted,
            document_ids=torch.zeros(1, T, dtype=torch.long),
            position_ids=torch.arange(T)[None],
            ttt_steps=2,
        )
    hook.remove()
    return logits


def assert_same_drafts(mine: list[torch.Tensor], other: list[torch.Tensor]) -> int:
    """Logits equal to 1e-5 (fp32) and the same top-1 draft token at every aligned position; returns
    how many draft tokens were compared."""
    pairs = [(mine[0], other[0]), (mine[1][:, 1:], other[1][:, :-1])]
    for a, b in pairs:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in pairs)
    total = sum(a.shape[1] for a, _ in pairs)
    assert agree == total == 2 * T - 1
    return total


def random_head(target, **options) -> Eagle3Head:
    torch.manual_seed(0)
    head = Eagle3Head(
        Eagle3Config.from_target(
            target.config,
            draft_vocab_size=VD,
            target_layers=LAYERS,
            target_name_or_path="org/tiny",
            **options,
        )
    )
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    head.set_draft_vocab(*draft_vocab())
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    return head.eval()


def load_theirs(directory, target_dir):
    """Eagle3DraftModel.from_pretrained as a user on another machine runs it: the verifier pointed at
    their copy of the target (the export records the portable id), eager attention on a CPU."""
    config = Eagle3SpeculatorConfig.from_pretrained(directory)
    config.speculators_config.verifier.name_or_path = str(target_dir)
    config.transformer_layer_config._attn_implementation = "eager"
    return Eagle3DraftModel.from_pretrained(directory, config=config).eval()


@pytest.mark.parametrize("options", [{}, EAGLE31, {"num_layers": 3}], ids=["eagle3", "eagle3.1", "3-layers"])
def test_our_export_drafts_the_same_in_speculators(target, target_dir, tmp_path, options) -> None:
    head = random_head(target, **options)
    out = export_head(head, "speculators", tmp_path / "spec")
    raw = json.loads((out / "config.json").read_text())
    # vLLM's speculators reader (algos.update_eagle3) takes these; a missing norm_before_residual is true
    assert raw["dtype"] == "float32" and "torch_dtype" not in raw
    assert raw["eagle_aux_hidden_state_layer_ids"] == LAYERS and raw["draft_vocab_size"] == VD
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    model = load_theirs(out, target_dir)
    cfg = model.config
    assert len(model.layers) == raw["transformer_layer_config"]["num_hidden_layers"] == head.config.num_layers
    for flag in ("norm_before_fc", "norm_before_residual", "norm_output"):
        assert getattr(cfg, flag) is bool(options.get(flag))
    assert cfg.eagle_aux_hidden_state_layer_ids == LAYERS and cfg.draft_vocab_size == VD
    assert torch.equal(model.d2t, head.d2t) and torch.equal(model.t2d, head.t2d)
    # the embedding is the one shipped (speculators' verifier fallback does not fire under transformers 5)
    shipped = load_file(out / "model.safetensors")["embed_tokens.weight"]
    assert torch.equal(shipped, target.get_input_embeddings().weight)
    assert torch.equal(model.embed_tokens.weight, shipped)
    assert assert_same_drafts(ours(head), theirs(model)) == 129


def test_without_the_shipped_embedding_speculators_has_none(target, target_dir, tmp_path) -> None:
    """Why the export ships embed_tokens.weight: left out (with_embedding=False, for vLLM, which shares the
    target's), speculators' model keeps an embedding it never loads, whatever memory it was given (seen:
    1.8e16 garbage, or by chance a freed tensor's values), not the target's from its verifier."""
    out = export_head(random_head(target), "speculators", tmp_path / "spec", with_embedding=False)
    assert "embed_tokens.weight" not in load_file(out / "model.safetensors")
    assert "embed_tokens.weight" in load_theirs(out, target_dir).state_dict()  # a parameter all the same


def speculators_head(target_dir, layer: str, num_hidden_layers: int = 1, **fields):
    """An Eagle3DraftModel built by speculators' own classes with its trainer's defaults (EAGLE-3.1 norms,
    norm_before_residual) unless `fields` say otherwise, random weights, the target's embedding."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig, Qwen3Config

    sizes = dict(
        vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=num_hidden_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, rms_norm_eps=1e-6,
    )  # fmt: skip
    layer_config = (LlamaConfig if layer == "llama" else Qwen3Config)(**sizes)
    layer_config._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=VD,
        **{**EAGLE31, **fields},
        eagle_aux_hidden_state_layer_ids=LAYERS,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(str(target_dir)),
        ),
    )
    torch.manual_seed(2)
    model = Eagle3DraftModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(("embed_tokens", "verifier_")):
                p.normal_(0, 0.2)
    d2t, t2d = draft_vocab()
    model.load_vocab_mappings(t2d, d2t)
    model.load_verifier_weights()  # the embedding (and verifier norm / lm_head) from the target
    return model.eval()


@pytest.mark.parametrize(("layer", "layers"), [("llama", 1), ("qwen3", 1), ("llama", 3)])
def test_a_head_speculators_saved_imports_the_same(target, target_dir, tmp_path, layer, layers) -> None:
    """Several decoder layers (speculators' layers.0.. as AWS's 4-layer P-EAGLE drafters ship them) import
    as `num_layers`."""
    model = speculators_head(target_dir, layer, num_hidden_layers=layers)
    model.save_pretrained(tmp_path / "theirs")
    head = load_head(tmp_path / "theirs", target_config=target.config)
    cfg = head.config
    assert cfg.num_layers == layers == len(head.decoder_layers)
    assert cfg.norm_before_fc and cfg.norm_before_residual and cfg.norm_output
    assert cfg.target_layers == LAYERS and cfg.layer_config["model_type"] == layer
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    assert assert_same_drafts(ours(head), theirs(model)) == 129


def test_a_head_that_trained_its_embedding_imports_with_it_as_its_own(target, target_dir, tmp_path) -> None:
    """embed_requires_grad true (speculators' --embed-requires-grad): the saved embedding, trained away from
    the target's, becomes the head's own and drafts the same as speculators' model; exported again, it
    ships with embed_requires_grad true and speculators' model loaded from it drafts the same too."""
    model = speculators_head(target_dir, "llama", embed_requires_grad=True)
    with torch.no_grad():
        model.embed_tokens.weight.add_(0.5 * torch.randn(V, H, generator=torch.Generator().manual_seed(6)))
    model.save_pretrained(tmp_path / "theirs")
    head = load_head(tmp_path / "theirs", target_config=target.config)
    assert head.config.own_embedding
    assert torch.equal(head.embed_tokens.weight, model.embed_tokens.weight)
    assert not torch.allclose(head.embed_tokens.weight, target.get_input_embeddings().weight, atol=0.1)
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    assert assert_same_drafts(ours(head), theirs(model)) == 129
    out = export_head(head, "speculators", tmp_path / "again")
    assert json.loads((out / "config.json").read_text())["embed_requires_grad"] is True
    back = load_theirs(out, target_dir)
    assert torch.equal(back.embed_tokens.weight, head.embed_tokens.weight)
    assert assert_same_drafts(ours(head), theirs(back)) == 129
    again = load_head(out, target_config=target.config)
    mine, other = head.state_dict(), again.state_dict()
    assert mine.keys() == other.keys() and all(torch.equal(mine[k], other[k]) for k in mine)


def test_a_trained_embedding_that_is_not_shipped_is_refused(target, target_dir, tmp_path) -> None:
    out = export_head(random_head(target), "speculators", tmp_path / "spec", with_embedding=False)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "embed_requires_grad": True}))
    with pytest.raises(HeadError, match="trained its own embedding .* ships no embed_tokens.weight"):
        load_head(out, target_config=target.config)


def test_norm_before_residual_absent_reads_true_as_vllm_does(target, target_dir, tmp_path) -> None:
    """A speculators config without norm_before_residual: vLLM runs it true, and so does the import
    (speculators' own config class would say false; the served head is what must match)."""
    model = speculators_head(target_dir, "llama", norm_before_residual=True)
    model.save_pretrained(tmp_path / "theirs")
    config = json.loads((tmp_path / "theirs" / "config.json").read_text())
    del config["norm_before_residual"]
    (tmp_path / "theirs" / "config.json").write_text(json.dumps(config))
    head = load_head(tmp_path / "theirs", target_config=target.config)
    assert head.config.norm_before_residual is True
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    assert assert_same_drafts(ours(head), theirs(model)) == 129


def test_a_windowed_draft_layer_is_refused_not_dropped(target, target_dir, tmp_path) -> None:
    """speculators' trainer windows its draft layers (sliding_attention, 2048 by default); spechead's layer
    attends to the whole context, so such a head is refused in one message, never run unwindowed."""
    model = speculators_head(target_dir, "llama")
    model.save_pretrained(tmp_path / "theirs")
    config = json.loads((tmp_path / "theirs" / "config.json").read_text())
    config["transformer_layer_config"].update(
        sliding_window=16, use_sliding_window=True, layer_types=["sliding_attention"]
    )
    (tmp_path / "theirs" / "config.json").write_text(json.dumps(config))
    assert (
        Eagle3SpeculatorConfig.from_pretrained(tmp_path / "theirs").transformer_layer_config.sliding_window
        == 16
    )
    with pytest.raises(HeadError, match="sliding window of 16 tokens"):
        load_head(tmp_path / "theirs", target_config=target.config)


def test_the_sglang_layout_converts_with_speculators_given_the_layer_ids(
    target, target_dir, tmp_path
) -> None:
    """speculators reads the SGLang layout only through its converter, which takes the layer ids as an
    argument (not from eagle_config): given SGLang's ids + 1, the converted head drafts the same."""
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    head = random_head(target)
    out = export_head(head, "sglang", tmp_path / "sgl")
    ids = json.loads((out / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [i - 1 for i in LAYERS]
    Eagle3Converter().convert(
        out,
        tmp_path / "conv",
        str(target_dir),
        validate=False,
        eagle_aux_hidden_state_layer_ids=[i + 1 for i in ids],
    )
    back = load_head(tmp_path / "conv", target_config=target.config)
    assert back.config.target_layers == LAYERS and not back.config.norm_before_residual
    back.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    for a, b in zip(ours(head), ours(back)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
