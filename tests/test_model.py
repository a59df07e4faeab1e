"""The model: shapes, transformers parity of the forward pass, deterministic init, and it learns."""

import pytest
import torch

from meshtrain.models.config import ModelConfig, RopeScalingConfig
from meshtrain.models.initialize import init_weights
from meshtrain.models.transformer import Transformer


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return ModelConfig(**(base | kw))


def build(cfg: ModelConfig, seed=0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    init_weights(model, seed)
    return model


def hf_model(cfg: ModelConfig):
    import transformers

    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                  num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.resolved_head_dim,
                  rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
                  tie_word_embeddings=cfg.tie_word_embeddings)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling.type == "llama3":
        s = cfg.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    config_cls = transformers.Qwen3Config if cfg.family == "qwen3" else transformers.LlamaConfig
    hf_cfg = config_cls(**common, rope_parameters=rope, attn_implementation="eager")
    model_cls = transformers.Qwen3ForCausalLM if cfg.family == "qwen3" else transformers.LlamaForCausalLM
    torch.manual_seed(1)
    return model_cls(hf_cfg).eval()


def load_hf_weights(model: Transformer, hf) -> None:
    sd = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= ({"lm_head.weight"} if model.cfg.tie_word_embeddings else set()), missing


@pytest.mark.parametrize("cfg", [
    tiny(),
    tiny(family="qwen3", head_dim=32),  # Qwen3: q/k norms, explicit head_dim != hidden/heads
    tiny(num_key_value_heads=4),        # plain multi-head attention
    tiny(num_key_value_heads=1, tie_word_embeddings=True),
    tiny(rope_scaling=RopeScalingConfig(type="llama3", factor=8.0, original_max_position_embeddings=16)),
], ids=["llama-gqa", "qwen3", "mha", "mqa-tied", "llama3-rope"])
def test_logits_equal_transformers(cfg):
    hf = hf_model(cfg)
    model = build(cfg)
    load_hf_weights(model, hf)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.shape == (2, 40, cfg.vocab_size)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_init_is_deterministic_and_seeded():
    a, b, c = build(tiny(), 0), build(tiny(), 0), build(tiny(), 1)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if "norm" not in n:
            assert not torch.equal(pa, pc), n
    assert torch.equal(a.layers["0"].input_layernorm.weight, torch.ones(64))
    std = a.layers["1"].mlp.gate_proj.weight.std().item()
    assert abs(std - 0.02) < 0.002


def test_tied_embeddings_share_one_tensor():
    model = build(tiny(tie_word_embeddings=True))
    assert model.lm_head.weight is model.embed_tokens.weight
    assert len(list(model.parameters())) == len(dict(model.named_parameters()))


@pytest.mark.parametrize("mode,every", [("full", 1), ("selective", 1), ("selective", 2)])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_activation_checkpointing_gives_the_same_gradients(mode, every, family):
    """Recomputation replays the same ops on CPU: bitwise the same loss and gradients, MoE routing
    (and its load statistics, counted once) included."""
    cfg = tiny(family=family, num_experts=4 if family == "qwen3_moe" else 0, moe_intermediate_size=32)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    grads, stats = [], []
    for ac in ("none", mode):
        model = build(cfg)
        model.activation_checkpointing, model.activation_checkpointing_every = ac, every
        model(tokens).sum().backward()
        grads.append([p.grad for p in model.parameters()])
        stats.append([m.tokens_per_expert.clone() for m in model.modules() if hasattr(m, "tokens_per_expert")])
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1, rtol=0, atol=0)
    for s0, s1 in zip(*stats):
        assert torch.equal(s0, s1)


def test_tiny_model_overfits_one_batch():
    """A fixed batch must be memorised: loss from ~ln(96)=4.56 to below 0.2 in 150 AdamW steps."""
    cfg = tiny()
    torch.manual_seed(0)
    model = build(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2, loss.item()
