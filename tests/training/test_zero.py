"""DeepSpeed settings owned by the trainer, ZeRO-3 refusals, and saving a head whose weights DeepSpeed flattened.

Real multi-process DeepSpeed runs are in test_deepspeed.py.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from spechead.heads import MedusaConfig, MedusaHead
from spechead.training import zero
from spechead.training.errors import TrainError
from spechead.training.objectives.medusa import MedusaLossConfig, MedusaObjective


def test_fill_auto_takes_the_trainer_value_and_refuses_a_clash():
    config = {"gradient_clipping": "auto"}
    zero.fill_auto(config, "gradient_clipping", 0.5, "trainer.grad_clip")
    zero.fill_auto(config, "train_micro_batch_size_per_gpu", 4, "trainer.batch_size")  # absent = auto
    assert config == {"gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": 4}
    zero.fill_auto(config, "gradient_clipping", 0.5, "trainer.grad_clip")  # the same value is fine
    with pytest.raises(TrainError, match=r"gradient_clipping=0.5 but trainer.grad_clip=1.0"):
        zero.fill_auto(config, "gradient_clipping", 1.0, "trainer.grad_clip")


def test_zero3_refuses_medusa2_and_offline_data(tmp_path, tiny_target_dir, chat_file, training_kit):
    def settings(**extra):
        return training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, tmp_path, **extra))

    zero.check_zero3(settings(head="eagle3"))  # what ZeRO-3 is for: no error
    with pytest.raises(TrainError, match="medusa2.*zero2.yaml"):
        zero.check_zero3(settings(head="medusa2"))
    offline = settings(**{"data.hidden_states": "offline", "data.cache_dir": str(tmp_path / "cache")})
    with pytest.raises(TrainError, match="offline.*nothing for ZeRO-3 to shard"):
        zero.check_zero3(offline)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU choice")
def test_deepspeed_on_cpu_uses_gloo_not_cpu_mode(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert zero.device_options() == {"cpu": True}
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what `accelerate launch` sets for DeepSpeed
    options = zero.device_options()
    assert options["cpu"] is False  # accelerate ignores DeepSpeed when cpu=True
    assert options["kwargs_handlers"][0].backend == "gloo"


def test_save_head_while_weights_are_views_of_one_flat_buffer(tmp_path):
    head = MedusaHead(MedusaConfig(hidden_size=8, vocab_size=16, num_heads=2))
    for p in head.parameters():
        torch.nn.init.normal_(p)
    # ZeRO-1/2 layout: every parameter is a view into one flat buffer.
    params = list(head.parameters())
    flat = torch.cat([p.detach().flatten() for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    expected = {k: v.clone() for k, v in head.state_dict().items()}
    with pytest.raises(RuntimeError):  # what safetensors does with such views
        head.save_pretrained(tmp_path / "plain")

    zero.save_head(MedusaObjective(head, MedusaLossConfig()), tmp_path / "head")
    saved = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert saved.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], value, rtol=0, atol=0)
    flat.add_(1.0)  # the parameters still read the buffer DeepSpeed updates
    torch.testing.assert_close(params[0], expected["heads.0.0.linear.weight"] + 1.0)
