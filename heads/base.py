"""Base class, config and safetensors save/load shared by every draft-head family.

Layer-index convention: a head reads the target's hidden states by the indices of HF
`output_hidden_states` (L = number of decoder layers):
  0     = token embeddings,
  i     = output of decoder layer i-1 (pre-norm), for 1 <= i < L,
  L, -1 = final hidden state AFTER the final norm (exactly what the target's lm_head sees).
The last layer's pre-norm output is not in `output_hidden_states`; it needs a forward hook.
Configs store resolved, non-negative indices whenever the target's layer count is known, because a
saved "-1" would silently mean a different state on a target with another depth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from spechead.heads.directory import CONFIG_NAME, WEIGHTS_NAME, drop_tree, read_config, resolve, write_config
from spechead.heads.errors import HeadError
from spechead.heads.files import umask_mode

FORMAT_VERSION = 1


def resolve_layers(layers: list[int], num_layers: int) -> list[int]:
    """Map HF hidden-state indices (negative counts from L+1, like Python) to 0..num_layers."""
    if num_layers <= 0:
        raise HeadError(f"a target must have at least one layer, got num_layers={num_layers}")
    resolved = []
    for index in layers:
        if isinstance(index, bool) or not isinstance(index, int):
            raise HeadError(f"layer indices must be ints, got {index!r} in {layers!r}")
        value = index + num_layers + 1 if index < 0 else index
        if not 0 <= value <= num_layers:
            raise HeadError(
                f"layer index {index} does not exist in a target with {num_layers} layers: valid "
                f"hidden-state indices are 0..{num_layers} (or {-(num_layers + 1)}..-1), "
                f"where {num_layers} is the final normed state"
            )
        resolved.append(value)
    return resolved


@dataclass(kw_only=True)
class HeadConfig:
    """Fields common to every head. `vocab_size` and `hidden_size` are the TARGET's sizes."""

    family: ClassVar[str] = ""

    hidden_size: int
    vocab_size: int
    target_layers: list[int]
    target_name_or_path: str = ""
    target_num_layers: int = 0  # 0 = unknown; then target_layers may stay negative
    target_architecture: str = ""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise HeadError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.target_num_layers < 0:
            raise HeadError(f"target_num_layers must be >= 0 (0 = unknown), got {self.target_num_layers}")
        self.target_layers = list(self.target_layers)
        if not self.target_layers:
            raise HeadError("target_layers is empty: a head must read at least one target hidden state")
        if self.target_num_layers:
            self.target_layers = resolve_layers(self.target_layers, self.target_num_layers)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the config fields (the family is not a field: save_pretrained adds it)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HeadConfig:
        """Build from a dict, rejecting keys this config does not know."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - known)
        if unknown:
            raise HeadError(
                f"unknown {cls.__name__} keys {unknown} (known: {sorted(known)}): the head was saved by "
                "another spechead version or the config was edited by hand; remove those keys"
            )
        try:
            return cls(**data)
        except TypeError as err:  # missing required fields
            raise HeadError(f"invalid {cls.__name__}: {err}") from err


_REGISTRY: dict[str, type[DraftHead]] = {}


def register_head(cls: type[DraftHead]) -> type[DraftHead]:
    """Class decorator: make `load_head` able to rebuild heads of `cls.family`."""
    if not cls.family or cls.family != cls.config_class.family:
        raise TypeError(f"{cls.__name__}.family must be non-empty and equal its config_class.family")
    existing = _REGISTRY.get(cls.family)
    # Re-running the defining module (importlib.reload, notebooks) re-registers the same class name.
    if existing is not None and (existing.__module__, existing.__qualname__) != (
        cls.__module__,
        cls.__qualname__,
    ):
        raise ValueError(f"head family {cls.family!r} is already registered by {existing.__qualname__}")
    _REGISTRY[cls.family] = cls
    return cls


def head_class(family: str) -> type[DraftHead]:
    """The registered head class of `family` (HeadError listing the known ones otherwise)."""
    if family not in _REGISTRY:
        raise HeadError(f"unknown head family {family!r}: known families are {known_families()}")
    return _REGISTRY[family]


def known_families() -> list[str]:
    """Families that `load_head` can rebuild."""
    return sorted(_REGISTRY)


class DraftHead(nn.Module):
    """Base of every head family: config, target checks, shared target modules, save/load."""

    config_class: ClassVar[type[HeadConfig]] = HeadConfig
    family: ClassVar[str] = ""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        if not isinstance(config, self.config_class):
            raise HeadError(
                f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}"
            )
        self.config = config
        # Frozen target modules (lm_head, embed_tokens) are kept as plain references, NOT submodules:
        # a registered module would land in state_dict (saving GBs of target weights with every head),
        # in parameters() (the optimizer and weight decay would touch the frozen target), in DDP's
        # gradient sync, and would be cast by head.to(dtype). A plain dict hides them from nn.Module.
        self._target_modules: dict[str, nn.Module] = {}

    # ---- frozen target modules ---------------------------------------------------------------

    def attach_target_modules(
        self, lm_head: nn.Module | None = None, embed_tokens: nn.Module | None = None
    ) -> None:
        """Share the target's frozen lm_head / embed_tokens by reference (None leaves one as is)."""
        for name, module in (("lm_head", lm_head), ("embed_tokens", embed_tokens)):
            if module is None:
                continue
            weight = getattr(module, "weight", None)
            expected = (self.config.vocab_size, self.config.hidden_size)
            if isinstance(weight, torch.Tensor) and tuple(weight.shape) != expected:
                raise HeadError(
                    f"target {name} has weight shape {tuple(weight.shape)} but the head expects "
                    f"(vocab_size, hidden_size) = {expected}: attach the modules of the head's own target"
                )
            self._target_modules[name] = module

    def _target_module(self, name: str, getter: str) -> nn.Module:
        if name not in self._target_modules:
            raise HeadError(
                f"no target {name} attached to this {type(self).__name__}: call "
                f"head.attach_target_modules({name}=target.{getter}()) after loading the target"
            )
        return self._target_modules[name]

    @property
    def target_lm_head(self) -> nn.Module:
        """The attached frozen target lm_head (HeadError if none)."""
        return self._target_module("lm_head", "get_output_embeddings")

    @property
    def target_embed_tokens(self) -> nn.Module:
        """The attached frozen target embedding (HeadError if none)."""
        return self._target_module("embed_tokens", "get_input_embeddings")

    @property
    def input_embeddings(self) -> nn.Module:
        """The embedding `embed` reads: the head's own `embed_tokens` submodule where it has one (a head
        that trains and ships its own, e.g. Eagle3Config.own_embedding), else the attached target's."""
        own = self._modules.get("embed_tokens")
        return own if own is not None else self.target_embed_tokens

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> embeddings (B, T, H) in the head's dtype: the head's own (trained with it)
        where it has one, else the frozen target's (no grad)."""
        own = self._modules.get("embed_tokens")
        if own is not None:
            return own(ids)
        with torch.no_grad():
            return self.target_embed_tokens(ids).to(next(self.parameters()).dtype)

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        """Raise HeadError unless this head fits a target of these sizes and depth."""
        cfg = self.config
        trained = f" (it was trained on {cfg.target_name_or_path})" if cfg.target_name_or_path else ""
        fix = "load the head trained for this target"
        for name, mine, theirs in (
            ("hidden_size", cfg.hidden_size, hidden_size),
            ("vocab_size", cfg.vocab_size, vocab_size),
        ):
            if mine != theirs:
                raise HeadError(f"head expects {name} {mine}{trained} but the target has {theirs}: {fix}")
        if cfg.target_num_layers and cfg.target_num_layers != num_layers:
            raise HeadError(
                f"head was trained on a target with {cfg.target_num_layers} layers{trained} but this "
                f"target has {num_layers}, so its layer indices {cfg.target_layers} would read other states: {fix}"
            )
        resolve_layers(cfg.target_layers, num_layers)

    # ---- save / load -------------------------------------------------------------------------

    def save_pretrained(self, path: str | Path) -> Path:
        """Write config.json and model.safetensors (the head's own weights only) into `path`; a tree.json
        left there by earlier weights is removed (`scripts/build_tree.py` measures one for these)."""
        if any(type(m).__name__ == "Fp8Linear" for m in self.modules()):  # (heads/fp8.py: decoding only)
            raise ValueError(
                "this head has FP8 drafting layers (to_fp8 / draft_fp8): save the head as trained"
            )
        if any(type(m).__name__ == "Int8Linear" for m in self.modules()):  # (heads/int8.py: decoding only)
            raise ValueError(
                "this head has int8 drafting layers (to_int8 / draft_int8): save the head as trained"
            )
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        drop_tree(path)
        # save_model stores tied tensors once (load_model re-ties them); attached target modules are
        # not submodules, so they are never in the file.
        save_model(self, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
        umask_mode(path / WEIGHTS_NAME)  # safetensors writes 0600 (heads/files.py)
        config = {
            "family": self.family,
            "spechead_version": _spechead_version(),
            "format_version": FORMAT_VERSION,
        }
        config.update(self.config.to_dict())
        write_config(path, config)
        return path

    @classmethod
    def from_pretrained(
        cls,
        path_or_hub_id: str | Path,
        *,
        revision: str | None = None,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | None = None,
    ) -> DraftHead:
        """Load a head saved by save_pretrained from a local directory or a Hub repo (eval mode)."""
        directory = resolve(path_or_hub_id, revision)
        foreign = _import_foreign(
            directory, path_or_hub_id, revision, family=cls.family, device=device, dtype=dtype
        )
        if foreign is not None:
            return foreign
        raw = read_config(directory)
        family = raw.pop("family")
        if not cls.family:  # DraftHead.from_pretrained: dispatch on the saved family
            return _registered(family, directory).from_pretrained(directory, device=device, dtype=dtype)
        if family != cls.family:
            raise HeadError(
                f"{directory} holds a {family!r} head, not {cls.family!r}: "
                f"use load_head() or the {family} head class"
            )
        fmt = raw.pop("format_version", None)
        if not isinstance(fmt, int) or fmt > FORMAT_VERSION:
            raise HeadError(
                f"{directory} has format_version {fmt!r}; this spechead reads <= {FORMAT_VERSION}: upgrade spechead"
            )
        raw.pop("spechead_version", None)
        config = cls.config_class.from_dict(raw)
        head = cls(config)
        _load_weights(head, directory / WEIGHTS_NAME, device)
        if dtype is not None:
            head.to(dtype=dtype)  # casts floating tensors only; integer buffers keep their dtype
        return head.eval()


def load_head(path_or_hub_id: str | Path, **kwargs: Any) -> DraftHead:
    """Load any registered head family from a local directory or Hub repo (kwargs as from_pretrained).

    Heads published in a reference project's layout are converted on the fly (spechead.heads.formats);
    `target_config=target.config` and `target_tokenizer=tokenizer` fill what such a layout leaves implicit
    (EAGLE-3's default layers, a z-lab DFlash drafter's mask token; ignored for spechead heads).
    """
    revision, target_config = kwargs.pop("revision", None), kwargs.pop("target_config", None)
    target = {"target_config": target_config, "target_tokenizer": kwargs.pop("target_tokenizer", None)}
    directory = resolve(path_or_hub_id, revision)
    foreign = _import_foreign(directory, path_or_hub_id, revision, **target, **kwargs)
    if foreign is not None:
        return foreign
    family = read_config(directory)["family"]
    return _registered(family, directory).from_pretrained(directory, **kwargs)


# The converter of heads in other projects' layouts (spechead.heads.formats.load_foreign): the formats
# package builds on this module, so it plugs itself in here when imported (spechead.heads imports it,
# hence before any head loads) instead of this module importing it (tests/test_import_cycles.py).
_FOREIGN: list[Callable[..., DraftHead | None]] = []


def register_foreign_loader(load: Callable[..., DraftHead | None]) -> None:
    """Make `load` (directory, *, source, revision, **from_pretrained's kwargs) -> head or None the
    converter `load_head` and `from_pretrained` try first (spechead.heads.formats registers its own)."""
    _FOREIGN[:] = [load]


def _import_foreign(
    directory: Path, source: str | Path, revision: str | None, **kwargs: Any
) -> DraftHead | None:
    """The head converted from another project's layout (EAGLE, EAGLE-3, speculators, DFlash, Medusa), else None."""
    if not _FOREIGN:  # (spechead.heads imports spechead.heads.formats, which registers it)
        raise RuntimeError("loading a head needs spechead.heads.formats imported")
    return _FOREIGN[0](directory, source=source, revision=revision, **kwargs)


def _registered(family: str, directory: Path) -> type[DraftHead]:
    if family not in _REGISTRY:
        raise HeadError(
            f"unknown head family {family!r} in {directory / CONFIG_NAME}: known families are "
            f"{known_families()}; upgrade spechead or import the module that registers it"
        )
    return _REGISTRY[family]


def _spechead_version() -> str:
    try:
        return metadata.version("spechead")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _load_weights(head: nn.Module, file: Path, device: torch.device | str | int | None) -> None:
    """Fill `head` from safetensors (never pickle); missing, unexpected or misshapen weights are errors."""
    if not file.is_file():
        raise HeadError(f"{file.parent} has no {WEIGHTS_NAME}: save the head with save_pretrained")
    if device is not None:
        head.to(device)
    try:
        missing, unexpected = load_model(
            head, str(file), strict=False, device=str(torch.device(device or "cpu"))
        )
    except RuntimeError as err:  # shape mismatches
        raise HeadError(f"{file} does not match its config.json: {str(err).strip()}") from err
    except Exception as err:  # safetensors raises its own error type for corrupt files
        raise HeadError(f"could not read {file}: {err}") from err
    if missing or unexpected:
        raise HeadError(
            f"{file} does not match its config.json: missing weights {sorted(missing)[:8]}, "
            f"unexpected weights {sorted(unexpected)[:8]}; re-save the head with save_pretrained"
        )
