"""Chat fine-tuning data as a Hugging Face chat model ships it, made here: a tokenizer with chat
special tokens and a Qwen-style template, and conversations in JSONL."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Callable

QWEN_STYLE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi there"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "how are you?"},
     {"role": "assistant", "content": "fine, thanks"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
]


def chat_tokenizer(directory: pathlib.Path) -> pathlib.Path:
    """A byte-level BPE tokenizer.json with chat special tokens, and a tokenizer_config.json with a
    Qwen-style chat template: what a Hugging Face chat model ships."""
    text = " ".join(m["content"] for c in CONVERSATIONS for m in c) * 20
    return bpe_tokenizer(directory, [text], ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 300, {
        "chat_template": QWEN_STYLE, "eos_token": "<|endoftext|>", "bos_token": None, "pad_token": "<|endoftext|>"})


def bpe_tokenizer(directory: pathlib.Path, texts: list[str], special: list[str], vocab_size: int,
                  config: dict) -> pathlib.Path:
    """A byte-level BPE tokenizer.json trained on ``texts`` with ``special`` tokens, beside a
    tokenizer_config.json holding ``config`` (its chat template and special-token names)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                 **config}))
    return directory


def write_chats(path: pathlib.Path, n: int = 200) -> pathlib.Path:
    with open(path, "w") as f:
        for i in range(n):
            conversation = [dict(m) for m in CONVERSATIONS[i % 2]]
            conversation[-1]["content"] += f" #{i}" * (i % 5)  # lengths vary
            f.write(json.dumps({"messages": conversation}) + "\n")
    return path


def sft_data(directory: pathlib.Path) -> tuple[str, ...]:
    tok = chat_tokenizer(directory / "tok")
    return ("--data.format", "chat", "--data.tokenizer", str(tok / "tokenizer.json"),
            "--data.path", str(write_chats(directory / "chats.jsonl")))


TEMPLATES = pathlib.Path(__file__).parent / "chat_templates"


@dataclass(frozen=True)
class Family:
    """A real chat template (tests/chat_templates/README.md says where from), the special tokens its
    tokenizer declares, and what the model learns to write for an assistant turn."""
    template: str
    special: tuple[str, ...]
    bos: str | None
    eos: str
    target: Callable[[dict, bool], str]  # (assistant message, is the conversation's last) -> its target text
    system: bool = True  # the template takes a system message
    reasoning: str | None = None  # how a record gives reasoning: "field" (reasoning_content/thinking) or "content"
    tool_call: str | None = None  # the target text of TOOL_CALL's turn, where the template writes tool calls


def _answer(content: str) -> str:
    return content.split("</think>")[-1]


def _qwen3(m: dict, last: bool) -> str:
    reasoning = m.get("reasoning_content") or ""
    answer = _answer(m["content"]).lstrip("\n") if "</think>" in m["content"] else m["content"]
    if "</think>" in m["content"] and not reasoning:
        reasoning = m["content"].split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    body = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{answer.lstrip(chr(10))}" if last else answer
    return body + "<|im_end|>"


def _qwq(m: dict, last: bool) -> str:
    # its generation prompt opens "<think>\n": the model writes the rest
    body = m["content"].removeprefix("<think>\n") if last else _answer(m["content"]).lstrip("\n")
    return body + "<|im_end|>"


def _gpt_oss(m: dict, last: bool) -> str:
    final = f"<|channel|>final<|message|>{m['content']}" + ("<|return|>" if last else "<|end|>")
    if last and (thinking := m.get("thinking") or m.get("reasoning_content")):  # analysis, then final
        return f"<|channel|>analysis<|message|>{thinking}<|end|><|start|>assistant" + final
    return final


FAMILIES = {
    "qwen3": Family("Qwen-Qwen3-0.6B.jinja", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>",
                    _qwen3, reasoning="field", tool_call='<tool_call>\n{"name": "get_weather", "arguments": '
                                                         '{"city": "Paris"}}\n</tool_call><|im_end|>'),
    "qwq": Family("Qwen-QwQ-32B.jinja", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", _qwq,
                  reasoning="content"),
    "deepseek_r1": Family("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
                          ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
                          "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                          lambda m, last: _answer(m["content"]) + "<｜end▁of▁sentence｜>", reasoning="content"),
    "phi3_5": Family("microsoft-Phi-3.5-mini-instruct.jinja",
                     ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), None, "<|endoftext|>",
                     lambda m, last: m["content"] + "<|end|>"),
    "gpt_oss": Family("openai-gpt-oss-120b.jinja",
                      ("<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"),
                      None, "<|return|>", _gpt_oss, reasoning="field",
                      tool_call=' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'),
    "mistral_nemo": Family("mistralai-Mistral-Nemo-Instruct-2407.jinja",
                           ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                            "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), "<s>", "</s>",
                           lambda m, last: m["content"] + "</s>",
                           tool_call='[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, '
                                     '"id": "call12345"}]</s>'),
    "deepseek_v3_1": Family("deepseek-ai-DeepSeek-V3.1.jinja",
                            ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
                            "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                            lambda m, last: m["content"] + "<｜end▁of▁sentence｜>"),
    "granite3_3": Family("ibm-granite-granite-3.3-2B-Instruct.jinja",
                         ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"), None,
                         "<|end_of_text|>", lambda m, last: m["content"] + "<|end_of_text|>"),
    "gemma2": Family("google-gemma-2-2b-it.jinja", ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), "<bos>",
                     "<eos>", lambda m, last: m["content"].strip() + "<end_of_turn>", system=False),
    "llama3_2": Family("meta-llama-Llama-3.2-3B-Instruct.jinja",
                       ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"), "<|begin_of_text|>", "<|eot_id|>",
                       lambda m, last: m["content"].strip() + "<|eot_id|>",
                       tool_call='{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'),
}


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}


def family_records(family: Family) -> list[dict]:
    """Records of the family's conversations; with the tools, a tool call and its result where the
    template writes tool calls."""
    records = [{"messages": c} for c in family_conversations(family)]
    if family.tool_call is not None:
        records.append({"tools": TOOLS, "messages": [
            {"role": "user", "content": "What is the weather in Paris?"}, TOOL_CALL,
            {"role": "tool", "content": "20 degrees", "tool_call_id": "call12345"},
            {"role": "assistant", "content": "It is 20 degrees in Paris."}]})
    return records


def family_conversations(family: Family) -> list[list[dict]]:
    """Multi-turn conversations as public SFT sets hold them: a system message where the template
    takes one, short answers that also occur in the prompts ("4", "yes"), and reasoning where the
    family has it, in the record form it reads."""
    user, assistant = "user", "assistant"
    conversations = [
        [{"role": user, "content": "What is 2+2? Answer yes if it is 4."}, {"role": assistant, "content": "4"},
         {"role": user, "content": "Is 4 even?"}, {"role": assistant, "content": "yes"}],
        [{"role": user, "content": "  Name a colour.  "}, {"role": assistant, "content": " Blue, like the sky. "}],
    ]
    if family.system:
        conversations.append([{"role": "system", "content": "You are terse."},
                              {"role": user, "content": "hi there"}, {"role": assistant, "content": "hello"},
                              {"role": user, "content": "how are you?"}, {"role": assistant, "content": "fine, thanks"}])
    if family.reasoning == "field":
        conversations.append([{"role": user, "content": "Is 7 prime?"},
                              {"role": assistant, "content": "No idea.", "reasoning_content": "It was asked before."},
                              {"role": user, "content": "Think: is 7 prime?"},
                              {"role": assistant, "content": "Yes, 7 is prime.",
                               "reasoning_content": "7 has no divisor between 2 and 6."}])
    if family.reasoning == "content":
        conversations.append([{"role": user, "content": "Is 9 prime?"},
                              {"role": assistant, "content": "<think>\n9 = 3 x 3.\n</think>\n\nNo, 9 = 3 x 3."},
                              {"role": user, "content": "And 11?"},
                              {"role": assistant, "content": "<think>\nNo divisor up to 3.\n</think>\n\nYes, 11 is prime."}])
    return conversations


def family_tokenizer(directory: pathlib.Path, family: Family) -> pathlib.Path:
    """A byte-level BPE tokenizer with the family's special tokens, and its tokenizer_config.json
    holding the family's real chat template."""
    template = (TEMPLATES / family.template).read_text()
    text = " ".join(m["content"] for r in family_records(family) for m in r["messages"]) * 20
    return bpe_tokenizer(directory, [text, template], list(family.special), 400, {
        "chat_template": template, "eos_token": family.eos, "bos_token": family.bos, "pad_token": family.eos})
