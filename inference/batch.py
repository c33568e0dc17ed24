"""Compatibility shim, to be deleted with the batch decode loops that still import it (batch_decode.py,
batch_plain_ahead.py): `BatchRunner` is the one runner (spechead.inference.target.TargetRunner), whose
`TargetRunner(model, hidden_layers, max_length=S)` takes B rows as the old batch runner did."""

from __future__ import annotations

from spechead.inference.target.runner import TargetRunner as BatchRunner

__all__ = ["BatchRunner"]
