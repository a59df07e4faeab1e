"""Float8 (torchao) as far as a CPU allows: which modules convert, and the rules that refuse it
off CUDA before any work. Its speed is measured by bench/gpu_check.sh on a GPU."""

import pytest
import torch

from meshtrain.config import ModelConfig
from meshtrain.errors import ConfigError
from meshtrain.models.float8 import check_float8, convert_to_float8
from meshtrain.models.transformer import Transformer

pytest.importorskip("torchao", reason="the float8 extra (pip install 'meshtrain[float8]') is part of the test extra")


def meta_model(**kw) -> Transformer:
    cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, **kw)
    with torch.device("meta"):
        return Transformer(cfg)


def test_the_decoders_projections_convert_and_names_stay():
    from torchao.float8.float8_linear import Float8Linear

    model = meta_model()
    names = [n for n, _ in model.named_parameters()]
    converted = convert_to_float8(model)
    assert len(converted) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert all(isinstance(model.get_submodule(n), Float8Linear) for n in converted)
    assert type(model.lm_head) is torch.nn.Linear  # the head keeps the compute dtype
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints and HF names unchanged


def test_moe_routers_stay_in_the_compute_dtype():
    model = meta_model(family="qwen3_moe", num_experts=16, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32)
    converted = convert_to_float8(model)
    assert not any(n.endswith(".mlp.gate") for n in converted)
    assert "layers.0.mlp.shared_expert.up_proj" in converted


def test_float8_is_refused_off_cuda_and_under_tp():
    with pytest.raises(ConfigError, match="train.float8=true needs CUDA float8 tensor cores; this job runs on cpu"):
        check_float8("cpu", tp=1)
    with pytest.raises(ConfigError, match="train.float8=true with parallel.tp=2 is not supported"):
        check_float8("cuda", tp=2)
    check_float8("cuda", tp=1)


def test_the_cli_refuses_float8_on_cpu_before_any_work(tmp_path, capsys, monkeypatch):
    from meshtrain.cli import main

    monkeypatch.setenv("MESHTRAIN_DEVICE", "cpu")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--train.run-dir", str(tmp_path), "--train.float8", "True", "--train.dry-run", "True"])
    assert exit_.value.code == 2 and "needs CUDA float8 tensor cores" in capsys.readouterr().err
