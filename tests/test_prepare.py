"""Prepared data: Megatron's indexed format read and written exactly (checked against the format's
spec, written here independently with struct), ``meshtrain prepare`` (parallel, resumable by
content hash, never leaving a dataset that looks complete), and the errors bad files get."""

import json
import os
import pathlib
import re
import struct
import subprocess
import sys

import pytest
import torch

from meshtrain.commands.prepare import PrepareConfig, prepare
from meshtrain.config import DataConfig
from meshtrain.data.blend import BlendedDataset
from meshtrain.data.indexed import IndexedDataset, IndexedWriter
from meshtrain.data.loader import PackedDataset
from meshtrain.data.sources import training_tokens
from meshtrain.data.text import tokenize_corpus
from meshtrain.data.tokenizer import ByteTokenizer
from meshtrain.errors import DataError
from tests.batch import Job
from tests.conftest import ROOT, tiny_args
from tests.parity import assert_matches_reference, reference, run_layout

SPEC_DTYPES = {"uint8": (1, "B"), "int32": (4, "i"), "uint16": (8, "H"), "int64": (5, "q")}


def write_by_spec(prefix: pathlib.Path, sequences: list[list[int]], document_ends: list[int], dtype: str) -> None:
    """A .bin/.idx pair as REFERENCE.md section 6 (Megatron's indexed_dataset.py) specifies it."""
    code, fmt = SPEC_DTYPES[dtype]
    item = struct.calcsize(fmt)
    with open(f"{prefix}.bin", "wb") as f:
        for seq in sequences:
            f.write(struct.pack(f"<{len(seq)}{fmt}", *seq))
    pointers, offset = [], 0
    for seq in sequences:
        pointers.append(offset)
        offset += len(seq) * item
    documents = [0, *document_ends]
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sequences)) + struct.pack("<Q", len(documents)))
        f.write(struct.pack(f"<{len(sequences)}i", *[len(s) for s in sequences]))
        f.write(struct.pack(f"<{len(sequences)}q", *pointers))
        f.write(struct.pack(f"<{len(documents)}q", *documents))


def read_by_spec(prefix: pathlib.Path) -> dict:
    idx = pathlib.Path(f"{prefix}.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    version, code, n, d = struct.unpack_from("<QBQQ", idx, 9)
    offset = 9 + 8 + 1 + 16
    sizes = list(struct.unpack_from(f"<{n}i", idx, offset))
    pointers = list(struct.unpack_from(f"<{n}q", idx, offset + 4 * n))
    documents = list(struct.unpack_from(f"<{d}q", idx, offset + 12 * n))
    fmt = {c: f for c, f in SPEC_DTYPES.values()}[code]
    data = pathlib.Path(f"{prefix}.bin").read_bytes()
    item = struct.calcsize(fmt)
    seqs = [list(struct.unpack_from(f"<{s}{fmt}", data, p)) for s, p in zip(sizes, pointers)]
    return {"version": version, "code": code, "sequences": seqs, "documents": documents, "pointers": pointers,
            "bin_bytes": len(data), "item": item}


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_a_pair_written_by_the_spec_reads_back_exactly(tmp_path, dtype):
    """Sequences of several documents (document_indices not 0..n), ids up to the dtype's range."""
    high = 65535 if dtype == "uint16" else 150_000
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, high + 1, (n,), generator=g).tolist() for n in (5, 1, 17, 3, 9)]
    sequences[0][0] = high
    write_by_spec(tmp_path / "spec", sequences, [2, 5], dtype)
    ds = IndexedDataset.open(tmp_path / "spec")
    assert ds.tokens.dtype == {"uint16": torch.uint16, "int32": torch.int32}[dtype]
    assert ds.tokens.to(torch.int64).tolist() == [t for s in sequences for t in s]
    assert ds.sizes.tolist() == [len(s) for s in sequences]
    assert ds.document_indices.tolist() == [0, 2, 5] and ds.num_documents == 2
    for path in (tmp_path / "spec.bin", tmp_path / "spec.idx"):  # PREFIX, PREFIX.bin and PREFIX.idx all name it
        assert IndexedDataset.open(path).tokens.to(torch.int64).tolist() == ds.tokens.to(torch.int64).tolist()


def test_the_writer_follows_the_spec(tmp_path):
    docs = [[1, 2, 3], [65535], [7, 8]]
    writer = IndexedWriter(tmp_path / "w", torch.uint16)
    writer.add_documents(torch.tensor([t for d in docs for t in d]), [len(d) for d in docs])
    writer.close()
    got = read_by_spec(tmp_path / "w")
    assert got["version"] == 1 and got["code"] == 8 and got["item"] == 2
    assert got["sequences"] == docs and got["pointers"] == [0, 6, 8] and got["documents"] == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.bin", "w.idx"]


def corpus(tmp_path: pathlib.Path, documents: int = 300) -> pathlib.Path:
    src = tmp_path / "src"
    src.mkdir()
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    with open(src / "a.jsonl", "w") as f:
        for i in range(documents):
            f.write(json.dumps({"text": " ".join(words[(i * j) % 8] for j in range(1 + i % 40)) + f" #{i}"}) + "\n")
    (src / "b.txt").write_text("one plain text document\nof two lines, é and ü\n")
    return src


@pytest.mark.parametrize("workers", [0, 2])
def test_prepare_equals_tokenizing_at_start_and_is_skipped_when_up_to_date(tmp_path, workers, capsys):
    src = corpus(tmp_path)
    cfg = PrepareConfig(input=str(src), output=str(tmp_path / "out" / "data"), workers=workers, chunk_documents=16)
    meta = prepare(cfg)
    want = tokenize_corpus(DataConfig(path=str(src)), ByteTokenizer())
    ds = IndexedDataset.open(tmp_path / "out" / "data")
    assert torch.equal(ds.tokens.to(torch.int64), want)  # documents in input order, each ending in EOS
    assert meta["documents"] == ds.num_documents == 301 and meta["tokens"] == len(want)
    assert "301 documents" in capsys.readouterr().err
    assert prepare(cfg)["skipped"] and "up to date" in capsys.readouterr().err
    with open(src / "a.jsonl", "a") as f:  # new content: prepared again
        f.write(json.dumps({"text": "one more"}) + "\n")
    assert not prepare(cfg).get("skipped") and IndexedDataset.open(cfg.output).num_documents == 302


def test_text_files_are_tokenized_as_their_bytes_without_newline_translation(tmp_path):
    """\r\n and lone \r stay what they are (Python's text mode would make both \n)."""
    text = "Windows line\r\nold Mac line\rUnix line\n"
    (tmp_path / "crlf.txt").write_bytes(text.encode())
    cfg = PrepareConfig(input=str(tmp_path / "crlf.txt"), output=str(tmp_path / "data"), workers=0)
    prepare(cfg)
    tokens = IndexedDataset.open(tmp_path / "data").tokens.tolist()
    assert tokens == list(text.encode()) + [ByteTokenizer().eos_id]


def test_a_second_prepare_to_a_busy_output_is_refused_naming_the_first(tmp_path):
    """Two prepares to one prefix renamed each other's files away and left one input's tokens beside
    the other's PREFIX.json: the second is refused while the first holds PREFIX.lock."""
    from meshtrain.commands.prepare import _held

    out = tmp_path / "data"
    cfg = PrepareConfig(input=str(corpus(tmp_path)), output=str(out), workers=0)
    with _held(str(out)):  # as a running prepare holds it (a second open file: flock refuses it too)
        with pytest.raises(DataError, match=rf"--output {out}: another meshtrain prepare is writing it \(pid "
                                            rf"{os.getpid()} on .*Fix: wait for it to finish"):
            prepare(cfg)
    assert prepare(cfg)["documents"] == 301 and not (tmp_path / "data.lock").exists()


def test_an_interrupted_prepare_leaves_nothing_that_opens(tmp_path):
    src = corpus(tmp_path)
    with open(src / "a.jsonl", "a") as f:
        f.write("{not json\n")  # fails after 300 documents were written
    cfg = PrepareConfig(input=str(src), output=str(tmp_path / "data"), workers=0, chunk_documents=16)
    with pytest.raises(DataError, match=r"a.jsonl:301: not valid JSON"):
        prepare(cfg)
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no .bin, .idx, .json, nor .incomplete


def test_the_cli_prepares_and_a_run_trains_on_it(tmp_path):
    src = corpus(tmp_path)
    out = tmp_path / "data"
    proc = subprocess.run([sys.executable, "-m", "meshtrain", "prepare", "--input", str(src), "--output", str(out),
                           "--workers", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "prepared" in proc.stderr and json.loads(out.with_suffix(".json").read_text())["tokenizer"] == "byte"
    tokens, source = training_tokens(DataConfig(path=str(out)), 384)
    assert source == f"{out}.bin" and tokens.dtype == torch.uint16
    assert torch.equal(tokens.to(torch.int64), tokenize_corpus(DataConfig(path=str(src)), ByteTokenizer()))


def damaged(tmp_path: pathlib.Path, how: str) -> pathlib.Path:
    prefix = tmp_path / "d"
    write_by_spec(prefix, [[1, 2, 3, 4], [5, 6]], [1, 2], "uint16")
    if how == "truncated bin":
        with open(f"{prefix}.bin", "r+b") as f:
            f.truncate(10)
    elif how == "truncated idx":
        with open(f"{prefix}.idx", "r+b") as f:
            f.truncate(40)
    elif how == "foreign idx":
        pathlib.Path(f"{prefix}.idx").write_bytes(b"NOTMEGATRON" * 4)
    elif how == "missing bin":
        pathlib.Path(f"{prefix}.bin").unlink()
    elif how == "pointers":
        write_by_spec(prefix, [[1, 2, 3, 4], [5, 6]], [1, 2], "uint16")
        idx = bytearray(pathlib.Path(f"{prefix}.idx").read_bytes())
        struct.pack_into("<q", idx, 9 + 8 + 1 + 16 + 8, 4)  # the first pointer
        pathlib.Path(f"{prefix}.idx").write_bytes(bytes(idx))
    return prefix


@pytest.mark.parametrize("how,message", [
    ("truncated bin", r"d.bin: 10 bytes, but its index d.idx describes 6 tokens of 2 B = 12 bytes: the pair does not match"),
    ("truncated idx", r"d.idx: the index is truncated \(40 bytes; its header promises 82\)"),
    ("foreign idx", r"d.idx: not a Megatron indexed dataset index \(no MMIDIDX magic\)"),
    ("missing bin", r"d.bin' does not exist; an indexed dataset is a PREFIX.bin and PREFIX.idx pair"),
    ("pointers", r"d.idx: its pointers do not describe d.bin"),
])
def test_a_damaged_dataset_is_refused_naming_the_file(tmp_path, how, message):
    prefix = damaged(tmp_path, how)
    with pytest.raises(DataError, match=message):
        IndexedDataset.open(prefix if how != "missing bin" else f"{prefix}.idx")


def test_token_ids_beyond_the_model_are_named_with_their_sample(tmp_path):
    write_by_spec(tmp_path / "big", [list(range(40)), [500, 1, 2, 3]], [2], "uint16")
    ds = PackedDataset(IndexedDataset.open(tmp_path / "big").tokens, 8, vocab_size=384, source="big.bin")
    assert ds[3][0].tolist() == list(range(24, 32))
    with pytest.raises(DataError, match=r"big.bin: token id 500 in sample 4 is outside model.vocab_size=384"):
        ds[4]


def test_data_prepared_with_a_larger_vocabulary_than_the_model_is_refused(tmp_path):
    src = corpus(tmp_path, documents=3)
    prepare(PrepareConfig(input=str(src), output=str(tmp_path / "data"), workers=0))
    with pytest.raises(DataError, match=r"model.vocab_size=100 is smaller than the vocabulary .*data was prepared "
                                        r"with \(258, data.json\). Fix: model.vocab_size >= 258"):
        training_tokens(DataConfig(path=str(tmp_path / "data")), 100)


def prepared_bundled_corpus(job_dir: pathlib.Path) -> tuple[str, ...]:
    prepare(PrepareConfig(input=DataConfig().path, output=str(job_dir / "corpus"), workers=0))
    return ("--data.path", str(job_dir / "corpus"))


def two_prepared_datasets(job_dir: pathlib.Path) -> tuple[str, ...]:
    prepared_bundled_corpus(job_dir)
    prepare(PrepareConfig(input=str(corpus(job_dir, documents=400)), output=str(job_dir / "words"), workers=0))
    return ("--data.blend", "0.7", str(job_dir / "corpus"), "0.3", str(job_dir / "words"))


PREPARED_DP2 = Job("data/prepared-dp2", 2, "train", (*tiny_args(), "--parallel.dp-shard", "2"),
                   prepare=prepared_bundled_corpus)


@pytest.mark.slow
@pytest.mark.job(PREPARED_DP2)
def test_training_on_prepared_data_equals_training_on_the_text(batches):
    """dp2 from the memory-mapped prepared bundled corpus against the 1-rank reference run that
    tokenizes the text itself: the same samples, so the same losses, grad norms and weights."""
    assert_matches_reference(run_layout(batches, PREPARED_DP2), reference(()))


BLEND_DP2 = Job("data/blend-dp2", 2, "train", (*tiny_args(), "--parallel.dp-shard", "2"), prepare=two_prepared_datasets)


@pytest.mark.slow
@pytest.mark.job(BLEND_DP2)
def test_a_blend_trains_under_dp2_like_one_rank(batches, tmp_path):
    """The blend's samples per optimizer step are the same for every dp size: dp2 equals the 1-rank
    run of the same blend (built from the same prepared files, written again here)."""
    got = run_layout(batches, BLEND_DP2)
    blend = two_prepared_datasets(tmp_path)
    assert_matches_reference(got, reference(blend))


# ---- blends -------------------------------------------------------------------------------------

def test_a_blend_gives_the_samples_asked_for_repeating_small_datasets_and_reading_large_ones_through():
    """Megatron's semantics: 2,000 samples at 3:1 from 1,000 and 250 samples are 1,500 of a (all of
    it, then half of it again) and 500 of b (twice over), each pass over a dataset in a new order,
    evenly interleaved; the first samples of a blend do not depend on its size; seeded."""
    a = PackedDataset(torch.arange(0, 8001), 8)  # 1000 samples, ids 0..8000
    b = PackedDataset(torch.arange(10_000, 12_001), 8)  # 250 samples
    blend = BlendedDataset([a, b], [0.75, 0.25], seed=0, names=["a", "b"], samples=2000)
    assert len(blend) == 2000 and blend.counts == {"a": 1500, "b": 500} and blend.epochs == {"a": 1.5, "b": 2.0}
    firsts = [int(blend[i][0][0]) for i in range(len(blend))]
    source = [int(f >= 10_000) for f in firsts]
    for start in range(0, 2000, 100):  # every window of 100 holds b's share within one sample
        assert abs(sum(source[start:start + 100]) - 25) <= 1
    draws = {name: [f for f in firsts if (f >= 10_000) == (name == "b")] for name in "ab"}
    assert sorted(draws["a"][:1000]) == list(range(0, 8000, 8))  # a read through once, then again
    assert len(set(draws["a"][1000:])) == 500
    first, second = draws["b"][:250], draws["b"][250:]
    assert sorted(first) == sorted(second) == list(range(10_000, 12_000, 8))  # b twice, all of it each time
    assert first != second  # in a new order
    shorter = BlendedDataset([a, b], [3, 1], seed=0, names=["a", "b"], samples=700)  # weights normalised
    assert [int(shorter[i][0][0]) for i in range(700)] == firsts[:700]
    other = BlendedDataset([a, b], [0.75, 0.25], seed=1, names=["a", "b"], samples=2000)
    assert [int(other[i][0][0]) for i in range(20)] != firsts[:20]
    in_order = BlendedDataset([a, b], [0.75, 0.25], seed=0, names=["a", "b"], samples=2000, shuffle=False)
    assert [int(in_order[i][0][0]) for i in range(4)] == [0, 8, 10_000, 16]


@pytest.mark.parametrize("blend,message", [
    (["0.7", "a", "0.3"], r"data.blend: .* has an odd number of entries; it is \[weight, path, weight, path, ...\]"),
    (["a", "0.7", "b", "0.3"], r"data.blend\[0\]: 'a' is not a weight"),
    (["0", "a", "0", "b"], r"data.blend: the weights \[0.0, 0.0\] do not sum to a positive number"),
    (["-1", "a", "2", "b"], r"data.blend\[0\]: weight -1 is negative"),
])
def test_bad_blends_are_refused_by_the_dry_run(tmp_path, blend, message, capsys, monkeypatch):
    from meshtrain.cli import main

    monkeypatch.setenv("MESHTRAIN_DEVICE", "cpu")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--train.run-dir", str(tmp_path), "--data.blend", *blend, "--train.dry-run", "True"])
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_yaml_blend_takes_numbers_for_weights(tmp_path):
    from meshtrain.cli import parse
    from meshtrain.config import JobConfig

    (tmp_path / "job.yaml").write_text("data:\n  blend: [0.7, data/web, 0.3, data/code]\n")
    cfg = parse(JobConfig, ["--config", str(tmp_path / "job.yaml")], "t")
    assert cfg.data.blend == ["0.7", "data/web", "0.3", "data/code"]


def test_a_prefix_json_that_is_not_prepares_is_not_read_as_its_metadata(tmp_path):
    write_by_spec(tmp_path / "d", [[1, 2, 3]], [1], "uint16")
    (tmp_path / "d.json").write_text("[1, 2, 3]\n")  # someone else's file beside a Megatron pair
    tokens, _ = training_tokens(DataConfig(path=str(tmp_path / "d")), 384)
    assert tokens.tolist() == [1, 2, 3]


def test_a_saved_hugging_face_dataset_prepares_like_its_text(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = [f"document {i}: " + "words " * (i % 7) for i in range(50)]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": texts, "id": list(range(50))})}) \
        .save_to_disk(str(tmp_path / "hf"))
    meta = prepare(PrepareConfig(input=str(tmp_path / "hf"), output=str(tmp_path / "data"), text_field="content",
                                 workers=0))
    want = [t for text in texts for t in [*text.encode(), ByteTokenizer.eos_id]]
    assert meta["documents"] == 50 and IndexedDataset.open(tmp_path / "data").tokens.tolist() == want
    with pytest.raises(DataError, match=r"no column 'text' \(columns: \['content', 'id'\]\)"):
        prepare(PrepareConfig(input=str(tmp_path / "hf"), output=str(tmp_path / "other"), workers=0))
