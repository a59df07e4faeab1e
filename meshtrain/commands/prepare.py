"""``meshtrain prepare``: text files to a pre-tokenized, memory-mappable indexed dataset.

Reads .txt / .jsonl / .parquet files (a file or a directory of them), or a Hugging Face dataset
saved to disk, document by document,
tokenizes chunks of documents in worker processes, and writes the tokens in order to
``OUTPUT.bin`` / ``OUTPUT.idx`` (Megatron's indexed format, ``data/indexed.py``) as they come back.
Memory is bounded by the chunks in flight (one per worker), never by the corpus. ``OUTPUT.json``
records what was prepared; a second run over the same inputs (same bytes, tokenizer and options:
a content hash) is skipped. Files are written under ``.incomplete`` names and renamed at the end, so
an interrupted prepare leaves nothing that opens as a dataset.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import multiprocessing
import os
import pathlib
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from meshtrain.config import DataConfig
from meshtrain.data.indexed import IndexedDataset, IndexedWriter, prefix_of, token_dtype
from meshtrain.data.text import documents, source_files
from meshtrain.data.tokenizer import build_tokenizer
from meshtrain.errors import ConfigError, DataError
from meshtrain.run_dir import held_lock_file

FORMAT = "meshtrain-prepare/2"  # 2: .txt files are tokenized without newline translation


@dataclass
class PrepareConfig:
    """meshtrain prepare: tokenize text into a memory-mapped indexed dataset (Megatron .bin/.idx)."""

    input: str
    """A .txt, .jsonl or .parquet file, a directory of them (searched recursively), or a Hugging Face
    dataset saved with save_to_disk (its 'train' split; the datasets extra)."""
    output: str
    """The dataset's PREFIX: writes PREFIX.bin, PREFIX.idx and PREFIX.json. Train with data.path=PREFIX."""
    tokenizer: str = "byte"
    """"byte" or the path of a Hugging Face tokenizer.json (the model's own, for a fine-tune)."""
    text_field: str = "text"
    """Field holding the text in jsonl/parquet records."""
    append_eos: bool = True
    """End every document with the tokenizer's EOS (what packing needs to see document ends)."""
    workers: int | None = None
    """Tokenizing processes beside the writer; 0 tokenizes in the writer's process. Default: one per
    CPU core, less one for the writer (at least one)."""
    chunk_documents: int = 256
    """Documents per task sent to a worker."""
    force: bool = False
    """Prepare again even if OUTPUT.json says these inputs were prepared already."""


def content_hash(cfg: PrepareConfig, files: list[pathlib.Path]) -> str:
    """sha256 over the inputs' names and bytes, the tokenizer file and the options that change tokens."""
    h = hashlib.sha256(json.dumps([FORMAT, cfg.text_field, cfg.append_eos, cfg.tokenizer == "byte"]).encode())
    sources = [(str(f.relative_to(cfg.input)) if pathlib.Path(cfg.input).is_dir() else f.name, f) for f in files]
    if cfg.tokenizer != "byte":
        tok = pathlib.Path(cfg.tokenizer)
        sources.append(("<tokenizer>", tok / "tokenizer.json" if tok.is_dir() else tok))
    for name, path in sources:
        h.update(name.encode() + b"\0")
        with path.open("rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


_tokenizer = None


def _init_worker(tokenizer: str) -> None:
    global _tokenizer
    _tokenizer = build_tokenizer(DataConfig(tokenizer=tokenizer))


def _encode_chunk(documents: list[str], append_eos: bool) -> tuple[torch.Tensor, list[int]]:
    """The chunk's tokens back to back (one tensor: cheap to send between processes) and each
    document's length."""
    encode = getattr(_tokenizer, "encode_batch", None)
    ids = encode(documents) if encode else [_tokenizer.encode(d) for d in documents]
    eos = [_tokenizer.eos_id] if append_eos and _tokenizer.eos_id is not None else []
    flat = list(itertools.chain.from_iterable(d + eos for d in ids))
    return torch.tensor(flat, dtype=torch.int32), [len(d) + len(eos) for d in ids]


def _chunks(source: str, text_field: str, size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for document in documents(source, text_field):
        chunk.append(document)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encoded(cfg: PrepareConfig, workers: int) -> Iterator[tuple[torch.Tensor, list[int]]]:
    """Every chunk's token tensors, in input order. One chunk per worker is in flight."""
    chunks = _chunks(cfg.input, cfg.text_field, cfg.chunk_documents)
    if workers == 0:
        _init_worker(cfg.tokenizer)
        yield from (_encode_chunk(c, cfg.append_eos) for c in chunks)
        return
    with _Tokenizers(workers, cfg.tokenizer, cfg.append_eos) as tokenizers:
        yield from tokenizers.encoded(chunks)


def _tokenize_forever(connection, tokenizer: str, append_eos: bool) -> None:
    """A worker: a chunk in, its tokens (or the exception that stopped them) out, until the parent
    closes the pipe or kills it."""
    try:
        _init_worker(tokenizer)
        failure = None
    except Exception as e:  # reported with the first chunk's answer, where the parent waits for one
        failure = e
    while True:
        try:
            chunk = connection.recv()
        except EOFError:
            return
        try:
            if failure is not None:
                raise failure
            answer = (_encode_chunk(chunk, append_eos), None)
        except Exception as e:
            answer = (None, e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}"))
        connection.send(answer)


def _picklable(e: Exception) -> bool:
    try:
        pickle.dumps(e)
        return True
    except Exception:
        return False


class _Tokenizers:
    """Tokenizing processes, each behind a pipe of its own: chunk k goes to worker k % n and its tokens
    come back from there, so they arrive in input order with no shared queue, lock or helper thread
    (multiprocessing.Pool has all three, and its shutdown handshake hung once on Ctrl-C in CI). Any
    way out (the end, an error, Ctrl-C) kills them: they hold nothing but chunks sent, and nothing
    waits on their cooperation. A worker that dies (the OOM killer) is an error naming it, where a
    Pool waited forever on the lost task."""

    def __init__(self, workers: int, tokenizer: str, append_eos: bool):
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding tokenizer threads
        self.processes, self.connections = [], []
        try:
            with _ignoring_ctrl_c():  # inherited through exec: the workers ignore it from their first instruction
                for _ in range(workers):
                    mine, theirs = ctx.Pipe()
                    self.connections.append(mine)
                    process = ctx.Process(target=_tokenize_forever, args=(theirs, tokenizer, append_eos),
                                          daemon=True, name=f"meshtrain-prepare-tokenizer-{len(self.processes)}")
                    self.processes.append(process)
                    process.start()
                    theirs.close()
        except BaseException:
            self.__exit__()  # the ones that started
            raise

    def __enter__(self) -> "_Tokenizers":
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            if process.pid is not None:
                process.kill()
        for process in self.processes:
            if process.pid is not None:
                process.join()
        for connection in self.connections:
            connection.close()

    def encoded(self, chunks: Iterator[list[str]]) -> Iterator[tuple[torch.Tensor, list[int]]]:
        """Each worker's next chunk goes out as soon as its last answer is in, before that answer is
        written: the writer never leaves a worker idle."""
        idle = collections.deque(range(len(self.processes)))
        in_flight: collections.deque[int] = collections.deque()
        for chunk in chunks:
            if idle:
                worker, answer = idle.popleft(), None
            else:
                worker = in_flight.popleft()
                answer = self._answer(worker)
            self.connections[worker].send(chunk)
            in_flight.append(worker)
            if answer is not None:
                yield answer
        while in_flight:
            yield self._answer(in_flight.popleft())

    def _answer(self, worker: int) -> tuple[torch.Tensor, list[int]]:
        try:
            tokens, failure = self.connections[worker].recv()
        except EOFError:
            process = self.processes[worker]
            process.join(timeout=5)
            code = process.exitcode
            if code is not None and code < 0:
                guess = ": out of memory?" if -code == signal.SIGKILL else ""
                how = f"was killed by signal {-code} ({signal.Signals(-code).name}{guess})"
            else:
                how = f"exited with status {code}"
            raise DataError(f"prepare: tokenizing worker {worker} (pid {process.pid}) {how} before answering; nothing "
                            "was published. Fix: rerun (with fewer --workers or a smaller --chunk-documents if memory "
                            "ran out)") from None
        if failure is not None:
            raise failure
        return tokens


@contextlib.contextmanager
def _ignoring_ctrl_c() -> Iterator[None]:
    """SIGINT ignored while processes start: they inherit it through exec and ignore it from their
    first instruction. Ctrl-C reaches every process of the terminal's group: the parent cleans up
    and says so once, where each worker would print a KeyboardInterrupt traceback. (A Ctrl-C within
    the milliseconds the workers take to start is ignored by the parent too: blocking it instead
    does not hold it, since another thread of the process then takes it.)"""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; nothing delivers SIGINT to the others anyway
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class Progress:
    """One line, redrawn on a terminal and printed every 10 s otherwise."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, documents: int, tokens: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < (0.5 if self.tty else 10):
            return
        self.last = now
        rate = tokens / max(now - self.start, 1e-9)
        line = f"prepare: {documents:,} documents  {tokens:,} tokens  {rate:,.0f} tokens/s"
        print(("\r" + line) if self.tty else line, end="\n" if final or not self.tty else "", file=sys.stderr,
              flush=True)


def prepare(cfg: PrepareConfig) -> dict:
    """Write the dataset (or find it up to date); returns the summary also written to OUTPUT.json."""
    if cfg.workers is not None and cfg.workers < 0:
        raise ConfigError(f"--workers {cfg.workers}: must be >= 0 (0 tokenizes in the writer's process)")
    if cfg.chunk_documents < 1:
        raise ConfigError(f"--chunk-documents {cfg.chunk_documents}: must be >= 1")
    files = source_files(cfg.input)
    prefix = prefix_of(cfg.output)
    pathlib.Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    with _held(prefix):
        return _prepare_held(cfg, files, prefix)


def _held(prefix: str) -> contextlib.AbstractContextManager[None]:
    """One prepare at a time per output prefix (a kernel lock on PREFIX.lock, removed at the end): two
    at once renamed each other's .incomplete files away, and left one input's tokens beside the
    other's PREFIX.json."""
    return held_lock_file(pathlib.Path(prefix + ".lock"), lambda holder: DataError(
        f"--output {prefix}: another meshtrain prepare is writing it ({holder}). Fix: wait for it to finish, or "
        "choose another --output"), remove=True)


def _prepare_held(cfg: PrepareConfig, files: list[pathlib.Path], prefix: str) -> dict:
    meta_path = pathlib.Path(prefix + ".json")
    digest = content_hash(cfg, files)
    if not cfg.force and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("content_sha256") == digest:
            try:
                IndexedDataset.open(prefix)
            except DataError:
                pass  # damaged since: prepare again
            else:
                print(f"prepare: {prefix}.bin/.idx are up to date with {cfg.input} (content hash {digest[:12]}); "
                      "nothing to do (--force prepares again)", file=sys.stderr)
                return meta | {"skipped": True}
    tokenizer = build_tokenizer(DataConfig(tokenizer=cfg.tokenizer, text_field=cfg.text_field))
    if cfg.append_eos and tokenizer.eos_id is None:
        raise DataError(f"tokenizer {cfg.tokenizer} has no EOS token, so packed documents would run together; "
                        "use a tokenizer with one, or set --append-eos False knowingly")
    workers = cfg.workers if cfg.workers is not None else max(1, (os.cpu_count() or 1) - 1)
    dtype = token_dtype(tokenizer.vocab_size)
    writer = IndexedWriter(prefix, dtype)
    progress = Progress()
    documents = tokens = 0
    try:
        for ids, sizes in _encoded(cfg, workers):
            writer.add_documents(ids, sizes)
            documents, tokens = documents + len(sizes), tokens + len(ids)
            progress.update(documents, tokens)
        if documents == 0:
            raise DataError(f"--input {cfg.input}: no documents with text (field {cfg.text_field!r}) were found")
        writer.close()
    except BaseException:
        writer.abort()
        raise
    seconds = time.perf_counter() - progress.start
    progress.update(documents, tokens, final=True)
    meta = {"format": FORMAT, "content_sha256": digest, "input": str(cfg.input), "files": len(files),
            "tokenizer": cfg.tokenizer, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
            "dtype": str(dtype).removeprefix("torch."), "documents": documents, "tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9), "workers": workers}
    tmp = meta_path.with_suffix(".json.incomplete")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, meta_path)
    print(f"prepared {prefix}.bin/.idx: {documents:,} documents, {tokens:,} {meta['dtype']} tokens in {seconds:.1f} s, "
          f"{meta['tokens_per_s']:,.0f} tokens/s ({workers} tokenizing processes beside the writer)", file=sys.stderr)
    return meta
