"""P-EAGLE exported in vLLM's parallel-drafting layout (speculators "peagle"), checked against the REAL
speculators 0.9.0 PEagleDraftModel: its parallel forward over all K positions of chosen anchors gives
our logits (fp32, 1e-5). Bad input (no mask token, a format that cannot hold the head) is refused."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from spechead.heads import HeadError, load_head
from spechead.heads.formats import export_head
from spechead.heads.formats.peagle_export import mask_hidden_input
from spechead.heads.peagle import PEagleConfig, PEagleHead

H, V, L, VD, K = 32, 48, 8, 20, 4
LAYERS = [1, 4, 6]
T = 24
ANCHORS = torch.tensor([0, 5, 11, 17, 20])  # <= T - K: speculators indexes x at anchor + depth
MASK = 47  # the token id whose embedding row carries the learned mask embedding
EAGLE31 = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(V, layers=L, hidden=H).requires_grad_(False)


@pytest.fixture(scope="module")
def target_dir(target, tmp_path_factory):
    path = tmp_path_factory.mktemp("verifier")
    target.save_pretrained(path)
    return path


def random_head(target, **options) -> PEagleHead:
    torch.manual_seed(0)
    head = PEagleHead(
        PEagleConfig.from_target(
            target.config,
            draft_vocab_size=VD,
            target_layers=LAYERS,
            target_name_or_path="org/tiny",
            block_size=K,
            **options,
        )
    )
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(5))[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    head.set_draft_vocab(ids - torch.arange(VD), t2d)
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    return head.eval()


def inputs() -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [2 * torch.randn(1, T, H, generator=g) for _ in range(3)], torch.randint(
        0, MASK, (1, T), generator=g
    )


def test_layout_config_and_tensors(target, tmp_path) -> None:
    head = random_head(target)
    out = export_head(head, "speculators", tmp_path / "p", mask_token_id=MASK)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["PEagleSpeculator"] and raw["speculators_model_type"] == "peagle"
    assert raw["speculators_config"]["algorithm"] == "peagle"
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == K
    assert raw["mask_token_id"] == MASK and raw["eagle_aux_hidden_state_layer_ids"] == LAYERS
    assert (
        raw["norm_before_residual"] is False
    )  # vLLM's P-EAGLE reader defaults it to false, EAGLE-3's to true
    tensors = load_file(out / "model.safetensors")
    assert "mask_embedding" not in tensors and "midlayer.fc" not in tensors
    assert tensors["mask_hidden"].shape == (1, 1, 3 * H)
    table = tensors["embed_tokens.weight"]
    assert torch.equal(table[MASK], head.mask_embedding.detach())
    others = torch.arange(V) != MASK
    assert torch.equal(table[others], target.get_input_embeddings().weight[others])


@pytest.mark.parametrize("options", [{}, EAGLE31], ids=["plain", "norm_before_fc"])
def test_mask_hidden_before_fc_reproduces_ours(target, options) -> None:
    head = random_head(target, **options)
    m = mask_hidden_input(head)
    with torch.no_grad():
        if head.config.norm_before_fc:
            m = head.input_norm(m)
        torch.testing.assert_close(head.fc(m), head.mask_hidden, atol=1e-5, rtol=1e-5)


def test_bad_input_is_refused(target, tmp_path) -> None:
    head = random_head(target)
    with pytest.raises(HeadError, match="--mask-token-id"):
        export_head(head, "speculators", tmp_path / "a")
    with pytest.raises(HeadError, match="0..47"):
        export_head(head, "speculators", tmp_path / "b", mask_token_id=V)
    with pytest.raises(HeadError, match="drop --no-embedding"):
        export_head(head, "speculators", tmp_path / "c", mask_token_id=MASK, with_embedding=False)
    with pytest.raises(HeadError, match="cannot be exported as 'sglang'"):
        export_head(head, "sglang", tmp_path / "d")


# ---- the real speculators library ------------------------------------------------------------------


def ours(head: PEagleHead) -> torch.Tensor:
    """(1, A, K, Vd): slot 0 the anchor's real position, slots 1..K-1 its future positions."""
    states, ids = inputs()
    with torch.no_grad():
        return head.parallel_logits(head.fuse(states), ids, ANCHORS)


def theirs(model, monkeypatch) -> torch.Tensor:
    """PEagleDraftModel.forward with its COD sampling replaced by every position at depth 0 and the
    anchors at depths 1..K-1 (its training forward IS the parallel forward); lm_head outputs captured."""
    core = pytest.importorskip("speculators.models.peagle.core")
    depth = torch.cat([torch.zeros(T, dtype=torch.long), torch.arange(1, K).repeat_interleave(len(ANCHORS))])
    anchor = torch.cat([torch.arange(T), ANCHORS.repeat(K - 1)])
    monkeypatch.setattr(core, "generate_cod_sample_indices", lambda **_: (anchor, depth))
    monkeypatch.setattr(core, "compute_metrics", lambda **_: (torch.tensor(0.0), {}))
    states, ids = inputs()
    shifted = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # depth 0 at t reads x_{t+1}
    logits = []
    hook = model.lm_head.register_forward_hook(lambda _m, _a, out: logits.append(out))
    with torch.no_grad():
        model(
            hidden_states=torch.cat(states, dim=-1),
            input_ids=shifted,
            document_ids=torch.zeros(1, T, dtype=torch.long),
            verifier_last_hidden_states=torch.zeros(1, T, H),
            num_depths=K,
        )
    hook.remove()
    flat = logits[0][0]  # (T + (K - 1) * A, Vd)
    first = flat[ANCHORS][:, None]  # (A, 1, Vd)
    future = flat[T:].view(K - 1, len(ANCHORS), -1).transpose(0, 1)  # (A, K - 1, Vd)
    return torch.cat([first, future], dim=1)[None]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(target, directory): a tiny GPT-OSS, P-EAGLE's published target's architecture: head_dim 16 against
    hidden / heads = 8, sliding-window layers, experts."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(
        vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize(
    "options",
    [{}, EAGLE31, {"own_embedding": True}, {"num_layers": 3}, {"gpt_oss": True}],
    ids=["peagle", "peagle+eagle3.1", "own-embedding", "3-layers", "gpt-oss-target"],
)
def test_real_speculators_drafts_the_same_block(
    target, target_dir, tmp_path, options, monkeypatch, request
) -> None:
    peagle = pytest.importorskip("speculators.models.peagle", reason="speculators is not installed")
    if options.get("gpt_oss"):
        target, target_dir = request.getfixturevalue("gpt_oss")
        options = {}
    from loguru import logger

    logger.disable("speculators")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    head = random_head(target, **options)
    out = export_head(head, "speculators", tmp_path / "p", mask_token_id=MASK)
    config = peagle.PEagleSpeculatorConfig.from_pretrained(out)
    config.speculators_config.verifier.name_or_path = str(target_dir)
    config.transformer_layer_config._attn_implementation = "eager"
    model = peagle.PEagleDraftModel.from_pretrained(out, config=config).eval()
    assert model.mask_token_id == MASK and model.config.eagle_aux_hidden_state_layer_ids == LAYERS
    assert model.mask_hidden.shape == (1, 1, 3 * H) and len(model.layers) == head.config.num_layers
    if options.get("own_embedding"):  # the head's own table ships (its mask row: the mask embedding)
        assert model.config.embed_requires_grad is True
        rows = torch.arange(V) != MASK
        assert torch.equal(model.embed_tokens.weight[rows], head.embed_tokens.weight[rows])
    mine, other = ours(head), theirs(model, monkeypatch)
    assert mine.shape == other.shape == (1, len(ANCHORS), K, VD)
    torch.testing.assert_close(mine, other, atol=1e-5, rtol=1e-5)
    assert torch.equal(mine.argmax(-1), other.argmax(-1))


# ---- through scripts/export.py -----------------------------------------------------------------------


def run_script(argv: list[str]) -> int:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "export.py"
    spec = importlib.util.spec_from_file_location("export_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main([str(a) for a in argv])


@pytest.fixture(scope="module")
def saved_head(target, target_dir, tmp_path_factory):
    head = random_head(target)
    head.config.target_name_or_path = str(target_dir)  # the script reads the embedding from the target
    return head.save_pretrained(tmp_path_factory.mktemp("peagle") / "head")


@pytest.mark.parametrize("dtype", [None, "bfloat16"], ids=["fp32", "bf16"])
def test_the_script_exports_with_a_mask_token(saved_head, tmp_path, capsys, dtype) -> None:
    """The export reloads through spechead's importer and the round trip checks every tensor: mask_hidden
    (stored before fc, solved back) up to the dtype's rounding, the rest bit for bit."""
    argv = [saved_head, "--format", "speculators", "--mask-token-id", MASK, "--out", tmp_path / "o"]
    assert run_script(argv + (["--dtype", dtype] if dtype else [])) == 0
    printed = capsys.readouterr().out
    count = len(load_head(saved_head).state_dict())
    assert f"reloaded with spechead, {count} tensors identical (mask_hidden equal up to rounding" in printed
    assert json.loads((tmp_path / "o" / "config.json").read_text())["speculators_model_type"] == "peagle"


def test_the_script_exports_a_head_of_a_bf16_target(target, tmp_path, capsys) -> None:
    """A bf16 target (the demo's, most served ones) under an fp32 head: the shipped table is widened to fp32
    so the mask row holds the mask embedding exactly (in the target's bf16 it would round and the round
    trip would refuse it); every other row is the target's, unchanged."""
    half = type(target)(target.config).to(torch.bfloat16)
    half.load_state_dict(target.state_dict())
    half.save_pretrained(tmp_path / "target")
    head = random_head(target)
    head.config.target_name_or_path = str(tmp_path / "target")
    saved = head.save_pretrained(tmp_path / "head")
    assert (
        run_script([saved, "--format", "speculators", "--mask-token-id", MASK, "--out", tmp_path / "o"]) == 0
    )
    assert "tensors identical" in capsys.readouterr().out
    shipped = load_file(tmp_path / "o" / "model.safetensors")["embed_tokens.weight"]
    assert shipped.dtype == torch.float32 and torch.equal(shipped[MASK], head.mask_embedding.detach())
    rows = torch.arange(V) != MASK
    assert torch.equal(shipped[rows], half.get_input_embeddings().weight[rows].float())


@pytest.mark.parametrize(
    ("words", "chosen"),
    [(40, 40), (V, 7), (V, None)],
    ids=["spare-row", "reserved-token", "none"],
)
def test_the_script_picks_an_unread_mask_token(target, tmp_path, capsys, words, chosen) -> None:
    """--mask-token-id auto reads the target's tokenizer: the first embedding row past its tokens (Qwen's,
    GPT-OSS's spare rows), else the lowest reserved special token (Llama 3's), else one error line."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(words)}
    if chosen == 7:
        vocab = {**{k: i for k, i in vocab.items() if i != 7}, "<|reserved_special_token_0|>": 7}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="w0")))
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    head = random_head(target)
    head.config.target_name_or_path = str(tmp_path / "target")
    saved = head.save_pretrained(tmp_path / "head")
    capsys.readouterr()  # (the saves' progress bars)
    argv = [saved, "--format", "speculators", "--mask-token-id", "auto", "--out", tmp_path / "o"]
    if chosen is None:
        assert run_script(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --mask-token-id auto found no token") and "\n" not in err
        return
    assert run_script(argv) == 0
    assert f"--mask-token-id auto: {chosen}," in capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "config.json").read_text())["mask_token_id"] == chosen
    shipped = load_file(tmp_path / "o" / "model.safetensors")["embed_tokens.weight"]
    assert torch.equal(shipped[chosen], head.mask_embedding.detach())


def test_the_script_round_trips_a_head_with_its_own_embedding(target, target_dir, tmp_path, capsys) -> None:
    """An own table ships with the mask token's row holding the mask embedding (the layout shares them):
    the round trip expects exactly that row changed, and no target is read."""
    head = random_head(target, own_embedding=True)
    head.config.target_name_or_path = "org/unreadable"  # an own embedding needs no target
    saved = head.save_pretrained(tmp_path / "head")
    assert (
        run_script([saved, "--format", "speculators", "--mask-token-id", MASK, "--out", tmp_path / "o"]) == 0
    )
    assert "tensors identical" in capsys.readouterr().out
    shipped = load_file(tmp_path / "o" / "model.safetensors")["embed_tokens.weight"]
    assert torch.equal(shipped[MASK], head.mask_embedding.detach())
    rows = torch.arange(V) != MASK
    assert torch.equal(shipped[rows], head.embed_tokens.weight.detach()[rows])


def test_the_script_round_trips_a_head_of_several_layers(target, target_dir, tmp_path, capsys) -> None:
    """A 3-layer head (AWS's published P-EAGLE drafters have 4) ships layers.0..2 in speculators' names and
    reloads with every tensor where it was."""
    head = random_head(target, num_layers=3)
    head.config.target_name_or_path = str(target_dir)
    saved = head.save_pretrained(tmp_path / "head")
    assert (
        run_script([saved, "--format", "speculators", "--mask-token-id", MASK, "--out", tmp_path / "o"]) == 0
    )
    assert f"{len(head.state_dict())} tensors identical" in capsys.readouterr().out
    names = load_file(tmp_path / "o" / "model.safetensors").keys()
    assert {n.split(".")[1] for n in names if n.startswith("layers.")} == {"0", "1", "2"}
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert config["transformer_layer_config"]["num_hidden_layers"] == 3


def test_the_round_trip_refuses_a_wrong_mask_hidden(saved_head, tmp_path, capsys, monkeypatch) -> None:
    """An exporter that wrote mask_hidden without solving for fc's input (ours after fc, zero-padded to
    3H) reloads another mask_hidden: the script says so in one line and exits 2."""
    from spechead.heads.formats import peagle_export

    def unsolved(head):
        return torch.cat([head.mask_hidden.detach(), torch.zeros(2 * head.mask_hidden.numel())])

    monkeypatch.setattr(peagle_export, "mask_hidden_input", unsolved)
    argv = [saved_head, "--format", "speculators", "--mask-token-id", MASK, "--out", tmp_path / "o"]
    assert run_script(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "reloads mask_hidden with other values" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--format", "sglang"], "is a peagle head; formats for peagle heads: speculators"),
        (["--format", "eagle"], "is a peagle head; formats for peagle heads: speculators"),
        (["--format", "medusa"], "is a peagle head; formats for peagle heads: speculators"),
        (["--format", "speculators"], "pass --mask-token-id ID"),
        (["--format", "speculators", "--mask-token-id", V], "must be a token id in 0..47"),
    ],
    ids=["to-sglang", "to-eagle", "to-medusa", "no-mask-token", "mask-token-out-of-range"],
)
def test_the_script_refuses_in_one_error_line(saved_head, tmp_path, capsys, argv, message) -> None:
    assert run_script([saved_head, *argv, "--out", tmp_path / "o"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err
