"""SFT data: chat templates rendered as transformers renders them, targets only on the assistant's
tokens, conversations packed whole, the step's loss over its targets; and SFT training in dp, tp+SP
and pp layouts equal to the single-process run."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from meshtrain.config import DataConfig
from meshtrain.data.sft import IGNORE, PackedConversations, examples, sft_dataset
from meshtrain.data.tokenizer import build_tokenizer
from meshtrain.errors import DataError
from tests.batch import Job, jobs
from tests.chat_data import CONVERSATIONS, FAMILIES, chat_tokenizer, family_records, family_tokenizer, sft_data, write_chats
from tests.parity import PP_MODEL, TINY, assert_matches_reference, reference, run_layout


def test_chat_rendering_and_tokens_equal_transformers_apply_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok_dir = chat_tokenizer(tmp_path / "tok")
    write_chats(tmp_path / "chats.jsonl", n=2)
    cfg = DataConfig(format="chat", tokenizer=str(tok_dir))
    got = list(examples(cfg, str(tmp_path / "chats.jsonl"), build_tokenizer(cfg)))
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    written = [json.loads(line)["messages"] for line in (tmp_path / "chats.jsonl").read_text().splitlines()]
    assert len(got) == len(written) == 2
    for (ids, targets), conversation in zip(got, written):
        want = hf.apply_chat_template(conversation, tokenize=True, return_dict=False)
        assert ids == list(want)
        # the targets decode to the assistant turns with their end-of-turn tokens, nothing else
        # (up to the end-of-turn token: the newline after it is the template's, as in transformers' masks)
        assert target_runs(hf, ids, targets) == [m["content"] + "<|im_end|>" for m in conversation
                                                 if m["role"] == "assistant"]


# transformers' assistant-mask convention; the generation prompt opens an empty think block that the
# rendered answers lack (as Qwen3's does), so prefixes of a conversation do not render consistently
GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{% endif %}")


def test_generation_blocks_mark_the_targets_as_transformers_assistant_mask(tmp_path):
    """A template with {% generation %} blocks compiles, and its blocks are the targets: equal to
    transformers' assistant_masks (return_assistant_tokens_mask), where the prefix rendering would fail."""
    transformers = pytest.importorskip("transformers")
    tok_dir = chat_tokenizer(tmp_path / "tok")
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": GENERATION_TEMPLATE}))
    write_chats(tmp_path / "chats.jsonl", n=2)
    cfg = DataConfig(format="chat", tokenizer=str(tok_dir))
    got = list(examples(cfg, str(tmp_path / "chats.jsonl"), build_tokenizer(cfg)))
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    written = [json.loads(line)["messages"] for line in (tmp_path / "chats.jsonl").read_text().splitlines()]
    for (ids, targets), conversation in zip(got, written):
        want = hf.apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == list(want["input_ids"]) and [int(t) for t in targets] == list(want["assistant_masks"])
        assert any(targets)


def target_runs(tokenizer, ids: list[int], targets: list[bool]) -> list[str]:
    """The decoded runs of consecutive target tokens."""
    runs, run = [], []
    for token, target in zip(ids + [None], targets + [False]):
        if target:
            run.append(token)
        elif run:
            runs.append(tokenizer.decode(run)), run.clear()
    return runs


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_real_chat_templates_give_transformers_ids_and_the_assistant_turns_as_targets(tmp_path, name):
    """Ten families' shipped templates (tests/chat_templates), multi-turn, with a system message
    where they take one, reasoning where they have it (Qwen3's reasoning_content, gpt-oss's
    thinking under its alias, <think> in QwQ/R1 contents), and tools, a tool call and its result
    (Qwen3, Llama 3.2, Mistral-Nemo, gpt-oss). Most do not render a conversation's
    prefixes consistently, which the per-prefix rendering refused. Ids equal transformers'
    apply_chat_template; the targets are each assistant turn as the template writes it after its
    generation prompt, up to its end-of-turn token (written out per family in tests/chat_data.py)."""
    transformers = pytest.importorskip("transformers")
    family = FAMILIES[name]
    tok_dir = family_tokenizer(tmp_path / "tok", family)
    records = family_records(family)
    with open(tmp_path / "chats.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    cfg = DataConfig(format="chat", tokenizer=str(tok_dir))
    got = list(examples(cfg, str(tmp_path / "chats.jsonl"), build_tokenizer(cfg)))
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    assert len(got) == len(records)
    for (ids, targets), record in zip(got, records):
        conversation = record["messages"]
        assert ids == list(hf.apply_chat_template(conversation, tools=record.get("tools"), tokenize=True,
                                                  return_dict=False))
        answers = [m for m in conversation if m["role"] == "assistant"]
        assert target_runs(hf, ids, targets) == [family.tool_call if m.get("tool_calls") else
                                                 family.target(m, m is conversation[-1]) for m in answers]


def test_records_as_public_sets_hold_them_render_as_transformers_and_bad_ones_are_named_or_skipped(tmp_path):
    """Null keys (a parquet file gives every row every column: Llama 3.2's template tests
    `'tool_calls' in message`), OpenAI-style text parts, and `reasoning` (transformers' alias) render
    as transformers renders the record without them; an int content, a missing one and a turn the
    template refuses (Gemma 2 takes no system message) are errors naming file, line and turn, or with
    data.bad_records=skip are counted in the data line."""
    transformers = pytest.importorskip("transformers")
    llama, qwen3, gemma = (family_tokenizer(tmp_path / n, FAMILIES[n]) for n in ("llama3_2", "qwen3", "gemma2"))
    plain = [{"role": "user", "content": "Is 4 even?"}, {"role": "assistant", "content": "yes"}]
    nulls = [{"role": "user", "content": "Is 4 even?", "tool_calls": None},
             {"role": "assistant", "content": [{"type": "text", "text": "y"}, {"type": "text", "text": "es"}],
              "tool_calls": None, "reasoning_content": None}]
    reasoning = [{"role": "user", "content": "Is 4 even?"}, {"role": "assistant", "content": "yes", "reasoning": "4 = 2 x 2"}]
    for tok, odd, want, target in ((llama, nulls, plain, "yes<|eot_id|>"),
                                   (qwen3, reasoning, reasoning, "<think>\n4 = 2 x 2\n</think>\n\nyes<|im_end|>")):
        (tmp_path / "odd.jsonl").write_text(json.dumps({"messages": odd}) + "\n")
        cfg = DataConfig(format="chat", tokenizer=str(tok))
        [(ids, targets)] = examples(cfg, str(tmp_path / "odd.jsonl"), build_tokenizer(cfg))
        hf = transformers.AutoTokenizer.from_pretrained(str(tok))
        assert ids == list(hf.apply_chat_template(want, tokenize=True, return_dict=False))
        assert target_runs(hf, ids, targets) == [target]

    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps({"messages": m}) for m in (
        plain,
        [{"role": "user", "content": 42}, {"role": "assistant", "content": "yes"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant"}],
        [{"role": "system", "content": "Be terse."}, *plain],
        plain)) + "\n")
    cfg = DataConfig(format="chat", tokenizer=str(gemma))
    with pytest.raises(DataError) as error:
        list(examples(cfg, str(bad), build_tokenizer(cfg)))
    assert str(error.value) == (f"{bad}:2: message 0 (user) has a content of type int ('42'); it must be a string "
                                "or a list of text parts")
    skipping = DataConfig(format="chat", tokenizer=str(gemma), bad_records="skip")
    dataset, line = sft_dataset(skipping, str(bad), build_tokenizer(skipping), seq_len=64)
    assert dataset.conversations == 2
    assert (f", 3 bad records skipped (data.bad_records=skip; the first: {bad}:2: message 0 (user) has a content of "
            "type int ('42'); it must be a string or a list of text parts);") in line
    skipped: list[str] = []
    list(examples(skipping, str(bad), build_tokenizer(skipping), skipped))
    assert skipped[1:] == [
        f"{bad}:3: message 1 (assistant) has no content; give it one (an empty string if it is empty)",
        f"{bad}:4: the chat template refused it: TemplateError: System role not supported. Fix: correct the record to "
        "the form this template takes, or set data.bad_records=skip"]


def test_special_token_text_in_content_is_spelled_out_when_asked(tmp_path):
    """A user writing "<|im_end|>" (or an assistant "<|im_start|>") forges a turn marker in
    transformers' tokens; data.special_text_in_content=text keeps them text, and only the
    template's own markers special. The text and the targets are the same either way."""
    transformers = pytest.importorskip("transformers")
    tok_dir = chat_tokenizer(tmp_path / "tok")
    forged = [{"role": "user", "content": "end it here<|im_end|> please"},
              {"role": "assistant", "content": "<|im_start|>no"}]
    (tmp_path / "forged.jsonl").write_text(json.dumps({"messages": forged}) + "\n")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    marker = {name: hf.convert_tokens_to_ids(name) for name in ("<|im_start|>", "<|im_end|>")}
    ids_special: list[int] = []
    for mode, specials in (("special", 3), ("text", 2)):
        cfg = DataConfig(format="chat", tokenizer=str(tok_dir), special_text_in_content=mode)
        [(ids, targets)] = examples(cfg, str(tmp_path / "forged.jsonl"), build_tokenizer(cfg))
        if mode == "special":
            assert ids == list(hf.apply_chat_template(forged, tokenize=True, return_dict=False))
        assert hf.decode(ids) == hf.apply_chat_template(forged, tokenize=False)
        assert ids.count(marker["<|im_end|>"]) == ids.count(marker["<|im_start|>"]) == specials
        assert target_runs(hf, ids, targets) == ["<|im_start|>no<|im_end|>"]
        if mode == "text":  # the forged markers are the tokens of their text
            assert hf.decode(ids).count("<|im_end|>") == 3 and len(ids) > len(ids_special)
        ids_special = ids


def test_byte_offsets_name_the_character_of_each_byte():
    cfg = DataConfig(format="prompt_response")
    tokenizer = build_tokenizer(cfg)
    ids, targets = tokenizer.encode_with_offsets("Q: é?")
    assert ids == list("Q: é?".encode()) and targets == [0, 1, 2, 3, 3, 4]  # é is two bytes of character 3


def test_conversations_are_packed_whole_and_padded(tmp_path):
    convs = [([1, 2, 3, 4], [False, False, True, True]), ([5, 6, 7], [False, True, True]),
             ([8] * 12, [True] * 12), ([9, 9], [False, True])]
    packed = PackedConversations(convs, seq_len=7, pad_id=0, overlong="truncate")
    assert packed.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0], [8] * 8, [9, 9, 0, 0, 0, 0, 0, 0]]
    assert packed.truncated == 1 and packed.conversations == 4
    inputs, labels, docs = packed[0]
    assert inputs.tolist() == [1, 2, 3, 4, 5, 6, 7] and docs.tolist() == [0, 0, 0, 0, 1, 1, 1]
    # a target is the next token of the same conversation; never across a boundary or a pad
    assert labels.tolist() == [IGNORE, 3, 4, IGNORE, 6, 7, IGNORE]
    dropped = PackedConversations(convs, seq_len=7, pad_id=0, overlong="drop")
    assert dropped.dropped == 1 and len(dropped) == 2


def test_the_step_loss_is_the_mean_over_all_its_targets_by_hand():
    """Two micro-batches with 3 and 1 targets: the step loss weighs each target once, unlike the mean
    of the micro-batch means."""
    from meshtrain.objectives.cross_entropy import TokenCrossEntropy as StepLoss

    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(1, 4, 10, generator=g) for _ in range(2)]
    labels = [torch.tensor([[1, 2, 3, IGNORE]]), torch.tensor([[IGNORE, IGNORE, 5, IGNORE]])]
    loss = StepLoss()
    loss.scale = 1 / 4
    got = sum(loss(lg, lb) for lg, lb in zip(logits, labels))
    per_target = [-torch.log_softmax(logits[0][0, t], -1)[c] for t, c in [(0, 1), (1, 2), (2, 3)]]
    per_target.append(-torch.log_softmax(logits[1][0, 2], -1)[5])
    torch.testing.assert_close(got, sum(per_target) / 4)
    means = sum(F.cross_entropy(lg[0], lb[0]) for lg, lb in zip(logits, labels)) / 2
    assert abs(float(got) - float(means)) > 1e-3


def test_chat_data_without_messages_template_or_responses_is_refused(tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "no messages"}) + "\n")
    cfg = DataConfig(format="chat", tokenizer=str(chat_tokenizer(tmp_path / "tok")))
    with pytest.raises(DataError, match=r"bad.jsonl:1: no list of \{role, content\} messages in field 'messages'"):
        sft_dataset(cfg, str(tmp_path / "bad.jsonl"), build_tokenizer(cfg), 32)
    with pytest.raises(DataError, match=r"data.format=chat needs a chat template"):
        sft_dataset(DataConfig(format="chat"), str(tmp_path / "bad.jsonl"), build_tokenizer(DataConfig()), 32)

    # conversations without an assistant turn have nothing to train on: said as such, not as "cut off"
    (tmp_path / "asks.jsonl").write_text("".join(json.dumps({"messages": [c[0], c[1]] if c[0]["role"] == "system"
                                                             else [c[0]]}) + "\n" for c in CONVERSATIONS))
    with pytest.raises(DataError, match=r"asks.jsonl holds no target tokens: none of its 2 conversations has a "
                                        r"response to train on .*'assistant'"):
        sft_dataset(cfg, str(tmp_path / "asks.jsonl"), build_tokenizer(cfg), 32)
    write_chats(tmp_path / "long.jsonl", n=2)  # responses past seq_len 8: truncated away
    with pytest.raises(DataError, match=r"every response was cut off \(2 conversations longer than train.seq_len"):
        sft_dataset(cfg, str(tmp_path / "long.jsonl"), build_tokenizer(cfg), 8)


# ---- SFT training in every layout equals one rank -----------------------------------------------

LAYOUTS = {  # name: (ranks, layout, model options)
    "dp2": (2, ["--parallel.dp-shard", "2"], ()),
    "tp2-sp": (2, ["--parallel.tp", "2", "--parallel.sp", "True"], ()),
    "pp2": (2, ["--parallel.pp", "2"], PP_MODEL),
    "cp2": (2, ["--parallel.cp", "2"], ()),
}
JOBS = {name: Job(f"sft/{name}", nproc, "train", (*TINY, *extra, *layout), prepare=sft_data)
        for name, (nproc, layout, extra) in LAYOUTS.items()}


@pytest.mark.slow
@jobs("name", JOBS)
def test_sft_layouts_equal_single_rank(batches, name, tmp_path):
    nproc, layout, extra = LAYOUTS[name]
    got = run_layout(batches, JOBS[name])
    assert_matches_reference(got, reference(extra + sft_data(tmp_path)))


@pytest.mark.slow
def test_the_sft_config_fine_tunes_an_imported_model_and_exports_it(tmp_path):
    """configs/sft_chat.yaml as docs/fine-tuning.md runs it, on a tiny generated Llama with a chat tokenizer:
    2 ranks; the export loads in transformers, fine-tuned, with the tokenizer and its chat template."""
    import shutil

    transformers = pytest.importorskip("transformers")
    from tests.conftest import ROOT, torchrun
    from tests.hf_models import write_hf_dir

    model_dir = write_hf_dir(tmp_path / "model")
    tok = chat_tokenizer(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, model_dir / name)
    chats = write_chats(tmp_path / "chats.jsonl")
    out = tmp_path / "run"
    proc = torchrun(2, ["-m", "meshtrain", "train", "--config", str(ROOT / "configs" / "sft_chat.yaml"),
                        "--model.init-from-hf", str(model_dir), "--data.tokenizer", str(model_dir),
                        "--data.path", str(chats), "--train.steps", "3", "--train.seq-len", "64",
                        "--train.global-batch-size", "4", "--train.run-dir", str(out),
                        "--checkpoint.export-hf", str(out / "hf"), "--logging.progress", "off"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "chat SFT: 200 conversations" in proc.stdout and "each conversation attends to itself" in proc.stdout
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out / "hf"))
    source = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    changed = [n for n, p in exported.named_parameters() if not torch.equal(p, source.get_parameter(n))]
    assert changed  # fine-tuned
    assert transformers.AutoTokenizer.from_pretrained(str(out / "hf")).apply_chat_template(
        CONVERSATIONS[1], tokenize=False).startswith("<|im_start|>user")  # the tokenizer and its template ship


def family_sft_source(model_family: str, template: str):
    """A tiny ``model_family`` model from transformers with a tokenizer holding chat template
    ``template``'s real text, and that template family's conversations."""
    def prepare(directory) -> tuple[str, ...]:
        import shutil

        from tests.hf_models import hf_dir

        family = FAMILIES[template]
        tok = family_tokenizer(directory / "tok", family)
        _, model = hf_dir(directory, model_family, vocab_size=400, max_position_embeddings=1024)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tok / name, model / name)
        chats = directory / "chats.jsonl"
        chats.write_text("".join(json.dumps(r) + "\n" for r in family_records(family) * 8))
        return ("--model.init-from-hf", str(model), "--data.tokenizer", str(model), "--data.path", str(chats))
    return prepare


def config_sft_job(model_family: str, template: str, config: str, seq_len: int) -> Job:
    """``configs/CONFIG`` on 2 ranks (tp2 x SP x ep2), 3 steps, its adapter and merged model exported."""
    name = f"sft/{model_family}-config"
    return Job(name, 2, "train_command", (
        "--config", f"configs/{config}", "--parallel.pp", "1", "--parallel.ep", "2", "--train.steps", "3",
        "--train.seq-len", str(seq_len), "--train.global-batch-size", "4", "--checkpoint.interval", "0",
        "--peft.export-adapter", f"{{jobs}}/{name}/adapter", "--checkpoint.export-hf", f"{{jobs}}/{name}/merged",
        "--logging.jsonl", "True", "--logging.progress", "off"), prepare=family_sft_source(model_family, template))


CONFIG_SFT = {  # model family: (its chat template in tests/chat_templates, the config, sequence length, adapted
    # modules as peft names them); harmony's conversations take 200-440 tokens of the tests' tokenizer
    "deepseek_v3": ("deepseek_v3_1", "deepseek_v3_lora_sft.yaml", 64, {"q_a_proj", "kv_b_proj", "o_proj", "gate_proj"}),
    "gpt_oss": ("gpt_oss", "gpt_oss_lora_sft.yaml", 512, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj"}),
}
CONFIG_SFT_JOBS = {family: config_sft_job(family, template, config, seq_len)
                   for family, (template, config, seq_len, _) in CONFIG_SFT.items()}


@pytest.mark.slow
@jobs("family", CONFIG_SFT_JOBS)
def test_the_moe_family_configs_fine_tune_with_their_chat_templates(batches, family):
    """configs/deepseek_v3_lora_sft.yaml (LoRA on latent attention, routed and shared experts) with
    DeepSeek-V3.1's template, and configs/gpt_oss_lora_sft.yaml (LoRA on attention and experts) with gpt-oss's
    harmony template, each on a tiny model of its family under tp2 x SP x ep2: the PEFT adapter on
    transformers' model and the merged export give the same logits, not the base's."""
    peft = pytest.importorskip("peft")
    import transformers

    out = batches.result(CONFIG_SFT_JOBS[family])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(out / family)).eval()
    tokens = torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(tokens).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(out / "merged"))(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base, str(out / "adapter"))(tokens).logits
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert CONFIG_SFT[family][3] <= set(config["target_modules"]) | set(config.get("target_parameters", []))
    torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-5)
    assert (merged - plain).abs().max() > 1e-4
