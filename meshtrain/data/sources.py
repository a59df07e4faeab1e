"""Where the training samples come from: a prepared indexed dataset, memory-mapped, or raw text
tokenized at start-up (small jobs: the bundled corpus, a few files), or a blend of several.

``data.path`` names either; an indexed dataset is recognised by its PREFIX.idx. Its tokens stay in
the page cache, shared by every rank on a node, and each rank touches only the samples it reads.
"""

from __future__ import annotations

import dataclasses
import pathlib

import torch
from torch.utils.data import Dataset

from meshtrain.config import DataConfig, TrainConfig
from meshtrain.data.blend import BlendedDataset, parse_blend
from meshtrain.data.indexed import IndexedDataset, is_indexed, prepared_metadata
from meshtrain.data.loader import PackedDataset
from meshtrain.data.preference import preference_dataset
from meshtrain.data.sft import sft_dataset
from meshtrain.data.text import tokenize_corpus
from meshtrain.data.tokenizer import build_tokenizer
from meshtrain.errors import ConfigError, DataError


def training_tokens(cfg: DataConfig, model_vocab: int, fix: str | None = None) -> tuple[torch.Tensor, str]:
    """The token stream, and the file it comes from (for errors). ``fix``: what to do when the data's
    vocabulary is larger than the model's, for an imported model (default: raise model.vocab_size)."""
    if is_indexed(cfg.path):
        dataset = IndexedDataset.open(cfg.path)
        vocab = prepared_metadata(cfg.path).get("vocab_size")
        if vocab is not None and vocab > model_vocab:
            raise DataError(f"model.vocab_size={model_vocab} is smaller than the vocabulary {dataset.prefix} was "
                            f"prepared with ({vocab}, {pathlib.Path(dataset.prefix).name}.json). Fix: "
                            f"{fix + ' (and prepare the data with it)' if fix else f'model.vocab_size >= {vocab}'}")
        return dataset.tokens, f"{dataset.prefix}.bin"
    return tokenize_corpus(cfg, fitting_tokenizer(cfg, model_vocab, fix)), cfg.path


def fitting_tokenizer(cfg: DataConfig, model_vocab: int, fix: str | None):
    """data.tokenizer, refused where its vocabulary is larger than the model's."""
    tokenizer = build_tokenizer(cfg)
    if tokenizer.vocab_size > model_vocab:
        raise ConfigError(f"model.vocab_size={model_vocab} is smaller than the vocabulary of "
                          f"data.tokenizer={cfg.tokenizer} ({tokenizer.vocab_size}). "
                          f"Fix: {fix or f'model.vocab_size >= {tokenizer.vocab_size}'}")
    return tokenizer


def training_dataset(cfg: DataConfig, train: TrainConfig, model_vocab: int, fix: str | None = None) -> tuple[Dataset, str]:
    """The packed samples of data.path, or the run's samples (train.steps x train.global_batch_size)
    drawn from data.blend's datasets in its proportions; and a line describing them for the log."""
    seq_len, seed = train.seq_len, train.seed
    if cfg.format != "pretrain":
        if cfg.blend:
            raise ConfigError(f"data.blend with data.format={cfg.format} is not supported: blend pretraining data, "
                              "or give SFT data as one data.path")
        make = preference_dataset if cfg.format == "preference" else sft_dataset
        return make(cfg, cfg.path, fitting_tokenizer(cfg, model_vocab, fix), seq_len)
    if not cfg.blend:
        tokens, source = training_tokens(cfg, model_vocab, fix)
        dataset = PackedDataset(tokens, seq_len, vocab_size=model_vocab, source=source)
        return dataset, f"data: {source}, {len(tokens):,} tokens, {len(dataset):,} samples"
    pairs = parse_blend(cfg.blend)
    parts = []
    for _, path in pairs:
        tokens, source = training_tokens(dataclasses.replace(cfg, path=path, blend=[]), model_vocab, fix)
        parts.append(PackedDataset(tokens, seq_len, vocab_size=model_vocab, source=source))
    blend = BlendedDataset(parts, [w for w, _ in pairs], seed, [p for _, p in pairs],
                           train.steps * train.global_batch_size, cfg.shuffle)
    shares = ", ".join(f"{name} {n:,} ({n / len(blend):.1%}, {blend.epochs[name]:.2f} epochs of it)"
                       for name, n in blend.counts.items())
    return blend, f"data: blend of {len(blend):,} samples (train.steps x train.global_batch_size): {shares}"


def end_of_document_id(cfg: DataConfig) -> int | None:
    """data.eos_id, else what the data says: the EOS recorded by `meshtrain prepare`, or the
    tokenizer's for text (None where nothing says, e.g. a Megatron dataset from elsewhere)."""
    if cfg.eos_id is not None:
        return cfg.eos_id
    found = set()
    for path in ([p for _, p in parse_blend(cfg.blend)] if cfg.blend else [cfg.path]):
        if is_indexed(path):
            found.add(prepared_metadata(path).get("eos_id"))
        else:
            found.add(build_tokenizer(dataclasses.replace(cfg, path=path)).eos_id)
    if len(found) > 1:
        raise DataError(f"data.blend: its datasets end documents with different tokens ({sorted(map(str, found))}); "
                        "prepare them with one tokenizer, or set data.eos_id")
    return found.pop()
