"""Every layout rule of REFERENCE section 2, each with its message; derived sizes; warnings."""

import warnings

import pytest

from meshtrain.errors import ConfigError
from meshtrain.parallel.layout import layout_warnings, plan_layout
from tests.conftest import tiny_config


def plan(world, parallel=None, model=None, train=None):
    cfg = tiny_config(parallel=parallel or {}, model=model or {}, train=train or {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_layout(cfg, world)


def test_dp_is_derived_from_the_world():
    lay = plan(8, {"tp": 2})
    assert (lay.dp_shard, lay.dp, lay.tp) == (4, 4, 2)
    lay = plan(8, {"tp": 2, "dp_replicate": 2})
    assert (lay.dp_replicate, lay.dp_shard, lay.dp) == (2, 2, 4)
    lay = plan(8, {"pp": 2, "tp": 2, "cp": 2}, train={"micro_batch_size": 1})
    assert lay.dp == 1 and lay.edp == 4


def test_grad_accumulation_from_global_micro_and_dp():
    lay = plan(2, {}, train={"global_batch_size": 16, "micro_batch_size": 2})
    assert lay.grad_accum_steps == 4


def test_layout_line():
    lay = plan(4, {"tp": 2, "pp": 2, "sp": True}, train={"micro_batch_size": 1})
    assert lay.describe().startswith("TP2 PP2 DP1 CP1 EP1 [SP, 1F1B]")
    lay = plan(2, {"pp": 2, "vpp": 2}, {"num_hidden_layers": 4}, {"micro_batch_size": 1})
    assert lay.describe() == "TP1 PP2 DP1 CP1 EP1 [VPP2, Interleaved1F1B] (world 2)"
    assert plan(8, {"dp_replicate": 2, "dp_shard": 4}, train={"micro_batch_size": 1}).describe() == "TP1 PP1 DP8 CP1 EP1 [HSDP 2x4] (world 8)"


@pytest.mark.parametrize("world,parallel,model,train,message", [
    (4, {"tp": 3}, {}, {},
     r"world size 4 is not divisible by pp\*dp_replicate\*cp\*tp"),
    (8, {"tp": 2, "dp_shard": 2}, {}, {}, r"does not equal the world size 8.*dp_shard=-1"),
    (2, {"tp": 0}, {}, {}, r"parallel.tp=0 must be >= 1"),
    (2, {"dp_shard": 0}, {}, {}, r"parallel.dp_shard=0 must be >= 1, or -1"),
    (2, {"timeout_s": 0}, {}, {}, r"parallel.timeout_s=0 must be > 0.*Fix: set parallel.timeout_s"),
    (2, {"sp": True}, {}, {}, r"parallel.sp=true requires parallel.tp > 1"),
    (2, {"cp": 2}, {}, {"seq_len": 30}, r"train.seq_len=30 must be divisible by 2\*cp = 4"),
    (2, {"ep": 2}, {}, {}, r"expert parallelism needs an MoE model"),
    (2, {"etp": 2}, {}, {}, r"expert parallelism needs an MoE model"),
    (2, {"tp": 2}, {"num_attention_heads": 3, "num_key_value_heads": 1}, {},
     r"tp=2 must divide model.num_attention_heads=3"),
    (4, {"tp": 4}, {"num_key_value_heads": 2}, {}, r"tp=4 must divide model.num_key_value_heads=2.*use tp <= 2"),
    (2, {"tp": 2}, {"intermediate_size": 129}, {}, r"must divide model.intermediate_size=129"),
    (2, {"tp": 2}, {"vocab_size": 385}, {}, r"must divide model.vocab_size=385.*model.vocab_size=386"),
    (4, {"pp": 4}, {"num_hidden_layers": 2}, {"micro_batch_size": 1}, r"num_hidden_layers=2 cannot be split.*pp\*vpp = 4\*1"),
    (4, {"pp": 2, "vpp": 2}, {"num_hidden_layers": 6}, {"micro_batch_size": 1}, r"pp\*vpp = 2\*2 = 4 stages"),
    (4, {}, {}, {"global_batch_size": 6, "micro_batch_size": 1},
     r"global_batch_size=6 must be divisible by micro_batch_size\*dp = 1\*4"),
    (2, {"pp": 2, "vpp": 2}, {"num_hidden_layers": 4}, {"global_batch_size": 1, "micro_batch_size": 1},
     r"interleaved pipeline schedules need n_microbatches >= pp.*= 1 < pp=2"),
    (1, {}, {"max_position_embeddings": 16}, {"seq_len": 32}, r"seq_len=32 exceeds model.max_position_embeddings=16"),
    # Pipeline stages and schedules (micro batch 1: 8 micro-batches unless stated).
    (2, {"vpp": 2}, {}, {}, r"parallel.vpp=2 needs parallel.pp > 1"),
    (2, {"pp": 2, "pp_layers_per_stage": [1, 1, 0]}, {}, {"micro_batch_size": 1}, r"has 3 entries but there are pp\*vpp = 2\*1 = 2"),
    (2, {"pp": 2, "pp_layers_per_stage": [2, 1]}, {}, {"micro_batch_size": 1}, r"summing to model.num_hidden_layers=2 \(they sum to 3\)"),
    (2, {"pp": 2, "vpp": 2, "pp_layers_per_stage": [2, 0, 1, 1]}, {"num_hidden_layers": 4}, {"micro_batch_size": 1},
     r"middle stage\(s\) \[1\] have no layers"),
    (2, {"pp": 2, "vpp": 2, "pp_schedule": "1F1B"}, {"num_hidden_layers": 4}, {"micro_batch_size": 1},
     r"pp_schedule=1F1B runs one stage per rank but parallel.vpp=2"),
    (4, {"pp": 2, "vpp": 4, "pp_schedule": "ZBVZeroBubble"}, {"num_hidden_layers": 8}, {"micro_batch_size": 1},
     r"ZBVZeroBubble places exactly two stages per rank in a V, so it needs parallel.vpp=2, not 4"),
    (4, {"pp": 4}, {"num_hidden_layers": 4}, {"global_batch_size": 3, "micro_batch_size": 1},
     r"1F1B needs n_microbatches >= pp, but global/\(micro\*dp\) = 3/\(1\*1\) = 3 < pp=4"),
    (2, {"pp": 2, "vpp": 2}, {"num_hidden_layers": 4}, {"global_batch_size": 5, "micro_batch_size": 1},
     r"Interleaved1F1B runs n_microbatches in rounds of pp: .* = 5 is not a multiple of 5//pp = 2 rounds"),
    (2, {"pp": 2, "vpp": 2, "pp_schedule": "DualPipeV"}, {"num_hidden_layers": 4}, {"global_batch_size": 3, "micro_batch_size": 1},
     r"DualPipeV needs n_microbatches >= pp\*vpp = 4 stages"),
    (4, {"pp": 2, "vpp": 2, "pp_schedule": "ZBVZeroBubble", "fsdp_reshard_after_forward": "always"},
     {"num_hidden_layers": 4}, {"micro_batch_size": 1}, r"fsdp_reshard_after_forward=always with parallel.pp_schedule=ZBVZeroBubble"),
])
def test_bad_layouts_are_rejected_with_the_rule(world, parallel, model, train, message):
    with pytest.raises(ConfigError, match=message) as info:
        plan(world, parallel, model, train)
    assert "Fix:" in str(info.value)


MOE = {"family": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2}


def test_expert_grid_must_fit_a_stage():
    lay = plan(8, {"tp": 2, "ep": 8}, MOE)  # pp1 tp2 ep8 fits 8 ranks: the grids share ranks
    assert lay.ep == 8 and lay.edp == 1
    with pytest.raises(ConfigError, match=r"minimum world is pp\*max\(tp\*cp, ep\*etp\) = 16"):
        plan(8, {"pp": 2, "tp": 2, "ep": 8}, MOE)
    with pytest.raises(ConfigError, match=r"num_experts=8 is not divisible by parallel.ep=3"):
        plan(6, {"ep": 3}, MOE, train={"global_batch_size": 12})


@pytest.mark.parametrize("model,message", [
    ({"family": "qwen3_moe"}, "needs model.num_experts >= 2"),
    (MOE | {"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be between 1 and model.num_experts=8"),
    (MOE | {"mlp_only_layers": [5]}, "names layers [5] outside 0..1"),
    (MOE | {"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be >= 1"),
    ({"num_experts": 4}, "model.num_experts=4 on the dense family 'llama'"),
    (MOE | {"capacity_factor": -1.0}, "model.capacity_factor=-1.0 must be >= 0"),
])
def test_moe_fields_are_checked(model, message):
    with pytest.raises(ConfigError) as info:
        plan(1, {}, model)
    assert message in str(info.value) and "Fix:" in str(info.value)


GEMMA = {"family": "gemma3", "tie_word_embeddings": True, "sliding_window": 8}


@pytest.mark.parametrize("model,message", [
    ({"sliding_window": 8}, "model.sliding_window=8 on the family 'llama', which has no such setting"),
    ({"family": "mistral", "attn_logit_softcapping": 50.0}, "families with it: gemma2"),
    ({"family": "gemma3", "sliding_window": 8}, "model.tie_word_embeddings=false: Gemma's output head is its embedding"),
    ({"family": "gemma3", "tie_word_embeddings": True}, "model.sliding_window is unset"),
    (GEMMA | {"layer_types": ["full_attention"]}, "for each of the 2 layers"),
    (GEMMA | {"layer_types": ["local", "full_attention"]}, "must name 'sliding_attention' or 'full_attention'"),
])
def test_a_family_refuses_the_settings_it_does_not_have(model, message):
    """Never silently dropped: a setting another family has, or a Gemma missing what its layers need."""
    with pytest.raises(ConfigError) as info:
        plan(1, {}, model)
    assert message in str(info.value) and "Fix:" in str(info.value)


def test_token_dropping_needs_whole_sequences_per_rank():
    assert plan(4, {"ep": 2, "pp": 2}, MOE | {"capacity_factor": 1.25}).ep == 2
    for parallel in ({"tp": 2}, {"cp": 2}):
        with pytest.raises(ConfigError, match=r"capacity_factor=1.25 with cp\*tp = .* is not supported") as info:
            plan(2, parallel, MOE | {"capacity_factor": 1.25})
        assert "Fix: set model.capacity_factor=0" in str(info.value)


def test_warnings_not_errors():
    lay = plan(8, {"tp": 8}, {"num_attention_heads": 8, "num_key_value_heads": 8})
    msgs = layout_warnings(lay, gpus_per_node=4)
    assert any("tp=8 is larger than the 4 ranks of one node" in m for m in msgs)
    lay = plan(4, {"pp": 2}, train={"micro_batch_size": 1})
    assert any("pipeline bubble" in m and "vpp" in m for m in layout_warnings(lay, None))
    with pytest.warns(UserWarning, match="pipeline bubble"):
        plan_layout(tiny_config(parallel={"pp": 2}, train={"micro_batch_size": 1}), 4)


def test_stage_layers_even_or_explicit():
    assert plan(2, {"pp": 2}, {"num_hidden_layers": 4}, {"micro_batch_size": 1}).stage_layers == (2, 2)
    lay = plan(2, {"pp": 2, "vpp": 2, "pp_layers_per_stage": [0, 2, 2, 0]}, {"num_hidden_layers": 4},
               {"micro_batch_size": 1})
    assert lay.stage_layers == (0, 2, 2, 0) and lay.pp_schedule == "Interleaved1F1B"


def test_schedule_default_follows_vpp_and_a_useless_one_warns():
    assert plan(2, {"pp": 2}, train={"micro_batch_size": 1}).pp_schedule == "1F1B"
    with pytest.warns(UserWarning, match="pp_schedule=GPipe has no effect with pp=1"):
        plan_layout(tiny_config(parallel={"pp_schedule": "GPipe"}), 2)


def test_fsdp_accumulate_under_a_pipeline_says_it_changes_nothing():
    with pytest.warns(UserWarning, match="fsdp_accumulate=reduce_last has no effect with pp > 1: the pipeline "
                                         "schedule already reduces"):
        plan_layout(tiny_config(parallel={"pp": 2, "fsdp_accumulate": "reduce_last"},
                                train={"micro_batch_size": 1}), 4)

