"""Context parallelism: ring attention equals full attention, and cp layouts train exactly like the
single-process run (the CPU path; CUDA runs torch's stock context_parallel)."""

import pytest

from tests.conftest import torchrun
from tests.test_parallel import PP_MODEL, assert_matches_reference, reference, run_layout

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_ring_attention_equals_full_attention(cp, rotate):
    proc = torchrun(cp, ["tests/cp_attention_worker.py", rotate])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


CP_LAYOUTS = {  # name: (ranks, options, model options, layout line)
    "cp2": (2, ["--parallel.cp", "2"], (), "TP1 PP1 DP1 CP2 EP1"),
    "cp4-alltoall": (4, ["--parallel.cp", "4", "--parallel.cp-rotate-method", "alltoall"], (), "CP4"),
    "cp2-tp2-sp": (4, ["--parallel.cp", "2", "--parallel.tp", "2", "--parallel.sp", "True"], (),
                   "TP2 PP1 DP1 CP2 EP1 [SP]"),
    "cp2-dp2": (4, ["--parallel.cp", "2", "--parallel.dp-shard", "2"], (), "TP1 PP1 DP2 CP2"),
    "cp2-qwen3-checkpointed": (2, ["--parallel.cp", "2", "--train.activation-checkpointing", "True"],
                               ("--model.family", "qwen3"), "CP2"),
    "pp2-cp2": (4, ["--parallel.cp", "2", "--parallel.pp", "2"], PP_MODEL, "TP1 PP2 DP1 CP2 EP1 [1F1B]"),
}


@pytest.mark.parametrize("name", CP_LAYOUTS)
def test_cp_layout_equals_single_rank(tmp_path, name):
    nproc, layout, model, line = CP_LAYOUTS[name]
    got = run_layout(tmp_path, nproc, layout, model)
    assert line in got["layout"]
    assert_matches_reference(got, reference(model))
