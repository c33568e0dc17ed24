"""A stand-in for FrozenTarget when training from a hidden-state cache: no decoder layers loaded.

Only the target's input embedding and lm_head are built (on the meta device, then filled with just
their tensors read from the target's safetensors files): heads embed tokens with the first and
read logits through the second. `capture_batch` returns the states the cache put in the batch, and
the target's logits as lm_head(final normed state): the cache stores that state (H values per token)
instead of logits (V values), and the builder checked that it reproduces the target's logits.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.utils.hub import cached_file

from spechead.heads.base import resolve_layers
from spechead.training.errors import TrainError
from spechead.training.target import DTYPES, Captured, TargetConfig


def _file(cfg: TargetConfig, name: str) -> str | None:
    try:
        return cached_file(cfg.path, name, revision=cfg.revision, _raise_exceptions_for_missing_entries=False)
    except OSError as err:
        raise TrainError(f"model.path={cfg.path!r}: cannot read {name} ({err})") from None


def weight_files(cfg: TargetConfig) -> dict[str, str]:
    """{tensor name: local safetensors file} of the target (sharded or single-file checkpoints)."""
    index = _file(cfg, "model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(open(index).read())["weight_map"]
        files = {name: _file(cfg, name) for name in sorted(set(weight_map.values()))}
        return {key: files[name] for key, name in weight_map.items()}
    single = _file(cfg, "model.safetensors")
    if single is None:
        raise TrainError(
            f"model.path={cfg.path!r} has no safetensors weights: offline training reads the embedding "
            "and lm_head from model.safetensors(.index.json); use data.hidden_states=online"
        )
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def load_modules(
    cfg: TargetConfig, config: PretrainedConfig, device: torch.device | str
) -> tuple[nn.Module, nn.Module]:
    """(input embedding, lm_head) of the target with their checkpoint weights, nothing else loaded."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.trust_remote_code)
    files = weight_files(cfg)
    embed, head = skeleton.get_input_embeddings(), skeleton.get_output_embeddings()
    tied = getattr(config.get_text_config(), "tie_word_embeddings", False)
    out = []
    for module in (embed, head):
        prefix = _module_name(skeleton, module) + "."
        state = {}
        for key in module.state_dict():
            name = prefix + key
            if name not in files and module is head and tied:
                name = _module_name(skeleton, embed) + "." + key  # tied: lm_head reuses the embedding
            if name not in files:
                raise TrainError(
                    f"the target checkpoint has no tensor {name!r}: offline training cannot load its "
                    "embedding/lm_head; use data.hidden_states=online"
                )
            with safe_open(files[name], framework="pt", device="cpu") as f:
                state[key] = f.get_tensor(name).to(DTYPES[cfg.dtype])
        module.load_state_dict(state, assign=True)
        left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        if left:
            raise TrainError(
                f"{type(module).__name__} of the target has state not in its checkpoint ({left[0]}): "
                "offline training does not support this architecture; use data.hidden_states=online"
            )
        out.append(module.to(device).eval().requires_grad_(False))
    return out[0], out[1]


class CachedTarget:
    """What objectives use of a FrozenTarget (sizes, embed_tokens, lm_head, capture_batch), cache-backed.

    `layers` lists the stored hidden-state indices in the order of batch["hidden_states"] (S, B, T, H);
    it includes num_layers, the final normed state that gives the logits.
    """

    def __init__(
        self, config: PretrainedConfig, embed: nn.Module, lm_head: nn.Module, name: str, layers: Sequence[int]
    ):
        text = config.get_text_config()
        self.config = config
        self.name_or_path = name
        self.num_layers: int = text.num_hidden_layers
        self.hidden_size: int = text.hidden_size
        self.vocab_size: int = lm_head.weight.shape[0]
        self.architecture: str = (config.architectures or ["?"])[0]
        self._embed, self._lm_head = embed, lm_head
        self.layers = list(layers)
        if self.num_layers not in self.layers:
            raise TrainError("the cache lacks the final hidden state: rebuild it")

    @property
    def lm_head(self) -> nn.Module:
        return self._lm_head

    @property
    def embed_tokens(self) -> nn.Module:
        return self._embed

    @property
    def model(self) -> nn.Module:
        raise TrainError(
            "this step needs the full target, but data.hidden_states=offline loads only its embedding and "
            "lm_head: turn that step off or train with data.hidden_states=online"
        )

    def to(self, device: torch.device | str) -> CachedTarget:
        self._embed.to(device)
        self._lm_head.to(device)
        return self

    @torch.no_grad()
    def capture_batch(self, batch: dict, layers: Sequence[int], with_logits: bool = False) -> Captured:
        """The cached states at `layers` (each (B, T, H)) and, if asked, logits (B, T, V)."""
        stored = batch["hidden_states"]  # (S, B, T, H)
        picked = [stored[self.layers.index(i)] for i in resolve_layers(list(layers), self.num_layers)]
        logits = None
        if with_logits:
            final = stored[self.layers.index(self.num_layers)]
            logits = self._lm_head(final.to(self._lm_head.weight.dtype))  # (B, T, V)
        return Captured(hidden=picked, logits=logits)


def load_cached_target(cfg: TargetConfig, layers: Sequence[int], device: torch.device | str) -> CachedTarget:
    """A CachedTarget for `cfg` reading states stored at `layers` (see CachedTarget)."""
    try:
        config = AutoConfig.from_pretrained(
            cfg.path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise TrainError(f"model.path={cfg.path!r}: cannot read its config ({err})") from None
    embed, lm_head = load_modules(cfg, config, device)
    return CachedTarget(config, embed, lm_head, cfg.path, layers)
