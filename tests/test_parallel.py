"""TP, SP, FSDP2, HSDP and PP equal the single-process run: per-step loss, grad norm, final weights.

Each layout trains 5 AdamW steps (global batch 8, lr warmup then cosine, clipping at 1.0) on
2 to 8 CPU ranks over gloo, and rank 0's full final weights are compared with the reference's.
Tolerances are fp32 summation-order noise: observed differences are ~1e-7 (see the closing note).
"""

import pytest
import torch

from meshtrain.cli import parse
from meshtrain.config import JobConfig
from tests.batch import Job, jobs
from tests.parity import (COMPILED_RTOL, FAMILY_LAYOUTS, LOSS_RTOL, PP_MODEL, TINY, assert_compiled_once,
                          assert_matches_reference, reference, run_layout, train_job)

pytestmark = pytest.mark.slow


LAYOUTS = {
    "dp2": (2, ["--parallel.dp-shard", "2"], "TP1 PP1 DP2"),
    "tp2": (2, ["--parallel.tp", "2"], "TP2 PP1 DP1"),
    "tp2-sp": (2, ["--parallel.tp", "2", "--parallel.sp", "True"], "TP2 PP1 DP1 CP1 EP1 [SP]"),
    "dp2-tp2": (4, ["--parallel.tp", "2"], "TP2 PP1 DP2"),
    "hsdp2x2": (4, ["--parallel.dp-replicate", "2", "--parallel.dp-shard", "2"], "[HSDP 2x2]"),
    "fsdp4-tp2-sp": (8, ["--parallel.tp", "2", "--parallel.sp", "True"], "TP2 PP1 DP4 CP1 EP1 [SP]"),
    # gradient accumulation (2 micro-batches) reduced once per step, then also without re-gathering
    "dp2-reduce-last": (2, ["--parallel.dp-shard", "2", "--parallel.fsdp-accumulate", "reduce_last"], "TP1 PP1 DP2"),
    "dp2-tp2-sp-reduce-last-unsharded": (4, ["--parallel.tp", "2", "--parallel.sp", "True",
                                             "--parallel.fsdp-accumulate", "reduce_last_unsharded"],
                                         "TP2 PP1 DP2 CP1 EP1 [SP]"),
    # selective activation checkpointing (matmul, attention and collective outputs kept) under
    # TP+SP, and on every other layer under FSDP
    "tp2-sp-selective-ac": (2, ["--parallel.tp", "2", "--parallel.sp", "True", "--train.activation-checkpointing", "selective"], "TP2 PP1 DP1 CP1 EP1 [SP]"),
    # torch.compile per layer (inductor on CPU), under FSDP and under TP+SP (DTensor traced in the graph)
    "dp2-compiled": (2, ["--parallel.dp-shard", "2", "--train.compile", "True"], "TP1 PP1 DP2"),
    "tp2-sp-compiled": (2, ["--parallel.tp", "2", "--parallel.sp", "True", "--train.compile", "True"],
                        "TP2 PP1 DP1 CP1 EP1 [SP]"),
    "dp2-selective-ac-every2": (2, ["--parallel.dp-shard", "2", "--train.activation-checkpointing", "selective", "--train.activation-checkpointing-every", "2"],
                                "TP1 PP1 DP2"),
}


L = 2  # layers of TINY


def expected_collectives(name: str, counts: dict) -> None:
    """The first step's collectives, by op. FSDP2 counts are c10d ops (_allgather_base,
    _reduce_scatter_base), TP/SP ones DTensor's functional ops (all_gather, reduce_scatter,
    all_reduce); ``allreduce`` is the trainer's own (loss over dp x cp, the global grad norm)."""
    fsdp = {"_allgather_base": 2 * L + 1, "_reduce_scatter_base": L + 1}  # per micro-batch: fwd+bwd gathers
    if name == "dp2":  # accumulation 8 / (2 * 2) = 2 micro-batches
        assert counts == {k: 2 * v for k, v in fsdp.items()} | {"allreduce": 2}
    elif name == "tp2":
        # no SP: every TP collective is an all-reduce. Per micro-batch (4): forward one after each
        # block's row-parallel projection and one after the vocab-parallel embedding; backward one
        # per block at its shared input and one at the lm_head's input: 2 * (2L + 1).
        assert counts == {"all_reduce": 4 * 2 * (2 * L + 1), "allreduce": 1}
    elif name == "tp2-sp":
        # SP turns each all-reduce of the residual stream into reduce-scatter + all-gather: per
        # micro-batch 2L+1 of each in forward and again in backward; 4 micro-batches. The
        # all-reduces left are the Partial grads of the 2L+1 replicated norm weights, once per step.
        assert counts == {"reduce_scatter": 4 * 2 * (2 * L + 1), "all_gather": 4 * 2 * (2 * L + 1),
                          "all_reduce": 2 * L + 1, "allreduce": 1}
    elif name == "hsdp2x2":  # 1 micro-batch; the replicate all-reduce is one per FSDP unit
        assert counts == fsdp | {"allreduce": 2 + (L + 1)}
    elif name == "dp2-reduce-last":  # 2 micro-batches, one reduce-scatter per unit for both
        assert counts == {"_allgather_base": 2 * (2 * L + 1), "_reduce_scatter_base": L + 1, "allreduce": 2}
    elif name == "dp2-tp2-sp-reduce-last-unsharded":
        # Micro-batch 1 gathers as usual (2L+1) and keeps its parameters after backward; micro-batch 2
        # forwards on them, reshards its blocks after forward and re-gathers them in backward (L).
        sp = 2 * 2 * (2 * L + 1)  # 2 micro-batches x forward and backward x (2L+1)
        assert counts == {"_allgather_base": 3 * L + 1, "_reduce_scatter_base": L + 1, "reduce_scatter": sp,
                          "all_gather": sp, "all_reduce": 2 * L + 1, "allreduce": 2}
    elif name == "fsdp4-tp2-sp":  # 1 micro-batch; the norms' Partial tp grads: 2L+1 all-reduces
        assert counts == fsdp | {"reduce_scatter": 2 * (2 * L + 1), "all_gather": 2 * (2 * L + 1),
                                 "all_reduce": 2 * L + 1, "allreduce": 2}


JOBS = {name: train_job(f"parallel/{name}", nproc, layout) for name, (nproc, layout, _) in LAYOUTS.items()}


@jobs("name", JOBS)
def test_layout_equals_single_rank(batches, name):
    nproc, layout, line = LAYOUTS[name]
    got = run_layout(batches, JOBS[name])
    assert line in got["layout"]
    assert_matches_reference(got, reference(()), COMPILED_RTOL if "compiled" in name else LOSS_RTOL)
    expected_collectives(name, got["comm_counts"])
    if "compiled" in name:
        assert_compiled_once(got)


FAMILY_JOBS = {f"{family}-{name}": train_job(f"parallel/{family}-{name}", nproc, parallel, options + model)
               for family, (options, layouts) in FAMILY_LAYOUTS.items()
               for name, (nproc, parallel, model) in layouts.items()}


@jobs("name", FAMILY_JOBS)
def test_family_layout_equals_single_rank(batches, name):
    """Each family of tests/parity.py's FAMILY_LAYOUTS on its representative layouts."""
    family, layout = name.split("-", 1)
    options, layouts = FAMILY_LAYOUTS[family]
    assert_matches_reference(run_layout(batches, FAMILY_JOBS[name]), reference(options + layouts[layout][2]))


PP = ["--parallel.pp", "2"]
V2 = PP + ["--parallel.vpp", "2"]
TIED = ("--model.tie-word-embeddings", "True")
TIED_AC_FSDP2 = train_job("parallel/tied-ac-fsdp2", 2, ["--parallel.dp-shard", "2"],
                          TIED + ("--train.activation-checkpointing", "full"))


@pytest.mark.job(TIED_AC_FSDP2)
def test_tied_embeddings_and_activation_checkpointing_under_fsdp(batches):
    assert_matches_reference(run_layout(batches, TIED_AC_FSDP2), reference(TIED))


TIED_LAYOUTS = {  # name: (ranks, layout, model)
    # one vocab-parallel parameter for the embedding and the head (FSDP alone: tied-ac-fsdp2 above)
    "tp2-sp": (2, ["--parallel.tp", "2", "--parallel.sp", "True"], ()),
    # a copy on the first and the last stage, gradients summed between their ranks every step
    "pp2": (2, PP, PP_MODEL),
    "pp2-tp2-sp": (4, PP + ["--parallel.tp", "2", "--parallel.sp", "True"], PP_MODEL),
    # the V schedule puts the first and the last stage on rank 0: the sum is local
    "pp2-zbv": (2, V2 + ["--parallel.pp-schedule", "ZBVZeroBubble"], PP_MODEL),
}
TIED_JOBS = {name: train_job(f"parallel/tied-{name}", nproc, layout, TIED + model)
             for name, (nproc, layout, model) in TIED_LAYOUTS.items()}


@jobs("name", TIED_JOBS)
def test_tied_embeddings_under_tensor_and_pipeline_parallelism(batches, name):
    got = run_layout(batches, TIED_JOBS[name])
    assert_matches_reference(got, reference(TIED + TIED_LAYOUTS[name][2]))
    # the head is the embedding, bit for bit, after 5 steps on whichever ranks hold them
    assert torch.equal(got["state"]["lm_head.weight"], got["state"]["embed_tokens.weight"])


PIPELINE_LAYOUTS = {  # name: (ranks, options, layout line, rank 0's stages)
    "pp2-1f1b": (2, PP, "TP1 PP2 DP1 CP1 EP1 [1F1B]", [0]),
    "pp2-gpipe": (2, PP + ["--parallel.pp-schedule", "GPipe"], "[GPipe]", [0]),
    "pp2-layers-1-3": (2, PP + ["--parallel.pp-layers-per-stage", "1", "3"], "[1F1B]", [0]),
    "pp2-vpp2-interleaved1f1b": (2, V2, "[VPP2, Interleaved1F1B]", [0, 2]),
    "pp2-vpp2-loopedbfs": (2, V2 + ["--parallel.pp-schedule", "LoopedBFS"], "LoopedBFS", [0, 2]),
    "pp2-vpp2-interleavedzb": (2, V2 + ["--parallel.pp-schedule", "InterleavedZeroBubble"], "InterleavedZeroBubble", [0, 2]),
    "pp2-zbv": (2, V2 + ["--parallel.pp-schedule", "ZBVZeroBubble"], "ZBVZeroBubble", [0, 3]),
    "pp2-dualpipev": (2, V2 + ["--parallel.pp-schedule", "DualPipeV"], "DualPipeV", [0, 3]),
    "pp2-tp2-sp": (4, PP + ["--parallel.tp", "2", "--parallel.sp", "True"], "TP2 PP2 DP1 CP1 EP1 [SP, 1F1B]", [0]),
    # FSDP under a zero-bubble schedule: wrong grads in torch 2.13 if blocks reshard after forward.
    "pp2-zbv-dp2": (4, V2 + ["--parallel.pp-schedule", "ZBVZeroBubble", "--train.micro-batch-size", "1"],
                    "TP1 PP2 DP2", [0, 3]),
    "pp2-dp2-tp2": (8, PP + ["--parallel.tp", "2"], "TP2 PP2 DP2 CP1 EP1 [1F1B]", [0]),
    "pp2-compiled": (2, PP + ["--train.compile", "True"], "TP1 PP2 DP1 CP1 EP1 [1F1B]", [0]),
    "pp2-selective-ac": (2, PP + ["--train.activation-checkpointing", "selective"], "TP1 PP2 DP1 CP1 EP1 [1F1B]", [0]),
}


def expected_p2p(stages: list[int], num_stages: int, microbatches: int) -> int:
    """Sends (= recvs) of one step on a rank holding ``stages``: an activation to the next stage and
    a gradient to the previous one per micro-batch, unless that neighbour is on the same rank."""
    sends = 0
    for s in stages:
        sends += (s < num_stages - 1 and s + 1 not in stages) + (s > 0 and s - 1 not in stages)
    return sends * microbatches


PIPELINE_JOBS = {name: train_job(f"parallel/{name}", nproc, layout, PP_MODEL)
                 for name, (nproc, layout, _, _) in PIPELINE_LAYOUTS.items()}


@jobs("name", PIPELINE_JOBS)
def test_pipeline_layout_equals_single_rank(batches, name):
    nproc, layout, line, stages = PIPELINE_LAYOUTS[name]
    got = run_layout(batches, PIPELINE_JOBS[name])
    assert line in got["layout"]
    assert_matches_reference(got, reference(PP_MODEL), COMPILED_RTOL if "compiled" in name else LOSS_RTOL)
    if "compiled" in name:  # collectives not counted (no dispatch mode under dynamo)
        assert_compiled_once(got)
        return
    cfg = parse(JobConfig, TINY + list(PP_MODEL) + layout, "check")
    dp = nproc // (2 * cfg.parallel.tp)
    microbatches = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    steady = got["comm_counts_step2"]
    want = expected_p2p(stages, 2 * cfg.parallel.vpp, microbatches)
    assert steady["send"] == steady["recv"] == want, steady
    # The trainer's own all-reduces: loss over pp, loss over dp (if any), the global grad norm.
    assert steady["allreduce"] == 2 + (dp > 1)
    if dp > 1:  # FSDP under a pipeline keeps blocks gathered: each unit gathers once per step
        units = len(stages) * (4 // (2 * cfg.parallel.vpp) + 1)  # each stage's layers and its root
        assert steady["_allgather_base"] == steady["_reduce_scatter_base"] == units, steady


MESH_GROUPS = Job("parallel/mesh-groups", 8, "mesh")


@pytest.mark.job(MESH_GROUPS)
def test_mesh_groups_on_eight_ranks(batches):
    """Every flattened submesh and the expert grid hold the ranks the layout table says
    (tests/workers/mesh.py raises on any other)."""
    assert (batches.result(MESH_GROUPS) / "done").exists()
