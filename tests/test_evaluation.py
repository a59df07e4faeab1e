"""Validation in every layout: the same val_loss as the single-process run, and training exactly as
without evaluation (losses, grad norms, weights). The held-out set here is the bundled corpus
itself (its first eval.steps x global batch samples, in order): what is checked is the mechanics."""

import pytest
import torch

from meshtrain.config import DataConfig
from tests.batch import Job, jobs
from tests.parity import MOE_ARGS, PP_MODEL, TINY, assert_matches_reference, reference, run_layout, train_job

pytestmark = pytest.mark.slow

EVAL = ("--eval.interval", "2", "--eval.steps", "2", "--eval.data", DataConfig().path)
LAYOUTS = {  # name: (ranks, layout, model options)
    "tp2-sp-loss-parallel": (2, ["--parallel.tp", "2", "--parallel.sp", "True", "--parallel.loss-parallel", "True"], ()),
    "pp2-interleaved": (2, ["--parallel.pp", "2", "--parallel.vpp", "2"], PP_MODEL),
    "cp2": (2, ["--parallel.cp", "2"], ()),
    "moe-ep2-dp2": (2, ["--parallel.ep", "2"], MOE_ARGS),  # ep folded over dp2: the dp reduction too
}
JOBS = {name: train_job(f"eval/{name}", nproc, layout, EVAL + model) for name, (nproc, layout, model) in LAYOUTS.items()}


@jobs("name", JOBS)
def test_eval_equals_single_rank_and_leaves_training_alone(batches, name):
    nproc, layout, model = LAYOUTS[name]
    got = run_layout(batches, JOBS[name])
    without = reference(model)  # no evaluation at all
    assert_matches_reference(got, without)
    ref = reference(EVAL + model)
    assert ref["losses"] == without["losses"] and len(got["val_losses"]) == 3  # steps 2, 4 and the last, 5
    torch.testing.assert_close(got["val_losses"], ref["val_losses"], rtol=1e-5, atol=0)


def run_cli(tmp_path, *args):
    import subprocess
    import sys

    from tests.conftest import ROOT, tiny_args

    return subprocess.run([sys.executable, "-m", "meshtrain", "train", *tiny_args(), "--train.run-dir",
                           str(tmp_path / "run"), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_an_eval_set_too_small_for_eval_steps_is_refused_naming_it(tmp_path):
    small = tmp_path / "held_out.txt"
    small.write_text("far too little held-out text " * 20)
    proc = run_cli(tmp_path, "--eval.interval", "2", "--eval.data", str(small))
    assert proc.returncode == 2, proc.stderr
    assert f"eval: {small} holds 18 samples of train.seq_len+1 tokens; eval.steps=4 x train.global_batch_size=8 " \
           "needs 32" in proc.stderr


def test_evaluation_without_held_out_data_is_refused_by_the_dry_run(tmp_path):
    proc = run_cli(tmp_path, "--eval.interval", "2", "--train.dry-run", "True")
    assert proc.returncode == 2 and "eval.interval=2 needs held-out data" in proc.stderr, proc.stderr


def test_a_split_holds_out_the_last_samples_and_reports_val_loss(tmp_path):
    import json

    proc = run_cli(tmp_path, "--eval.interval", "5", "--eval.split", "0.01", "--logging.jsonl", "True")
    assert proc.returncode == 0, proc.stderr
    assert "the last 190 held out for evaluation" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [5]
    assert records[-1]["val_ppl"] == pytest.approx(2.718281828 ** records[-1]["val_loss"], rel=1e-6)


def sft_eval_data(directory):
    from tests.chat_data import sft_data

    args = sft_data(directory)
    return (*args, "--eval.data", args[args.index("--data.path") + 1])


SFT_EVAL = ("--eval.interval", "2", "--eval.steps", "2")
SFT_PP2 = Job("eval/sft-pp2", 2, "train", (*TINY, *PP_MODEL, *SFT_EVAL, "--parallel.pp", "2"), prepare=sft_eval_data)


@pytest.mark.job(SFT_PP2)
def test_sft_eval_through_the_pipeline_weights_every_target_once(batches, tmp_path):
    """Masked labels: micro-batches hold different numbers of targets, so each must count by its
    targets, whatever scale the last training step left on the pipeline's loss function."""
    got = run_layout(batches, SFT_PP2)
    ref = reference(PP_MODEL + SFT_EVAL + sft_eval_data(tmp_path))
    assert_matches_reference(got, ref)
    torch.testing.assert_close(got["val_losses"], ref["val_losses"], rtol=1e-5, atol=0)
