"""Text in, packed token sequences out, one shard per data-parallel rank, resumable.

Documents (a .txt file, a jsonl record, a parquet row) are tokenized, joined with EOS and packed
into fixed-length samples of seq_len + 1 tokens (inputs and shifted labels), so no token is padding.
A ``StatefulDistributedSampler`` over the dp ranks feeds a ``StatefulDataLoader``: rank r of dp
takes samples r, r+dp, ..., so the samples of one optimizer step are the same set for every dp size
(what makes a dp run comparable with the single-rank run), and the loader's state is checkpointable.
"""

from __future__ import annotations

import json
import pathlib
import warnings
from typing import Iterator, Protocol

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from meshtrain.config import DataConfig
from meshtrain.errors import DataError

SUFFIXES = (".txt", ".jsonl", ".parquet")

# torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13: one warning per rank and loader,
# nothing a user can act on.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then BOS=256 and EOS=257. Needs no files."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library."""

    EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tokenizer

        file = pathlib.Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise DataError(f"data.tokenizer: no tokenizer file at {str(file)!r}; "
                            "give the path of a tokenizer.json or use data.tokenizer=byte")
        try:
            self._tok = _Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise DataError(f"data.tokenizer: cannot read {str(file)!r} as a Hugging Face tokenizer.json "
                            f"({e}); check the file or use data.tokenizer=byte") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = next((i for n in self.EOS_NAMES if (i := self._tok.token_to_id(n)) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    return ByteTokenizer() if cfg.tokenizer == "byte" else HFTokenizer(cfg.tokenizer)


def data_files(path: str) -> list[pathlib.Path]:
    root = pathlib.Path(path)
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file())
    else:
        raise DataError(f"data.path: {path!r} does not exist; point it at a .txt/.jsonl/.parquet file "
                        "or a directory of them (the default is the bundled corpus)")
    bad = [p for p in files if p.suffix not in SUFFIXES]
    if bad:
        raise DataError(f"data.path: {str(bad[0])!r} is not one of {', '.join(SUFFIXES)}")
    if not files:
        raise DataError(f"data.path: directory {path!r} holds no {'/'.join(SUFFIXES)} files")
    return files


def read_documents(file: pathlib.Path, text_field: str) -> Iterator[str]:
    if file.suffix == ".txt":
        yield file.read_text(encoding="utf-8", errors="replace")
    elif file.suffix == ".jsonl":
        with file.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{file}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    raise DataError(f"{file}:{lineno}: no string field {text_field!r}; "
                                    "set data.text_field to the field holding the text")
                yield record[text_field]
    else:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{file}: reading parquet needs pyarrow; pip install 'meshtrain[parquet]'") from None
        try:
            table = pq.read_table(file, columns=[text_field])
        except Exception as e:  # pyarrow raises several unrelated types for bad files and columns
            raise DataError(f"{file}: cannot read column {text_field!r} ({e}); "
                            "check the file or set data.text_field") from None
        yield from (t for t in table.column(text_field).to_pylist() if t)


def tokenize_corpus(cfg: DataConfig, tokenizer: Tokenizer) -> torch.Tensor:
    """All documents as one token stream, each followed by EOS where the tokenizer has one."""
    ids: list[int] = []
    for file in data_files(cfg.path):
        for doc in read_documents(file, cfg.text_field):
            ids.extend(tokenizer.encode(doc))
            if tokenizer.eos_id is not None:
                ids.append(tokenizer.eos_id)
    return torch.tensor(ids, dtype=torch.int64)


class PackedDataset(Dataset):
    """Sample i is tokens[i*seq_len : (i+1)*seq_len + 1], split into (inputs, labels)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class BatchStream:
    """Yields the micro-batches of each optimizer step for this dp rank, epoch after epoch.

    An epoch is len(dataset) // global_batch steps; the sampler reshuffles per epoch. The state
    (epoch, steps taken in it, the loader's own state) restores the exact position.
    """

    def __init__(self, dataset: PackedDataset, *, global_batch: int, micro_batch: int, dp_size: int,
                 dp_rank: int, shuffle: bool, seed: int, num_workers: int):
        self.steps_per_epoch = len(dataset) // global_batch
        if self.steps_per_epoch == 0:
            raise DataError(
                f"the data holds {len(dataset)} sequences of train.seq_len+1 tokens, fewer than one "
                f"global batch ({global_batch}); add data or lower train.global_batch_size / train.seq_len"
            )
        self.accum = global_batch // (micro_batch * dp_size)
        self.sampler = StatefulDistributedSampler(
            dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        self.loader = StatefulDataLoader(
            dataset, batch_size=micro_batch, sampler=self.sampler, drop_last=True, num_workers=num_workers
        )
        self.epoch = 0
        self.step_in_epoch = 0
        self._it: Iterator | None = None

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch, self._it = self.epoch + 1, 0, None
        if self._it is None:
            if self.step_in_epoch == 0:
                self.sampler.set_epoch(self.epoch)
            self._it = iter(self.loader)
        batches = [next(self._it) for _ in range(self.accum)]
        self.step_in_epoch += 1
        return batches

    def state_dict(self) -> dict:
        """The position, as global (epoch, step in epoch): the same samples whatever the dp size."""
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        self.sampler.set_epoch(self.epoch)
        # This rank's samples already taken this epoch; the sampler skips them on the next iter().
        self.sampler.load_state_dict({"yielded": self.step_in_epoch * self.accum * self.loader.batch_size})
        self._it = None
