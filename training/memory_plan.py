"""A memory plan printed at start: where the bytes of a run go, per process, before anything runs out.

`plan` is a pure function of counts and shapes; `from_run` reads them off the loaded target and
head. Figures are per process (one GPU):

- weights: the target in its dtype (ZeRO-3: 1/N of it, plus the whole embedding and lm_head that
  heads read, see spechead.training.sharded_target); the head in its training dtype.
- gradients: trainable parameters x their element size (ZeRO-2/3: 1/N).
- optimizer: AdamW m + v in fp32 = 8 bytes per trainable parameter, plus a 4-byte fp32 master copy
  when DeepSpeed trains in bf16/fp16 (under DDP the head itself stays fp32); ZeRO: 1/N; in CPU RAM
  instead of GPU memory with `offload_optimizer_device: cpu`.
- activations (estimates, per micro-batch of B sequences of T tokens, element size b):
  target pass, no grad, one decoder layer live at a time:  B*T*(4H + 3I)*b
      + captured states B*T*H*b each + the target's logits B*T*V*b when the objective reads them;
      a target trained with LoRA (Medusa-2) keeps every layer for backward: B*T*L*(4H + 3I)*b.
  head: S logit sets of fp32 logits and their gradients, B*T*S*V_head*8, plus its decoder layers
      B*T*(17H + 4I)*b_head per layer pass (what autograd keeps of one pass, counted on the CPU: the
      norms' and projections' inputs, q/k/v at full width after GQA's repeat, the MLP's four I-wide
      tensors), plus its additive attention masks B*T^2*M*b_head (EAGLE: S = 1, V_head = V, M = 1;
      EAGLE-3: S = ttt steps, V_head = draft vocabulary, M = S(S+1)/2; P-EAGLE: S = 1 + ceil((K - 1) /
      partitions), see its objective; DFlash: S = 1, V_head = V, M = 2; Medusa: S = heads, no decoder
      layer, M = 0; each family's `Work`, heads/families.py). The masks grow with
      T^2: at 8k tokens EAGLE-3's seven TTT masks alone are 7 GiB in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from spechead.training.objectives.base import Objective
from spechead.training.target import FrozenTarget

GiB = 1024**3


@dataclass(frozen=True)
class Shapes:
    """The sizes the plan needs; all counts are whole-model numbers (not per process)."""

    target_params: int
    target_bytes: int  # in the target's dtype
    target_replica_bytes: int  # whole embedding + lm_head kept beside a ZeRO-3 sharded target
    head_params: int  # trainable
    head_bytes: int  # trainable parameters in their training dtype
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    target_element: int  # bytes per target activation element
    head_element: int
    captured: int  # hidden states captured per pass
    reads_logits: bool
    target_trained: bool  # Medusa-2: LoRA inside the target
    runs_target: bool  # False when training from a hidden-state cache
    head_logit_sets: int
    head_vocab: int
    head_layer_passes: int
    head_mask_area: float  # additive mask elements kept for backward per row, in units of T^2


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per process."""

    processes: int
    stage: int
    target_weights: float
    head_weights: float
    gradients: float
    optimizer: float
    target_activations: float
    head_activations: float
    shapes: Shapes

    @property
    def total(self) -> float:
        return (
            self.target_weights
            + self.head_weights
            + self.gradients
            + self.optimizer
            + self.target_activations
            + self.head_activations
        )

    def summary(self) -> str:
        """A few lines for the console."""
        sh, mode = self.shapes, f"ZeRO-{self.stage}" if self.stage else "no ZeRO"
        return "\n".join(
            [
                f"memory plan per process ({self.processes} process{'es' if self.processes > 1 else ''}, "
                f"{mode}; activations are estimates, see spechead.training.memory_plan):",
                f"  target  {_num(sh.target_params)} params, {_gib(sh.target_bytes)} in all; "
                f"{_gib(self.target_weights)} here",
                f"  head    {_num(sh.head_params)} trainable, {_gib(self.head_weights)}; grads "
                f"{_gib(self.gradients)}; AdamW state {_gib(self.optimizer)}",
                f"  activations per micro-batch: target pass {_gib(self.target_activations)}, head "
                f"{_gib(self.head_activations)}",
                f"  total ~{_gib(self.total)}",
            ]
        )


def plan(
    sh: Shapes, *, processes: int, stage: int, deepspeed_mixed: bool, batch_size: int, seq_len: int
) -> MemoryPlan:
    """Per-process bytes for `sh` on `processes` processes at ZeRO `stage` (0 = DDP or one process)."""
    # ZeRO-1 partitions the optimizer states, ZeRO-2 the gradients too, ZeRO-3 the weights as well
    states_shard, grads_shard = (processes if stage >= 1 else 1), (processes if stage >= 2 else 1)
    target = sh.target_bytes / processes + sh.target_replica_bytes if stage == 3 else sh.target_bytes
    optimizer_per_param = 8 + (4 if deepspeed_mixed else 0)
    tokens = batch_size * seq_len
    layer = tokens * (4 * sh.hidden + 3 * sh.intermediate)  # elements of one decoder layer in flight
    target_act = 0
    if sh.runs_target:
        target_act = (sh.layers if sh.target_trained else 1) * layer + sh.captured * tokens * sh.hidden
        target_act += tokens * sh.vocab if sh.reads_logits or sh.target_trained else 0
    head_layer = tokens * (17 * sh.hidden + 4 * sh.intermediate)  # elements autograd keeps of one pass
    masks = tokens * seq_len * sh.head_mask_area  # (B, 1, queries, keys) per pass, summed
    head_act = (
        tokens * sh.head_logit_sets * sh.head_vocab * 8
        + (sh.head_layer_passes * head_layer + masks) * sh.head_element
    )
    return MemoryPlan(
        processes=processes,
        stage=stage,
        target_weights=target,
        head_weights=sh.head_bytes,
        gradients=sh.head_bytes / grads_shard,
        optimizer=sh.head_params * optimizer_per_param / states_shard,
        target_activations=target_act * sh.target_element,
        head_activations=head_act,
        shapes=sh,
    )


def over_device(plan: MemoryPlan, device_bytes: int | None) -> str:
    """A one-line warning when the plan's total exceeds the device's memory (None: not a GPU), else ""."""
    if device_bytes is None or plan.total <= device_bytes:
        return ""
    activations = plan.target_activations + plan.head_activations
    return (
        f"warning: the memory plan needs ~{_gib(plan.total)} per process ({_gib(activations)} of it "
        f"activations) and this GPU has {_gib(device_bytes)}: lower trainer.max_length (the head's masks grow "
        f"with its square) or trainer.batch_size, raise head.loss.partitions (P-EAGLE), or shard with ZeRO-3 "
        f"(accelerate launch --config_file configs/accelerate/zero3.yaml)"
    )


def numel(p: nn.Parameter) -> int:
    """Elements of a parameter, also when ZeRO-3 has partitioned it."""
    return int(getattr(p, "ds_numel", p.numel()))


def count(modules: list[nn.Module], trainable_only: bool = False) -> tuple[int, int]:
    """(parameters, bytes in their dtypes) of `modules`, each shared parameter once."""
    seen = {id(p): p for m in modules for p in m.parameters() if p.requires_grad or not trainable_only}
    return sum(numel(p) for p in seen.values()), sum(numel(p) * p.element_size() for p in seen.values())


def from_run(
    target,
    objective: Objective,
    *,
    processes: int,
    stage: int,
    mixed_precision: str,
    batch_size: int,
    seq_len: int,
) -> MemoryPlan:
    """The plan for a loaded target (FrozenTarget, its ZeRO-3 form, or an offline CachedTarget) and head."""
    runs_target = isinstance(target, FrozenTarget)
    target_modules = [target.model] if runs_target else [target.embed_tokens, target.lm_head]
    target_params, target_bytes = count(target_modules)
    replica = count([target.embed_tokens, target.lm_head])[1] if stage == 3 else 0
    head_params, head_bytes = count([objective.module()], trainable_only=True)
    deepspeed_mixed = stage > 0 and mixed_precision in ("bf16", "fp16")
    if deepspeed_mixed:  # DeepSpeed trains 16-bit weights (fp32 masters live in the optimizer state)
        head_bytes = head_params * 2
    text = (target.model if runs_target else target).config.get_text_config()
    target_element = next(target_modules[0].parameters()).element_size()
    work = objective.work()
    shapes = Shapes(
        target_params=target_params,
        target_bytes=target_bytes,
        target_replica_bytes=replica,
        head_params=head_params,
        head_bytes=head_bytes,
        hidden=target.hidden_size,
        intermediate=int(getattr(text, "intermediate_size", 4 * target.hidden_size)),
        layers=target.num_layers,
        vocab=target.vocab_size,
        target_element=target_element,
        head_element=2 if deepspeed_mixed else 4,
        captured=len(objective.layers),
        reads_logits=objective.needs_logits,
        target_trained=runs_target and any(p.requires_grad for p in target.model.parameters()),
        runs_target=runs_target,
        head_logit_sets=work.logit_sets,
        head_vocab=work.vocab,
        head_layer_passes=work.layer_passes,
        head_mask_area=work.mask_area,
    )
    return plan(
        shapes,
        processes=processes,
        stage=stage,
        deepspeed_mixed=deepspeed_mixed,
        batch_size=batch_size,
        seq_len=seq_len,
    )


def _num(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:,.2f}{unit}"
    return str(n)


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB" if n >= GiB / 100 else f"{n / 1024**2:,.2f} MiB"
