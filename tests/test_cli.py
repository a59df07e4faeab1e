"""End to end: what the README's main command runs (shortened), the CLI surfaces, and user
mistakes ending in one clear message with exit status 2 and no traceback."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT, torchrun


def meshtrain(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "meshtrain", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def launch(nproc, *args, timeout=600) -> subprocess.CompletedProcess:
    """The README's launcher, with this interpreter."""
    env = {**os.environ, "MESHTRAIN_PYTHON": sys.executable}
    return subprocess.run(["bash", "launch/torchrun.sh", str(nproc), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_readme_main_job_shortened(tmp_path):
    run_dir = tmp_path / "debug"
    proc = launch(4, "--config", "configs/debug.yaml", "--train.steps", "4", "--train.run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "layout: TP2 PP1 DP2 CP1 EP1 [SP] (world 4)" in proc.stdout
    assert "step 4/4" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["loss"] == r["loss"] and r["tokens_per_s"] > 0 for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["parallel"]["tp"] == 2 and resolved["train"]["steps"] == 4  # the CLI override


@pytest.mark.slow
def test_readme_smoke_test_tp2_pp2_sp(tmp_path):
    """REFERENCE's smoke test: 4 ranks, tp2 pp2 sp, 3 iterations, global batch 8, micro batch 1."""
    proc = launch(4, "--config", "configs/smoke_tp2_pp2.yaml", "--train.run-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "layout: TP2 PP2 DP1 CP1 EP1 [SP, 1F1B] (world 4)" in proc.stdout
    assert proc.stderr.count("pipeline bubble") == 1  # the vpp=1 warning, once (rank 0)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)


def test_help_lists_subcommands_and_options():
    top = meshtrain("--help")
    assert top.returncode == 0 and "train" in top.stdout
    sub = meshtrain("train", "--help")
    assert sub.returncode == 0 and "--parallel.tp" in sub.stdout and "--config" in sub.stdout
    script = pathlib.Path(sys.executable).parent / "meshtrain"
    assert subprocess.run([str(script), "--help"], capture_output=True, text=True).returncode == 0


def test_dry_run_prints_the_layout_without_training():
    proc = meshtrain("train", "--config", "configs/smoke_tp2_pp2.yaml", "--train.dry-run", "True",
                     env={"WORLD_SIZE": "4"})
    assert proc.returncode == 0, proc.stderr
    assert "layout: TP2 PP2 DP1 CP1 EP1 [SP, 1F1B] (world 4)" in proc.stdout
    assert "grad_accum_steps = 8" in proc.stdout and "stage_layers = (2, 2)" in proc.stdout
    assert "pipeline bubble" in proc.stderr  # pp without vpp is a warning


def test_single_process_run_writes_metrics(tmp_path):
    proc = meshtrain("train", "--train.steps", "3", "--model.num-hidden-layers", "1", "--train.seq-len", "32",
                     "--train.run-dir", str(tmp_path), "--logging.progress", "off")
    assert proc.returncode == 0, proc.stderr
    assert "layout: TP1 PP1 DP1 CP1 EP1 (world 1)" in proc.stdout
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_bf16_with_a_peak_reports_mfu(tmp_path):
    proc = meshtrain("train", "--train.steps", "2", "--model.num-hidden-layers", "1", "--train.seq-len", "32",
                     "--train.mixed-precision", "bf16", "--logging.peak-tflops", "1.0",
                     "--train.run-dir", str(tmp_path), "--logging.progress", "off")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["mfu"] < 1 and r["loss"] < 7 for r in records)
    assert "MFU n/a" not in proc.stdout


@pytest.mark.parametrize("args,env,message", [
    (["--parallel.tp", "3"], {"WORLD_SIZE": "4"}, "world size 4 is not divisible"),
    (["--parallel.sp", "True"], {}, "parallel.sp=true requires parallel.tp > 1"),
    (["--data.path", "/nonexistent/corpus.txt"], {}, "data.path: '/nonexistent/corpus.txt' does not exist"),
    (["--data.tokenizer", "/nonexistent/tokenizer.json"], {}, "data.tokenizer: no tokenizer file"),
    (["--config", "/nonexistent.yaml"], {}, "--config: no such file"),
    (["--model.vocab-size", "100"], {},
     "model.vocab_size=100 is smaller than the vocabulary of data.tokenizer=byte (258). Fix: model.vocab_size >= 258"),
    (["--parallel.cp", "2", "--train.seq-len", "30"], {"WORLD_SIZE": "2"},
     "train.seq_len=30 must be divisible by 2*cp = 4"),
    (["--parallel.ep", "2"], {"WORLD_SIZE": "2"}, "expert parallelism needs an MoE model"),
    (["--model.family", "qwen3_moe", "--model.num-experts", "4", "--parallel.tp", "2", "--train.seq-len", "33"],
     {"WORLD_SIZE": "2"}, "train.seq_len=33 / cp=1 must be divisible by tp=2 for the MoE family qwen3_moe"),
    (["--parallel.pp", "2", "--parallel.pp-schedule", "ZBVZeroBubble", "--train.micro-batch-size", "1"],
     {"WORLD_SIZE": "2"}, "parallel.pp_schedule=ZBVZeroBubble places exactly two stages per rank"),
    (["--parallel.pp", "2", "--parallel.pp-layers-per-stage", "1", "2"], {"WORLD_SIZE": "2"},
     "must be non-negative counts summing to model.num_hidden_layers=4"),
    (["--train.seq-len", "4096"], {}, "exceeds model.max_position_embeddings"),
    (["--checkpoint.interval", "-1"], {}, "checkpoint.interval=-1 must be >= 0"),
    (["--model.init-from-hf", "/nonexistent"], {}, "/nonexistent/config.json: no such file"),
    (["--checkpoint.resume", "/nonexistent/step-000010"], {}, "no such checkpoint directory"),
    (["--checkpoint.export-hf", "meshtrain"], {}, "meshtrain: already exists and is not empty"),
])
def test_user_mistakes_are_one_clear_message(args, env, message, tmp_path, monkeypatch, capsys):
    """In-process (``cli.main``, what the ``meshtrain`` script runs): every case fails before any
    work, so a new interpreter per case would only add its start-up; an exception other than the
    clear exit 2 would escape with its traceback and fail the test. test_unknown_yaml_key_is_one_clear_message
    and test_non_finite_loss_stops_with_the_step run the same path through a real process."""
    from meshtrain.cli import main

    monkeypatch.chdir(ROOT)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--train.run-dir", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("option,value,message", [
    ("train.global-batch-size", "-8", "train.global_batch_size=-8 must be >= 1"),
    ("train.steps", "-1", "train.steps=-1 must be >= 1"),
    ("lr-schedule.warmup-steps", "-1", "lr_schedule.warmup_steps=-1 must be >= 0"),
    ("model.num-hidden-layers", "0", "model.num_hidden_layers=0 must be >= 1"),
    ("train.seq-len", "0", "train.seq_len=0 must be >= 1"),
    ("train.seq-len", "-4", "train.seq_len=-4 must be >= 1"),
    ("train.micro-batch-size", "0", "train.micro_batch_size=0 must be >= 1"),
    ("model.num-attention-heads", "0", "model.num_attention_heads=0 must be >= 1"),
    ("model.hidden-size", "130", "model.hidden_size=130 must be divisible by model.num_attention_heads=4"),
    ("optimizer.lr", "-0.001", "optimizer.lr=-0.001 must be >= 0"),
    ("data.num-workers", "-1", "data.num_workers=-1 must be >= 0"),
    ("parallel.timeout-s", "0", "parallel.timeout_s=0 must be > 0"),
    ("logging.log-every", "0", "logging.log_every=0 must be >= 1"),
    ("model.vocab-size", "0", "model.vocab_size=0 must be >= 1"),
    ("optimizer.beta2", "1.5", "optimizer.beta2=1.5 must be in [0, 1)"),
])
def test_every_field_out_of_range_is_refused_by_the_dry_run(option, value, message, tmp_path, capsys):
    from meshtrain.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--train.run-dir", str(tmp_path), f"--{option}", value, "--train.dry-run", "True"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Fix:" in err, err


def test_a_yaml_key_given_twice_is_an_error_not_last_one_wins(tmp_path):
    from meshtrain.config_files import load_yaml
    from meshtrain.errors import ConfigError

    cfg = tmp_path / "twice.yaml"
    cfg.write_text("train:\n  steps: 3\nmodel:\n  hidden_size: 64\ntrain:\n  seq_len: 16\n")
    with pytest.raises(ConfigError, match="line 5: key 'train' is given twice"):
        load_yaml(str(cfg))


def test_unknown_yaml_key_is_one_clear_message(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("parallel:\n  tensor_parallel: 2\n")
    proc = meshtrain("train", "--config", str(cfg))
    assert proc.returncode == 2 and "unknown config key 'parallel.tensor_parallel'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_cli_option_is_rejected():
    proc = meshtrain("train", "--train.stpes", "3")
    assert proc.returncode != 0 and "--train.steps" in proc.stderr  # tyro suggests the right one


def test_non_finite_loss_stops_with_the_step(tmp_path):
    proc = meshtrain("train", "--train.steps", "5", "--optimizer.lr", "1e4", "--train.grad-clip", "0",
                     "--lr-schedule.warmup-steps", "1", "--model.num-hidden-layers", "1", "--train.seq-len", "32",
                     "--train.run-dir", str(tmp_path), "--logging.progress", "off")
    assert proc.returncode == 2
    assert "became nan at step" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_multi_rank_user_mistake_does_not_hang(tmp_path):
    """A config error under torchrun ends every rank with the message, not a hang."""
    proc = torchrun(2, ["-m", "meshtrain", "train", "--data.path", str(tmp_path / "missing.txt"),
                        "--parallel.tp", "2", "--train.run-dir", str(tmp_path)], timeout=120)
    assert proc.returncode != 0
    assert "data.path" in proc.stderr and "does not exist" in proc.stderr
