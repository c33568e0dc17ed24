"""The frozen target under ZeRO-3: its parameters sharded across processes, for inference only.

The target is loaded inside `deepspeed.zero.Init` (transformers does that while a HfDeepSpeedConfig is
alive), so each process only ever holds its 1/N slice of every large parameter: a 70B target never
materialises on one GPU. The slices keep the target's dtype (`model.dtype`), whatever the head's mixed
precision. A DeepSpeed engine with no optimizer then gathers each layer's parameters just before it
runs and frees them after ("ZeRO-Inference"); the target is never given an optimizer and never
checkpointed.

Heads also read the target's lm_head and input embedding directly (EAGLE logits, EAGLE-3 embeddings,
initialisation from lm_head). Sharded parameters are empty outside the target's own forward, so those
two modules are gathered once into whole replicas on every process (2 x vocab x hidden in the target
dtype). The head itself trains under ZeRO-2 (see spechead.training.zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import deepspeed
import torch
from accelerate import Accelerator
from torch import nn
from transformers.integrations import HfDeepSpeedConfig
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from spechead.training.errors import TrainError
from spechead.training.settings import TrainSettings
from spechead.training.target import DTYPES, Captured, FrozenTarget, load_target
from spechead.training.zero import HEAD_STAGE_UNDER_ZERO3

DTYPE_FLAGS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def full_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's real shape, also when ZeRO-3 has partitioned it (then `.shape` is empty)."""
    return getattr(param, "ds_shape", param.shape)


def replicate(module: nn.Module) -> nn.Module:
    """A whole, frozen copy of a (possibly ZeRO-3 sharded) nn.Linear or nn.Embedding, on every process."""
    if not isinstance(module, (nn.Embedding, nn.Linear)):
        raise TrainError(
            f"ZeRO-3: cannot replicate the target's {type(module).__name__} (an nn.Linear or nn.Embedding "
            "is expected for lm_head and embed_tokens); use a ZeRO-2 config for this target"
        )
    weight = module.weight
    rows, cols = full_shape(weight)
    where = {"device": weight.device, "dtype": weight.dtype}
    if isinstance(module, nn.Embedding):
        copy: nn.Module = nn.Embedding(rows, cols, padding_idx=module.padding_idx, **where)
    else:
        copy = nn.Linear(cols, rows, bias=module.bias is not None, **where)
    params = list(module.parameters(recurse=False))
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        with torch.no_grad():
            for mine, theirs in zip(copy.parameters(), params):
                mine.copy_(theirs)
    return copy.eval().requires_grad_(False)


def inference_config(
    zero3: dict[str, Any], batch_size: int, num_processes: int, dtype: torch.dtype
) -> dict[str, Any]:
    """A complete DeepSpeed config for loading and running the target as a ZeRO-3 inference engine.

    `zero3` is the launch's `zero_optimization` section; "auto" entries are dropped (DeepSpeed's
    defaults), and so is the optimizer offload. bf16/fp16 follow the target's dtype, never the head's
    mixed precision: zero.Init converts every parameter it partitions to that dtype.
    """
    zero = {k: v for k, v in zero3.items() if k != "offload_optimizer" and v != "auto"}
    zero["stage"] = 3
    flag = DTYPE_FLAGS.get(dtype)
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": batch_size * num_processes,
        "zero_optimization": zero,
        "bf16": {"enabled": flag == "bf16"},
        "fp16": {"enabled": flag == "fp16"},
    }


class ShardedTarget(FrozenTarget):
    """A FrozenTarget whose parameters are ZeRO-3 partitioned; every process must call `capture` together."""

    def __init__(self, model: nn.Module, name_or_path: str, engine_config: dict[str, Any]):
        super().__init__(model, name_or_path)
        self.vocab_size = full_shape(model.get_output_embeddings().weight)[0]
        self._lm_head = replicate(model.get_output_embeddings())
        self._embed_tokens = replicate(model.get_input_embeddings())
        # The engine installs the gather/release hooks on the model's modules; we keep calling the model.
        self.engine, *_ = deepspeed.initialize(model=self.model, config=engine_config)
        self.model.eval()

    @property
    def lm_head(self) -> nn.Module:
        return self._lm_head

    @property
    def embed_tokens(self) -> nn.Module:
        return self._embed_tokens

    def to(self, device: torch.device | str) -> ShardedTarget:
        return self  # DeepSpeed places the shards

    def capture(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        layers: Sequence[int],
        with_logits: bool = False,
    ) -> Captured:
        """As FrozenTarget.capture, but always through the whole model: ZeRO-3's gather hooks start at
        the root module's forward (the lm_head costs little next to the layers of a large target)."""
        cap = super().capture(input_ids, attention_mask, layers, with_logits=True)
        return cap if with_logits else Captured(cap.hidden, None)


def load_sharded_target(s: TrainSettings, accelerator: Accelerator) -> ShardedTarget:
    """Load `s.model` already partitioned across the processes (deepspeed.zero.Init) as a ZeRO-3
    inference target, then switch the launch's DeepSpeed config to ZeRO-2 for the head prepared next."""
    plugin = accelerator.state.deepspeed_plugin
    config = inference_config(
        plugin.deepspeed_config["zero_optimization"],
        s.trainer.batch_size,
        accelerator.num_processes,
        DTYPES[s.model.dtype],
    )
    # transformers runs from_pretrained inside zero.Init with the config of the live HfDeepSpeedConfig.
    loading = HfDeepSpeedConfig(config)
    try:
        target = load_target(s.model, accelerator.device)
    finally:
        unset_hf_deepspeed_config()  # the head built next is an ordinary module
        del loading
    zero = plugin.deepspeed_config["zero_optimization"]
    zero["stage"] = HEAD_STAGE_UNDER_ZERO3
    for key in [k for k in zero if k.startswith("stage3_") or k == "offload_param"]:
        del zero[key]
    return ShardedTarget(target.model, target.name_or_path, config)
