"""LoRA: adapters on the chosen linears and experts, base frozen, every layout equal to the single-process LoRA run."""

import json

import pytest
import torch

from meshtrain.config import ModelConfig, PeftConfig
from meshtrain.errors import ConfigError
from meshtrain.models.initialize import init_weights
from meshtrain.models.lora import LoRALinear, add_lora, check_lora, init_lora, lora_targets
from meshtrain.models.transformer import Transformer
from tests.batch import Job, jobs
from tests.parity import GPT_OSS, MOE_ARGS, PP_MODEL, assert_matches_reference, metrics, reference, run_layout, train_job


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


def test_targets_that_match_nothing_or_split_the_fused_gate_up_pair_for_peft_are_refused():
    with pytest.raises(ConfigError, match=r"peft.targets=\['\*.nothing'\] match no linear layer"):
        check_lora(PeftConfig(method="lora", targets=["*.nothing"]), tiny())
    moe = tiny(family="qwen3_moe", num_experts=4, moe_intermediate_size=32)
    assert lora_targets(moe, ["*.experts"]) == [f"layers.{i}.mlp.experts.{p}" for i in range(2)
                                                for p in ("gate_proj", "up_proj", "down_proj")]
    assert lora_targets(moe, ["*.up_proj"]) == ["layers.0.mlp.experts.up_proj", "layers.1.mlp.experts.up_proj"]
    check_lora(PeftConfig(method="lora", targets=["*.experts.up_proj"]), moe)  # fine without a PEFT export
    with pytest.raises(ConfigError, match=r"adapt the experts' \{'up_proj'\} without the other.*Fix: target both"):
        check_lora(PeftConfig(method="lora", targets=["*.experts.up_proj"], export_adapter="out"), moe)
    with pytest.raises(ConfigError, match=r"peft.method=dora .* stacked experts \(layers.0.mlp.experts.gate_proj"):
        check_lora(PeftConfig(method="dora"), moe)  # the default targets include the experts
    check_lora(PeftConfig(method="dora", targets=["*.self_attn.*"]), moe)
    # a dense MLP beside MoE layers: peft takes its adapters only as target_parameters, never with DoRA
    mixed = tiny(family="qwen3_moe", num_experts=4, moe_intermediate_size=32, mlp_only_layers=[0])
    check_lora(PeftConfig(method="dora", targets=["layers.0.mlp.*_proj"]), mixed)  # fine without a PEFT export
    with pytest.raises(ConfigError, match=r"dense MLP of this MoE model \(layers.0.mlp.gate_proj\).*Fix: target the "
                                          r"attention projections only"):
        check_lora(PeftConfig(method="dora", targets=["layers.0.mlp.*_proj"], export_adapter="out"), mixed)
    # Phi-3's checkpoint fuses q/k/v_proj and gate/up_proj: LoRA on some parts exports (zero rows for the
    # others), DoRA rescales every row of the fused module, so it needs all of them
    phi3 = tiny(family="phi3")
    check_lora(PeftConfig(method="lora", targets=["*.q_proj"], export_adapter="out"), phi3)
    check_lora(PeftConfig(method="dora", targets=["*.q_proj"]), phi3)
    with pytest.raises(ConfigError, match=r"adapt layers.\d.self_attn.q_proj but not all of self_attn.q_proj, "
                                          r"self_attn.k_proj, self_attn.v_proj.*Fix: target all of \*.q_proj, \*.k_proj"):
        check_lora(PeftConfig(method="dora", targets=["*.q_proj"], export_adapter="out"), phi3)


LORA = ("--peft.method", "lora", "--peft.rank", "4", "--peft.alpha", "8", "--optimizer.lr", "3e-3")
LAYOUTS = {  # name: (ranks, layout, extra)
    "dp2": (2, ["--parallel.dp-shard", "2"], ()),
    "tp2-sp": (2, ["--parallel.tp", "2", "--parallel.sp", "True"], ()),
    "pp2": (2, ["--parallel.pp", "2"], PP_MODEL),
    # per-expert adapters on the stacked experts: sharded over ep with them, or split over etp like each expert
    "moe-ep2": (2, ["--parallel.ep", "2"], MOE_ARGS + ("--peft.targets", "*.q_proj", "*.o_proj", "*.experts")),
    "moe-tp2-sp-etp2": (2, ["--parallel.tp", "2", "--parallel.sp", "True", "--parallel.etp", "2"],
                        MOE_ARGS + ("--peft.targets", "*.q_proj", "*.o_proj", "*.experts")),
    # GPT-OSS's interleaved experts: adapters of gate_up_proj's [E, out, in] view, split over etp in whole
    # (gate, up) column pairs with the weight, down_proj's over its input rows
    "gpt_oss-tp2-sp-etp2": (2, ["--parallel.tp", "2", "--parallel.sp", "True", "--parallel.etp", "2"],
                            GPT_OSS + ("--peft.targets", "*.q_proj", "*.experts")),
    # DoRA: row norms of column-parallel (local rows) and row-parallel (summed over tp) weights
    "dora-tp2-sp": (2, ["--parallel.tp", "2", "--parallel.sp", "True"], ("--peft.method", "dora")),
}
JOBS = {name: train_job(f"lora/{name}", nproc, layout, LORA + extra)
        for name, (nproc, layout, extra) in LAYOUTS.items()}


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
    if name.startswith("dora"):
        assert sum(n.endswith("lora_magnitude") for n in ref["state"]) == 14
    if name.startswith("moe"):  # the expert adapters trained too (B starts at zero)
        expert_b = [n for n in ref["state"] if n.endswith("experts.down_proj_lora_B")]
        assert expert_b and all(ref["state"][n].abs().max() > 0 for n in expert_b)
    if name == "dp2":  # 14 adapters of 4096 + 4096 elements in all, half on each FSDP rank; AdamW's two moments
        assert got["trainable_elements"] == 4096 and got["optimizer_bytes"] == 2 * 4 * 4096


def write_model(directory) -> tuple[str, ...]:
    from tests.hf_models import write_hf_dir

    return ("--model.init-from-hf", str(write_hf_dir(directory / "model")))


def write_moe_model(directory) -> tuple[str, ...]:
    from tests.hf_models import hf_dir

    return ("--model.init-from-hf", str(hf_dir(directory, "qwen3_moe", vocab_size=384)[1]))


def hf_lora_job(name: str, *args: str, prepare=write_model, after: tuple[Job, ...] = (),
                kind: str = "train_command") -> Job:
    """``meshtrain train`` of LoRA on a tiny Hugging Face model, 2 ranks (tests/workers/train_command.py)."""
    return Job(f"lora/{name}", 2, kind,
               (*LORA, "--train.steps", "4", "--train.global-batch-size", "4", "--train.micro-batch-size", "2",
                "--train.seq-len", "32", "--logging.progress", "off", *args), prepare=prepare, after=after)


def checkpoint_job(name: str, *args: str, after: tuple[Job, ...] = ()) -> Job:
    return hf_lora_job(f"checkpoint-{name}", "--parallel.dp-shard", "2", "--logging.jsonl", "True", *args, after=after)


WHOLE = checkpoint_job("whole")
FIRST = checkpoint_job("first", "--checkpoint.interval", "2", "--train.steps", "2")
REST = checkpoint_job("rest", "--checkpoint.interval", "2", "--checkpoint.resume",
                      f"{{jobs}}/{FIRST.name}/checkpoints/step-000002", after=(FIRST,))
DORA = checkpoint_job("dora", "--peft.method", "dora", "--train.steps", "1")


@pytest.mark.slow
@pytest.mark.job(WHOLE, FIRST, REST, DORA)
def test_lora_checkpoints_hold_the_adapters_only_and_resume_exactly(batches):
    from torch.distributed.checkpoint import FileSystemReader

    whole, first, rest = metrics(batches, WHOLE), metrics(batches, FIRST), metrics(batches, REST)
    saved = FileSystemReader(str(batches.result(FIRST) / "checkpoints" / "step-000002")).read_metadata()
    weights = [k for k in saved.state_dict_metadata if k.startswith("model.")]
    assert len(weights) == 28 and all(k.endswith(("lora_A", "lora_B")) for k in weights)  # no base weight
    assert [r["step"] for r in rest] == [3, 4]
    assert [r["loss"] for r in first + rest if r["step"] > 2] == [r["loss"] for r in whole if r["step"] > 2]
    # DoRA starts as the loaded model too: its magnitudes are the loaded weights' row norms
    assert metrics(batches, DORA)[0]["loss"] == pytest.approx(whole[0]["loss"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.job(FIRST)
def test_lora_checkpoints_refuse_to_resume_on_another_base(batches, tmp_path):
    """The checkpoint holds only adapters: resumed onto another base they would train another model."""
    import subprocess
    import sys

    from tests.conftest import ROOT, env
    from tests.hf_models import write_hf_dir

    other = write_hf_dir(tmp_path / "other", seed=1)  # the same architecture, other weights
    checkpoint = batches.result(FIRST) / "checkpoints" / "step-000002"
    args = [*LORA, "--train.steps", "4", "--train.global-batch-size", "4", "--train.micro-batch-size", "2",
            "--train.seq-len", "32", "--logging.progress", "off", "--train.run-dir", str(tmp_path / "run"),
            "--model.init-from-hf", str(other), "--checkpoint.resume", str(checkpoint)]
    proc = subprocess.run([sys.executable, "-m", "meshtrain", "train", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    saved = json.loads((checkpoint / "meshtrain.json").read_text())["frozen_base"]
    assert f"its LoRA adapters were trained on model.init_from_hf={saved['init_from_hf']} (safetensors sha256 " \
           f"{saved['sha256'][:16]}...); this run's frozen base is model.init_from_hf={other}" in proc.stderr, \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_a_random_lora_base_is_recorded_by_its_seed_and_init():
    from meshtrain.checkpoint.frozen_base import check_frozen_base
    from meshtrain.errors import CheckpointError

    base = {"random": {"train.seed": 0, "model.init_std": 0.02}}
    meta = {"kind": "train", "frozen_base": base}
    check_frozen_base(meta, base, "ckpt")
    for other in ({"random": {"train.seed": 1, "model.init_std": 0.02}},
                  {"random": {"train.seed": 0, "model.init_std": 0.01}},
                  {"init_from_hf": "/m", "sha256": "ab" * 32}):
        with pytest.raises(CheckpointError, match="its LoRA adapters were trained on a random base "
                                                  r"\(train.seed=0, model.init_std=0.02\); this run's frozen base is"):
            check_frozen_base(meta, other, "ckpt")
    with pytest.raises(CheckpointError, match="holds whole weights"):
        check_frozen_base({"kind": "weights"}, base, "ckpt")


MOE_EXPORT_DIR = "{jobs}/lora/moe-ep2-export"
MOE_EXPORT = hf_lora_job("moe-ep2-export", "--parallel.ep", "2", "--peft.targets", "*.q_proj", "*.experts",
                         "--peft.export-adapter", f"{MOE_EXPORT_DIR}/adapter", "--checkpoint.export-hf",
                         f"{MOE_EXPORT_DIR}/merged", "--train.steps", "2", prepare=write_moe_model,
                         kind="slow_export_check")  # rank 1 checks each target 2 s after rank 0


@pytest.mark.slow
@pytest.mark.job(MOE_EXPORT)
def test_moe_lora_under_ep2_exports_a_peft_adapter_and_a_merged_model_with_equal_logits(batches):
    """A Qwen3-MoE from transformers, LoRA on q_proj and every expert, trained with the experts split
    over ep2: the gathered per-expert adapters load in peft and the merged export in transformers,
    with the same logits. Rank 1 reaches each export's target check 2 s late: both exports still
    complete (no rank writes before every rank has checked)."""
    peft = pytest.importorskip("peft")
    import transformers
    from safetensors import safe_open

    out = batches.result(MOE_EXPORT)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(out / "qwen3_moe")).eval()
    with safe_open(str(out / "adapter" / "adapter_model.safetensors"), "pt") as f:
        adapted_modules = {key.split(".lora_")[0] for key in f.keys()}
    # PEFT names each expert: 3 q_proj + 2 MoE layers x 8 experts x 3 projections, all gathered over ep
    assert len(adapted_modules) == 3 + 2 * 8 * 3, sorted(adapted_modules)
    x = torch.randint(0, 384, (2, 24))
    with torch.no_grad():
        plain = base(x).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(out / "merged"))(x).logits
        adapted = peft.PeftModel.from_pretrained(base, str(out / "adapter"))(x).logits
    torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-5)
    assert (merged - plain).abs().max() > 1e-4


@pytest.mark.slow
def test_the_lora_config_fine_tunes_chat_data_into_a_peft_adapter_and_a_merged_model(tmp_path):
    """configs/lora_chat.yaml as the README and docs/fine-tuning.md run it, on a tiny Llama with a chat tokenizer, tp2: the
    PEFT adapter on the base model (loaded by peft) and the merged export (by transformers) give the
    same logits, not the base model's."""
    import json
    import shutil

    peft = pytest.importorskip("peft")
    import transformers

    from tests.conftest import ROOT, torchrun
    from tests.hf_models import write_hf_dir
    from tests.chat_data import chat_tokenizer, write_chats

    model_dir = write_hf_dir(tmp_path / "model")
    tok = chat_tokenizer(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, model_dir / name)
    out = tmp_path / "run"
    proc = torchrun(2, ["-m", "meshtrain", "train", "--config", str(ROOT / "configs" / "lora_chat.yaml"),
                        "--model.init-from-hf", str(model_dir), "--data.tokenizer", str(model_dir),
                        "--data.path", str(write_chats(tmp_path / "chats.jsonl")), "--train.steps", "2",
                        "--train.seq-len", "64", "--train.global-batch-size", "4", "--train.run-dir", str(out),
                        "--parallel.tp", "2", "--optimizer.lr", "1e-2", "--lr-schedule.warmup-steps", "1",
                        "--peft.export-adapter", str(out / "adapter"), "--checkpoint.export-hf", str(out / "merged"),
                        "--logging.progress", "off"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(14 LoRA adapters merged into their weights)" in proc.stdout  # 2 layers x 7 projections
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 16 and config["target_modules"] == [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    x = torch.randint(0, 384, (2, 24))
    with torch.no_grad():
        plain = base(x).logits
        adapted = peft.PeftModel.from_pretrained(base, str(out / "adapter"))(x).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(out / "merged"))(x).logits
    torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-5)
    assert (merged - plain).abs().max() > 1e-4


def test_merging_gives_the_adapted_models_logits():
    from meshtrain.models.lora import merge_lora

    model = tiny()
    add_lora(model, PeftConfig(method="lora", rank=4, alpha=8))
    init_lora(model, 0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.1)  # trained adapters
    x = torch.randint(0, 384, (2, 16))
    adapted = model(x)
    assert merge_lora(model) == 14 and not any(isinstance(m, LoRALinear) for m in model.modules())
    torch.testing.assert_close(model(x), adapted, rtol=1e-5, atol=1e-5)
    assert not any(n.endswith(("lora_A", "lora_B")) for n, _ in model.named_parameters())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_expert_adapters_load_in_peft_and_merge_into_a_transformers_model(tmp_path, family):
    """Per-expert adapters on a model imported from transformers, with the default targets (Qwen3-MoE's
    layer 0 is a dense MLP: its gate/up/down get adapters too): peft holds every LoRA tensor of the
    PEFT directory (per-expert names, which peft fuses for transformers 5's gate_up_proj; the dense
    MLP's as target_parameters, which peft's fusion leaves alone) on the HF base model, and that and
    the merged export loaded by transformers both give meshtrain's adapted logits."""
    peft = pytest.importorskip("peft")
    import transformers
    from safetensors import safe_open

    from meshtrain.hf.io import export_dtypes, save_hf
    from meshtrain.hf.peft import save_peft_adapter
    from meshtrain.models.lora import merge_lora
    from tests.hf_models import hf_dir, meshtrain_from

    hf, directory = hf_dir(tmp_path, family)
    ours = meshtrain_from(directory)
    lora = PeftConfig(method="lora", rank=4, alpha=8)
    add_lora(ours, lora)
    init_lora(ours, 0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.2)  # trained adapters
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted, plain = ours(tokens), hf(tokens).logits
    adapter = save_peft_adapter([ours], str(tmp_path / "adapter"), lora, ours.cfg, str(directory), torch.float32)
    config = json.loads((adapter / "adapter_config.json").read_text())
    attention = ["k_proj", "o_proj", "q_proj", "v_proj"]
    if family == "qwen3_moe":
        assert config["target_modules"] == sorted(attention + ["down_proj", "gate_proj", "up_proj"])
        assert config["target_parameters"] == ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]
    else:
        assert config["target_modules"] == sorted(attention + ["w1", "w2", "w3"])
        assert "target_parameters" not in config
    merged = 2 * (4 + 3) if family == "mixtral" else 3 * 4 + 3 + 2 * 3  # qwen3_moe: layer 0 is dense
    assert merge_lora(ours) == merged
    out = save_hf([ours], str(tmp_path / "merged"), export_dtypes(ours.cfg, "auto"), max_shard_bytes=10**9)
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        written = {key: f.get_tensor(key) for key in f.keys()}
    with torch.no_grad():
        peft_model = peft.PeftModel.from_pretrained(hf, str(adapter))
        from_peft = peft_model(tokens).logits
        from_merged = transformers.AutoModelForCausalLM.from_pretrained(str(out))(tokens).logits
    # peft holds every tensor of the file: the others by name with the file's values, and each MoE
    # layer's per-expert ones fused (A and B of gate_up_proj and of down_proj); nothing is dropped
    held = {n: p for n, p in peft_model.named_parameters() if ".lora_" in n}
    unfused = {k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"):
               t for k, t in written.items() if ".experts." not in k}
    moe_layers = {k.split(".experts.")[0] for k in written if ".experts." in k}
    assert len(held) == len(unfused) + 4 * len(moe_layers), sorted(set(held) - set(unfused))
    for name, tensor in unfused.items():
        torch.testing.assert_close(held[name], tensor, rtol=0, atol=0, msg=name)
    assert sum(".mlp." in n and ".experts." not in n for n in unfused) == (6 if family == "qwen3_moe" else 0)
    torch.testing.assert_close(from_peft, adapted, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(from_merged, adapted, rtol=1e-4, atol=1e-5)
    assert (adapted - plain).abs().max() > 1e-2


@pytest.mark.parametrize("family, targets", [("llama", ["*.q_proj", "*.o_proj", "*.down_proj"]),
                                             ("phi3", ["*.gate_proj", "*.up_proj", "*.o_proj"])])
def test_dora_starts_as_the_base_model_and_gives_peft_s_logits_merged_or_not(tmp_path, family, targets):
    """DoRA on a Llama imported from transformers (and on a Phi-3's gate and up projections: one DoRA
    adapter of the checkpoint's gate_up_proj, the magnitudes stacked): at init the base model's logits; trained (B and
    the magnitudes moved) the PEFT adapter (use_dora) on the HF model and the merged weights give
    meshtrain's logits."""
    peft = pytest.importorskip("peft")
    import transformers

    from meshtrain.hf.peft import save_peft_adapter
    from meshtrain.models.lora import DoRALinear, merge_lora
    from tests.hf_models import write_hf_dir
    from tests.hf_models import meshtrain_from

    directory = write_hf_dir(tmp_path / "model", family, shard=None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    ours = meshtrain_from(directory)
    dora = PeftConfig(method="dora", rank=4, alpha=8, targets=targets)
    assert len(add_lora(ours, dora)) == 6 and isinstance(ours.layers["0"].self_attn.o_proj, DoRALinear)
    init_lora(ours, 0)
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = hf(tokens).logits
        torch.testing.assert_close(ours(tokens), plain, rtol=1e-5, atol=1e-5)
        for name, p in ours.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.2)
            if name.endswith("lora_magnitude"):
                p.mul_(1 + 0.1 * torch.randn_like(p))
        adapted = ours(tokens)
    adapter = save_peft_adapter([ours], str(tmp_path / "adapter"), dora, ours.cfg, str(directory), torch.float32)
    assert json.loads((adapter / "adapter_config.json").read_text())["use_dora"] is True
    with torch.no_grad():
        from_peft = peft.PeftModel.from_pretrained(hf, str(adapter))(tokens).logits
        assert merge_lora(ours) == 6
        merged = ours(tokens)
    torch.testing.assert_close(from_peft, adapted, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-5)
    assert (adapted - plain).abs().max() > 1e-2


def test_a_lora_checkpoint_of_an_hf_base_resumed_without_it_names_the_base():
    from meshtrain.checkpoint.checkpointer import check_architecture
    from meshtrain.errors import CheckpointError

    meta = {"kind": "train", "model": {}, "frozen_base": {"init_from_hf": "/models/llama", "sha256": "ab" * 32}}
    with pytest.raises(CheckpointError, match=r"holds LoRA adapters trained on model.init_from_hf=/models/llama, and "
                                              r"this run has no model.init_from_hf. Fix: set model.init_from_hf"):
        check_architecture(meta, ModelConfig(), "ckpt")


DEEPSEEK_TARGETS = ["*.q_a_proj", "*.q_b_proj", "*.kv_a_proj_with_mqa", "*.kv_b_proj", "*.o_proj", "*.experts",
                    "*.shared_expert.*", "*.mlp.down_proj"]


@pytest.mark.parametrize("family, targets, adapted", [
    ("qwen2", None, 14), ("gemma3", None, 21), ("phi3", None, 14), ("phi3", ["*.q_proj", "*.v_proj", "*.up_proj"], 6),
    # 5 latent-attention linears a layer, the dense first MLP's down_proj, each MoE layer's experts (3
    # stacks) and shared expert (3 linears)
    ("deepseek_v3", DEEPSEEK_TARGETS, 3 * 5 + 1 + 2 * 6),
    # attention with biases on q/k/v/o and sinks beside the adapters; the interleaved experts (their
    # adapters as peft's target_parameters, gate_up_proj's wrapped in down_proj's)
    ("gpt_oss", ["*.self_attn.*_proj", "*.experts"], 2 * (4 + 2))],
    ids=["qwen2", "gemma3", "phi3", "phi3-some-parts", "deepseek_v3", "gpt_oss"])
def test_new_family_adapters_load_in_peft_and_merge_into_a_transformers_model(tmp_path, family, targets, adapted):
    """LoRA on the default targets of a Qwen2 (q/k/v biases beside the adapters), a Gemma 3 (tied,
    four norms a layer) and a Phi-3 (adapters of q/k/v_proj as one of the checkpoint's qkv_proj, also
    with some parts only), and on DeepSeek-V3's latent attention, routed and shared experts, imported
    from transformers: the PEFT adapter on the HF model and the merged export loaded by transformers
    give meshtrain's adapted logits."""
    peft = pytest.importorskip("peft")
    import transformers

    from meshtrain.hf.io import export_dtypes, save_hf
    from meshtrain.hf.peft import save_peft_adapter
    from meshtrain.models.lora import merge_lora
    from tests.hf_models import hf_dir, meshtrain_from

    hf, directory = hf_dir(tmp_path, family)
    ours = meshtrain_from(directory)
    lora = PeftConfig(method="lora", rank=4, alpha=8, **({"targets": targets} if targets else {}))
    assert len(add_lora(ours, lora)) == adapted
    init_lora(ours, 0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.2)  # trained adapters
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted, plain = ours(tokens), hf(tokens).logits
    adapter = save_peft_adapter([ours], str(tmp_path / "adapter"), lora, ours.cfg, str(directory), torch.float32)
    merge_lora(ours)
    out = save_hf([ours], str(tmp_path / "merged"), export_dtypes(ours.cfg, "auto"), max_shard_bytes=10**9)
    with torch.no_grad():
        from_peft = peft.PeftModel.from_pretrained(hf, str(adapter))(tokens).logits
        from_merged = transformers.AutoModelForCausalLM.from_pretrained(str(out))(tokens).logits
    torch.testing.assert_close(from_peft, adapted, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(from_merged, adapted, rtol=1e-4, atol=1e-5)
    assert (adapted - plain).abs().max() > 1e-2
