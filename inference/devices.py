"""Check a device name before loading anything onto it (one clear message instead of a traceback)."""

from __future__ import annotations

import torch


def check_device(name: str, flag: str = "--device") -> torch.device:
    """`torch.device(name)` when this machine has it; ValueError saying what to use otherwise.

    `flag` names the option in the message (a script's `--device`).
    """
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
