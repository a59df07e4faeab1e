"""Hugging Face interop in one process: name and config.json mapping, import with logits equal to
transformers', bit-exact export, and every bad input ending in a CheckpointError naming file and key."""

import json
import re
import pathlib

import pytest
import torch

from meshtrain.config import ModelConfig
from meshtrain.errors import CheckpointError
from meshtrain.hf.adapter import (from_hf, hf_config_from_model, hf_shapes, model_config_from_hf,
                                  resolve_init_from_hf, to_hf)
from meshtrain.hf.io import export_dtypes, inspect_hf_dir, save_hf, shard_plan
from tests.hf_models import assert_same_tensors, hf_model, hf_shapes_of, imported, read_tensors, write_hf_dir

CASES = {"llama": ("llama", {}), "qwen3": ("qwen3", {}), "llama-tied": ("llama", {"tie_word_embeddings": True}),
         "qwen3-mha": ("qwen3", {"num_key_value_heads": 4}),
         "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}), "mistral": ("mistral", {}),
         "mistral-no-window": ("mistral", {"sliding_window": None}), "gemma3": ("gemma3", {}),
         "gemma2": ("gemma2", {}), "phi3": ("phi3", {}), "phi3-tied-no-window": ("phi3", {"tie_word_embeddings": True,
                                                                                      "sliding_window": None}),
         "deepseek_v3": ("deepseek_v3", {}), "gpt_oss": ("gpt_oss", {}),
         # Qwen2.5's long-context setting (its model cards: YaRN, factor 4), the tests' sequences past the original
         "qwen2-yarn": ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                      "original_max_position_embeddings": 32}})}



@pytest.mark.parametrize("case", CASES)
def test_names_and_shapes_equal_transformers(case, tmp_path):
    """What transformers writes (its checkpoint format, not its modules': transformers 5 fuses experts
    in memory and splits them again on saving)."""
    family, overrides = CASES[case]
    directory = write_hf_dir(tmp_path, family, shard=None, **overrides)
    cfg, _ = model_config_from_hf(json.loads((directory / "config.json").read_text()))
    assert hf_shapes(cfg) == {k: v.shape for k, v in read_tensors(directory).items()}
    assert from_hf(to_hf({"embed_tokens.weight": 1, "lm_head.weight": 2, "norm.weight": 3}, cfg), cfg) == (
        {"embed_tokens.weight": 1, "norm.weight": 3} if cfg.tie_word_embeddings
        else {"embed_tokens.weight": 1, "lm_head.weight": 2, "norm.weight": 3})


@pytest.mark.parametrize("case", CASES)
def test_config_json_round_trip(case, tmp_path):
    import transformers

    family, overrides = CASES[case]
    original = hf_model(family, **overrides).config
    cfg, dtype = model_config_from_hf(original.to_dict())
    assert cfg.family == family and dtype in (None, torch.float32)
    written = hf_config_from_model(cfg, torch.bfloat16, base=original.to_dict())
    (tmp_path / "config.json").write_text(json.dumps(written))
    reread = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(reread) is type(original)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                "tie_word_embeddings", "rope_parameters", "bos_token_id", "eos_token_id"):
        # Qwen2's config has no head_dim (its model falls back to hidden / heads); meshtrain writes it
        default = original.hidden_size // original.num_attention_heads if key == "head_dim" else None
        assert getattr(reread, key) == getattr(original, key, default), key
    assert reread.dtype == torch.bfloat16
    assert model_config_from_hf(reread.to_dict())[0] == cfg


def test_legacy_rope_spelling_reads_the_same():
    new = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64,
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    old = {k: v for k, v in new.items() if k != "rope_parameters"} | {
        "rope_theta": 5e5, "rope_scaling": {k: v for k, v in new["rope_parameters"].items() if k != "rope_theta"}}
    assert model_config_from_hf(new)[0] == model_config_from_hf(old)[0]
    assert model_config_from_hf(new)[0].rope_scaling.factor == 32.0


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["Qwen3MoeForCausalLM"]}, "required key 'num_local_experts' is missing"),
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures=['GPT2LMHeadModel'] is not supported"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type 'dynamic' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     "rope_type 'yarn' needs 'factor' and 'original_max_position_embeddings'"),
    ({"hidden_size": None}, "hidden_size"),
    ({"architectures": [], "model_type": "gpt2"}, "model_type='gpt2' (and no architectures) is not supported"),
])
def test_unsupported_configs_name_the_key(change, message):
    config = hf_model("llama").config.to_dict() | change
    if change.get("hidden_size", 0) is None:
        del config["hidden_size"]
    with pytest.raises(CheckpointError, match=re.escape(message)):
        model_config_from_hf(config, "x/config.json")


def test_user_settings_that_contradict_the_checkpoint_are_errors(tmp_path):
    directory = write_hf_dir(tmp_path / "hf")
    with pytest.raises(CheckpointError, match=r"model.hidden_size=256 but .*config.json says 64.*drop"):
        resolve_init_from_hf(ModelConfig(init_from_hf=str(directory), hidden_size=256))
    agreeing = resolve_init_from_hf(ModelConfig(init_from_hf=str(directory), hidden_size=64))
    assert agreeing.num_hidden_layers == 2 and agreeing.rope_theta == 500000.0  # the rest from config.json


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_import_logits_equal_transformers_and_export_is_bit_exact(case, dtype, tmp_path):
    import transformers

    family, overrides = CASES[case]
    src = write_hf_dir(tmp_path / "src", family, dtype, **overrides)
    model = imported(src)
    reference = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=1e-5, atol=1e-5)

    out = save_hf([model], str(tmp_path / "out"), export_dtypes(model.cfg, "auto"), max_shard_bytes=100_000,
                  base_config=json.loads((src / "config.json").read_text()))
    assert_same_tensors(read_tensors(src), read_tensors(out))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded by max_shard_bytes
    assert not (tmp_path / "out.incomplete").exists() and not (out / "sharded").exists()
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, reference(tokens).logits)


def test_export_dtype_choice_and_shard_plan(tmp_path):
    src = write_hf_dir(tmp_path / "src", "llama", torch.float32)
    model = imported(src)
    out = save_hf([model], str(tmp_path / "bf16"), export_dtypes(model.cfg, "bfloat16"), max_shard_bytes=10**9)
    tensors = read_tensors(out)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    plan = shard_plan({"a": torch.Size([10]), "b": torch.Size([10]), "c": torch.Size([30])},
                      dict.fromkeys("abc", torch.float32), max_shard_bytes=80)
    assert plan == {"a": 1, "b": 1, "c": 2}


# --- bad input -----------------------------------------------------------------------------------

def _break(directory: pathlib.Path, how: str) -> str:
    """Damage ``directory`` one way; returns what the error must say."""
    files = sorted(directory.glob("*.safetensors"))
    index_path = directory / "model.safetensors.index.json"
    if how == "truncated":
        data = files[0].read_bytes()
        files[0].write_bytes(data[: len(data) - 100])
        return f"{files[0].name}: not a readable safetensors file, truncated or corrupted"
    if how == "corrupted-header":
        data = bytearray(files[1].read_bytes())
        data[8:20] = b"\x00garbage!!\x00\x00"
        files[1].write_bytes(bytes(data))
        return f"{files[1].name}: not a readable safetensors file"
    if how == "missing-file":
        files[0].unlink()
        return "names files that are not there: " + files[0].name
    if how == "extra-file":
        (directory / "consolidated.safetensors").write_bytes(files[0].read_bytes())
        return "consolidated.safetensors not in model.safetensors.index.json"
    from safetensors.torch import load_file, save_file

    tensors = load_file(files[0])
    key = sorted(tensors)[0]
    if how == "missing-key":
        del tensors[key]
    elif how == "extra-key":
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
        key = "model.layers.0.self_attn.q_proj.bias"
    elif how == "wrong-shape":
        tensors[key] = torch.zeros(3, 3)
    save_file(tensors, files[0])
    if how in ("missing-key", "extra-key"):  # keep the index consistent, so the key check is what fires
        index = json.loads(index_path.read_text())
        index["weight_map"].pop(key, None) if how == "missing-key" else index["weight_map"].update({key: files[0].name})
        index_path.write_text(json.dumps(index))
    return {"missing-key": f"missing tensors {key}", "extra-key": f"unexpected tensors {key}",
            "wrong-shape": f"{key} has shape [3, 3]"}[how]


@pytest.mark.parametrize("how", ["truncated", "corrupted-header", "missing-file", "extra-file", "missing-key",
                                 "extra-key", "wrong-shape"])
def test_bad_hf_directories_name_the_file_and_key(how, tmp_path):
    directory = write_hf_dir(tmp_path / "hf")
    expected = hf_shapes_of(directory)
    message = _break(directory, how)
    with pytest.raises(CheckpointError) as e:
        inspect_hf_dir(directory, expected)
    assert message in str(e.value)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: no such file"):
        resolve_init_from_hf(ModelConfig(init_from_hf=str(tmp_path)))
    with pytest.raises(CheckpointError, match="no such directory"):
        inspect_hf_dir(tmp_path / "nope", {})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        resolve_init_from_hf(ModelConfig(init_from_hf=str(tmp_path)))


def test_export_never_overwrites_and_a_failed_one_leaves_no_complete_looking_dir(tmp_path, monkeypatch):
    src = write_hf_dir(tmp_path / "src")
    model = imported(src)
    dtypes = export_dtypes(model.cfg, "auto")
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        save_hf([model], str(src), dtypes, max_shard_bytes=10**9)

    import meshtrain.hf.io

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(meshtrain.hf.io.dcp, "save", crash)
    with pytest.raises(OSError):
        save_hf([model], str(tmp_path / "out"), dtypes, max_shard_bytes=10**9)
    assert not (tmp_path / "out").exists() and (tmp_path / "out.incomplete").is_dir()
    monkeypatch.undo()
    out = save_hf([model], str(tmp_path / "out"), dtypes, max_shard_bytes=10**9)  # a retry clears the debris
    assert_same_tensors(read_tensors(src), read_tensors(out))
    assert not (tmp_path / "out.incomplete").exists()


@pytest.mark.parametrize("family", ["qwen2", "mistral", "phi3", "deepseek_v3", "gpt_oss"])
def test_convert_round_trip_of_a_new_family_is_exact(family, tmp_path):
    """``meshtrain convert`` HF -> DCP -> HF in one process (tests/test_checkpoint_parallel.py does it
    on several ranks for qwen3): the same bytes, biases, explicit head_dim and fused tensors included."""
    from meshtrain.cli import main

    src = write_hf_dir(tmp_path / "src", family, torch.bfloat16)
    main(["convert", "--src", str(src), "--dst", str(tmp_path / "dcp")])
    main(["convert", "--src", str(tmp_path / "dcp"), "--dst", str(tmp_path / "hf")])
    assert_same_tensors(read_tensors(src), read_tensors(tmp_path / "hf"))
    assert model_config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))[0] == \
        model_config_from_hf(json.loads((src / "config.json").read_text()))[0]
