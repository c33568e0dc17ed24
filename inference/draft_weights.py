"""How `from_pretrained` quantizes a head's draft weights (`draft_fp8`, `draft_int8`: the "auto" defaults
and the checks). Either only changes which tokens are proposed: the target verifies every one, so decoding
stays lossless. FP8 e4m3 (heads/fp8.py): an EAGLE / EAGLE-3 head's per-depth layers, by default on a GPU
with FP8 tensor cores; int8 (heads/int8.py) on a CPU: a Medusa head's projections by default, EAGLE heads
when asked. Measured: docs/PERFORMANCE.md.
"""

from __future__ import annotations

import copy
from typing import TypeGuard

import torch
from torch import nn

from spechead.heads import DraftHead, MedusaHead
from spechead.heads.fp8 import per_depth_linears, to_fp8
from spechead.heads.int8 import K_MULTIPLE, int8_linears, to_int8

AUTO = "auto"
# the compute capability FP8 tensor cores start at (Ada 8.9, Hopper 9.0)
FP8_CAPABILITY = (8, 9)
# CPUs whose torch int8 kernels the default was measured on; elsewhere (AVX2, ARM) `_weight_int8pack_mm`
# runs other, unmeasured code: draft_int8=True asks for it
INT8_AUTO_CPUS = ("AVX512",)


def _asked(value: bool | str) -> bool:
    """Whether a setting asks for the quantization outright (not "auto")."""
    return value != AUTO and bool(value)


def has_fp8_tensor_cores(device: torch.device) -> bool:
    """Whether `device` is a GPU of compute capability FP8_CAPABILITY or later."""
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY
    )


def check_draft_settings(draft_fp8: bool | str, draft_int8: bool | str, device: str | torch.device) -> None:
    """ValueError (one line, before anything loads) unless each setting is "auto", True or False and what
    it asks for runs on `device`: FP8 on a GPU with FP8 tensor cores or a CPU (emulated), int8 on a CPU
    (its weight-only int8 GEMM is a CPU kernel) and not beside FP8 (one quantization per layer)."""
    for name, value in (("draft_fp8", draft_fp8), ("draft_int8", draft_int8)):
        if value not in (AUTO, True, False, 0, 1):
            raise ValueError(f"{name} takes auto, True or False, got {value!r}")
    fp8, int8 = _asked(draft_fp8), _asked(draft_int8)
    if not (fp8 or int8):
        return
    where = torch.device(device)  # (only when asked: else a bad name is loading's check_device line)
    if fp8 and where.type == "cuda" and not has_fp8_tensor_cores(where):
        name = torch.cuda.get_device_name(where) if torch.cuda.is_available() else str(where)
        raise ValueError(
            f"draft_fp8 needs FP8 tensor cores (compute capability >= 8.9); {name} has none: drop draft_fp8"
        )
    if int8 and fp8:
        raise ValueError(
            "draft_int8 and draft_fp8 both quantize the draft: pick one (int8 on a CPU, FP8 on a GPU)"
        )
    if int8 and where.type != "cpu":
        raise ValueError(f"draft_int8 runs on a CPU, not {where}: on a GPU use draft_fp8")


def fp8_by_default(head: object, device: torch.device) -> bool:
    """Whether draft_fp8="auto" puts `head` in FP8 on `device`: a head with a per-depth layer FP8 can take
    (`per_depth_linears`: an EAGLE / EAGLE-3 head's; features multiples of 16) on a GPU with FP8 tensor
    cores."""
    if not (isinstance(head, nn.Module) and has_fp8_tensor_cores(device)):
        return False
    layers = [getattr(parent, name) for parent, name in per_depth_linears(head)]
    return any(x.in_features % 16 == 0 and x.out_features % 16 == 0 for x in layers)  # (`to_fp8`'s rule)


def int8_by_default(head: object, device: torch.device) -> TypeGuard[MedusaHead]:
    """Whether draft_int8="auto" puts `head` in int8 on `device`: a Medusa head with projections of its
    own on a CPU of `INT8_AUTO_CPUS` (there its draft is bound by the bytes it reads: heads/int8.py)."""
    return (
        device.type == "cpu"
        and torch.backends.cpu.get_cpu_capability() in INT8_AUTO_CPUS
        and isinstance(head, MedusaHead)
        and any(getattr(parent, name).in_features % K_MULTIPLE == 0 for parent, name in int8_linears(head))
    )


def quantize_draft(
    head: object, device: torch.device, draft_fp8: bool | str, draft_int8: bool | str, drafter: object
) -> str | None:
    """Quantize `head`'s draft layers in place as the settings say (module doc), on `device`; returns
    "fp8", "int8" or None. ValueError (one line) when a setting asks for what `head` does not have."""
    module = head if isinstance(head, nn.Module) else nn.Module()  # (a drafter without a head: nothing)
    if draft_fp8 == AUTO:
        fp8 = not _asked(draft_int8) and fp8_by_default(module, device) and to_fp8(module) > 0
    elif draft_fp8 and not to_fp8(module):
        raise ValueError(
            f"draft_fp8 needs an EAGLE / EAGLE-3 head (its layers run per draft depth), got drafter {drafter!r}"
        )
    else:
        fp8 = bool(draft_fp8)
    if fp8:
        return "fp8"
    if draft_int8 == AUTO:  # (a Medusa head sharing the target's lm_head has nothing to swap)
        return "int8" if int8_by_default(module, device) and to_int8(module) > 0 else None
    if draft_int8 and not to_int8(module):
        raise ValueError(
            f"draft_int8 needs an EAGLE / EAGLE-3 head or a Medusa head with its own projections, got drafter {drafter!r}"
        )
    return "int8" if draft_int8 else None


def as_drafted(head: DraftHead, device: torch.device) -> DraftHead:
    """`head` as from_pretrained's defaults draft with it on `device` (what decode evals and tree tuning
    time): where a default quantizes it, a quantized copy (sharing the target's modules; the head itself
    keeps training), else the head itself."""
    if not (fp8_by_default(head, device) or int8_by_default(head, device)):
        return head
    drafted = copy.deepcopy(head, {id(m): m for m in head._target_modules.values()})
    quantize_draft(drafted, device, AUTO, AUTO, None)
    return drafted
