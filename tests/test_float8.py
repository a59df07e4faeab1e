"""Float8 (torchao) as far as a CPU allows: which modules convert, and the rules that refuse it
off CUDA before any work, and torchao's emulation (train.float8_emulate) under FSDP with float8
all-gathers. Its speed is measured by bench/gpu_check.sh on a GPU."""

import pytest
import torch

from meshtrain.config import ModelConfig
from meshtrain.errors import ConfigError
from meshtrain.models.float8 import check_float8, convert_to_float8
from meshtrain.models.transformer import Transformer
from tests.parity import reference, run_layout, train_job

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


def test_float8_is_refused_off_cuda_unless_emulated_and_with_sp_off_cuda():
    with pytest.raises(ConfigError, match="train.float8=true needs CUDA float8 tensor cores; this job runs on cpu"):
        check_float8("cpu", sequence_parallel=False)
    check_float8("cpu", sequence_parallel=False, emulate=True)
    with pytest.raises(ConfigError, match="train.float8=true with parallel.sp=true needs CUDA"):
        check_float8("cpu", sequence_parallel=True, emulate=True)
    check_float8("cuda", sequence_parallel=True)


def test_the_cli_refuses_float8_on_cpu_before_any_work(tmp_path, capsys, monkeypatch):
    from meshtrain.cli import main

    monkeypatch.setenv("MESHTRAIN_DEVICE", "cpu")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--train.run-dir", str(tmp_path), "--train.float8", "True", "--train.dry-run", "True"])
    assert exit_.value.code == 2 and "needs CUDA float8 tensor cores" in capsys.readouterr().err


FLOAT8 = ("--train.float8", "True", "--train.float8-emulate", "True")
DP2 = ["--parallel.dp-shard", "2"]
FLOAT8_JOBS = {"float8-all-gather": train_job("float8/dp2", 2, DP2, FLOAT8),
               "bf16-all-gather": train_job("float8/dp2-gather-high-precision", 2, DP2,
                                            FLOAT8 + ("--train.float8-all-gather", "False")),
               "fp32": train_job("float8/dp2-fp32", 2, DP2)}
TP2 = train_job("float8/tp2", 2, ["--parallel.tp", "2"], FLOAT8)


@pytest.mark.slow
@pytest.mark.job(*FLOAT8_JOBS.values())
def test_fsdp_all_gathers_float8_weights_exactly(batches):
    """Emulated float8 under FSDP dp2. Weights all-gathered in float8 (each shard cast with the whole
    weight's scale) train exactly as weights gathered in fp32 and cast after; the all-gathers carry
    1 byte per projection weight instead of 4. Against the 1-rank float8 run only loosely: under dp
    each micro-batch holds other sequences (the sampler strides over ranks), so the activations'
    dynamic scales differ and float8 rounds differently: 2e-5 off in step 1's loss, 5e-4 by step 5."""
    got, gathered_high, fp32 = (run_layout(batches, job) for job in FLOAT8_JOBS.values())
    assert got["losses"] == gathered_high["losses"] and got["grad_norms"] == gathered_high["grad_norms"]
    for name, want in gathered_high["state"].items():
        torch.testing.assert_close(got["state"][name], want, rtol=0, atol=0, msg=name)
    model = meta_model()
    projections = sum(model.get_submodule(name).weight.numel() for name in convert_to_float8(model))
    micro_batches, gathers = 2, 2  # per layer and micro-batch: forward, and again in backward (resharded)
    saved = 3 * projections // 2 * gathers * micro_batches  # 4 -> 1 byte, (n-1)/n of each weight on the wire
    assert fp32["comm_bytes"]["_allgather_base"] - got["comm_bytes"]["_allgather_base"] == saved
    assert gathered_high["comm_bytes"] == fp32["comm_bytes"]
    ref8, ref32 = reference(FLOAT8), reference(())
    torch.testing.assert_close(got["losses"], ref8["losses"], rtol=2e-3, atol=0)
    assert max(abs(a - b) for a, b in zip(ref8["losses"], ref32["losses"])) > 1e-5  # float8 rounded something


@pytest.mark.slow
@pytest.mark.job(TP2)
def test_tensor_parallel_float8_equals_one_rank(batches):
    """torchao's float8 TP styles: every scale comes from the whole tensor's amax (all-reduced over
    tp), so step 1 equals the 1-rank float8 run: loss to fp32 noise (6e-8), grad norm to 1e-5 (float8
    rounds the tp reductions' summation-order noise into a whole float8 step now and then), where the
    fp32 run is 3e-5 and 1e-3 away. Later steps are only bounded: Adam turns those flips in tiny
    gradients into full-size updates (grad norms 3e-4 apart in step 2)."""
    got, ref8, ref32 = run_layout(batches, TP2), reference(FLOAT8), reference(())
    assert got["losses"][0] == pytest.approx(ref8["losses"][0], rel=1e-6)
    assert got["grad_norms"][0] == pytest.approx(ref8["grad_norms"][0], rel=1e-4)
    assert abs(ref32["losses"][0] - ref8["losses"][0]) > 1e-5 * ref8["losses"][0]
    assert abs(ref32["grad_norms"][0] - ref8["grad_norms"][0]) > 5e-4 * ref8["grad_norms"][0]
    torch.testing.assert_close(got["losses"], ref8["losses"], rtol=1e-3, atol=0)
    assert got["losses"][-1] < got["losses"][0] - 0.5
