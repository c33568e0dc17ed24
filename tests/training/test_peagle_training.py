"""P-EAGLE trains through the real entry (`head=peagle`, Hydra composition, the trainer): its loss falls on a
tiny run, the saved head reloads, partitioned training equals the one forward, COD sampling trains each anchor
up to its drawn depth, each depth's targets are the right tokens, and the memory plan counts K depths (fewer
with partitions)."""

from __future__ import annotations

import json

import pytest
import torch

from spechead.heads import PEagleHead, load_head
from spechead.heads.errors import HeadError
from spechead.training.eagle_losses import eagle3_step_loss
from spechead.training.errors import TrainError
from spechead.training.objectives import peagle as objective
from spechead.training.objectives.eagle import next_token_valid, shift_left
from spechead.training.objectives.peagle import ParallelModel, PEagleLossConfig, PEagleObjective, shifted
from spechead.training.trainer import train

H, V, VD, K = 32, 48, 20, 4


def _extra(**more) -> dict:
    return {"head": "peagle", "head.block_size": K, "head.draft_vocab_size": 200, **more}


@pytest.mark.parametrize(
    ("own", "layers"),
    [(False, 1), (True, 1), (False, 3)],
    ids=["target-embedding", "own-embedding", "3-layers"],
)
def test_head_peagle_trains_through_the_entry_and_its_loss_falls(
    tmp_path, tiny_target_dir, chat_file, training_kit, own, layers
) -> None:
    """own: head.own_embedding=true trains the head's own embedding (from the target's), saved with it;
    head.num_layers=3: a head of three decoder layers."""
    more = {"head.own_embedding": True} if own else {}
    if layers > 1:
        more["head.num_layers"] = layers
    extra = _extra(**{"trainer.lr": 0.003, "trainer.max_steps": 12, "trainer.eval_every": 12, **more})
    settings = training_kit.settings(
        training_kit.overrides(tiny_target_dir, chat_file, tmp_path / "o", **extra)
    )
    assert settings.head.family == "peagle" and settings.head.loss == {
        "decay": 0.8,
        "partitions": 4,
        "cod_ratio": 1.0,
        "cod_min": 0.2,
    }
    result = train(settings)
    head = load_head(result.head_dir)
    assert isinstance(head, PEagleHead) and head.block_size == K and head.config.own_embedding is own
    assert head.config.num_layers == layers == len(head.decoder_layers)
    if own:  # trained away from the target's table it started from
        from transformers import AutoModelForCausalLM

        table = AutoModelForCausalLM.from_pretrained(tiny_target_dir).get_input_embeddings().weight
        same = (head.embed_tokens.weight == table.to(head.embed_tokens.weight.dtype)).all(-1)  # (V,)
        assert same.any() and not same.all(), int(same.sum())  # rows never read keep the target's
    metrics = result.metrics
    assert {f"acc/step{j}_top1" for j in range(K)} <= set(metrics)
    assert {f"acc/depth{d}" for d in range(1, K + 1)} <= set(metrics)
    assert 1.0 <= metrics["tau"] <= 1.0 + K
    rows = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3]), losses


@pytest.fixture(scope="module")
def kit(tiny_llama):
    """A tiny target, a P-EAGLE head on it and a batch with a padded row and a prompt part."""
    target = tiny_llama(V, layers=4, hidden=H).requires_grad_(False)
    from spechead.heads import PEagleConfig

    torch.manual_seed(1)
    head = PEagleHead(PEagleConfig.from_target(target.config, draft_vocab_size=V, block_size=K))
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    loss_mask = mask.clone()
    loss_mask[:, :3] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}
    out = target(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    states = [out.hidden_states[i] for i in head.config.target_layers]
    return target, head, batch, states, out.logits


@pytest.mark.parametrize("layers", [1, 3])
def test_partitions_give_the_same_loss_gradients_and_counts(kit, layers) -> None:
    """Partitions recompute blocks over the real pass's keys/values of every decoder layer."""
    target, head, batch, states, logits = kit
    if layers > 1:
        from spechead.heads import PEagleConfig

        torch.manual_seed(1)
        config = PEagleConfig.from_target(target.config, draft_vocab_size=V, block_size=K, num_layers=layers)
        head = PEagleHead(config)
        head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    results = []
    for partitions in (1, 3):
        model = ParallelModel(head, [1.0, 0.8, 0.64, 0.512], partitions)
        head.zero_grad()
        loss, correct, count, hits = model(states, logits, batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
        results.append((loss.detach(), correct, count, hits, grads))
    (l1, c1, n1, h1, g1), (l3, c3, n3, h3, g3) = results
    torch.testing.assert_close(l3, l1)
    assert torch.equal(c1, c3) and torch.equal(n1, n3) and torch.equal(h1, h3)
    assert set(g1) == set(g3) and {"mask_hidden", "mask_embedding", "fc.weight"} <= set(g1)
    assert any(name.startswith("extra_layers.") for name in g1) is (layers > 1)  # every layer trains
    for name in g1:
        torch.testing.assert_close(g3[name], g1[name], rtol=1e-4, atol=1e-6)


def test_cod_depths_keep_a_geometric_nested_share_of_the_anchors() -> None:
    torch.manual_seed(0)
    depths = objective.cod_depths(20000, 7, 0.7, 0.2, torch.device("cpu"))  # (20000,) in 0..7
    for j in range(1, 8):  # an anchor trained at depth j trains every depth below it: its depth is >= j
        assert abs(float((depths >= j).float().mean()) - max(0.7**j, 0.2)) < 0.015, j
    with pytest.raises(TrainError, match=r"^head.loss.cod_ratio must be a number in \(0, 1\], got 0$"):
        PEagleLossConfig(cod_ratio=0)


def test_cod_sampling_trains_each_anchor_up_to_its_drawn_depth(kit, monkeypatch) -> None:
    """Training with COD: depth j's loss is the mean over the anchors drawn to reach j (the full forward's
    logits there), its hits those of the full forward at those anchors only; evaluation keeps them all."""
    _, head, batch, states, logits = kit
    weights = [1.0, 0.8, 0.64, 0.512]
    drawn = []

    def fixed(count, depth, ratio, floor, device):  # depths 0..K-1 in turn: dropped anchors and every length
        drawn.append(torch.arange(count, device=device) % (depth + 1))
        return drawn[-1]

    monkeypatch.setattr(objective, "cod_depths", fixed)
    model = ParallelModel(head, weights, 2, (0.5, 0.2))
    loss, _, count, hits = model(states, logits, batch)
    loss.backward()  # (through the checkpointed groups)
    with torch.no_grad():
        _, _, all_count, all_hits = model(states, logits, batch)  # no COD outside training
        ids, mask = batch["input_ids"], batch["attention_mask"]
        drafts = head.parallel_logits(head.fuse(states), ids, torch.arange(12), mask)  # (B, T, K, Vd)
    predicted = next_token_valid(batch) & mask.bool()  # (B, T)
    anchors = torch.stack([shifted(predicted, j) for j in range(K)]).any(0).any(0).nonzero().squeeze(-1)
    reach = torch.zeros(12, dtype=torch.long).index_put_(
        (anchors,), drawn[0]
    )  # (T,) depth each anchor trains
    assert len(drawn) == 1 and {0, K - 1} <= set(reach[anchors].tolist())
    expected = torch.zeros(())
    for j in range(K):
        ok = shifted(predicted, j) & (reach >= j if j else True)  # (B, T): depth j's trained anchors
        expected = (
            expected
            + weights[j] * eagle3_step_loss(drafts[:, :, j], shifted(shift_left(logits), j), head.t2d, ok)[0]
        )
        assert torch.equal(hits[j], all_hits[j] & ok) and int(count[j]) == int(ok.sum()), j
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(all_count, torch.tensor([int(shifted(predicted, j).sum()) for j in range(K)]).float())


def test_each_depth_is_scored_against_its_own_token(kit) -> None:
    """Depth j at anchor a predicts x_{a+2+j}: scored against the target's greedy token there (its logits at
    a + 1 + j), counted only where that token is a loss token. A shift off by one scores other tokens."""
    target, head, batch, states, logits = kit
    model = ParallelModel(head, [1.0] * K, 1)
    with torch.no_grad():
        _, correct, count, hits = model(states, logits, batch)
        anchors = torch.arange(12)
        drafts = head.parallel_logits(head.fuse(states), batch["input_ids"], anchors, batch["attention_mask"])
    drafted = head.draft_to_target(drafts.argmax(-1))  # (B, T, K): anchor a's K drafts
    greedy = logits.argmax(-1)  # (B, T): the target's token for x_{t+1}
    loss_mask = batch["loss_mask"].bool()
    for j in range(K):
        expected = torch.zeros(2, 12, dtype=torch.bool)
        for a in range(12):
            t = a + 2 + j  # the token depth j drafts
            if t < 12:
                expected[:, a] = (drafted[:, a, j] == greedy[:, t - 1]) & loss_mask[:, t]
        assert torch.equal(hits[j], expected), j
        assert int(count[j]) == int(loss_mask[:, 2 + j :].sum()) and int(correct[j]) == int(expected.sum())


def test_memory_plan_counts_k_depths_and_partitions_lower_it(kit) -> None:
    _, head, *_ = kit
    whole = PEagleObjective(head, PEagleLossConfig(partitions=1))
    assert whole.work() == (K, V, K, 1 + (K - 1) * K)  # the causal mask + (T(K-1), TK)
    assert PEagleObjective(head, PEagleLossConfig(partitions=3)).work() == (2, V, 2, 3.0)  # + (T, 2T)
    with pytest.raises(TrainError, match="partitions must be an int >= 1"):
        PEagleLossConfig(partitions=0)


def test_block_size_errors(tmp_path, tiny_target_dir, chat_file, training_kit) -> None:
    def run(**extra):
        out = tmp_path / "o"
        train(
            training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, out, **_extra(**extra)))
        )

    with pytest.raises(HeadError, match="block_size must be an int >= 2"):
        run(**{"head.block_size": 1})
    with pytest.raises(TrainError, match="head.block_size=60 needs sequences of at least block_size \\+ 2"):
        run(**{"head.block_size": 60, "trainer.max_length": 40})


def test_a_peagle_head_refuses_a_target_of_another_width(
    tmp_path, tiny_target_dir, chat_file, tiny_llama, chatml_tokenizer, training_kit
) -> None:
    """check_target: a P-EAGLE head trained on one target is refused for another one (head.init_from)."""
    first = tmp_path / "first"
    train(training_kit.settings(training_kit.overrides(
        tiny_target_dir, chat_file, first, **_extra(**{"trainer.max_steps": 1}))))  # fmt: skip
    other = tmp_path / "other-target"
    tiny_llama(len(chatml_tokenizer), layers=4, hidden=48).save_pretrained(other)
    chatml_tokenizer.save_pretrained(other)
    overrides = training_kit.overrides(
        other, chat_file, tmp_path / "o", **_extra(**{"head.init_from": first / "head"})
    )
    with pytest.raises(TrainError, match="hidden_size 32.*target has 48"):
        train(training_kit.settings(overrides))


@pytest.mark.parametrize(
    "extra, needle",
    [({"head.block_size": 1}, "block_size must be an int >= 2"),
     ({"head.block_size": 60, "trainer.max_length": 40}, "head.block_size=60 needs sequences")],
)  # fmt: skip
def test_cli_bad_block_size_is_one_error_line_and_exit_2(
    tmp_path, tiny_target_dir, chat_file, training_kit, extra, needle, monkeypatch, capsys
) -> None:
    proc = training_kit.cli_in_process(
        training_kit.overrides(tiny_target_dir, chat_file, tmp_path / "o", **_extra(**extra)),
        monkeypatch,
        capsys,
    )
    lines = proc.stderr.strip().splitlines()  # (the data and target progress bars come first)
    errors = [line for line in lines if line.startswith("error: ")]
    assert proc.returncode == 2 and errors == lines[-1:] and "Traceback" not in proc.stderr, proc.stderr
    assert needle in errors[0], errors[0]
