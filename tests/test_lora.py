"""LoRA: adapters on the chosen linears, base frozen, every layout equal to the single-process LoRA run."""

import pytest
import torch

from meshtrain.config import ModelConfig, PeftConfig
from meshtrain.errors import ConfigError
from meshtrain.models.initialize import init_weights
from meshtrain.models.lora import LoRALinear, add_lora, check_lora, init_lora
from meshtrain.models.transformer import Transformer
from tests.batch import jobs
from tests.test_moe import MOE_ARGS
from tests.test_parallel import PP_MODEL, assert_matches_reference, reference, run_layout, train_job


def tiny(**kw) -> Transformer:
    cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=384, **kw)
    model = Transformer(cfg)
    init_weights(model, 0)
    return model


def test_adapters_start_as_a_no_op_and_only_they_train():
    model = tiny()
    x = torch.randint(0, 384, (2, 16))
    before = model(x)
    targets = add_lora(model, PeftConfig(method="lora", rank=4, alpha=8, targets=["*.q_proj", "*.down_proj"]))
    init_lora(model, 0)
    assert targets == ["layers.0.self_attn.q_proj", "layers.0.mlp.down_proj", "layers.1.self_attn.q_proj",
                       "layers.1.mlp.down_proj"]
    assert isinstance(model.layers["0"].self_attn.q_proj, LoRALinear)
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)  # B = 0
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [f"{t}.{a}" for t in targets for a in ("lora_A", "lora_B")]
    model(x).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    q = model.layers["0"].self_attn.q_proj
    assert q.lora_A.shape == (4, 64) and q.lora_B.shape == (64, 4) and q.lora_scale == 2.0


def test_targets_that_match_nothing_or_the_experts_are_refused():
    with pytest.raises(ConfigError, match=r"peft.targets=\['\*.nothing'\] match no linear layer"):
        check_lora(PeftConfig(method="lora", targets=["*.nothing"]), tiny())
    moe = tiny(family="qwen3_moe", num_experts=4, moe_intermediate_size=32)
    with pytest.raises(ConfigError, match=r"LoRA on MoE experts is not supported yet"):
        check_lora(PeftConfig(method="lora", targets=["*.experts"]), moe)


LORA = ("--peft.method", "lora", "--peft.rank", "4", "--peft.alpha", "8", "--optimizer.lr", "1e-2")
LAYOUTS = {  # name: (ranks, layout, extra)
    "dp2": (2, ["--parallel.dp-shard", "2"], ()),
    "tp2-sp": (2, ["--parallel.tp", "2", "--parallel.sp", "True"], ()),
    "pp2": (2, ["--parallel.pp", "2"], PP_MODEL),
    "dp2-tp2-sp": (4, ["--parallel.tp", "2", "--parallel.sp", "True"], ()),
    "moe-dp2-attention": (2, ["--parallel.dp-shard", "2"], MOE_ARGS + ("--peft.targets", "*.q_proj", "*.v_proj", "*.o_proj")),
    "moe-ep2-attention": (2, ["--parallel.ep", "2"], MOE_ARGS + ("--peft.targets", "*.q_proj", "*.v_proj", "*.o_proj")),
}
JOBS = {name: train_job(f"lora/{name}", nproc, layout, LORA + extra) for name, (nproc, layout, extra) in LAYOUTS.items()}


@pytest.mark.slow
@jobs("name", JOBS)
def test_lora_layouts_equal_single_rank(batches, name):
    nproc, layout, extra = LAYOUTS[name]
    got = run_layout(batches, JOBS[name])
    ref = reference(LORA + extra)
    assert_matches_reference(got, ref)
    full = reference(extra)
    frozen = [n for n in ref["state"] if not n.endswith(("lora_A", "lora_B"))]
    assert all(torch.equal(ref["state"][n], got["state"][n]) for n in frozen if "norm" in n)  # untouched
    assert ref["losses"][-1] != full["losses"][-1]
