"""The memory plan: exact parameter counts and bytes of a tiny target and head, and the ZeRO arithmetic."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spechead.heads import MedusaConfig, MedusaHead
from spechead.training.memory_plan import GiB, Shapes, from_run, over_device, plan
from spechead.training.objectives.medusa import MedusaLossConfig, MedusaObjective
from spechead.training.target import FrozenTarget

# tiny_llama: vocab, hidden, intermediate (MLP), layers, k/v width (2 of 4 heads of 8)
V, H, MLP, L, KV = 384, 32, 64, 4, 16


def llama_params() -> int:
    """Counted by hand: embedding, per layer q/k/v/o + gate/up/down + 2 norms, final norm, lm_head."""
    per_layer = H * H + 2 * H * KV + H * H + 3 * H * MLP + 2 * H
    return V * H + L * per_layer + H + V * H


def medusa_params(heads: int) -> int:
    """Per head: one ResBlock (H x H weight + bias) and a Linear(H, V) without bias."""
    return heads * (H * H + H + H * V)


@pytest.fixture
def tiny_run(tiny_llama):
    target = FrozenTarget(tiny_llama(V, layers=L, hidden=H), "tiny")
    head = MedusaHead(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=2, target_num_layers=L))
    return target, MedusaObjective(head, MedusaLossConfig())


def test_counts_are_exact(tiny_run):
    target, objective = tiny_run
    p = from_run(target, objective, processes=1, stage=0, mixed_precision="no", batch_size=2, seq_len=16)
    assert llama_params() == 61_728
    assert p.shapes.target_params == llama_params() and p.shapes.target_bytes == 4 * llama_params()
    assert p.shapes.head_params == medusa_params(2) and p.head_weights == 4 * medusa_params(2)
    assert p.target_weights == 4 * llama_params()
    assert p.gradients == 4 * medusa_params(2)
    assert p.optimizer == 8 * medusa_params(2)  # AdamW m + v in fp32, no master copy under DDP
    # Activations: target pass B*T*(4H + 3I) + one captured state B*T*H, fp32, no logits (Medusa-1).
    assert p.target_activations == 2 * 16 * (4 * H + 3 * MLP + H) * 4
    assert p.head_activations == 2 * 16 * 2 * V * 8  # 2 heads of fp32 logits and their gradients
    assert p.total == pytest.approx(sum(dataclasses.astuple(p)[2:8]))
    assert "61.73K params" in p.summary() and "no ZeRO" in p.summary()


def test_bf16_target_bytes(tiny_run):
    target, objective = tiny_run
    target.model.to(torch.bfloat16)
    p = from_run(target, objective, processes=1, stage=0, mixed_precision="no", batch_size=1, seq_len=8)
    assert p.shapes.target_bytes == 2 * llama_params() and p.shapes.target_element == 2


def test_zero_stages_shard_per_process(tiny_run):
    target, objective = tiny_run
    n, head = llama_params(), medusa_params(2)
    runs = {
        stage: from_run(target, objective, processes=4, stage=stage, mixed_precision="bf16", batch_size=1, seq_len=8)
        for stage in (0, 2, 3)
    }  # fmt: skip
    ddp, zero2, zero3 = runs[0], runs[2], runs[3]
    assert ddp.target_weights == zero2.target_weights == 4 * n  # a whole replica per process
    assert ddp.optimizer == 8 * head and ddp.gradients == 4 * head  # native AMP: fp32 head, no masters
    # DeepSpeed bf16: 16-bit weights and gradients, fp32 masters + m + v, gradients and states / 4.
    assert zero2.head_weights == 2 * head and zero2.gradients == 2 * head / 4
    assert zero2.optimizer == 12 * head / 4
    # ZeRO-3: a quarter of the target plus whole embedding and lm_head replicas (2 x V x H fp32).
    assert zero3.target_weights == 4 * n / 4 + 2 * V * H * 4
    assert "ZeRO-3" in zero3.summary()


def test_zero1_shards_the_optimizer_states_not_the_gradients(tiny_run):
    """ZeRO-1 partitions the optimizer states (fp32 masters + m + v) over the processes; only ZeRO-2 and
    -3 partition gradients: under ZeRO-1 each process holds all of them."""
    target, objective = tiny_run
    p = from_run(target, objective, processes=4, stage=1, mixed_precision="bf16", batch_size=1, seq_len=8)
    assert p.gradients == 2 * medusa_params(2)  # DeepSpeed bf16: 16-bit gradients, not / 4
    assert p.optimizer == 12 * medusa_params(2) / 4


def test_trained_target_keeps_every_layer_and_logits():
    sh = Shapes(
        target_params=0, target_bytes=0, target_replica_bytes=0, head_params=0, head_bytes=0,
        hidden=10, intermediate=20, layers=3, vocab=50, target_element=2, head_element=4, captured=1,
        reads_logits=False, target_trained=True, runs_target=True, head_logit_sets=1, head_vocab=50,
        head_layer_passes=2, head_mask_area=1.5,
    )  # fmt: skip
    p = plan(sh, processes=1, stage=0, deepspeed_mixed=False, batch_size=2, seq_len=5)
    layer = 2 * 5 * (4 * 10 + 3 * 20)
    assert p.target_activations == (3 * layer + 2 * 5 * 10 + 2 * 5 * 50) * 2
    head_layer = 2 * 5 * (17 * 10 + 4 * 20)  # what autograd keeps of one head layer pass
    masks = 2 * 5 * 5 * 1.5  # B * T^2 * mask area
    assert p.head_activations == 2 * 5 * 50 * 8 + (2 * head_layer + masks) * 4
    offline = plan(dataclasses.replace(sh, runs_target=False), processes=1, stage=0, deepspeed_mixed=False,
                   batch_size=2, seq_len=5)  # fmt: skip
    assert offline.target_activations == 0


@pytest.mark.parametrize("family", ["eagle3", "peagle"])
def test_an_own_embedding_starts_from_the_targets_and_is_counted(tiny_llama, family):
    """head.own_embedding=true: build_objective starts the head's embedding from the target's, the optimizer
    sees it, and the plan counts its V x H weights with the head's."""
    from spechead.training.objectives import build_objective
    from spechead.training.settings import HeadSettings

    target = FrozenTarget(tiny_llama(V, layers=L, hidden=H), "tiny")
    rows = [{"input_ids": list(range(12)), "loss_mask": [1] * 12}]
    plans = {}
    for own in (False, True):
        arch = {"draft_vocab_size": 64, "own_embedding": own}
        objective = build_objective(HeadSettings(family, family, None, arch, {}), target, rows)
        plans[own] = from_run(
            target, objective, processes=1, stage=0, mixed_precision="no", batch_size=1, seq_len=8
        )
    head = objective.head
    assert torch.equal(head.embed_tokens.weight, target.embed_tokens.weight)
    assert any(p is head.embed_tokens.weight for g in objective.param_groups(1e-3) for p in g["params"])
    assert plans[True].shapes.head_params - plans[False].shapes.head_params == V * H


@pytest.mark.parametrize(
    "family, arch, loss",
    [
        ("eagle", {}, {}),
        ("eagle3", {"ttt_steps": 4, "draft_vocab_size": 256}, {}),
        ("peagle", {"block_size": 4, "draft_vocab_size": 256}, {"partitions": 1}),
        ("dflash", {"block_size": 8, "num_layers": 2}, {}),
    ],
)
def test_head_activations_are_what_autograd_keeps(tiny_llama, family, arch, loss):
    """The plan's head activations are the bytes autograd saves for backward in one training forward
    (counted by a saved-tensors hook, each storage once, parameters left out): the additive attention
    masks (B, 1, queries, keys) to 5% (the family's mask area), the logit sets and layer passes to 20%."""
    from spechead.training.objectives import build_objective
    from spechead.training.settings import HeadSettings

    torch.manual_seed(0)
    B, T = 2, 128
    target = FrozenTarget(tiny_llama(V, layers=L, hidden=H), "tiny")
    ids = torch.randint(0, V, (B, T))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    rows = [{"input_ids": ids[0].tolist(), "loss_mask": [1] * T}]
    objective = build_objective(HeadSettings(family, family, None, arch, loss), target, rows)
    model = objective.module().train()
    params = {p.untyped_storage().data_ptr() for m in (model, target.model) for p in m.parameters()}
    saved: dict[int, tuple[bool, int]] = {}  # storage -> (is a mask, bytes)

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            is_mask = t.dim() == 4 and t.shape[1] == 1 and t.shape[-1] >= T
            saved[storage.data_ptr()] = (is_mask, storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        objective.loss(model, target, batch, 0)
    p = from_run(target, objective, processes=1, stage=0, mixed_precision="no", batch_size=B, seq_len=T)
    masks = sum(n for is_mask, n in saved.values() if is_mask)
    planned_masks = B * T * T * p.shapes.head_mask_area * p.shapes.head_element
    assert masks > 0 and planned_masks == pytest.approx(masks, rel=0.05)
    rest = sum(n for is_mask, n in saved.values() if not is_mask)
    assert 0.8 < (p.head_activations - planned_masks) / rest < 1.2


def test_a_plan_over_the_gpu_memory_warns_in_one_line(tiny_run):
    """Past the device's memory the plan prints one warning naming what to lower; within it, or on a CPU
    (no device size), nothing."""
    target, objective = tiny_run
    p = from_run(target, objective, processes=1, stage=0, mixed_precision="no", batch_size=2, seq_len=16)
    assert over_device(p, None) == "" and over_device(p, int(p.total)) == ""
    warning = over_device(p, int(p.total) - 1)
    assert warning.startswith("warning: the memory plan needs") and "\n" not in warning
    assert "trainer.max_length" in warning and "zero3.yaml" in warning
    assert over_device(dataclasses.replace(p, head_activations=80 * GiB), 80 * GiB) != ""
