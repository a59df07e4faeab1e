"""Preference training: pairs read from the public forms and packed whole; DPO, IPO, hinge, SimPO
and RPO's NLL term equal to an independent computation on transformers' logits (losses and
gradients); the first step's loss is ln 2; dp2, tp2+SP with loss parallel, pp2, cp2, MoE ep2 and
LoRA equal one rank; resume is exact."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from meshtrain.config import DataConfig, PreferenceConfig
from meshtrain.data.packing import PackedUnits
from meshtrain.data.preference import preference_dataset
from meshtrain.data.tokenizer import build_tokenizer
from meshtrain.errors import DataError
from meshtrain.objectives.preference import PreferenceObjective
from tests.batch import Job, jobs
from tests.chat_data import chat_tokenizer
from tests.parity import MOE_ARGS, PP_MODEL, TINY, assert_matches_reference, run_layout


def targets_text(tokenizer_dir, dataset, sample: int) -> list[str]:
    """The target tokens of each document of a sample, decoded."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    inputs, labels, documents = dataset[sample]
    out: dict[int, list[int]] = {}
    for label, doc in zip(labels.tolist(), documents.tolist()):
        if label != -100:
            out.setdefault(doc, []).append(label)
    return [tokenizer.decode(ids, skip_special_tokens=False) for _, ids in sorted(out.items())]


def test_pairs_from_text_and_chat_forms_target_the_responses_only(tmp_path):
    tok = chat_tokenizer(tmp_path / "tok")
    cfg = DataConfig(format="preference", tokenizer=str(tok))
    tokenizer = build_tokenizer(cfg)
    user = {"role": "user", "content": "What is the sky?"}
    records = [
        {"prompt": "Q: sky? A:", "chosen": " blue", "rejected": " green"},  # text
        {"prompt": [user], "chosen": [{"role": "assistant", "content": "It is blue."}],  # trl's conversational form
         "rejected": [{"role": "assistant", "content": "Green."}]},
        {"prompt": "What is the sky?", "chosen": [{"role": "assistant", "content": "Blue."}],  # a string prompt
         "rejected": [{"role": "assistant", "content": "No idea."}]},
        # two whole conversations (UltraFeedback, HH): the prompt is what both begin with
        {"chosen": [user, {"role": "assistant", "content": "Blue, by day."}],
         "rejected": [user, {"role": "assistant", "content": "Red."}]},
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    dataset, line = preference_dataset(cfg, str(tmp_path / "pairs.jsonl"), tokenizer, seq_len=400)
    assert "4 pairs in 1 samples" in line and "0 truncated, 0 dropped" in line
    eos = "<|endoftext|>"
    assert targets_text(tok, dataset, 0) == [
        " blue" + eos, " green" + eos, "It is blue.<|im_end|>", "Green.<|im_end|>", "Blue.<|im_end|>",
        "No idea.<|im_end|>", "Blue, by day.<|im_end|>", "Red.<|im_end|>"]
    _, _, documents = dataset[0]
    assert documents.unique().tolist() == list(range(9))  # 4 pairs (documents 2k, 2k + 1), then the padding

    # bad records name the record and the rule; data.bad_records=skip counts them
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "Q", "chosen": " a", "rejected": ["b"]}) + "\n"
                                        + json.dumps(records[0]) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: no preference pair: 'chosen' and 'rejected' must both be "
                                        r"strings or both lists of messages \(got str and list\)"):
        preference_dataset(cfg, str(tmp_path / "bad.jsonl"), tokenizer, seq_len=400)
    skipping = DataConfig(format="preference", tokenizer=str(tok), bad_records="skip")
    assert "1 bad records skipped" in preference_dataset(skipping, str(tmp_path / "bad.jsonl"), tokenizer, 400)[1]


def test_a_pair_longer_than_a_sample_is_cut_on_its_longer_side_or_dropped():
    chosen, rejected = ([1] * 3 + [2] * 10, [False] * 3 + [True] * 10), ([1] * 3 + [3] * 2, [False] * 3 + [True] * 2)
    cut = PackedUnits([[chosen, rejected]], seq_len=11, pad_id=0, overlong="truncate", need_targets=True)
    assert cut.tokens.tolist() == [[1, 1, 1, 2, 2, 2, 2, 1, 1, 1, 3, 3]] and cut.truncated == 1  # 7 + 5 tokens
    assert PackedUnits([[chosen, rejected]], 11, 0, "drop", need_targets=True).dropped == 1
    # a side left without targets drops the pair (a prompt longer than the share of a sample)
    long_prompt = ([1] * 9 + [2], [False] * 9 + [True])
    lost = PackedUnits([[long_prompt, long_prompt], [chosen, rejected]], 11, 0, "truncate", need_targets=True)
    assert lost.dropped == 1 and lost.units == 1


# --- the losses, against an independent computation ------------------------------------------------

def _formula(loss: str, beta: float, smoothing: float, gamma: float, nll_weight: float,
             policy: list[tuple[float, float, int, int]], ref: list[tuple[float, float]]) -> torch.Tensor:
    """The papers' losses, written out per pair: (chosen, rejected) summed log-probs and lengths."""
    out = []
    for (pc, pr, nc, nr), (rc, rr) in zip(policy, ref):
        if loss == "dpo":
            x = beta * ((pc - rc) - (pr - rr))
            value = -(1 - smoothing) * F.logsigmoid(x) - smoothing * F.logsigmoid(-x)
        elif loss == "ipo":
            value = ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2
        elif loss == "hinge":
            value = torch.relu(1 - beta * ((pc - rc) - (pr - rr)))
        else:  # simpo
            x = beta * (pc / nc - pr / nr) - gamma
            value = -(1 - smoothing) * F.logsigmoid(x) - smoothing * F.logsigmoid(-x)
        out.append(value + nll_weight * (-pc / nc))
    return torch.stack(out).mean()


@pytest.mark.parametrize("loss, options", [("dpo", {}), ("dpo", {"label_smoothing": 0.2, "nll_weight": 0.5}),
                                           ("ipo", {}), ("hinge", {}), ("simpo", {"label_smoothing": 0.1})],
                         ids=["dpo", "cdpo-rpo", "ipo", "hinge", "simpo"])
def test_losses_and_gradients_equal_an_independent_computation_on_transformers_logits(loss, options):
    """Pairs packed several to a sample and document-masked in meshtrain's model; each sequence run
    alone through transformers' model with the same weights, its response's log-probs summed, and
    the loss written out: the same loss and the same gradient for every weight."""
    from meshtrain.hf.adapter import from_hf, model_config_from_hf, to_hf
    from meshtrain.models.transformer import Transformer
    from tests.hf_models import hf_model

    policy_hf, reference_hf = hf_model("llama", seed=0), hf_model("llama", seed=1)
    cfg, _ = model_config_from_hf(policy_hf.config.to_dict())

    def ours(hf):
        model = Transformer(cfg)
        model.load_state_dict(from_hf(dict(hf.state_dict()), cfg), strict=True)
        return model
    policy, reference = ours(policy_hf), ours(reference_hf)
    g = torch.Generator().manual_seed(0)

    def sequence(prompt, length):
        response = torch.randint(3, 384, (length,), generator=g).tolist()
        return prompt + response, [False] * len(prompt) + [True] * length
    units = []
    for _ in range(6):
        prompt = torch.randint(3, 384, (int(torch.randint(2, 9, (), generator=g)),), generator=g).tolist()
        units.append([sequence(prompt, int(torch.randint(1, 8, (), generator=g))),
                      sequence(prompt, int(torch.randint(1, 8, (), generator=g)))])
    packed = PackedUnits(units, seq_len=47, pad_id=0, overlong="truncate", need_targets=True)
    assert len(packed) < len(units) and packed.truncated == 0  # several pairs to a sample

    pcfg = PreferenceConfig(loss=loss, beta=0.5, **options)
    objective = PreferenceObjective(pcfg)
    samples = [packed[i] for i in range(len(packed))]
    from meshtrain.data.batch import Batch
    batches = [Batch(x[None], y[None], d[None]) for x, y, d in samples]
    objective.reference_logps, objective.scoring = torch.zeros(len(samples), 47), True
    with torch.no_grad():
        objective.commit([objective(reference(b.inputs, b.documents), objective.target(b, row))
                          for row, b in enumerate(batches)])
    objective.scoring, objective.scale = False, 1 / len(units)
    losses = [objective(policy(b.inputs, b.documents), objective.target(b, row)) for row, b in enumerate(batches)]
    objective.commit(losses)
    got = sum(losses)
    got.backward()

    def logp(model, ids, flags):
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
        token = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        return token[torch.tensor(flags[1:])].sum()
    stats, ref_stats = [], []
    for (c_ids, c_flags), (r_ids, r_flags) in units:
        stats.append((logp(policy_hf, c_ids, c_flags), logp(policy_hf, r_ids, r_flags), sum(c_flags), sum(r_flags)))
        with torch.no_grad():
            ref_stats.append((logp(reference_hf, c_ids, c_flags), logp(reference_hf, r_ids, r_flags)))
    want = _formula(loss, 0.5, pcfg.label_smoothing, pcfg.simpo_gamma, pcfg.nll_weight, stats, ref_stats)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    theirs = dict(policy_hf.named_parameters())
    grads = to_hf({n: p.grad for n, p in policy.named_parameters()}, cfg)
    assert grads.keys() == theirs.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, theirs[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    if loss == "dpo" and not options:  # the logged values, trl's names: the mean over pairs
        rewards = [0.5 * (s[0] - r[0]).item() for s, r in zip(stats, ref_stats)]
        metrics = objective.metrics(objective.sums, training=True)
        assert metrics["rewards/chosen"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-5)
        assert math.isclose(metrics["loss"], float(want), rel_tol=1e-5)


# --- training ------------------------------------------------------------------------------------

WORDS = "the sky sea is blue green red grey dark light at noon night".split()


def write_pairs(path, n: int = 200, seed: int = 0) -> str:
    """Text-form pairs for the byte tokenizer, short enough that a pair fits TINY's 33 tokens: a
    question of two words, answered yes (chosen) or with one of them (rejected), which a few steps
    learn."""
    g = torch.Generator().manual_seed(seed)

    def word() -> str:
        return WORDS[int(torch.randint(len(WORDS), (), generator=g))]
    with open(path, "w") as f:
        for _ in range(n):
            first = word()
            f.write(json.dumps({"prompt": f"{first} {word()}?", "chosen": " yes", "rejected": f" {first}"}) + "\n")
    return str(path)


PREFERENCE = ("--data.format", "preference", "--preference.beta", "0.5", "--optimizer.lr", "1e-3",
              "--train.steps", "3")


def test_a_preference_run_starts_at_ln2_and_resumes_bitwise(tmp_path):
    """Policy and reference start equal: every pair's loss is -log sigmoid(0) = ln 2. A run resumed
    from its step-2 checkpoint continues with the same losses, bit for bit (the reference is built
    again from the starting weights, not from the checkpoint). Evaluation on held-out pairs logs the
    same values."""
    from meshtrain.commands.train import run
    from tests.conftest import tiny_config

    data = write_pairs(tmp_path / "pairs.jsonl")

    def job(run_dir, **checkpoint):
        return tiny_config(train={"steps": 4, "run_dir": str(run_dir)}, data={"format": "preference", "path": data},
                           preference={"beta": 0.5}, optimizer={"lr": 1e-3}, checkpoint=checkpoint,
                           eval={"interval": 2, "split": 0.1, "steps": 1})
    history = run(job(tmp_path / "whole", interval=2, resume="never"))
    whole = [m["loss"] for m in history]
    assert whole[0] == pytest.approx(math.log(2), abs=1e-6) and whole[-1] < whole[0]
    # held-out pairs, evaluated with the same reference: their reward accuracy rises as training's does
    assert history[1]["val_rewards/accuracies"] <= history[3]["val_rewards/accuracies"]
    assert history[3]["val_loss"] < math.log(2) and history[3]["val_pairs"] > 0
    resumed = run(job(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoints" / "step-000002")))
    assert [m["loss"] for m in resumed] == whole[2:]


def write_data(directory) -> tuple[str, ...]:
    return ("--data.path", write_pairs(directory / "pairs.jsonl"))


def preference_job(name: str, nproc: int, layout: tuple[str, ...], extra: tuple[str, ...] = (),
                   after: tuple[Job, ...] = ()) -> Job:
    return Job(f"preference/{name}", nproc, "train", (*TINY, *PREFERENCE, *extra, *layout), prepare=write_data,
               after=after)


LORA = ("--peft.method", "lora", "--peft.rank", "4", "--peft.alpha", "8")
PREFERENCE_LAYOUTS = {  # name: (ranks, layout, model options: the one-rank run with them is the reference)
    "dp2": (2, ("--parallel.dp-shard", "2"), ()),
    # per-token log-probs from the vocab shards (loss parallel), the same on both tp ranks
    "tp2-sp": (2, ("--parallel.tp", "2", "--parallel.sp", "True"), ()),
    # the loss on the last stage; the frozen copy of the reference pipelined like the policy
    "pp2": (2, ("--parallel.pp", "2"), PP_MODEL),
    # each rank's share of a sequence's tokens: partial sums over cp, the gradient through its own
    "cp2": (2, ("--parallel.cp", "2"), ()),
    "moe-ep2": (2, ("--parallel.ep", "2"), MOE_ARGS),
    # the reference is the base with the adapters off: no second copy
    "lora-tp2-sp": (2, ("--parallel.tp", "2", "--parallel.sp", "True"), LORA),
}
ONE_RANK = {extra: preference_job(f"one-rank{'-' + str(i) if i else ''}", 1, (), extra)
            for i, extra in enumerate(dict.fromkeys(e for _, _, e in PREFERENCE_LAYOUTS.values()))}
PREFERENCE_JOBS = {name: preference_job(name, n, layout, extra, after=(ONE_RANK[extra],))
                   for name, (n, layout, extra) in PREFERENCE_LAYOUTS.items()}


@jobs("name", PREFERENCE_JOBS)
def test_preference_layouts_equal_one_rank(batches, name):
    extra = PREFERENCE_LAYOUTS[name][2]
    got, ref = run_layout(batches, PREFERENCE_JOBS[name]), run_layout(batches, ONE_RANK[extra])
    assert ref["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert_matches_reference(got, ref)


def chat_pairs(path) -> str:
    """Chat-form pairs (trl's conversational form) for the chat tokenizer."""
    records = []
    for i in range(40):
        question = [{"role": "user", "content": f"Is the sky {WORDS[i % len(WORDS)]}?"}]
        records.append({"prompt": question, "chosen": [{"role": "assistant", "content": "Yes, it is."}],
                        "rejected": [{"role": "assistant", "content": "No."}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("config", ["dpo_lora.yaml", "dpo_full.yaml"])
def test_the_dpo_configs_run_end_to_end_and_export_models_transformers_loads(tmp_path, config, capsys):
    """configs/dpo_lora.yaml and configs/dpo_full.yaml as docs/fine-tuning.md runs them (in one process
    here: their layouts are the layout tests' above), on a tiny Llama with a chat tokenizer and
    chat-form pairs: the first loss is ln 2, the chosen responses' margin grows, and the exports
    (LoRA: the PEFT adapter and the merged model) load in transformers (and peft) with the same
    logits, not the base model's."""
    import shutil

    import transformers

    from meshtrain.cli import parse
    from meshtrain.commands.train import run
    from meshtrain.config import JobConfig
    from tests.conftest import ROOT
    from tests.hf_models import write_hf_dir

    model_dir = write_hf_dir(tmp_path / "model")
    tok = chat_tokenizer(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, model_dir / name)
    out = tmp_path / "run"
    lora = config == "dpo_lora.yaml"
    history = run(parse(JobConfig, [
        "--config", str(ROOT / "configs" / config), "--model.init-from-hf", str(model_dir),
        "--data.tokenizer", str(model_dir), "--data.path", chat_pairs(tmp_path / "pairs.jsonl"),
        "--train.steps", "4", "--train.seq-len", "192", "--train.global-batch-size", "4", "--train.run-dir", str(out),
        "--parallel.tp", "1", "--parallel.sp", "False", "--optimizer.lr", "1e-2" if lora else "1e-3",
        "--lr-schedule.warmup-steps", "1", "--checkpoint.export-hf", str(out / "merged"),
        *(("--peft.export-adapter", str(out / "adapter")) if lora else ()), "--logging.progress", "off"], "train"))
    assert "preference pairs: 40 pairs in 20 samples; 0 truncated" in capsys.readouterr().out
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert history[-1]["rewards/margins"] > history[0]["rewards/margins"]
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    x = torch.randint(0, 384, (2, 24))
    with torch.no_grad():
        plain = base(x).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(out / "merged"))(x).logits
        if lora:
            peft = pytest.importorskip("peft")
            adapted = peft.PeftModel.from_pretrained(base, str(out / "adapter"))(x).logits
            torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-5)
    assert (merged - plain).abs().max() > 1e-4
