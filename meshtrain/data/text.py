"""Raw text sources: .txt files, jsonl records, parquet rows and Hugging Face datasets saved to disk
(``save_to_disk``; the optional datasets extra), read into one token stream.

Documents are tokenized and joined with EOS, so packing (``data.loader``) never pads.
"""

from __future__ import annotations

import json
import pathlib
from typing import Iterator

import torch

from meshtrain.config import DataConfig
from meshtrain.data.tokenizer import Tokenizer
from meshtrain.errors import DataError

SUFFIXES = (".txt", ".jsonl", ".parquet")


def is_hf_dataset(path: str | pathlib.Path) -> bool:
    """A directory written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    root = pathlib.Path(path)
    return (root / "state.json").is_file() and (root / "dataset_info.json").is_file() or \
        (root / "dataset_dict.json").is_file()


def read_hf_dataset(path: str | pathlib.Path, text_field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading a Hugging Face dataset needs the datasets package; "
                        "pip install 'meshtrain[datasets]'") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path}: a DatasetDict without a 'train' split (it has {sorted(ds)}); save the split "
                            "to read with Dataset.save_to_disk")
        ds = ds["train"]
    if text_field not in ds.column_names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {ds.column_names}); set the text field to the "
                        "column holding the text")
    for batch in ds.iter(batch_size=1024):
        yield from (text for text in batch[text_field] if text)


def records(path: str) -> Iterator[tuple[str, dict]]:
    """Every record (jsonl line, parquet row, saved HF dataset row) under ``path`` with where it is
    (``file:line``), for structured data such as SFT conversations."""
    if is_hf_dataset(path):
        try:
            import datasets
        except ImportError:
            raise DataError(f"{path}: reading a Hugging Face dataset needs the datasets package; "
                            "pip install 'meshtrain[datasets]'") from None
        ds = datasets.load_from_disk(str(path))
        ds = ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
        for i, row in enumerate(ds):
            yield f"{path}[{i}]", row
        return
    for file in data_files(path):
        if file.suffix == ".jsonl":
            for lineno, record in jsonl_records(file):
                yield f"{file}:{lineno}", record if isinstance(record, dict) else {}
        elif file.suffix == ".parquet":
            import pyarrow.parquet as pq

            for i, row in enumerate(pq.read_table(file).to_pylist()):
                yield f"{file}[{i}]", row
        else:
            raise DataError(f"{file}: structured records come from .jsonl or .parquet files, not {file.suffix}")


def documents(path: str, text_field: str) -> Iterator[str]:
    """Every document under ``path`` (a file, a directory of files, or a saved HF dataset), in order."""
    if is_hf_dataset(path):
        yield from read_hf_dataset(path, text_field)
        return
    for file in data_files(path):
        yield from read_documents(file, text_field)


def source_files(path: str) -> list[pathlib.Path]:
    """The files whose bytes make up ``path``'s documents (what a content hash covers)."""
    if is_hf_dataset(path):
        return sorted(p for p in pathlib.Path(path).rglob("*") if p.is_file())
    return data_files(path)


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


def jsonl_records(file: pathlib.Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) of each non-blank line."""
    with file.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{file}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start} of the "
                                "line): a .jsonl file is UTF-8 JSON, one record a line; is this a binary file?") from None
            if line.strip():
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{file}:{lineno}: not valid JSON ({e.msg})") from None


def read_documents(file: pathlib.Path, text_field: str) -> Iterator[str]:
    if file.suffix == ".txt":  # the file's own text: no newline translation (read_text makes \r\n and \r \n)
        yield file.read_bytes().decode("utf-8", errors="replace")
    elif file.suffix == ".jsonl":
        for lineno, record in jsonl_records(file):
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
    for doc in documents(cfg.path, cfg.text_field):
        ids.extend(tokenizer.encode(doc))
        if tokenizer.eos_id is not None:
            ids.append(tokenizer.eos_id)
    return torch.tensor(ids, dtype=torch.int64)
