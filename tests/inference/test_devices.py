"""inference/devices.py: device names checked in one line; host values copied without a wait (the CUDA
side of `host_to_device` is tested in test_cuda_syncs.py)."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.devices import check_device, host_ids, host_to_device


def test_host_to_device_on_the_same_device_is_the_tensor_itself():
    x = torch.arange(4)
    assert host_to_device(x, torch.device("cpu")) is x  # (no copy, no op: the CPU loop pays nothing)


def test_host_ids_are_long_tensors_of_the_lists_shape_on_the_device():
    ids = host_ids([[5, 0, 2**40]], torch.device("cpu"))  # [1, K]; an id past int32 kept exactly
    assert ids.dtype == torch.long and ids.tolist() == [[5, 0, 2**40]]
    path = host_ids([0, 2, 3], torch.device("meta"))  # [K], moved to the device given
    assert path.device.type == "meta" and path.shape == (3,) and path.dtype == torch.long


def test_bad_device_names_are_one_clear_error():
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="not a device name"):
        check_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"CUDA is not available on this machine .*use --device cpu"):
            check_device("cuda")
