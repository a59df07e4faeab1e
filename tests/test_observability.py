"""Observability on CPU, read back from the files a user opens: profiler traces per rank, the
phase breakdown, TensorBoard events and an offline Weights & Biases run, all from one 2-rank job.
(The flight recorder is checked by the hung-rank tests in test_launch.py.)"""

import json
import re
import struct
import subprocess

import pytest

from tests.conftest import ROOT, env, tiny_args

STEPS = 5


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("observed")
    args = [*tiny_args(), "--train.steps", str(STEPS), "--train.run-dir", str(run_dir), "--logging.jsonl", "True",
            "--checkpoint.interval", "2", "--logging.phase-every", "2", "--logging.tensorboard", "True",
            "--logging.wandb-project", "meshtrain-test", "--logging.wandb-mode", "offline",
            "--profiling.trace", "True", "--profiling.trace-wait", "1", "--profiling.trace-warmup", "1",
            "--profiling.trace-active", "2", "--profiling.memory-snapshot-steps", "2"]
    proc = subprocess.run(["bash", "launch/torchrun.sh", "2", *args], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, proc.stdout, records


@pytest.mark.slow
def test_a_trace_per_rank_holds_the_steps_matmuls_and_collectives(job):
    run_dir, out, _ = job
    for rank in (0, 1):
        events = json.loads((run_dir / "profile" / f"rank{rank}.json").read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        assert "aten::mm" in names and any(n and n.startswith("gloo:all_reduce") for n in names), rank
        assert {n for n in names if n and n.startswith("ProfilerStep#")} == {"ProfilerStep#2", "ProfilerStep#3"}
    assert f"profiler trace {run_dir / 'profile' / 'rank0.json'}" in out
    assert "memory snapshots need CUDA; none on cpu" in out  # said, not silently dropped


@pytest.mark.slow
def test_the_phase_breakdown_is_logged_at_its_interval(job):
    _, out, records = job
    lines = re.findall(r"step (\d+) phases: data [\d.]+ ms \(\d+%\), forward\+backward [\d.]+ ms \(\d+%\), "
                       r"optimizer [\d.]+ ms \(\d+%\)(, checkpoint [\d.]+ ms)?", out)
    assert [(int(step), bool(ckpt)) for step, ckpt in lines] == [(2, True), (4, True)]
    timed = {r["step"]: r for r in records if "time_forward_backward_s" in r}
    assert sorted(timed) == [2, 4]
    for r in timed.values():  # the phases of the step itself add up to (at most) its measured time
        parts = r["time_data_s"] + r["time_forward_backward_s"] + r["time_optimizer_s"]
        assert 0 < parts <= r["step_time_s"] * 1.05 + 1e-3 and r["time_checkpoint_s"] > 0


@pytest.mark.slow
def test_tensorboard_events_carry_every_step_and_the_layout(job):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, records = job
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("loss")]
    assert losses == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]
    assert {"grad_norm", "lr", "tokens_per_s", "memory_gib", "time_optimizer_s"} <= set(events.Tags()["scalars"])
    layout = events.Tensors("layout/text_summary")[0].tensor_proto.string_val[0].decode()
    assert layout == "TP1 PP1 DP2 CP1 EP1 (world 2)"


def wandb_records(path):
    """The protobuf records of an offline W&B run file: a 7-byte header, then LevelDB-log framed
    records (4-byte crc, 2-byte length, 1-byte type) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.mark.slow
def test_an_offline_wandb_run_carries_config_layout_and_every_step(job):
    run_dir, _, records = job
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history, config = [], {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        if record.WhichOneof("record_type") == "run":
            config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
    assert [(h["_step"], h["loss"]) for h in history] == [(r["step"], pytest.approx(r["loss"])) for r in records]
    assert config["layout"] == "TP1 PP1 DP2 CP1 EP1 (world 2)" and config["train"]["steps"] == STEPS
    assert "time_forward_backward_s" in history[1]


def test_a_dashboard_whose_package_is_missing_is_refused_before_training(monkeypatch):
    import importlib.util

    from meshtrain.config import LoggingConfig
    from meshtrain.errors import ConfigError
    from meshtrain.telemetry.backends import check_installed

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"wandb package is not installed. Fix: pip install 'meshtrain\[wandb\]'"):
        check_installed(LoggingConfig(wandb_project="p"))
    check_installed(LoggingConfig(tensorboard=True))


def test_flops_per_token_count_each_head_s_query_key_and_value_dims():
    """PaLM's count: 6 x the matmul parameters a token meets, plus 6 x heads x (q/k dims + v dims) x
    the keys each query meets, per layer. Latent attention's heads are 192 (q/k) and 128 (v) wide
    in DeepSeek-V3, whatever hidden / heads says; a Llama's are head_dim both."""
    from meshtrain.config import ModelConfig
    from meshtrain.hf.adapter import model_config_from_hf
    from meshtrain.telemetry.metrics import flops_per_token

    llama = ModelConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=100)
    params = 10_000
    assert flops_per_token(llama, 32, params) == 6 * (params - 100 * 64) + 12 * 4 * 16 * 32 * 2
    deepseek, _ = model_config_from_hf(json.loads((ROOT / "tests/model_configs/deepseek-ai-DeepSeek-V3.json").read_text()))
    active = 37_552_000_000
    assert flops_per_token(deepseek, 4096, active) == 6 * (active - 129280 * 7168) + 6 * 128 * (192 + 128) * 4096 * 61
