"""The one decoding engine: rows state, the one loop (prefill; draft -> verify -> accept -> commit)."""
