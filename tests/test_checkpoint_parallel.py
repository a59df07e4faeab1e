"""Checkpoints across layouts, on 2-4 gloo ranks: HF import into tp/dp/pp layouts with logits equal to
transformers' and a bit-exact export, resume under another layout, bitwise resume under the same
one, and ``meshtrain convert`` on several ranks."""

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from tests.batch import COMMAND, Job, command_result, jobs
from tests.conftest import ROOT, torchrun
from tests.hf_models import assert_same_tensors, read_tensors, write_hf_dir
from tests.parity import LOSS_RTOL, TINY, TINY_NO_MODEL, checkpoint_of_step3, losses

pytestmark = pytest.mark.slow


IMPORT_LAYOUTS = {
    "llama-fp32-tp2": (2, "llama", torch.float32, ["--parallel.tp", "2"]),
    "qwen3-bf16-fsdp2": (2, "qwen3", torch.bfloat16, []),
    "llama-bf16-pp2": (2, "llama", torch.bfloat16, ["--parallel.pp", "2"]),
    "qwen3-fp32-pp2-tp2": (4, "qwen3", torch.float32, ["--parallel.pp", "2", "--parallel.tp", "2"]),
    # one vocab-parallel matrix for the embedding and the head: one tensor in and out
    "llama-tied-bf16-tp2-sp": (2, "llama", torch.bfloat16, ["--parallel.tp", "2", "--parallel.sp", "True"]),
    # the last stage's head is read from, and written back as, the embedding's one tensor
    "llama-tied-fp32-pp2": (2, "llama", torch.float32, ["--parallel.pp", "2"]),
    # q/k/v biases read and written as column-parallel slices, beside a tied vocab-parallel matrix
    "qwen2-tied-bf16-tp2-sp": (2, "qwen2", torch.bfloat16, ["--parallel.tp", "2", "--parallel.sp", "True"]),
    # a head_dim that is not hidden / heads, split by head over the stages' ranks
    "mistral-fp32-pp2-tp2": (4, "mistral", torch.float32, ["--parallel.pp", "2", "--parallel.tp", "2"]),
    # the scaled embedding on the first stage, the tied head on the last, local and global RoPE tables
    "gemma3-bf16-pp2": (2, "gemma3", torch.bfloat16, ["--parallel.pp", "2"]),
    # fused qkv_proj / gate_up_proj: each rank reads and writes its row ranges of every part (tp, then FSDP)
    "phi3-bf16-tp2-dp2": (4, "phi3", torch.bfloat16, ["--parallel.tp", "2"]),
}
OVERRIDES = {"llama-tied-bf16-tp2-sp": {"tie_word_embeddings": True}, "llama-tied-fp32-pp2": {"tie_word_embeddings": True},
             "qwen2-tied-bf16-tp2-sp": {"tie_word_embeddings": True, "vocab_size": 384},
             "mistral-fp32-pp2-tp2": {"vocab_size": 384}, "phi3-bf16-tp2-dp2": {"vocab_size": 384},
             "gemma3-bf16-pp2": {"vocab_size": 384, "num_hidden_layers": 4,
                                 "layer_types": ["sliding_attention", "full_attention"] * 2}}


def import_job(name: str) -> Job:
    nproc, family, dtype, layout = IMPORT_LAYOUTS[name]

    def write_source(directory) -> tuple[str, ...]:
        return ("--model.init-from-hf",
                str(write_hf_dir(directory / "src", family, dtype, **OVERRIDES.get(name, {}))))

    return Job(f"checkpoint/import-{name}", nproc, "hf", (*TINY_NO_MODEL, *layout), prepare=write_source)


IMPORT_JOBS = {name: import_job(name) for name in IMPORT_LAYOUTS}


@jobs("name", IMPORT_JOBS)
def test_hf_import_into_layout_matches_transformers_and_exports_bit_exact(batches, name):
    import transformers

    nproc, family, dtype, layout = IMPORT_LAYOUTS[name]
    out = batches.result(IMPORT_JOBS[name])
    src = out / "src"  # written by write_hf_dir before the launch
    reference = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    from tests.workers.hf import TOKENS

    with torch.no_grad():
        expected = reference(TOKENS).logits
    torch.testing.assert_close(torch.load(out / "logits.pt"), expected, rtol=1e-5, atol=1e-5)
    source = read_tensors(src)
    assert_same_tensors(source, read_tensors(out / "hf"))
    # Each rank read only its slices: never the whole model, and under pure FSDP exactly 1/world of it.
    total = sum(t.numel() * t.element_size() for t in source.values())
    read = [int((out / f"read_bytes_rank{r}").read_text()) for r in range(nproc)]
    assert max(read) < total, (read, total)
    if not layout:
        assert sum(read) == total and max(read) <= total / nproc * 1.05, (read, total)
    assert json.loads((out / "hf" / "config.json").read_text())["eos_token_id"] == 2  # carried from the source


def resume_job(name: str, nproc: int, *options: str, after: tuple[Job, ...] = ()) -> Job:
    """``meshtrain train`` for 6 steps (tests/workers/train_command.py), metrics.jsonl in its directory."""
    return Job(f"checkpoint/resume-{name}", nproc, "train_command",
               (*TINY, "--train.steps", "6", "--logging.jsonl", "True", *options), after=after)


ONE_RANK = resume_job("one-rank", 1, "--checkpoint.interval", "3")
RESUMED = [resume_job(name, 4, "--checkpoint.resume", checkpoint_of_step3(ONE_RANK), "--checkpoint.interval", "3", *layout,
                      after=(ONE_RANK,))
           for name, layout in [("tp2-dp2", ["--parallel.tp", "2"]), ("pp2-dp2", ["--parallel.pp", "2"])]]
# A 4-rank checkpoint (written in the background), resumed by 4 ranks of the same layout and by a pipeline.
SHARDED = resume_job("tp2-dp2-whole", 4, "--parallel.tp", "2", "--checkpoint.interval", "3",
                     "--checkpoint.async-save", "True")
SHARDED_AGAIN = resume_job("tp2-dp2-again", 4, "--parallel.tp", "2", "--checkpoint.resume", checkpoint_of_step3(SHARDED),
                           after=(SHARDED,))
SHARDED_TO_PP = resume_job("pp2", 2, "--parallel.pp", "2", "--checkpoint.resume", checkpoint_of_step3(SHARDED), after=(SHARDED,))


@pytest.mark.job(ONE_RANK)
@pytest.mark.job(RESUMED[0])
@pytest.mark.job(RESUMED[1])
@pytest.mark.job(SHARDED)
@pytest.mark.job(SHARDED_AGAIN)
@pytest.mark.job(SHARDED_TO_PP)
def test_resume_under_other_layouts_and_bitwise_under_the_same(batches):
    whole = losses(batches, ONE_RANK)
    for job in RESUMED:
        torch.testing.assert_close(losses(batches, job), whole[3:], rtol=LOSS_RTOL, atol=0)
    # the 4-rank checkpoint, resumed by 4 ranks of the same layout: the very same floats
    sharded = losses(batches, SHARDED)
    torch.testing.assert_close(sharded, whole, rtol=LOSS_RTOL, atol=0)
    assert losses(batches, SHARDED_AGAIN) == sharded[3:]
    # ... and by 2 ranks of a pipeline: from tp x FSDP shards to pp stages.
    torch.testing.assert_close(losses(batches, SHARDED_TO_PP), sharded[3:], rtol=LOSS_RTOL, atol=0)


# A tied model: one rank's checkpoint (embedding and head one matrix) resumed by pp2, whose stages
# hold a copy each, and the pipeline's checkpoint resumed by one rank again.
TIED = ("--model.tie-word-embeddings", "True")
TIED_ONE_RANK = resume_job("tied-one-rank", 1, *TIED, "--checkpoint.interval", "3")
TIED_PP = resume_job("tied-pp2", 2, *TIED, "--parallel.pp", "2", "--checkpoint.interval", "1",
                     "--checkpoint.resume", checkpoint_of_step3(TIED_ONE_RANK), after=(TIED_ONE_RANK,))
TIED_BACK = resume_job("tied-back-to-one-rank", 1, *TIED, "--checkpoint.resume",
                       f"{{jobs}}/{TIED_PP.name}/checkpoints/step-000004", after=(TIED_PP,))


@pytest.mark.job(TIED_ONE_RANK, TIED_PP, TIED_BACK)
def test_a_tied_model_resumes_into_and_out_of_a_pipeline(batches):
    whole = losses(batches, TIED_ONE_RANK)
    torch.testing.assert_close(losses(batches, TIED_PP), whole[3:], rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(losses(batches, TIED_BACK), whole[4:], rtol=LOSS_RTOL, atol=0)


def meshtrain(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtrain", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def convert_steps(directory: str) -> None:
    """The convert round trip's launches, one after another (run as a command job): HF -> DCP on 4
    ranks, DCP -> HF on 2, then training from the source on tp2 with an export; each launch's exit
    status and output in steps.json, stopping at the first that fails."""
    out = pathlib.Path(directory)
    src = out / "src"
    steps = {
        "to_dcp": (4, ["-m", "meshtrain", "convert", "--src", str(src), "--dst", str(out / "dcp")]),
        "to_hf": (2, ["-m", "meshtrain", "convert", "--src", str(out / "dcp"), "--dst", str(out / "hf")]),
        # a weights-only checkpoint: step 0, fresh optimizer; export at the end
        "train": (2, ["-m", "meshtrain", "train", *TINY_NO_MODEL, "--model.init-from-hf", str(src),
                      "--parallel.tp", "2", "--train.steps", "2", "--train.run-dir", str(out / "run"),
                      "--checkpoint.export-hf", str(out / "trained")]),
    }
    done = {}
    for name, (nproc, args) in steps.items():
        proc = torchrun(nproc, args)
        done[name] = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
        if proc.returncode:
            break
    (out / "steps.json").write_text(json.dumps(done))


def write_convert_source(directory: pathlib.Path) -> tuple[str, ...]:
    src = write_hf_dir(directory / "src", "qwen3", torch.bfloat16)
    (src / "tokenizer.json").write_text("{}")  # carried along, not interpreted
    return (sys.executable, "-c", f"from tests.test_checkpoint_parallel import convert_steps; "
                                  f"convert_steps({str(directory)!r})")


CONVERT = Job("checkpoint/convert-round-trip", 0, COMMAND, prepare=write_convert_source)


@pytest.mark.job(CONVERT)
def test_convert_round_trip_on_several_ranks(batches):
    tmp_path = batches.result(CONVERT)
    assert command_result(tmp_path).returncode == 0, command_result(tmp_path).stderr[-3000:]
    steps = json.loads((tmp_path / "steps.json").read_text())
    for name in ("to_dcp", "to_hf", "train"):
        proc = steps[name]
        assert proc["returncode"] == 0, name + proc["stdout"][-3000:] + proc["stderr"][-6000:]
    src = tmp_path / "src"
    assert "verified: every tensor" in steps["to_dcp"]["stdout"] and "over 4 rank(s)" in steps["to_dcp"]["stdout"]
    assert_same_tensors(read_tensors(src), read_tensors(tmp_path / "hf"))
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == "{}"
    trained = read_tensors(tmp_path / "trained")
    assert {t.dtype for t in trained.values()} == {torch.bfloat16}  # auto: the source's dtype
    assert any(not torch.equal(trained[k], v) for k, v in read_tensors(src).items())  # it did train


def test_user_mistakes_in_conversion_are_one_line_errors(tmp_path, capsys):
    from meshtrain.cli import main

    src = write_hf_dir(tmp_path / "src")
    cases = [
        (["--src", str(tmp_path / "nope"), "--dst", str(tmp_path / "x")], "no such directory"),
        (["--src", str(src), "--dst", str(src)], "already exists and is not empty"),
        (["--src", str(tmp_path), "--dst", str(tmp_path / "y")], "neither a Hugging Face model"),
    ]
    for args, message in cases:  # in-process: each fails before any work (as in test_cli)
        with pytest.raises(SystemExit) as exit_:
            main(["convert", *args])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and "Traceback" not in err, err
    # a damaged source is found while reading, on the process group: a real process
    bad = tmp_path / "src" / sorted(p.name for p in src.glob("*.safetensors"))[0]
    bad.write_bytes(bad.read_bytes()[:-64])
    proc = meshtrain("convert", "--src", str(src), "--dst", str(tmp_path / "z"))
    assert proc.returncode == 2 and "truncated or corrupted" in proc.stderr and bad.name in proc.stderr
    assert not (tmp_path / "z").exists()
