"""Megatron-LM's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), read by memory map and written
streaming. It is also meshtrain's own prepared format (``meshtrain prepare``), so corpora that
Megatron's preprocess_data.py made load as they are, and prepared ones load in Megatron.

``.bin``: every sequence's tokens back to back, little-endian, in the index's dtype. ``.idx``: the
magic ``MMIDIDX\\x00\\x00``, version u64 = 1, dtype code u8, sequence count u64, document count u64
(documents + 1), then ``sizes`` int32[sequences], ``pointers`` int64[sequences] (byte offsets into
.bin) and ``document_indices`` int64[documents + 1] (sequence indices where documents end, from 0).
Here one document is one sequence, as preprocess_data.py writes without sentence splitting.

Reading maps both files: a rank's memory holds the pages it touches, not the corpus.
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
import struct
from dataclasses import dataclass

import torch

from meshtrain.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: torch.uint8, 2: torch.int8, 3: torch.int16, 4: torch.int32, 5: torch.int64, 6: torch.float64,
               7: torch.float32, 8: torch.uint16}
CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}
_HEADER = struct.Struct("<QBQQ")  # version, dtype code, sequences, documents + 1


def token_dtype(vocab_size: int) -> torch.dtype:
    """uint16 while every id fits (vocabularies up to 65,536), int32 above, as Megatron picks."""
    return torch.uint16 if vocab_size <= 2**16 else torch.int32


def is_indexed(path: str | os.PathLike) -> bool:
    """Whether ``path`` names an indexed dataset: a PREFIX (or PREFIX.bin / PREFIX.idx) with its .idx."""
    return pathlib.Path(prefix_of(path) + ".idx").is_file()


def prefix_of(path: str | os.PathLike) -> str:
    text = str(path)
    return text[:-4] if text.endswith((".bin", ".idx")) else text


def prepared_metadata(path: str | os.PathLike) -> dict:
    """What `meshtrain prepare` recorded in PREFIX.json (tokenizer, vocab_size, eos_id, ...); {} for a
    dataset prepared elsewhere (a PREFIX.json that is not prepare's is not read as one)."""
    meta = pathlib.Path(prefix_of(path) + ".json")
    try:
        data = json.loads(meta.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and str(data.get("format", "")).startswith("meshtrain-prepare") else {}


def _map(path: pathlib.Path) -> mmap.mmap | None:
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        # Copy-on-write: a writable buffer for torch.frombuffer, while nothing written reaches the file
        # (nothing is written; pages stay the shared page cache).
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None


@dataclass
class IndexedDataset:
    """An indexed dataset, memory-mapped: ``tokens`` is the whole .bin as one 1-D tensor over the map
    (slicing it reads only those pages), ``sizes`` / ``document_ends`` come from the .idx."""

    prefix: str
    tokens: torch.Tensor
    sizes: torch.Tensor
    pointers: torch.Tensor
    document_indices: torch.Tensor

    @classmethod
    def open(cls, path: str | os.PathLike) -> "IndexedDataset":
        prefix = prefix_of(path)
        idx, bin_ = pathlib.Path(prefix + ".idx"), pathlib.Path(prefix + ".bin")
        for p in (idx, bin_):
            if not p.is_file():
                raise DataError(f"data.path: {str(p)!r} does not exist; an indexed dataset is a PREFIX.bin and "
                                "PREFIX.idx pair (written by `meshtrain prepare` or Megatron's preprocess_data.py)")
        index = _map(idx)
        if index is None or index[:len(MAGIC)] != MAGIC:
            raise DataError(f"{idx}: not a Megatron indexed dataset index (no MMIDIDX magic); rewrite it with "
                            "`meshtrain prepare`")
        if len(index) < len(MAGIC) + _HEADER.size:
            raise DataError(f"{idx}: the index is truncated inside its header; rewrite it with `meshtrain prepare`")
        version, code, sequences, documents = _HEADER.unpack_from(index, len(MAGIC))
        if version != VERSION or code not in DTYPE_CODES:
            raise DataError(f"{idx}: index version {version}, dtype code {code}: expected version {VERSION} and one "
                            f"of the codes {sorted(DTYPE_CODES)}")
        offset = len(MAGIC) + _HEADER.size
        need = offset + 4 * sequences + 8 * sequences + 8 * documents
        if len(index) < need:
            raise DataError(f"{idx}: the index is truncated ({len(index):,} bytes; its header promises {need:,}): "
                            "an interrupted write? Rewrite it with `meshtrain prepare`")
        sizes = torch.frombuffer(index, dtype=torch.int32, count=sequences, offset=offset) if sequences else \
            torch.zeros(0, dtype=torch.int32)
        offset += 4 * sequences
        pointers = torch.frombuffer(index, dtype=torch.int64, count=sequences, offset=offset) if sequences else \
            torch.zeros(0, dtype=torch.int64)
        offset += 8 * sequences
        document_indices = torch.frombuffer(index, dtype=torch.int64, count=documents, offset=offset)
        dtype = DTYPE_CODES[code]
        itemsize = dtype.itemsize
        total = int(sizes.sum(dtype=torch.int64)) if sequences else 0
        data = _map(bin_)
        have = len(data) if data is not None else 0
        if have != total * itemsize:
            raise DataError(f"{bin_}: {have:,} bytes, but its index {idx.name} describes {total:,} tokens of "
                            f"{itemsize} B = {total * itemsize:,} bytes: the pair does not match (a truncated or "
                            "foreign .bin?). Rewrite both with `meshtrain prepare`")
        if sequences and (int(pointers[0]) != 0 or int(pointers[-1]) + int(sizes[-1]) * itemsize != have):
            raise DataError(f"{idx}: its pointers do not describe {bin_.name} (first {int(pointers[0])}, last "
                            f"{int(pointers[-1])}): the pair does not match. Rewrite both with `meshtrain prepare`")
        tokens = torch.frombuffer(data, dtype=dtype, count=total) if total else torch.zeros(0, dtype=dtype)
        return cls(prefix, tokens, sizes, pointers, document_indices)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1


class IndexedWriter:
    """Writes PREFIX.bin / PREFIX.idx streaming: tokens go straight to disk, only the per-document
    sizes stay in memory (12 bytes a document). Both files are written under ``.incomplete`` names
    and renamed by ``close`` (.bin first, then .idx), so an interrupted write never leaves a pair
    that opens."""

    def __init__(self, prefix: str | os.PathLike, dtype: torch.dtype):
        if dtype not in CODE_OF:
            raise ValueError(f"no indexed-dataset code for {dtype}")
        self.prefix, self.dtype = prefix_of(prefix), dtype
        pathlib.Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self.prefix + ".bin.incomplete", "wb")
        self.sizes: list[int] = []

    def add_documents(self, tokens: torch.Tensor, sizes: list[int]) -> None:
        """Documents given back to back: ``tokens`` holds them all, ``sizes`` their lengths."""
        self._bin.write(tokens.to(self.dtype).numpy().tobytes())
        self.sizes.extend(sizes)

    def close(self) -> None:
        self._bin.close()
        sizes = torch.tensor(self.sizes, dtype=torch.int64)
        pointers = torch.zeros_like(sizes)
        if len(sizes) > 1:
            pointers[1:] = torch.cumsum(sizes[:-1] * self.dtype.itemsize, 0)
        documents = torch.arange(len(sizes) + 1, dtype=torch.int64)
        with open(self.prefix + ".idx.incomplete", "wb") as f:
            f.write(MAGIC + _HEADER.pack(VERSION, CODE_OF[self.dtype], len(sizes), len(documents)))
            f.write(sizes.to(torch.int32).numpy().tobytes())
            f.write(pointers.numpy().tobytes())
            f.write(documents.numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.prefix + ".bin.incomplete", self.prefix + ".bin")
        os.replace(self.prefix + ".idx.incomplete", self.prefix + ".idx")

    def abort(self) -> None:
        self._bin.close()
        for suffix in (".bin.incomplete", ".idx.incomplete"):
            pathlib.Path(self.prefix + suffix).unlink(missing_ok=True)
