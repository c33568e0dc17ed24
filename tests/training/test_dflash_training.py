"""DFlash training: which anchors and targets a block learns from, a loss that falls on a tiny target, the
`head=dflash` recipe through the trainer's Hydra composition, and its bad inputs (one line, exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

from spechead.heads import DFlashConfig, DFlashHead, load_head
from spechead.heads.errors import HeadError
from spechead.heads.formats.dflash_export import export_dflash_sglang, sglang_mask_token_id
from spechead.training.eagle_losses import step_weights
from spechead.training.errors import TrainError
from spechead.training.metrics import answer_roots, walked_counts
from spechead.training.objectives import build_objective
from spechead.training.objectives import dflash as dflash_objective
from spechead.training.objectives.dflash import (
    BlockModel,
    DFlashLossConfig,
    DFlashObjective,
    block_targets,
    block_valid,
    candidates,
    longest_row,
    pick_anchors,
)
from spechead.training.settings import HeadSettings
from spechead.training.target import FrozenTarget
from spechead.training.trainer import train

VOCAB = 64


def test_block_position_j_learns_from_the_target_at_anchor_plus_j():
    """Anchor c, block position j >= 1 predicts x_{c+1+j}: the target's distribution at c + j (the logits
    at a position predict the next token). One off either way fails here."""
    values = torch.arange(10)[None]  # (1, T): each position's own index
    anchors = torch.tensor([[2, 7]])
    assert block_targets(values, anchors, 4).tolist() == [[[3, 4, 5], [8, 9, 9]]]  # clamped at the end
    loss_mask = torch.ones(1, 10, dtype=torch.bool)
    loss_mask[0, 5] = False  # x_5 is not trained: anchor 2's position 2 (x_{2+1+2})
    ok = torch.tensor([[True, True]])
    assert block_valid(loss_mask, anchors, ok, 4).tolist() == [[[True, False, True], [True, False, False]]]
    assert not block_valid(loss_mask, anchors, ~ok, 4).any()


def test_anchors_have_a_first_draft_to_learn():
    batch = {
        "input_ids": torch.zeros(2, 8, dtype=torch.long),
        "attention_mask": torch.tensor([[1] * 8, [1] * 5 + [0] * 3]),
        "loss_mask": torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0, 0]]),
    }
    anchors, ok = pick_anchors(batch, 5, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 5)
    assert sorted(anchors[0][ok[0]].tolist()) == [2, 3, 4, 5]  # x_{c+2} is a loss token, c + 2 < T
    assert sorted(anchors[1][ok[1]].tolist()) == [0, 1, 2]
    again, _ = pick_anchors(batch, 5, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)  # evaluation's anchors are the same every time


def test_loss_falls_on_a_tiny_target(tiny_llama):
    torch.manual_seed(0)
    target = tiny_llama(VOCAB, layers=4, hidden=32)
    head = DFlashHead(DFlashConfig.from_target(target.config, block_size=3, num_layers=2))
    head.attach_target_modules(target.get_output_embeddings(), target.get_input_embeddings())
    model = BlockModel(head, step_weights(2, 0.8))
    ids = torch.randint(0, VOCAB, (2, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # a random tiny target is near uniform: peaked, it leaves room to learn
        out = target(ids, output_hidden_states=True)
    teacher = out.logits
    states = [out.hidden_states[i] for i in head.config.target_layers]
    anchors, ok = pick_anchors(batch, 6, torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss, correct, count, hits, *_ = model(states, teacher, batch, anchors, ok)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert count.tolist() == [12.0, 12.0] and hits.shape == (2, 2, 6)
    probs = block_targets(teacher, anchors, 3).softmax(-1)  # (B, A, 2, V): the teacher's entropy is the floor
    entropy = -(probs * probs.log()).sum(-1).mean(dim=(0, 1))
    floor = float(entropy[0] + 0.8 * entropy[1])
    assert losses[-1] - floor < 0.3 * (losses[0] - floor), (floor, losses)
    assert head.mask_embedding.grad is not None and head.mask_embedding.grad.abs().sum() > 0


def test_head_dflash_trains_through_the_trainer(tmp_path, tiny_target_dir, chat_file, training_kit):
    extra = {"head": "dflash", "head.block_size": 4, "head.num_layers": 2, "trainer.lr": 0.003}
    settings = training_kit.settings(
        training_kit.overrides(tiny_target_dir, chat_file, tmp_path / "o", **extra)
    )
    result = train(settings)
    head = load_head(result.head_dir)
    assert isinstance(head, DFlashHead) and head.config.block_size == 4 and len(head.layers) == 2
    assert head.config.target_layers == [2, 2, 1]  # [2, L//2, L-3] of the 4-layer target
    # head.mask_token_id=auto (the default): the tokenizer fills this target's embedding and has no reserved
    # special token, so nothing is spare for SGLang's masks: a learned mask embedding
    assert head.config.mask_token_id == -1 and hasattr(head, "mask_embedding")
    assert 1.0 <= result.metrics["tau"] <= 4.0
    assert {"acc/step0_top1", "acc/step2_top1", "acc/depth3"} <= set(result.metrics)


def test_auto_mask_token_is_the_id_sglang_gives_it(
    tmp_path, chat_file, training_kit, tiny_llama, chatml_tokenizer, capsys
):
    """A target whose embedding has rows past its tokenizer's tokens (Qwen's, GPT-OSS's): head.mask_token_id
    =auto trains with the first of them, the id SGLang's DFLASH adds <|MASK|> at, so the head exports for
    SGLang with that id; the run says which id it took."""
    target = tmp_path / "spare-rows"
    tiny_llama(len(chatml_tokenizer) + 8, layers=8).save_pretrained(target)  # layers [2, 4, 5]
    chatml_tokenizer.save_pretrained(target)
    extra = {"head": "dflash", "head.block_size": 2, "trainer.max_steps": 1}
    result = train(training_kit.settings(training_kit.overrides(target, chat_file, tmp_path / "o", **extra)))
    head = load_head(result.head_dir)
    assert head.config.mask_token_id == len(chatml_tokenizer) and not hasattr(head, "mask_embedding")
    assert f"head.mask_token_id=auto: {len(chatml_tokenizer)} (<|MASK|>, added)" in capsys.readouterr().out
    export_dflash_sglang(head, tmp_path / "sglang")
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == len(chatml_tokenizer)


def test_init_from_a_head_with_a_learned_mask_names_it(
    tmp_path, chat_file, training_kit, tiny_llama, chatml_tokenizer
):
    """A head that learned its mask (-1) as init_from of a run whose auto mask is a target token: one error
    naming mask_embedding, not a shape mismatch to guess at."""
    target = tmp_path / "spare-rows"
    tiny_llama(len(chatml_tokenizer) + 8, layers=4).save_pretrained(target)
    chatml_tokenizer.save_pretrained(target)
    base = {"head": "dflash", "head.block_size": 2, "trainer.max_steps": 1}
    learned = {**base, "head.mask_token_id": -1}
    train(training_kit.settings(training_kit.overrides(target, chat_file, tmp_path / "learned", **learned)))
    extra = {**base, "head.init_from": tmp_path / "learned" / "head"}
    with pytest.raises(TrainError, match="mask_embedding only in the trained head.*mask_token_id"):
        train(training_kit.settings(training_kit.overrides(target, chat_file, tmp_path / "o", **extra)))


def test_sglang_mask_token_id():
    vocab = {"a": 0, "b": 1, "<|MASK|>": 2}
    assert sglang_mask_token_id(vocab, 3, 3) == 2  # the tokenizer's own <|MASK|>
    del vocab["<|MASK|>"]
    assert sglang_mask_token_id(vocab, 2, 5) == 2  # added after the tokenizer's 2 tokens: row 2 is spare
    assert sglang_mask_token_id(vocab, 5, 5) == -1  # no row past the tokenizer's and nothing reserved
    vocab.update({"<|reserved_special_token_1|>": 4, "<|reserved_special_token_0|>": 3})
    assert sglang_mask_token_id(vocab, 5, 5) == 3  # Llama 3's: the lowest reserved special token
    for reserved in ("<unused0>", "<mask>", "<|dummy_3|>", "[control_8]"):  # Gemma's, Phi-4's, Mistral's
        assert sglang_mask_token_id({"a": 0, "b": 1, reserved: 2}, 3, 3) == 2, reserved
    for word in ("<unused>", "<masked>", "<|dummy|>", "[control]", "x<unused0>"):  # ordinary tokens
        assert sglang_mask_token_id({"a": 0, "b": 1, word: 2}, 3, 3) == -1, word


def test_auto_mask_token_needs_the_tokenizer(tiny_llama):
    target = FrozenTarget(tiny_llama(VOCAB, layers=4), "tiny")
    settings = HeadSettings("dflash", "dflash", None, {"mask_token_id": "auto"}, {})
    with pytest.raises(TrainError, match="mask_token_id=auto needs the target's tokenizer"):
        build_objective(settings, target)


@pytest.mark.parametrize(
    "extra, error, needle",
    [
        ({"head.block_size": 1}, HeadError, "block_size must be >= 2"),
        ({"head.block_size": 500}, TrainError, "head.block_size=500 needs sequences of at least 501"),
        ({"head.loss.anchors": -1}, TrainError, "head.loss.anchors must be >= 0"),
        ({"+head.blocksize": 4}, TrainError, "head.blocksize"),
    ],
)
def test_bad_dflash_settings(tmp_path, tiny_target_dir, chat_file, training_kit, extra, error, needle):
    overrides = training_kit.overrides(tiny_target_dir, chat_file, tmp_path / "o", head="dflash", **extra)
    with pytest.raises(error, match=needle):
        train(training_kit.settings(overrides))


def test_a_dflash_head_of_another_target_is_refused(
    tmp_path, tiny_target_dir, chat_file, training_kit, tiny_llama, chatml_tokenizer
):
    """init_from a DFlash head trained on a wider target: one error naming both widths."""
    other = tmp_path / "other-target"
    tiny_llama(len(chatml_tokenizer), layers=4, hidden=48).save_pretrained(other)
    chatml_tokenizer.save_pretrained(other)
    base = {"head": "dflash", "head.block_size": 2, "trainer.max_steps": 1}
    train(training_kit.settings(training_kit.overrides(other, chat_file, tmp_path / "wide", **base)))
    extra = {**base, "head.init_from": tmp_path / "wide" / "head"}
    with pytest.raises(TrainError, match="hidden_size 48.*target has 32"):
        train(
            training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, tmp_path / "o", **extra))
        )


def test_cli_one_line_and_exit_2(tmp_path, tiny_target_dir, chat_file, training_kit, monkeypatch, capsys):
    args = training_kit.overrides(
        tiny_target_dir, chat_file, tmp_path / "o", head="dflash", **{"head.block_size": 1}
    )
    proc = training_kit.cli_in_process(args, monkeypatch, capsys)
    # the error comes after the target loaded: transformers' loading bar may stand before it on stderr
    errors = [line for line in proc.stderr.strip().splitlines() if "error" in line.lower()]
    assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: "), proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == errors[0]
    assert "block_size must be >= 2" in errors[0]


def test_longest_row_reads_nested_rows():
    assert longest_row([{"input_ids": [1, 2, 3]}, [{"input_ids": [1] * 7}]]) == 7


def test_evaluation_walks_blocks_at_every_anchor(tiny_llama, monkeypatch):
    """tau_walked: eval drafts a block at every anchor (a few per forward) and walks them as decoding does;
    the same as walking blocks computed one anchor at a time."""
    from ..inference.drafters.parallel_heads import _sequences, dflash_head

    model = tiny_llama(VOCAB, layers=2, hidden=32, seed=3)
    prompts = [[5, 9, 14, 9, 5], [3, 3, 8, 21, 30, 2]]
    head = dflash_head(model, prompts)  # fitted to the greedy continuations: blocks right for several tokens
    seqs, _ = _sequences(model, prompts, 24)
    width = max(len(s) for s in seqs)
    ids = torch.stack([torch.cat([s, s.new_zeros(width - len(s))]) for s in seqs])  # (B, T)
    attention = torch.stack([torch.arange(width) < len(s) for s in seqs]).long()
    loss_mask = attention.clone()
    loss_mask[:, :5] = 0  # the prompts
    loss_mask[:, 15:18] = 0  # as a user turn inside: drafts of those tokens count as wrong, right or not
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    objective = DFlashObjective(head.train().requires_grad_(True), DFlashLossConfig())
    target = FrozenTarget(model, "tiny")
    # 3 anchors a forward: the walk (steps of block_size here) lands at every offset of a forward's anchors
    monkeypatch.setattr(dflash_objective, "WALK_QUERIES", 3 * len(seqs) * head.config.block_size)
    with torch.no_grad():
        counts = objective.eval_counts(objective.module(), target, batch)
        cap = objective.capture(target, batch)
        anchor_ok = candidates(batch)
        correct = torch.zeros(head.config.block_size - 1, *ids.shape, dtype=torch.bool)
        for c in range(width):
            anchors = torch.full((len(seqs), 1), c)
            hits = objective.module()(cap.hidden, cap.logits, batch, anchors, anchor_ok[:, [c]])[
                3
            ]  # (bs-1, B, 1)
            correct[:, :, c] = hits[..., 0]
    expected = walked_counts(correct, anchor_ok & answer_roots(batch))
    assert correct.any(dim=0).float().mean() > 0.3  # the walk has runs to skip
    assert (
        counts["walk_tokens"] == expected["walk_tokens"] and counts["walk_passes"] == expected["walk_passes"]
    )
    assert counts["walk_tokens"] / counts["walk_passes"] > 1.5
