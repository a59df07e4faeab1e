"""meshtrain plan: recommendations per the reference table, rejections with their rule, the memory
model's headline numbers, and its per-rank bytes against what the trainer really allocates."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from meshtrain.cli import main
from meshtrain.config import ModelConfig, PeftConfig
from meshtrain.errors import ConfigError
from meshtrain.models.initialize import init_weights
from meshtrain.models.lora import add_lora
from meshtrain.parallel.layout import plan_layout
from meshtrain.models.transformer import Transformer, count_parameters
from meshtrain.planning.memory import Sizes, estimate, layer_activation_elements, rank_parameters, trainer_rank_state
from meshtrain.planning.options import GB, PlanConfig
from meshtrain.planning.recommend import recommend
from meshtrain.planning.report import unsharded
from meshtrain.planning.shapes import (active_parameters, parameter_tensors, resolve, shape_from_count,
                                      shape_from_hf_config, shape_from_model_config, total_parameters,
                                      trainable_parameters)
from tests.batch import Job, jobs
from tests.conftest import ROOT, tiny_config


def plan(**kw):
    cfg, shape = resolve(PlanConfig(**kw))
    return recommend(cfg, shape), cfg


# ---- recommendations ---------------------------------------------------------------------------

def test_deepseek_v3_gets_its_published_layout_class():
    p, _ = plan(params="671b", active_params="37b", num_experts=256, experts_per_token=8, gpus=2048)
    assert (p.sizes.tp, p.sizes.pp, p.sizes.ep) == (2, 16, 64)
    assert abs(total_parameters(p.shape) / 671e9 - 1) < 0.01 and abs(active_parameters(p.shape) / 37e9 - 1) < 0.01


def test_deepseek_v3_s_own_config_json_counts_its_published_parameters_and_gets_its_layout():
    """The released config.json (tests/model_configs/README.md): latent attention's real tensors and
    the dense first layers counted from the model itself. DeepSeek's weight notes give 671B
    parameters, 36.6B activated counting the output head but not the embedding (0.93B)."""
    p, _ = plan(model=str(ROOT / "tests/model_configs/deepseek-ai-DeepSeek-V3.json"), gpus=2048)
    embedding = 129280 * 7168
    assert p.shape.model.family == "deepseek_v3" and p.shape.dense_layers == (0, 1, 2)
    assert abs(total_parameters(p.shape) / 671.0e9 - 1) < 1e-3
    assert abs((active_parameters(p.shape) - embedding) / 36.6e9 - 1) < 2e-3
    assert (p.sizes.tp, p.sizes.pp, p.sizes.ep) == (2, 16, 64)


def test_kimi_k2_lands_in_the_over_500b_moe_row():
    p, _ = plan(params="1t", active_params="32b", num_experts=384, experts_per_token=8, gpus=2048)
    assert p.sizes.tp == 2 and p.sizes.pp == 16 and p.sizes.ep in (32, 64)


@pytest.mark.parametrize("interconnect,tp", [("nvlink", 4), ("infiniband", 4), ("ethernet", 2)])
def test_topology_moves_tp_inside_the_table_range(interconnect, tp):
    p, _ = plan(params="8b", gpus=16, interconnect=interconnect)
    assert p.sizes.tp == tp and p.sizes.pp == 1


def test_small_models_get_data_parallel_only():
    p, _ = plan(params="0.5b", gpus=8)
    assert (p.sizes.tp, p.sizes.pp, p.sizes.dp) == (1, 1, 8)


def test_ethernet_prefers_pipeline_over_tensor_parallel():
    ib, _ = plan(params="70b", gpus=64, interconnect="infiniband")
    eth, _ = plan(params="70b", gpus=64, interconnect="ethernet")
    assert ib.sizes.tp == 8 and eth.sizes.tp == 4 and eth.sizes.pp > ib.sizes.pp


@pytest.mark.parametrize("seq,cp", [(4096, 1), (16384, 2), (65536, 4)])
def test_long_sequences_add_context_parallel(seq, cp):
    p, _ = plan(params="8b", gpus=64, seq_len=seq, activation_checkpointing="full")
    assert p.sizes.cp == cp and p.sizes.sp


def test_the_biggest_dense_row_adds_cp2():
    p, _ = plan(params="405b", gpus=1024, activation_checkpointing="full")
    assert p.sizes.tp == 8 and 8 <= p.sizes.pp <= 16 and p.sizes.cp == 2


def test_mixtral_and_qwen3_moe_from_hf_configs(tmp_path):
    import transformers

    configs = {
        "mixtral": transformers.MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                              num_experts_per_tok=2),
        "qwen3_moe": transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                                 moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                                                 num_key_value_heads=2, head_dim=16, num_experts=8,
                                                 num_experts_per_tok=2, mlp_only_layers=[0]),
    }
    for name, hf in configs.items():
        with torch.device("meta"):
            want = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf).parameters())
        d = tmp_path / name
        hf.save_pretrained(d)
        shape = shape_from_hf_config(json.loads((d / "config.json").read_text()), name)
        # HF's router is "gate" in both; the planner stacks experts as the trainer will (#6).
        assert total_parameters(shape) == want, name
        p, _ = plan(model=str(d), gpus=4, seq_len=256)
        assert p.sizes.ep > 1 and shape.num_experts % p.sizes.ep == 0


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma2", "gemma3"])
def test_dense_family_configs_plan_the_tensors_transformers_builds(family, tmp_path):
    """The inventory is the model itself: Qwen2's q/k/v biases and Mistral's head_dim counted (and a tied
    head once), with the biases split by tp like their weights."""
    from tests.hf_models import hf_config

    hf = hf_config(family, tie_word_embeddings=family != "mistral")
    with torch.device("meta"):
        want = sum(p.numel() for p in transformers_model(hf).parameters())
    hf.save_pretrained(tmp_path)
    shape = shape_from_hf_config(json.loads((tmp_path / "config.json").read_text()), family)
    assert total_parameters(shape) == want
    biases = {t.name: t.tp_dim for t in parameter_tensors(shape) if t.name.endswith(".bias")}
    assert (len(biases) == 3 * 2 and set(biases.values()) == {0}) if family == "qwen2" else not biases
    p, _ = plan(model=str(tmp_path), gpus=2, seq_len=32)
    assert p.sizes.world == 2


def test_an_architecture_meshtrain_cannot_train_is_planned_by_size_instead(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], "hidden_size": 64}))
    with pytest.raises(ConfigError, match=r"FalconForCausalLM.*not supported.*Fix: plan it by size instead"):
        plan(model=str(tmp_path), gpus=8)


def transformers_model(config):
    import transformers

    return transformers.AutoModelForCausalLM.from_config(config)


def test_a_meshtrain_yaml_supplies_shape_sequence_and_precision():
    p, cfg = plan(model=str(ROOT / "configs" / "debug.yaml"), gpus=4)
    job = __import__("meshtrain.config_files", fromlist=["load_yaml"]).load_yaml(str(ROOT / "configs" / "debug.yaml"))
    assert total_parameters(p.shape) == count_parameters(job.model)
    assert cfg.seq_len == job.train.seq_len and cfg.precision == "fp32"


# ---- rejections --------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,needle", [
    (dict(params="70b", gpus=6, tp=4), "--gpus=6 is not divisible by --tp = 4"),
    (dict(params="8b", gpus=12, tp=3), "--tp=3 must divide model.num_attention_heads=32"),
    (dict(params="8b", gpus=8, ep=2), "expert parallelism needs an MoE model"),
    (dict(params="8b", gpus=16, cp=4, seq_len=4100), "--seq-len=4100 must be divisible by 2*cp = 8"),
    (dict(params="70b", gpus=8), "does not fit on 8 GPUs of 80 GB"),
    (dict(params="671b", active_params="37b", num_experts=256, gpus=2048, ep=48), "not divisible by --ep=48"),
    (dict(params="seventy", gpus=8), "--params='seventy' is not a parameter count"),
    (dict(gpus=8), "exactly one of --model"),
    (dict(model="/nonexistent", gpus=8), "no such file or directory"),
    (dict(params="8b", active_params="1b", gpus=8), "--active-params is given for a dense model"),
])
def test_impossible_requests_name_the_rule(kw, needle):
    with pytest.raises(ConfigError, match=None) as e:
        plan(**kw)
    assert needle in str(e.value)


def test_not_fitting_says_how_many_gpus_would(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--params", "70b", "--gpus", "8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "use at least 16 GPUs" in err and "Traceback" not in err


# ---- the memory model --------------------------------------------------------------------------

def test_headline_70b_fp16_without_parallelism():
    """The reference's 608 GB: 8 B/param (fp16 weights, grads, two fp16 Adam moments) for 70.55B
    parameters is 564.4 GB; activations at seq 2048 (SwiGLU with GQA saves 20.25 T h per layer with a
    fused norm, the headline's GPT-style count 17 T h) bring it to ~621 GB, 2% above."""
    p, cfg = plan(params="70b", gpus=64, precision="fp16", optimizer_states="half", seq_len=2048, tp=4, pp=4, vpp=1)
    single = unsharded(p, cfg)
    assert single.states == pytest.approx(total_parameters(p.shape) * 8)
    assert single.states / GB == pytest.approx(564.4, abs=0.1)
    assert single.total / GB == pytest.approx(608, rel=0.03)
    # TP4 x PP4 (x DP4 replicas): weights, grads and optimizer state are about 1/16 each (the
    # first stage also holds the embedding, +3%); FSDP over dp4 divides them by 4 more.
    assert p.memory.states_no_fsdp / (single.states / 16) == pytest.approx(1.0, abs=0.04)
    assert p.memory.states == pytest.approx(p.memory.states_no_fsdp / 4, rel=1e-3)
    # The naive 608/16 = 38 GB per GPU assumes one micro-batch of activations; 1F1B's first stage
    # keeps pp = 4 of them, which this estimate counts.
    assert p.memory.in_flight == 4
    assert p.memory.activations == pytest.approx(4 * 20 * p.memory.activations_per_layer)


def test_sp_cp_and_checkpointing_shrink_activations_as_stated():
    s = shape_from_count(70e9, None, 0, 0)
    base = Sizes(world=8, tp=8)
    no_sp = layer_activation_elements(s, 0, base, 4096, "none")
    sp = layer_activation_elements(s, 0, dataclasses.replace(base, sp=True), 4096, "none")
    cp2 = layer_activation_elements(s, 0, dataclasses.replace(base, sp=True, cp=2), 4096, "none")
    ac = layer_activation_elements(s, 0, dataclasses.replace(base, sp=True), 4096, "full")
    T, h = 4096, s.hidden_size
    assert no_sp - sp == pytest.approx(2 * T * h * (1 - 1 / 8))
    assert cp2 == pytest.approx(sp / 2) and ac == pytest.approx(T * h / 8)


FAMILY_OPTIONS = {  # each family's own blocks at the tests' size: windows shorter than the sequence, MoE layers
    "llama": {}, "qwen3": {}, "qwen3_moe": dict(num_experts=4, moe_intermediate_size=192),
    "gemma2": dict(tie_word_embeddings=True, sliding_window=32, query_pre_attn_scalar=32, attn_logit_softcapping=50.0),
    "gpt_oss": dict(num_experts=4, moe_intermediate_size=192, sliding_window=32),
    "deepseek_v3": dict(num_key_value_heads=8, kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32,
                        qk_rope_head_dim=16, v_head_dim=32, num_experts=4, moe_intermediate_size=192),
}


def family_config(family: str) -> ModelConfig:
    return ModelConfig(**(dict(family=family, hidden_size=256, intermediate_size=768, num_hidden_layers=1,
                               num_attention_heads=8, num_key_value_heads=2, vocab_size=512) | FAMILY_OPTIONS[family]))


@pytest.mark.parametrize("family", FAMILY_OPTIONS)
def test_activation_formula_matches_what_autograd_saves(family):
    """One decoder layer on CPU (fp32, composite RMSNorm): the bytes of every tensor its backward keeps
    (weights and the RoPE tables excluded) against the per-layer formula: Gemma 2's four norms and
    soft-capped scores, GPT-OSS's sinks and clamped experts, DeepSeek-V3's latent attention, the MoE
    layers' routed copies."""
    cfg = family_config(family)
    formula = layer_activation_elements(shape_from_model_config(cfg, family), 0, Sizes(world=1), 2 * 128, "none",
                                        fused_norm=False, seq_len=128, activation_bytes=4) * 4
    # what the formula leaves out: RMSNorm's rstd, SDPA's logsumexp (a number per row), routing's indices
    assert saved_bytes(cfg, 128) == pytest.approx(formula, rel=0.01)


def saved_bytes(cfg: ModelConfig, seq: int, batch: int = 2) -> int:
    """The bytes of every tensor one decoder layer's backward keeps (weights and RoPE tables excluded)."""
    model = Transformer(cfg)
    init_weights(model, 0)
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t):
        if (ptr := t.untyped_storage().data_ptr()) not in skip:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(batch, seq, cfg.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers["0"](x, model.rope_cos, model.rope_sin)
    return sum(saved.values())


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_materialised_attention_keeps_every_score_as_planned(family):
    """Soft-capped (Gemma 2) and sink (GPT-OSS) attention keep each head's probabilities for every
    key (Gemma 2 its tanh output too), the only activations that grow with the square of the
    sequence: what autograd keeps beyond twice the half-length run is the formula's."""
    cfg = family_config(family)
    shape = shape_from_model_config(cfg, family)

    def formula(seq: int) -> float:
        return layer_activation_elements(shape, 0, Sizes(world=1), 2 * seq, "none", fused_norm=False, seq_len=seq,
                                         activation_bytes=4) * 4

    quadratic = saved_bytes(cfg, 128) - 2 * saved_bytes(cfg, 64)
    assert quadratic == pytest.approx(formula(128) - 2 * formula(64), rel=0.025)  # the boolean mask is left out


def kept_for_backward(layer, x: torch.Tensor, *args) -> int:
    """Bytes a layer's forward leaves alive for backward (``telemetry.allocation.activations_kept``),
    plus its input, which the caller keeps; weights and the RoPE tables are not counted."""
    from meshtrain.telemetry.allocation import activations_kept

    kept, out = activations_kept(layer, x, *args, exclude=[*layer.parameters(), *args])
    out.sum().backward()
    return kept + x.untyped_storage().nbytes()


@pytest.mark.parametrize("family,ac", [("llama", "none"), ("llama", "full"), ("llama", "selective"),
                                       ("qwen3", "selective"), ("qwen3_moe", "selective")])
def test_activation_formula_matches_what_a_checkpointed_layer_keeps(family, ac):
    """none, full and selective checkpointing (models/checkpointing.py) of one decoder layer on CPU
    against the per-layer formula (composite RMSNorm)."""
    moe = dict(num_experts=4, moe_intermediate_size=192) if family == "qwen3_moe" else {}
    cfg = ModelConfig(family=family, hidden_size=256, intermediate_size=768, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=2, vocab_size=512, **moe)
    model = Transformer(cfg)
    init_weights(model, 0)
    model.activation_checkpointing = ac
    x = torch.randn(2, 128, 256, requires_grad=True)

    def layer(h, cos, sin):  # through the model's own dispatch of checkpointing
        from meshtrain.models.checkpointing import run_layer

        return run_layer(model.layers["0"], 0, ac, 1, h, cos, sin)

    layer.parameters = model.layers["0"].parameters
    kept = kept_for_backward(layer, x, model.rope_cos, model.rope_sin)
    formula = layer_activation_elements(shape_from_model_config(cfg, family), 0, Sizes(world=1), 2 * 128, ac,
                                        fused_norm=False) * 4
    # what the formula leaves out: RMSNorm's rstd, SDPA's logsumexp, routing indices (a number per row)
    assert kept == pytest.approx(formula, rel=0.03), (kept, formula)


def test_parameter_inventory_equals_the_model():
    moe = dict(num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=32, mlp_only_layers=[1])
    for family in ("llama", "qwen3", "qwen3_moe", "mixtral"):
        cfg = ModelConfig(family=family, head_dim=48 if family == "qwen3" else None,
                          **(moe if family in ("qwen3_moe", "mixtral") else {}))
        with torch.device("meta"):
            names = {n: tuple(p.shape) for n, p in Transformer(cfg).named_parameters()}
        assert {t.name: t.shape for t in parameter_tensors(shape_from_model_config(cfg, family))} == names
        # with LoRA (dense and expert targets, the head named): the adapters and which tensors train
        targets = ("*.q_proj", "*.down_proj", "*.experts.up_proj", "lm_head")
        with torch.device("meta"):
            model = Transformer(cfg)
        add_lora(model, PeftConfig(method="lora", rank=8, targets=list(targets)))
        lora = dataclasses.replace(shape_from_model_config(cfg, family), lora_rank=8, lora_targets=targets)
        assert {t.name: (t.shape, t.trainable) for t in parameter_tensors(lora)} == {
            n: (tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()}


def test_lora_plans_gradients_and_optimizer_state_for_the_adapters_only(capsys):
    cfg, s = resolve(PlanConfig(params="8b", lora_rank=16))
    assert trainable_parameters(s) == 41_943_040  # Llama 3 8B, r = 16 on all seven projections (PEFT's count too)
    sizes = Sizes(world=8, tp=4, sp=True, stage_layers=(32,))
    lora, full = (estimate(shape, sizes, cfg, "1F1B", 1, "none") for shape in (s, dataclasses.replace(s, lora_rank=0)))
    assert lora.params == full.params + lora.trained  # the base stays, the adapters add to it
    assert lora.grads == lora.trained * 4 and lora.optimizer == lora.trained * 8 < full.optimizer / 50
    main(["plan", "--model", str(ROOT / "configs" / "lora_chat.yaml"), "--gpus", "2"])
    assert "LoRA rank 16 on *.q_proj" in capsys.readouterr().out  # the YAML's peft section
    _, dora = resolve(PlanConfig(params="8b", lora_rank=16, dora=True))
    assert trainable_parameters(dora) - trainable_parameters(s) == 32 * (2 * 4096 + 2 * 1024 + 2 * 14336 + 4096)  # rows
    with pytest.raises(ConfigError, match="--lora-targets or --dora is given without --lora-rank"):
        resolve(PlanConfig(params="8b", lora_targets=["*.q_proj"]))
    with pytest.raises(ConfigError, match=r"LoRA targets \['\*.qproj'\] match no linear layer"):
        resolve(PlanConfig(params="8b", lora_rank=8, lora_targets=["*.qproj"]))


def test_preference_training_plans_the_frozen_reference_copy_unless_lora_switches_adapters_off(capsys):
    sizes = Sizes(world=8, tp=2, sp=True, stage_layers=(32,))
    cfg, s = resolve(PlanConfig(params="8b", preference=True))
    plain, dpo = (estimate(shape, sizes, cfg, "1F1B", 1, "none") for shape in (dataclasses.replace(s, reference_copy=False), s))
    assert dpo.total - plain.total == dpo.weights  # one more copy of the weights, sharded alike; no grads or moments
    cfg, lora = resolve(PlanConfig(params="8b", preference=True, lora_rank=16))
    assert not lora.reference_copy  # the base with the adapters off is the reference
    main(["plan", "--params", "8b", "--gpus", "8", "--preference", "True"])
    assert "reference copy, frozen (4 B/param)" in capsys.readouterr().out


# ---- per-rank bytes vs the trainer -------------------------------------------------------------

LAYOUTS = {
    2: [("dp2", {}), ("tp2", {"parallel": {"tp": 2}}), ("pp2", {"parallel": {"pp": 2}}),
        ("moe_dp2", {"model": {"family": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32,
                               "shared_expert_intermediate_size": 48, "mlp_only_layers": [0]}}),
        ("moe_tp2_sp", {"model": {"family": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32,
                                  "shared_expert_intermediate_size": 48}, "parallel": {"tp": 2, "sp": True}}),
        # LoRA: the base frozen (weights only), the adapters placed like their base (here on experts split by etp)
        ("lora_moe_tp2_sp_etp2", {"model": {"family": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32},
                                  "parallel": {"tp": 2, "sp": True, "etp": 2},
                                  "peft": {"method": "lora", "rank": 4,
                                           "targets": ["*.q_proj", "*.o_proj", "*.experts"]}})],
    4: [("dp4", {"train": {"micro_batch_size": 1}}),
        ("tp2_dp2", {"parallel": {"tp": 2, "sp": True}}),
        ("tp2_dp2_qwen3_bf16", {"model": {"family": "qwen3"}, "parallel": {"tp": 2},
                                "train": {"mixed_precision": "bf16"}}),
        ("pp2_dp2", {"parallel": {"pp": 2}}),
        ("pp2_tp2_vpp2", {"model": {"num_hidden_layers": 4}, "parallel": {"pp": 2, "tp": 2, "vpp": 2},
                          "train": {"micro_batch_size": 1}}),
        ("hsdp2x2", {"parallel": {"dp_replicate": 2}, "train": {"micro_batch_size": 1}}),
        ("moe_hsdp2x2_ep2", {"model": {"family": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32},
                             "parallel": {"dp_replicate": 2, "ep": 2}, "train": {"micro_batch_size": 1}}),
        ("moe_ep2_etp2", {"model": {"family": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32},
                          "parallel": {"ep": 2, "etp": 2}, "train": {"micro_batch_size": 1}}),
        # FSDP shards each rank's experts over edp = 2 (evenly, and with one expert per ep rank padded)
        ("moe_ep2_edp2", {"model": {"family": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32},
                          "parallel": {"ep": 2}, "train": {"micro_batch_size": 1}}),
        ("moe_ep2_edp2_uneven", {"model": {"family": "qwen3_moe", "num_experts": 2, "num_experts_per_tok": 1,
                                           "moe_intermediate_size": 32},
                                 "parallel": {"ep": 2}, "train": {"micro_batch_size": 1}}),
        ("dora_pp2_dp2", {"parallel": {"pp": 2}, "peft": {"method": "dora", "rank": 4}}),
        ("lora_moe_ep2_edp2", {"model": {"family": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32},
                               "parallel": {"ep": 2}, "train": {"micro_batch_size": 1},
                               "peft": {"method": "lora", "rank": 4, "targets": ["*.v_proj", "*.experts"]}})],
}


ALLOCATION_JOBS = {world: Job(f"planner/allocation-{world}", world, "allocation",
                              (json.dumps([{"name": n, "sections": s} for n, s in LAYOUTS[world]]),))
                   for world in sorted(LAYOUTS)}


@pytest.mark.slow
@jobs("world", ALLOCATION_JOBS)
def test_plan_bytes_match_the_trainers_allocation(batches, world):
    tmp_path = batches.result(ALLOCATION_JOBS[world])
    for name, sections in LAYOUTS[world]:
        cfg = tiny_config(**sections)
        layout = plan_layout(cfg, world)
        for rank in range(world):
            got = json.loads((tmp_path / f"{name}.rank{rank}.json").read_text())
            want = trainer_rank_state(cfg, layout, pp_rank=got["pp_rank"], tp_rank=got["tp_rank"],
                                      fsdp_rank=got["fsdp_rank"], edp_rank=got["edp_rank"])
            for kind in ("param", "grad", "optimizer"):
                # within 2%: AdamW's per-tensor step counters are the only bytes the plan leaves out
                assert got[f"{kind}_bytes"] == pytest.approx(want[f"{kind}_bytes"], rel=0.02), (name, rank, kind)
            assert got["param_elements"] == want["param_elements"], (name, rank)


def test_estimate_is_the_busiest_pipeline_rank():
    """pp rank 0 keeps pp micro-batches of activations in flight; the last rank holds the head and
    the logits: the estimate is whichever needs more."""
    s = shape_from_model_config(tiny_config(model={"num_hidden_layers": 4}).model, "tiny")
    sizes = Sizes(world=2, pp=2, stage_layers=(2, 2))
    for seq in (32, 4096):
        cfg = PlanConfig(params=None, seq_len=seq, micro_batch_size=1, precision="fp32")
        m = estimate(s, sizes, cfg, "1F1B", 2, "none")
        first = rank_parameters(s, sizes, "1F1B", pp_rank=0) * 16 + 2 * 2 * m.activations_per_layer
        last_params = rank_parameters(s, sizes, "1F1B", pp_rank=1)
        last = last_params * 16 + 2 * m.activations_per_layer + seq * s.vocab_size * (4 + 8)
        assert m.total == pytest.approx(max(first, last))


def test_a_tied_embedding_under_pp_counts_the_last_stages_copy():
    """The last stage holds its own copy of a tied embedding as its head (parallel/tied.py), also
    beside the first stage under a V schedule; without a pipeline the one matrix is counted once."""
    model = tiny_config(model={"num_hidden_layers": 4, "tie_word_embeddings": True}).model
    s = shape_from_model_config(model, "tiny")
    embedding = s.vocab_size * s.hidden_size
    untied = shape_from_model_config(dataclasses.replace(model, tie_word_embeddings=False), "tiny")
    sizes = Sizes(world=2, pp=2, stage_layers=(2, 2))
    assert rank_parameters(s, sizes, "1F1B", pp_rank=1) == rank_parameters(untied, sizes, "1F1B", pp_rank=1)
    assert rank_parameters(s, Sizes(world=1), "1F1B") == rank_parameters(untied, Sizes(world=1), "1F1B") - embedding
    v = Sizes(world=2, pp=2, vpp=2, stage_layers=(1, 1, 1, 1))
    assert rank_parameters(s, v, "ZBVZeroBubble", pp_rank=0) == rank_parameters(untied, v, "ZBVZeroBubble",
                                                                                pp_rank=0)
