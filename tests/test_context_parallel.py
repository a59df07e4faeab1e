"""Context parallelism: ring attention equals full attention, and cp layouts train exactly like the
single-process run (the CPU path; CUDA runs torch's stock context_parallel)."""

import pytest

from tests.batch import Job, jobs
from tests.parity import PP_MODEL, assert_matches_reference, reference, run_layout, train_job

pytestmark = pytest.mark.slow

RING_JOBS = {f"{rotate}-{cp}": Job(f"cp/ring-attention-cp{cp}-{rotate}", cp, "ring_attention", (rotate,))
             for cp in (2, 4) for rotate in ("allgather", "alltoall")}


@jobs("case", RING_JOBS)
def test_ring_attention_equals_full_attention(batches, case):
    """tests/workers/ring_attention.py raises unless output and input grads match full attention."""
    assert (batches.result(RING_JOBS[case]) / "done").exists()


CP_LAYOUTS = {  # name: (ranks, options, model options, layout line)
    "cp2": (2, ["--parallel.cp", "2"], (), "TP1 PP1 DP1 CP2 EP1"),
    "cp4-alltoall": (4, ["--parallel.cp", "4", "--parallel.cp-rotate-method", "alltoall"], (), "CP4"),
    "cp2-tp2-sp": (4, ["--parallel.cp", "2", "--parallel.tp", "2", "--parallel.sp", "True"], (),
                   "TP2 PP1 DP1 CP2 EP1 [SP]"),
    "cp2-dp2": (4, ["--parallel.cp", "2", "--parallel.dp-shard", "2"], (), "TP1 PP1 DP2 CP2"),
    "cp2-qwen3-checkpointed": (2, ["--parallel.cp", "2", "--train.activation-checkpointing", "full"],
                               ("--model.family", "qwen3"), "CP2"),
    "pp2-cp2": (4, ["--parallel.cp", "2", "--parallel.pp", "2"], PP_MODEL, "TP1 PP2 DP1 CP2 EP1 [1F1B]"),
}
CP_JOBS = {name: train_job(f"cp/{name}", nproc, layout, model) for name, (nproc, layout, model, _) in CP_LAYOUTS.items()}


@jobs("name", CP_JOBS)
def test_cp_layout_equals_single_rank(batches, name):
    nproc, layout, model, line = CP_LAYOUTS[name]
    got = run_layout(batches, CP_JOBS[name])
    assert line in got["layout"]
    assert_matches_reference(got, reference(model))
