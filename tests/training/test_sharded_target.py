"""ZeRO-3 target pieces that run in one process: the inference engine config and whole replicas.

The sharded target itself (zero.Init loading, two processes) is exercised in test_deepspeed.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spechead.training.errors import TrainError
from spechead.training.sharded_target import full_shape, inference_config, replicate


def test_inference_config_has_no_auto_left_and_no_optimizer_offload():
    zero3 = {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
        "stage3_prefetch_bucket_size": "auto",
        "stage3_gather_16bit_weights_on_model_save": False,
    }
    config = inference_config(zero3, batch_size=4, num_processes=8, dtype=torch.bfloat16)
    zero = config["zero_optimization"]
    assert "offload_optimizer" not in zero and zero["offload_param"] == {"device": "cpu"}
    assert "stage3_prefetch_bucket_size" not in zero  # "auto" is left to DeepSpeed's default
    assert zero["stage3_gather_16bit_weights_on_model_save"] is False
    assert config["train_batch_size"] == 32 and config["train_micro_batch_size_per_gpu"] == 4
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert "auto" not in repr(config)
    fp32 = inference_config(zero3, batch_size=1, num_processes=2, dtype=torch.float32)
    assert not fp32["bf16"]["enabled"] and not fp32["fp16"]["enabled"]  # zero.Init keeps fp32
    assert zero3["offload_optimizer"] == {"device": "cpu"}  # the launch's own config is left alone


@pytest.mark.parametrize("module", [nn.Linear(8, 12, bias=False), nn.Embedding(12, 8, padding_idx=0)])
def test_replicate_is_an_equal_frozen_copy(module):
    copy = replicate(module)
    assert type(copy) is type(module) and full_shape(copy.weight) == (12, 8)
    torch.testing.assert_close(copy.weight, module.weight, rtol=0, atol=0)
    assert copy.weight.data_ptr() != module.weight.data_ptr() and not copy.weight.requires_grad
    x = torch.arange(3) if isinstance(module, nn.Embedding) else torch.randn(3, 8)
    torch.testing.assert_close(copy(x), module(x))


def test_replicate_refuses_other_modules():
    with pytest.raises(TrainError, match="nn.Linear or nn.Embedding"):
        replicate(nn.Conv1d(2, 2, 1))
