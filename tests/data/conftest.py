"""Data tests: each test gets its own datasets cache, so cached map results never leak between tests."""

import datasets
import pytest


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")
