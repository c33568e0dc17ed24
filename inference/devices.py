"""Devices: check a device name before loading anything onto it (one clear message, not a traceback),
the dtype to load in, and small host tensors copied to a GPU without waiting for its queued work."""

from __future__ import annotations

import numpy as np
import torch

from spechead.heads.dtypes import DTYPES


def check_device(name: str, flag: str = "--device") -> torch.device:
    """`torch.device(name)` when this machine has it; ValueError saying what to use otherwise (`flag`
    names the option in the message)."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"{flag} {name}: not a device name (use cpu, cuda, cuda:N or mps)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "torch has no CUDA build" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"{flag} {name}: CUDA is not available on this machine ({why}); use {flag} cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"{flag} {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{flag} {name}: MPS is not available on this machine; use {flag} cpu")
    return device


DTYPE_CHOICES = ("auto", *DTYPES)  # a command line's --dtype
DTYPE_HELP = "the target's and the head's weights; auto: float32 on a CPU, else the checkpoint's own dtype"


def load_dtype(dtype: str | torch.dtype, device: str | torch.device, saved: object = None) -> torch.dtype:
    """The dtype to load a target in: `dtype` itself (a name in DTYPES or a torch.dtype) or, for "auto",
    float32 on a CPU (its bf16 / fp16 matmuls are slow) and elsewhere the checkpoint's own dtype (`saved`:
    its config's `dtype`) when it is one of DTYPES, else bfloat16 (half float32's bytes per token)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if torch.device(device).type == "cpu":
        return torch.float32
    return DTYPES.get(str(saved).removeprefix("torch."), torch.bfloat16)  # (None: "None", not one)


def host_to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """x (a small host tensor: ids, a path) on `device` without waiting for the work queued there: on CUDA
    a non-blocking copy through pinned memory (a blocking copy, or one from pageable memory, waits for
    every kernel queued while the GPU idles), of a contiguous `x` (PyTorch pins no expanded view)."""
    if x.device == device:
        return x
    if device.type != "cuda" or x.device.type != "cpu":
        return x.to(device)
    return x.contiguous().pin_memory().to(device, non_blocking=True)


def host_ids(ids: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    """A long tensor of host ints ([K] or [1, K]: ids, a path) on `device` (`host_to_device`), made
    through numpy: `torch.tensor` of a short list costs several times as much, once or twice a pass."""
    return host_to_device(torch.from_numpy(np.array(ids, dtype=np.int64)), device)
