"""Training checkpoints in one process: bitwise resume, keep-last-k, atomic publish after a crash,
async save, and mismatched or damaged checkpoints ending in a CheckpointError."""

import json
import shutil
import time

import pytest

import meshtrain.checkpoint.checkpointer
from meshtrain.checkpoint.checkpointer import complete_checkpoints
from meshtrain.errors import CheckpointError
from meshtrain.commands.train import run
from tests.conftest import tiny_config


def job(run_dir, **checkpoint):
    return tiny_config(train={"steps": 6, "run_dir": str(run_dir)}, checkpoint=checkpoint)


def losses(history):
    return [m["loss"] for m in history]


def test_interrupted_and_resumed_run_has_the_same_losses_bitwise(tmp_path):
    whole = losses(run(job(tmp_path / "whole", interval=3, resume="never")))
    first = losses(run(job(tmp_path / "split", interval=3)))  # writes step-3 and step-6
    assert first == whole
    resumed = run(job(tmp_path / "resumed", resume=str(tmp_path / "split" / "checkpoints" / "step-000003")))
    assert losses(resumed) == whole[3:]  # bitwise: same floats, not just close
    assert "train" == json.loads((tmp_path / "split/checkpoints/step-000003/meshtrain.json").read_text())["kind"]


def test_auto_resume_takes_the_newest_and_keep_last_prunes(tmp_path):
    history = run(job(tmp_path, interval=1, keep_last=2))
    assert [s for s, _ in complete_checkpoints(tmp_path / "checkpoints")] == [5, 6]
    more = tiny_config(train={"steps": 8, "run_dir": str(tmp_path)}, checkpoint={"interval": 1, "keep_last": 2})
    assert len(run(more)) == 2  # continues at step 6: only steps 7 and 8 run
    assert [s for s, _ in complete_checkpoints(tmp_path / "checkpoints")] == [7, 8]
    assert len(history) == 6


def test_a_crash_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    real_save = meshtrain.checkpoint.checkpointer.dcp.save

    def save_then_die(state, checkpoint_id):
        if checkpoint_id.endswith("step-000004.incomplete"):
            real_save(state, checkpoint_id=checkpoint_id)  # the data is on disk, the publish never happens
            raise KeyboardInterrupt("killed mid-save")
        return real_save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(meshtrain.checkpoint.checkpointer.dcp, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(job(tmp_path, interval=2))
    ckpts = tmp_path / "checkpoints"
    assert [s for s, _ in complete_checkpoints(ckpts)] == [2]
    assert (ckpts / "step-000004.incomplete").is_dir()
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="not a complete meshtrain checkpoint.*interrupted save"):
        run(job(tmp_path / "other", resume=str(ckpts / "step-000004.incomplete")))
    resumed = run(job(tmp_path, interval=2))  # auto: from step 2, past the debris
    assert len(resumed) == 4
    assert [s for s, _ in complete_checkpoints(ckpts)] == [2, 4, 6]
    assert not (ckpts / "step-000004.incomplete").exists()


def test_async_save_gives_the_same_checkpoint(tmp_path):
    sync = losses(run(job(tmp_path / "sync", interval=2)))
    asynchronous = losses(run(job(tmp_path / "async", interval=2, async_save=True)))
    assert asynchronous == sync  # training went on while the writes ran, and was not disturbed
    a = run(job(tmp_path / "a", resume=str(tmp_path / "sync/checkpoints/step-000004")))
    b = run(job(tmp_path / "b", resume=str(tmp_path / "async/checkpoints/step-000004")))
    assert losses(a) == losses(b) == sync[4:]


def test_resuming_another_architecture_names_the_field(tmp_path):
    run(job(tmp_path, interval=6))
    other = tiny_config(model={"hidden_size": 32}, train={"steps": 6, "run_dir": str(tmp_path)})
    with pytest.raises(CheckpointError, match=r"written for model.hidden_size=64, this run has model.hidden_size=32"):
        run(other)


def test_a_damaged_checkpoint_is_a_clear_error(tmp_path):
    run(job(tmp_path, interval=6))
    step = tmp_path / "checkpoints" / "step-000006"
    data = next(step.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"step-000006: could not be read: truncated, corrupted"):
        run(job(tmp_path / "again", resume=str(step)))
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        run(job(tmp_path / "again", resume=str(tmp_path / "nope")))


def test_an_async_checkpoint_is_published_once_written_not_at_the_next_save(tmp_path, monkeypatch):
    """A crash between two saves (here at step 4, interval 3) keeps the step-3 checkpoint whose
    background write had finished: resume starts from it, not from step 0."""
    from meshtrain.trainer import Trainer

    ckpts = tmp_path / "checkpoints"
    real_step = Trainer.train_step

    def crash_at_step_5(trainer):
        if trainer.step == 4:
            deadline = time.monotonic() + 30  # the write is tiny; this only waits out a loaded machine
            while not complete_checkpoints(ckpts) and time.monotonic() < deadline:
                time.sleep(0.05)
            raise KeyboardInterrupt("kill -9 at step 5")
        return real_step(trainer)

    monkeypatch.setattr(Trainer, "train_step", crash_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        run(job(tmp_path, interval=3, async_save=True))
    assert [s for s, _ in complete_checkpoints(ckpts)] == [3]
    monkeypatch.undo()
    assert len(run(job(tmp_path, interval=3, async_save=True))) == 3  # steps 4..6


def test_metrics_jsonl_holds_each_step_once_after_a_resume(tmp_path):
    def job_with_metrics():
        return tiny_config(train={"steps": 6, "run_dir": str(tmp_path)}, checkpoint={"interval": 2, "keep_last": 0},
                           logging={"jsonl": True})

    run(job_with_metrics())  # metrics for steps 1-6, checkpoints 2, 4, 6
    shutil.rmtree(tmp_path / "checkpoints" / "step-000006")  # as if the job died before saving step 6
    replayed = run(job_with_metrics())  # resumes at step 4: steps 5 and 6 run again
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records[4:]] == losses(replayed)  # the rerun's own records
