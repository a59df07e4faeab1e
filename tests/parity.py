"""What every parity test shares: a layout's run (a batch job, tests/workers/train.py) equals the
single-process reference run (tests/reference.py) in per-step loss, grad norm and final weights.

A new model family proves itself by a line in FAMILY_LAYOUTS (its model options and a few
representative layouts); tests/test_parallel.py runs each against that family's reference.
"""

from __future__ import annotations

import functools
import json

import torch

from meshtrain.cli import parse
from meshtrain.config import JobConfig
from tests.batch import Job
from tests.conftest import tiny_args
from tests.reference import reference_run

TINY = tiny_args()
# The model section of TINY would contradict an imported config.json; data and steps still apply.
TINY_NO_MODEL = [a for i, a in enumerate(TINY) if not (a.startswith("--model.") or
                                                      (i > 0 and TINY[i - 1].startswith("--model.")))]
PP_MODEL = ("--model.num-hidden-layers", "4")  # pp2 x vpp2 = 4 stages of one layer
MOE_ARGS = ("--model.family", "qwen3_moe", "--model.num-experts", "4", "--model.num-experts-per-tok", "2",
            "--model.moe-intermediate-size", "32")

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-4
"""AdamW moves each element by lr x m / sqrt(v): where an element's gradients are near-cancelling
sums, a reduction-order difference of ~1e-7 in them changes that ratio visibly. Measured outliers,
one element in thousands: up to 4.2e-5 on a Xeon runner (qwen3 tp2 down_proj, LoRA dp2 at lr 1e-2),
under 2e-5 on the one before; every other element, and the losses and grad norms (1e-5), agree
much closer. 1e-4 is 3% of one step's largest move at lr 3e-3."""
WEIGHT_RTOL = 1e-4
COMPILED_RTOL = 1e-4
"""Compiled layers against the eager reference: inductor's fused kernels sum in another order."""

QWEN3 = ("--model.family", "qwen3")
NEW_FAMILY_STEPS = ("--train.steps", "3")
"""The families after Qwen3 train 3 steps (TINY: 5): the suite's time, spent on their 20 layouts."""
GEMMA3 = (*NEW_FAMILY_STEPS, "--model.family", "gemma3", "--model.tie-word-embeddings", "True", "--model.sliding-window", "8",
          "--model.local-rope-theta", "10000", "--model.head-dim", "8", "--model.query-pre-attn-scalar", "12",
          "--model.layer-types", "sliding_attention", "full_attention")
GEMMA2 = (*NEW_FAMILY_STEPS, "--model.family", "gemma2", "--model.tie-word-embeddings", "True", "--model.sliding-window", "8",
          "--model.head-dim", "8", "--model.query-pre-attn-scalar", "12", "--model.attn-logit-softcapping", "2.0",
          "--model.final-logit-softcapping", "3.0")
GEMMA3_PP = PP_MODEL + ("--model.layer-types", "sliding_attention", "full_attention", "sliding_attention",
                        "full_attention")
DEEPSEEK_V3 = (*NEW_FAMILY_STEPS, "--model.family", "deepseek_v3", "--model.kv-lora-rank", "16",
               "--model.q-lora-rank", "24", "--model.qk-nope-head-dim", "8", "--model.qk-rope-head-dim", "4",
               "--model.v-head-dim", "6", "--model.num-experts", "8", "--model.num-experts-per-tok", "3",
               "--model.moe-intermediate-size", "16", "--model.shared-expert-intermediate-size", "32",
               "--model.n-group", "4", "--model.topk-group", "2", "--model.routed-scaling-factor", "2.5",
               "--model.mlp-only-layers", "0", "--model.router-bias-update-rate", "0.01",
               "--model.rope-scaling.type", "yarn", "--model.rope-scaling.factor", "4",
               "--model.rope-scaling.original-max-position-embeddings", "16", "--model.rope-scaling.mscale-all-dim", "0.8")
GPT_OSS = (*NEW_FAMILY_STEPS, "--model.family", "gpt_oss", "--model.num-experts", "4", "--model.num-experts-per-tok", "2",
           "--model.moe-intermediate-size", "32", "--model.sliding-window", "8", "--model.swiglu-limit", "0.5",
           "--model.rope-scaling.type", "yarn", "--model.rope-scaling.factor", "4", "--model.rope-scaling.truncate", "False",
           "--model.rope-scaling.original-max-position-embeddings", "16")
EP2, SP2 = ("--parallel.ep", "2"), ("--parallel.tp", "2", "--parallel.sp", "True")


def expert_layouts(pp_model: tuple[str, ...]) -> dict:
    """Beside every_layout's: ep2, ep2 x etp2, tp2+SP x ep2 and the 8-rank pp2 x dp2 x tp2+SP x ep2."""
    return {"ep2": (2, EP2, ()), "ep2-etp2": (4, (*EP2, "--parallel.etp", "2"), ()), "tp2-sp-ep2": (2, (*SP2, *EP2), ()),
            "pp2-dp2-tp2-sp-ep2": (8, ("--parallel.pp", "2", *SP2, *EP2), pp_model)}


def every_layout(pp_model: tuple[str, ...], *names: str) -> dict:
    """Of dp2, tp2+SP, pp2, cp2 and pp2 x dp2 x tp2+SP (8 ranks), the ``names`` (all by default): the
    layouts a family's own blocks meet. The parallel plumbing itself is proven on Llama's full matrix."""
    pp = ("--parallel.pp", "2")
    layouts = {"dp2": (2, ("--parallel.dp-shard", "2"), ()),
               "tp2-sp": (2, ("--parallel.tp", "2", "--parallel.sp", "True"), ()),
               "pp2": (2, pp, pp_model),
               "cp2": (2, ("--parallel.cp", "2"), ()),
               "pp2-dp2-tp2-sp": (8, (*pp, "--parallel.tp", "2", "--parallel.sp", "True"), pp_model)}
    return {name: layouts[name] for name in names or layouts}


FAMILY_LAYOUTS = {  # family: (model options over TINY, {layout: (ranks, parallel options, more model options)})
    "qwen3": (QWEN3, {
        # q/k norms are replicated over tp and fed sharded heads: their grads must be summed over tp
        "tp2-sp-hsdp": (8, ("--parallel.tp", "2", "--parallel.sp", "True", "--parallel.dp-replicate", "2"),
                        ("--model.head-dim", "8")),
        # without FSDP the replicated q/k norm DTensors sit beside plain norm tensors: the optimizer's
        # foreach step must not mix them (it raised before the param groups were split by kind)
        "tp2": (2, ("--parallel.tp", "2"), ()),
    }),
    # q/k/v biases: column-parallel with their weights (tp), gathered by FSDP (dp)
    "qwen2": (("--model.family", "qwen2", *NEW_FAMILY_STEPS), every_layout(PP_MODEL, "tp2-sp", "dp2")),
    # a window of 8 in sequences of 32 (under cp: keys gathered, the window masked by global position),
    # and head_dim 8, not hidden / heads = 16 (tp splits heads)
    "mistral": (("--model.family", "mistral", "--model.sliding-window", "8", "--model.head-dim", "8",
                 *NEW_FAMILY_STEPS), every_layout(PP_MODEL, "cp2", "tp2-sp")),
    # a local layer (window 8, its own RoPE base) and a global one, four norms per layer, a tied scaled
    # embedding, query_pre_attn_scalar 12 with head_dim 8: every layout, the 8-rank one too
    "gemma3": (GEMMA3, every_layout(GEMMA3_PP)),
    # soft-capped scores (computed without SDPA: under cp with every rank's keys) and logits (under tp
    # on the vocab shards), alternating local and global layers
    "gemma2": (GEMMA2, every_layout(PP_MODEL, "cp2", "tp2-sp")),
    # Mistral's blocks (the checkpoint's fused tensors are tests/test_checkpoint_parallel.py's import
    # layout): the family trains under tp and SP as on one rank
    "phi3": (("--model.family", "phi3", "--model.sliding-window", "8", *NEW_FAMILY_STEPS), every_layout(PP_MODEL, "tp2-sp")),
    # latent attention (tp: per-head projections split, the latent ones whole; cp: the ring with values
    # padded to the query dims), YaRN, a dense first layer, sigmoid group-limited routing with a shared
    # expert and the routing bias updated every step, under every layout and the expert ones
    "deepseek_v3": (DEEPSEEK_V3, every_layout(PP_MODEL, "dp2", "tp2-sp", "pp2", "cp2") | expert_layouts(PP_MODEL)),
    # sinks (computed on materialised scores: under cp against every rank's gathered keys; under tp
    # each rank's heads' sinks), q/k/v/o biases, a window of 8 on alternate layers, interleaved gate/up
    # experts with biases (etp: whole gate/up column pairs; the down bias beside the router)
    "gpt_oss": (GPT_OSS, every_layout(PP_MODEL, "dp2", "tp2-sp", "pp2", "cp2") | expert_layouts(PP_MODEL)),
}
"""Families other than Llama (tests/test_parallel.py's full matrix) and the MoE families
(tests/test_moe.py's), each on a few layouts chosen for what the family adds."""


@functools.cache
def reference(extra: tuple[str, ...]) -> dict:
    """The single-process run of TINY + ``extra`` (cached: many layouts share one reference)."""
    return reference_run(parse(JobConfig, TINY + list(extra), "ref"))


def train_job(name: str, nproc: int, layout: list[str] | tuple[str, ...], extra: tuple[str, ...] = ()) -> Job:
    """A batch job (tests/workers/train.py) training TINY (+ extra) under ``layout`` on ``nproc`` ranks."""
    return Job(name, nproc, "train", (*TINY, *extra, *layout))


def run_layout(batches, job: Job) -> dict:
    return torch.load(batches.result(job) / "out.pt", weights_only=False)


def assert_matches_reference(got: dict, ref: dict, rtol: float = LOSS_RTOL) -> None:
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=rtol, atol=0)
    torch.testing.assert_close(got["grad_norms"], ref["grad_norms"], rtol=rtol, atol=0)
    assert got["state"].keys() == ref["state"].keys()
    for name, want in ref["state"].items():
        torch.testing.assert_close(got["state"][name], want, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL, msg=name)
    assert ref["losses"][-1] < ref["losses"][0]  # the run trained: a comparison of something


def assert_compiled_once(got: dict) -> None:
    """Graphs compiled in step 1 and none after it: no step recompiles."""
    graphs = got["compiled_graphs"]
    assert graphs[0] >= 1 and graphs == graphs[:1] * len(graphs), graphs


def checkpoint_of_step3(job: Job) -> str:
    """The step-3 checkpoint a ``meshtrain train`` job (tests/workers/train_command.py) writes."""
    return f"{{jobs}}/{job.name}/checkpoints/step-000003"


def metrics(batches, job: Job) -> list[dict]:
    """The metrics.jsonl records of a ``meshtrain train`` job run with --logging.jsonl True."""
    return [json.loads(line) for line in (batches.result(job) / "metrics.jsonl").read_text().splitlines()]


def losses(batches, job: Job) -> list[float]:
    return [record["loss"] for record in metrics(batches, job)]
