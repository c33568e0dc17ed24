"""Load the frozen target model and capture exactly the hidden states a head needs.

Layer indices follow Hugging Face `output_hidden_states` (see spechead.heads.capture, shared with
inference so training and decoding read exactly the same states).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.integrations import is_deepspeed_zero3_enabled

from spechead.heads.attention import NAME as TREE_SDPA  # (registers it with transformers)
from spechead.heads.attention import runs_sdpa
from spechead.heads.base import resolve_layers
from spechead.heads.capture import capture_hidden
from spechead.heads.dtypes import DTYPES
from spechead.training.errors import TrainError

# "auto": sdpa where the target's class runs it, else eager (Gemma-2's soft-capping, GPT-OSS's sinks).
ATTENTION = ("auto", "eager", "sdpa", TREE_SDPA, "flash_attention_2", "flash_attention_3", "flex_attention")


@dataclass
class TargetConfig:
    """Which target to load and how (the `model` config group)."""

    name: str = "demo"
    path: str = ""  # local directory or Hub id
    dtype: str = "float32"  # float32 | bfloat16 | float16
    attn_implementation: str = "auto"
    revision: str | None = None
    trust_remote_code: bool = False
    chat_template: str | None = None  # a Jinja template or a path to a .jinja file; None = the tokenizer's

    def __post_init__(self) -> None:
        if not self.path:
            raise TrainError(
                "model.path is empty: set model.path=DIR_OR_HUB_ID or pick a preset (model=demo)"
            )
        if self.dtype not in DTYPES:
            raise TrainError(f"model.dtype={self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.attn_implementation not in ATTENTION:
            raise TrainError(
                f"model.attn_implementation={self.attn_implementation!r} is not one of {list(ATTENTION)}"
            )


@dataclass
class Captured:
    """What one target pass yields: `hidden[i]` (B, T, H) per requested layer, optional logits (B, T, V)."""

    hidden: list[torch.Tensor]
    logits: torch.Tensor | None


def _load_error(path: str, err: Exception) -> TrainError:
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if Path(path).expanduser().exists():
        return TrainError(f"model.path={path!r} exists but could not be loaded as a model: {reason}")
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        return TrainError(
            f"model.path={path!r}: no such directory; set model.path to a model directory or Hub id"
        )
    return TrainError(
        f"model.path={path!r} is not a local directory and could not be loaded from the Hub ({reason}); "
        "check the id, log in with `hf auth login`, or set model.path=DIR"
    )


def _target_config(cfg: TargetConfig):
    """The target's transformers config, or None when it cannot be read here (loading then says why)."""
    try:
        return AutoConfig.from_pretrained(
            cfg.path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError):
        return None


def attention_for(cfg: TargetConfig) -> str:
    """The attention implementation to load `cfg.path` with: `cfg.attn_implementation`, where "auto" is
    sdpa when the target's class runs it and eager otherwise. TrainError, in one line, when sdpa is asked
    for a class that cannot run it."""
    wanted = cfg.attn_implementation
    if wanted not in ("auto", "sdpa", TREE_SDPA):
        return wanted
    config = _target_config(cfg)
    if config is None or runs_sdpa(config):
        return "sdpa" if wanted == "auto" else wanted
    if wanted == "auto":
        return "eager"
    raise TrainError(
        f"model.attn_implementation={wanted}: transformers cannot run {type(config).__name__} "
        f"({config.model_type}) with sdpa attention (soft-capped or sink attention); set "
        "model.attn_implementation=auto (eager for it) or eager"
    )


def load_tokenizer(cfg: TargetConfig) -> PreTrainedTokenizerBase:
    """The target's tokenizer, with `cfg.chat_template` applied when given."""
    try:
        tok = AutoTokenizer.from_pretrained(
            cfg.path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise _load_error(cfg.path, err) from None
    if cfg.chat_template:
        template = Path(cfg.chat_template)
        tok.chat_template = template.read_text() if template.suffix == ".jinja" else cfg.chat_template
    if tok.pad_token_id is None:
        # Padding positions are masked out everywhere; any id works, eos is the usual choice.
        tok.pad_token = tok.eos_token
    return tok


class FrozenTarget:
    """A causal LM in eval mode with no gradients, plus hooks that capture selected hidden states."""

    def __init__(self, model: PreTrainedModel, name_or_path: str):
        self.model = model.eval().requires_grad_(False)
        self.name_or_path = name_or_path
        self.decoder = model.get_decoder()
        cfg = model.config.get_text_config()
        self.num_layers: int = cfg.num_hidden_layers
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        self.architecture: str = (model.config.architectures or [type(model).__name__])[0]

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def config(self):
        """The target's transformers config."""
        return self.model.config

    def to(self, device: torch.device | str) -> FrozenTarget:
        self.model.to(device)
        return self

    @torch.no_grad()
    def capture(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        layers: Sequence[int],
        with_logits: bool = False,
    ) -> Captured:
        """Run the target on (B, T) ids; return the states at `layers` (each (B, T, H)) and logits."""
        layers = resolve_layers(list(layers), self.num_layers)
        # Without logits, run the decoder only: the lm_head over a 128k vocab is the costly part.
        runner = self.model if with_logits else self.decoder
        with capture_hidden(self.model, layers) as grabbed:
            out = runner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return Captured(hidden=[grabbed[i] for i in layers], logits=out.logits if with_logits else None)

    def capture_batch(self, batch: dict, layers: Sequence[int], with_logits: bool = False) -> Captured:
        """`capture` on a collated batch (input_ids, attention_mask (B, T)); CachedTarget reads a cache."""
        return self.capture(batch["input_ids"], batch["attention_mask"], layers, with_logits)


def load_target(cfg: TargetConfig, device: torch.device | str = "cpu") -> FrozenTarget:
    """Load `cfg.path` (local dir or Hub id) as a frozen causal LM on `device`."""
    # Each process loads straight onto its device, shard by shard (not a whole copy per process staged in
    # host memory: 8 ranks x an 8B target is 128 GB of host memory); under ZeRO-3's zero.Init the
    # partitioning places the weights, and transformers refuses a device_map there.
    placed = {} if is_deepspeed_zero3_enabled() else {"device_map": torch.device(device)}
    attention = attention_for(cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            cfg.path,
            revision=cfg.revision,
            dtype=DTYPES[cfg.dtype],
            attn_implementation=attention,
            trust_remote_code=cfg.trust_remote_code,
            **placed,
        )
    except (OSError, ValueError) as err:
        raise _load_error(cfg.path, err) from None
    return FrozenTarget(model, cfg.path).to(device)
