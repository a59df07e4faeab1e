"""Tiny random Hugging Face checkpoints, written with transformers from configs (nothing downloads),
and the ways tests read them back: every test's Hugging Face model comes from FAMILIES here."""

from __future__ import annotations

import glob
import json
import pathlib

import torch

FAMILIES = {  # family: (transformers config class, its tiny config)
    "llama": ("LlamaConfig", dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen3": ("Qwen3Config", dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)),
    # awkward sizes: an odd vocabulary, grouped-query attention, Mistral's head_dim not hidden / heads
    # and a window shorter than the tests' sequences
    "qwen2": ("Qwen2Config", dict(
        vocab_size=383, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)),
    "mistral": ("MistralConfig", dict(
        vocab_size=383, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=16, max_position_embeddings=256, bos_token_id=1,
        eos_token_id=2)),
    # soft caps small enough to bend the scores and logits of a random model
    "gemma2": ("Gemma2Config", dict(
        vocab_size=383, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=20,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # local and global layers with their own RoPE (the global one linearly scaled), a window shorter than
    # the tests' sequences, query_pre_attn_scalar not head_dim, tied (Gemma always is)
    "gemma3": ("Gemma3TextConfig", dict(
        vocab_size=383, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=20,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=256,
        rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # the checkpoint's fused qkv_proj and gate_up_proj (awkward rows: 64 + 2 x 32 and 2 x 80), a window
    "phi3": ("Phi3Config", dict(
        vocab_size=383, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=16, max_position_embeddings=256, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        mlp_only_layers=[0], norm_topk_prob=True, max_position_embeddings=128)),
    # latent attention with a query latent, YaRN whose mscale_all_dim bends cos/sin and the softmax scale,
    # 8 experts in 4 groups (2 chosen) for 3 per token, 2 shared experts' worth, a dense first layer,
    # head dims that differ (12 + 6 for queries/keys, 10 for values); hf_model randomises the routing bias
    "deepseek_v3": ("DeepseekV3Config", dict(
        vocab_size=383, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=20, q_lora_rank=28, qk_nope_head_dim=12,
        qk_rope_head_dim=6, v_head_dim=10, n_routed_experts=8, n_shared_experts=2, n_group=4, topk_group=2,
        num_experts_per_tok=3, first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 0.8, "original_max_position_embeddings": 32},
        bos_token_id=1, eos_token_id=2)),
    # sinks, biases everywhere, a window (8) shorter than the tests' sequences on alternate layers, YaRN
    # (not truncated), 4 experts top-2 with interleaved gate/up, a limit (0.1) that the clamp meets often
    "gpt_oss": ("GptOssConfig", dict(
        vocab_size=383, hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
        swiglu_limit=0.1, max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "mixtral": ("MixtralConfig", dict(
        vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128)),
}


def hf_config(family: str, **overrides):
    import transformers

    config_class, values = FAMILIES[family]
    return getattr(transformers, config_class)(**(values | overrides))


def hf_model(family: str, dtype=torch.float32, seed: int = 0, **overrides):
    """A transformers model of ``family`` with random weights; norms and routers carry information too."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **overrides)).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norm weights start at one
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("bias"):  # biases start at zero (gpt-oss: its experts' *_proj_bias too)
                p.normal_(0.0, 0.1)
            if name.endswith(("gate.weight", "router.weight")):  # MoE routers: random, so every expert gets tokens
                p.normal_(0.0, 0.5)
            if name.endswith("sinks"):  # attention sinks: large enough to take a visible share
                p.normal_(0.0, 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias starts at zero
                b.normal_(0.0, 0.1)
    return model


def write_hf_dir(path: pathlib.Path, family: str = "llama", dtype=torch.float32, shard: str | None = "150KB",
                 **overrides) -> pathlib.Path:
    model = hf_model(family, dtype, **overrides)
    model.save_pretrained(path, max_shard_size=shard) if shard else model.save_pretrained(path)
    return path


def hf_dir(tmp_path: pathlib.Path, family: str, **overrides):
    """The model and its one-file checkpoint directory, ``tmp_path / family``."""
    model = hf_model(family, **overrides)
    model.save_pretrained(tmp_path / family)
    return model, tmp_path / family


def read_tensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(str(path / "*.safetensors"))):
        out.update(load_file(f))
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit-exact: same keys, dtypes, shapes and bytes."""
    assert sorted(a) == sorted(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k


def meshtrain_from(directory: pathlib.Path):
    """meshtrain's model of a checkpoint directory, loaded in one process with a plain state dict."""
    from meshtrain.hf.adapter import from_hf, model_config_from_hf
    from meshtrain.models.initialize import init_weights
    from meshtrain.models.transformer import Transformer

    cfg, _ = model_config_from_hf(json.loads((directory / "config.json").read_text()))
    model = Transformer(cfg)
    init_weights(model, 0)
    missing, unexpected = model.load_state_dict(from_hf(read_tensors(directory), cfg), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg.tie_word_embeddings else set()), \
        (missing, unexpected)  # a tied head is the embedding it shares
    return model.eval()


def imported(directory: pathlib.Path, **model_options):
    """meshtrain's model of a checkpoint directory, loaded as the trainer loads it (meta, then the files)."""
    from meshtrain.config import ModelConfig
    from meshtrain.hf.adapter import resolve_init_from_hf
    from meshtrain.hf.io import load_hf_weights
    from meshtrain.models.transformer import Transformer

    cfg = resolve_init_from_hf(ModelConfig(init_from_hf=str(directory), **model_options))
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    load_hf_weights([model], str(directory))
    return model


def hf_shapes_of(directory: pathlib.Path) -> dict:
    """The tensor shapes meshtrain expects in a checkpoint directory, from its config.json."""
    from meshtrain.config import ModelConfig
    from meshtrain.hf.adapter import hf_shapes, resolve_init_from_hf

    return hf_shapes(resolve_init_from_hf(ModelConfig(init_from_hf=str(directory))))


def write_mxfp4_dir(path: pathlib.Path, seed: int = 0, **overrides) -> pathlib.Path:
    """A GPT-OSS checkpoint as the releases store it: each expert tensor as MXFP4 blocks (random 4-bit
    codes) and scales (random exponents around 2**0), the rest as written by transformers, and the
    release's quantization_config. Hidden 64 and FFN 32: MXFP4 packs 32 values per scale."""
    from safetensors.torch import load_file, save_file

    model = hf_model("gpt_oss", seed=seed, **({"hidden_size": 64, "intermediate_size": 32} | overrides))
    model.save_pretrained(path)
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    generator = torch.Generator().manual_seed(seed)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, columns, rows = tensors.pop(key).shape  # stored [E, in, out]: blocks run along `in`
        groups = columns // 32
        tensors[key + "_blocks"] = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8,
                                                 generator=generator)
        tensors[key + "_scales"] = torch.randint(120, 130, (experts, rows, groups), dtype=torch.uint8,
                                                 generator=generator)
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
