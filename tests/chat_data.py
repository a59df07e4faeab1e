"""Chat fine-tuning data as a Hugging Face chat model ships it, made here: a tokenizer with chat
special tokens and a Qwen-style template, and conversations in JSONL."""

from __future__ import annotations

import json
import pathlib

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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    text = " ".join(m["content"] for c in CONVERSATIONS for m in c) * 20
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": QWEN_STYLE,
        "eos_token": "<|endoftext|>", "bos_token": None, "pad_token": "<|endoftext|>"}))
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
