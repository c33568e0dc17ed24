"""Training alignment of the EAGLE objectives, checked against a target whose logits the test controls.

Indexing: the head output at position t predicts x_{t+2}, so it is trained toward the target's
distribution at position t + 1. EAGLE-3's TTT step j at position t is the depth-(j+1) draft of the
chain rooted at t - j: it also predicts x_{t+2} (= token root + 2 + j), from the target at t + 1.
EAGLE-1 reads (f_t, x_{t+1}) and regresses onto f_{t+1}.

The expected positions and distributions are computed here by plain loops and a plain forward of the
target, never with the objectives' own helpers (shift_left, next_token_valid, ttt_valid).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spechead.heads.eagle import EagleConfig, EagleHead
from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.training.metrics import chain_summary as chain_summary_of
from spechead.training.objectives.eagle import EagleLossConfig, EagleObjective, greedy_chain_tau
from spechead.training.objectives.eagle3 import Eagle3LossConfig, Eagle3Objective
from spechead.training.target import FrozenTarget

V, H, L, T = 64, 32, 4, 12
STEPS = 3
SHARPEN = 40.0  # scales the target's lm_head: peaked distributions, neighbours clearly different


@pytest.fixture(scope="module")
def target(tiny_llama) -> FrozenTarget:
    model = tiny_llama(V, layers=L, hidden=H, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPEN)
    return FrozenTarget(model, "controlled-target")


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    """Two rows: a prompt of 3 tokens (no loss), one more unmasked token in row 0, row 1 right-padded."""
    ids = torch.randint(1, V, (2, T), generator=torch.Generator().manual_seed(0))
    attention = torch.ones(2, T, dtype=torch.long)
    attention[1, 9:] = 0
    ids[1, 9:] = 0  # padding id
    loss = attention.clone()
    loss[:, :3] = 0
    loss[0, 7] = 0
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}


@pytest.fixture(scope="module")
def reference(target, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own final normed states (B, T, H) and logits (B, T, V) from a plain forward."""
    with torch.no_grad():
        out = target.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
        )
    return out.hidden_states[-1], out.logits


def expected_positions(batch, step: int) -> list[tuple[int, int]]:
    """(b, t) trained at TTT step `step`: chain t-step..t+1 all real tokens and x_{t+2} a loss token."""
    att, loss = batch["attention_mask"], batch["loss_mask"]
    out = []
    for b in range(att.shape[0]):
        for t in range(step, T - 2):
            if all(att[b, s] for s in range(t - step, t + 2)) and loss[b, t + 2]:
                out.append((b, t))
    return out


def entropy(logits: torch.Tensor) -> float:
    return float(-(F.softmax(logits, -1) * F.log_softmax(logits, -1)).sum())


# ---- EAGLE-3 -------------------------------------------------------------------------------------


def eagle3_objective(target, reference, batch) -> Eagle3Objective:
    """An EAGLE-3 objective over a draft vocabulary that holds every trained-on target argmax, not all V."""
    _, logits = reference
    tops = {int(logits[b, t + 1].argmax()) for b, t in expected_positions(batch, 0)}
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[sorted(tops)] = True
    t2d[[i for i in range(V) if i not in tops][:4]] = True  # a few non-argmax tokens too
    assert int(t2d.sum()) < V
    d2t = t2d.nonzero().squeeze(-1) - torch.arange(int(t2d.sum()))
    torch.manual_seed(0)
    config = Eagle3Config.from_target(target.config, draft_vocab_size=int(t2d.sum()))
    head = Eagle3Head(config)
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.embed_tokens)
    head.set_draft_vocab(d2t, t2d)
    return Eagle3Objective(head, Eagle3LossConfig(decay=0.8), STEPS)


def oracle_logits(head: Eagle3Head, ideal: torch.Tensor):
    """A forward hook making the head's lm_head output `ideal` (B, T, Vd) at every TTT step."""
    return head.lm_head.register_forward_hook(lambda module, args, out: ideal + 0 * out)


def eagle3_min_loss(reference, batch, t2d) -> float:
    """sum_j 0.8^j * mean over step j's positions of the entropy of the target at t + 1 (draft vocab)."""
    _, logits = reference
    total = 0.0
    for j in range(STEPS):
        pos = expected_positions(batch, j)
        total += 0.8**j * sum(entropy(logits[b, t + 1, t2d]) for b, t in pos) / len(pos)
    return total


def chain_summary(batch) -> dict[str, float]:
    """tau and per-depth accuracy of chains rooted at step-0 positions s when every trained draft is right.

    The depth-(j+1) draft of the chain rooted at s is step j at s + j (it predicts x_{s+2+j}).
    """
    trained = [set(expected_positions(batch, j)) for j in range(STEPS)]
    anchors = expected_positions(batch, 0)
    right = [[(b, s + j) in trained[j] for j in range(STEPS)] for b, s in anchors]
    leading = [next((j for j, ok in enumerate(row) if not ok), STEPS) for row in right]
    out = {"tau": 1 + sum(leading) / len(anchors)}
    out.update({f"acc/depth{j + 1}": sum(row[j] for row in right) / len(anchors) for j in range(STEPS)})
    # decoding's walk: passes start at anchors whose root x_{s+1} is an answer token; the next at s + 1 + a
    accepted = {(b, s): a for (b, s), a in zip(anchors, leading) if batch["loss_mask"][b, s + 1]}
    tokens = passes = 0
    for b in range(batch["loss_mask"].shape[0]):
        s = 0
        while s < T:
            if (b, s) in accepted:
                tokens, passes = tokens + 1 + accepted[b, s], passes + 1
                s += 1 + accepted[b, s]
            else:
                s += 1
    out["tau_walked"] = tokens / passes
    return out


def test_eagle3_step0_reads_the_target_states_at_t_and_x_t_plus_1(target, reference, batch):
    objective = eagle3_objective(target, reference, batch)
    head = objective.head
    with torch.no_grad():
        out = target.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
        )
    states = torch.cat([out.hidden_states[i] for i in head.config.target_layers], dim=-1)  # (B, T, 3H)
    fused_in: list[torch.Tensor] = []
    embedded: list[torch.Tensor] = []
    hooks = [
        head.fc.register_forward_pre_hook(lambda module, args: fused_in.append(args[0])),
        target.embed_tokens.register_forward_pre_hook(lambda module, args: embedded.append(args[0])),
    ]
    try:
        with torch.no_grad():
            objective.loss(objective.module(), target, batch, step=0)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(fused_in) == 1 and len(embedded) == 1 + STEPS  # the target's own pass, then one per step
    for b, t in expected_positions(batch, 0):
        torch.testing.assert_close(fused_in[0][b, t], states[b, t], msg=f"fused input at {b, t}")
        for j, ids in enumerate(embedded[1:]):  # (B, T): the token every step reads at t
            assert ids[b, t] == batch["input_ids"][b, t + 1], f"step {j} token at {b, t} is not x_(t+1)"


def test_eagle3_every_step_is_trained_toward_the_target_at_t_plus_1(target, reference, batch):
    """The loss gradient on step j's logits at t is (softmax(draft) - p_{t+1}) * weight_j / count_j."""
    objective = eagle3_objective(target, reference, batch)
    head, t2d = objective.head, objective.head.t2d
    _, logits = reference
    seen: list[torch.Tensor] = []

    def keep(module, args, out):
        out.retain_grad()
        seen.append(out)

    handle = head.lm_head.register_forward_hook(keep)
    try:
        loss, _ = objective.loss(objective.module(), target, batch, step=0)
    finally:
        handle.remove()
    loss.backward()
    assert len(seen) == STEPS
    for j, out in enumerate(seen):  # (B, T, Vd) each
        pos = expected_positions(batch, j)
        trained = {(b, t) for b in range(2) for t in range(T) if out.grad[b, t].abs().sum() > 0}
        assert trained == set(pos), f"step {j} trains positions {sorted(trained)}, expected {pos}"
        scale = len(pos) / 0.8**j
        for b, t in pos:
            pulled_to = F.softmax(out[b, t].detach(), -1) - out.grad[b, t] * scale
            expected = F.softmax(logits[b, t + 1, t2d], -1)
            torch.testing.assert_close(pulled_to, expected, atol=2e-5, rtol=0, msg=f"step {j} at {b, t}")
            assert not torch.allclose(expected, F.softmax(logits[b, t, t2d], -1), atol=1e-2)  # t != t + 1


def test_eagle3_a_head_predicting_the_target_at_t_plus_1_reaches_min_loss_and_accuracy_1(
    target, reference, batch
):
    objective = eagle3_objective(target, reference, batch)
    head, t2d = objective.head, objective.head.t2d
    _, logits = reference
    ideal = torch.zeros(2, T, int(t2d.sum()))  # position t: the target at t + 1 over the draft vocab
    ideal[:, : T - 1] = logits[:, 1:][..., t2d]
    lagging = logits[..., t2d].clone()  # a head one token behind: the target at t itself
    best = eagle3_min_loss(reference, batch, t2d)
    for output, exact in ((ideal, True), (lagging, False)):
        handle = oracle_logits(head, output)
        try:
            with torch.no_grad():
                loss, logged = objective.loss(objective.module(), target, batch, step=0)
                summary = objective.summarize(objective.eval_counts(objective.module(), target, batch))
        finally:
            handle.remove()
        accuracy = [logged[f"acc/step{j}"] for j in range(STEPS)]
        top1 = [summary[f"acc/step{j}_top1"] for j in range(STEPS)]
        if exact:
            assert float(loss) == pytest.approx(best, abs=1e-4)
            assert accuracy == top1 == [1.0] * STEPS
            chains = chain_summary(batch)
            assert chains["tau"] > 2.5  # most chains are complete: the check below has something to see
            assert {k: summary[k] for k in chains} == pytest.approx(chains)
        else:
            assert float(loss) > best + 1.0
            assert max(accuracy) < 0.5 and max(top1) < 0.5 and summary["tau"] < 1.5


# ---- EAGLE-1 -------------------------------------------------------------------------------------


class FixedHead(nn.Module):
    """Stands in for the EAGLE-1 head module the objective runs: records its inputs, returns `output`.

    output None: return the input features themselves (a head that copies f_t).
    """

    def __init__(self, output: torch.Tensor | None):
        super().__init__()
        self.output = output
        self.inputs: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, features, next_ids, attention_mask=None):
        self.inputs = (features.detach().clone(), next_ids.clone())
        return features.clone() if self.output is None else self.output.clone()


def eagle_objective(target) -> EagleObjective:
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.from_target(target.config))
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.embed_tokens)
    return EagleObjective(head, EagleLossConfig(noise=0.0))


def test_eagle1_head_reads_f_t_and_x_t_plus_1(target, reference, batch):
    objective = eagle_objective(target)
    states, _ = reference
    model = FixedHead(None)
    objective.loss(model, target, batch, step=0)
    features, next_ids = model.inputs
    for b, t in expected_positions(batch, 0):
        torch.testing.assert_close(features[b, t], states[b, t], msg=f"feature at {b, t} is not f_t")
        assert next_ids[b, t] == batch["input_ids"][b, t + 1], f"token at {b, t} is not x_(t+1)"


def test_eagle1_regresses_onto_the_next_feature(target, reference, batch):
    """A head outputting f_{t+1} reaches zero feature loss, the minimum CE and accuracy 1; copying f_t does not."""
    objective = eagle_objective(target)
    states, logits = reference
    pos = expected_positions(batch, 0)
    best_ce = sum(entropy(logits[b, t + 1]) for b, t in pos) / len(pos)
    ideal = torch.zeros_like(states)
    ideal[:, : T - 1] = states[:, 1:]  # position t: f_{t+1}
    for model, exact in ((FixedHead(ideal), True), (FixedHead(None), False)):
        with torch.no_grad():
            loss, logged = objective.loss(model, target, batch, step=0)
            summary = objective.summarize(objective.eval_counts(model, target, batch))
        if exact:
            assert logged["feature_loss"] < 1e-10 and summary["feature_loss"] < 1e-10
            assert logged["ce_loss"] == pytest.approx(best_ce, abs=1e-4)
            assert logged["accuracy"] == summary["acc/step0_top1"] == 1.0
            assert float(loss) == pytest.approx(0.1 * best_ce, abs=1e-5)
        else:
            assert logged["feature_loss"] > 0.05
            assert logged["accuracy"] < 0.5


def test_eagle1_simulated_chain_scores_step_j_at_t_against_the_target_at_t_plus_1(reference, batch):
    """EAGLE-1's evaluation tau: unrolled drafts that equal the target at t + 1 give every possible chain."""
    _, logits = reference
    ideal = torch.zeros_like(logits)
    ideal[:, : T - 1] = logits[:, 1:]
    summary = chain_summary_of(greedy_chain_tau([ideal] * STEPS, lambda x: x, logits, batch))
    assert summary == pytest.approx(chain_summary(batch))
    lagging = chain_summary_of(greedy_chain_tau([logits] * STEPS, lambda x: x, logits, batch))
    assert lagging["tau"] < 1.5
