"""Data: reading, tokenizing, packing, dp sharding and loader resume."""

import json

import pytest
import torch

from meshtrain.config import DataConfig
from meshtrain.data.loader import BatchStream, PackedDataset
from meshtrain.data.text import tokenize_corpus
from meshtrain.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer
from meshtrain.errors import DataError


def stream(dataset, dp_size=1, dp_rank=0, global_batch=8, micro=2, shuffle=True):
    return BatchStream(dataset, global_batch=global_batch, micro_batch=micro, dp_size=dp_size, dp_rank=dp_rank,
                       shuffle=shuffle, seed=0, num_workers=0)


def test_bundled_corpus_is_real_text():
    text = open(DataConfig().path, encoding="utf-8").read()
    assert len(text) > 500_000
    words = text.split()
    assert sum(w.isalpha() for w in words) / len(words) > 0.5  # mostly words, not noise
    assert "the" in words


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids == list("héllo".encode()) and tok.decode(ids) == "héllo"
    assert tok.vocab_size == 258 and tok.eos_id == 257


def test_packing_has_no_padding_and_shifts_labels():
    tokens = torch.arange(21)
    ds = PackedDataset(tokens, seq_len=5)
    assert len(ds) == 4  # (21 - 1) // 5
    x, y = ds[1]
    assert x.tolist() == [5, 6, 7, 8, 9] and y.tolist() == [6, 7, 8, 9, 10]
    assert ds[3][1].tolist() == [16, 17, 18, 19, 20]


def test_txt_jsonl_parquet_and_directories(tmp_path):
    (tmp_path / "a.txt").write_text("ab")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "cd"}) + "\n\n" + json.dumps({"text": "e"}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["fg"]}), tmp_path / "c.parquet")
    ids = tokenize_corpus(DataConfig(path=str(tmp_path)), ByteTokenizer()).tolist()
    eos = ByteTokenizer.eos_id
    assert ids == [97, 98, eos, 99, 100, eos, 101, eos, 102, 103, eos]


@pytest.mark.parametrize("setup,message", [
    (lambda d: None, "data.path: .* does not exist"),
    (lambda d: d.mkdir(), "holds no .txt/.jsonl/.parquet files"),
    (lambda d: (d.mkdir(), (d / "x.jsonl").write_text("{bad\n")), r"x.jsonl:1: not valid JSON"),
    (lambda d: (d.mkdir(), (d / "x.jsonl").write_bytes(b'{"text": "a"}\n\x86\xff\n')),
     r"x.jsonl:2: not UTF-8 text \(byte 0x86 at byte 0 of the line\).*is this a binary file\?"),
    (lambda d: (d.mkdir(), (d / "x.jsonl").write_text('{"body": "a"}\n')), r"no string field 'text'.*data.text_field"),
    (lambda d: (d.mkdir(), (d / "x.parquet").write_bytes(b"not parquet")), r"x.parquet: cannot read column 'text'"),
])
def test_bad_data_is_a_clear_error(tmp_path, setup, message):
    d = tmp_path / "data"
    setup(d)
    with pytest.raises(DataError, match=message):
        tokenize_corpus(DataConfig(path=str(d)), ByteTokenizer())


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<|endoftext|>": 0, "hello": 1, "world": 2, "[UNK]": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = build_tokenizer(DataConfig(tokenizer=str(tmp_path)))
    assert isinstance(hf, HFTokenizer) and hf.vocab_size == 4 and hf.eos_id == 0
    assert hf.encode("hello world") == [1, 2]


def test_unreadable_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no tokenizer file"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path / "missing.json")))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot read .* as a Hugging Face tokenizer.json"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path / "tokenizer.json")))


def test_too_little_data_for_one_batch():
    with pytest.raises(DataError, match="fewer than one global batch"):
        stream(PackedDataset(torch.arange(20), 4), global_batch=8)


def step_samples(batches):
    return sorted(tuple(row.tolist()) for x, _ in batches for row in x)


def test_each_step_sees_the_same_samples_for_any_dp_size():
    ds = PackedDataset(torch.arange(64 * 4 + 1), seq_len=4)  # 64 samples, distinct rows
    single = stream(ds)
    sharded = [stream(ds, dp_size=4, dp_rank=r) for r in range(4)]
    for _ in range(10):  # 8 steps per epoch: crosses an epoch boundary
        ref = single.next_step()
        parts = [s.next_step() for s in sharded]
        assert all(len(p) == 1 for p in parts) and len(ref) == 4  # accumulation 8/(2*4)=1 vs 8/2=4
        assert step_samples(ref) == step_samples([b for p in parts for b in p])
        rank_sets = [set(step_samples(p)) for p in parts]
        assert all(not (a & b) for i, a in enumerate(rank_sets) for b in rank_sets[i + 1:])


def test_epochs_reshuffle():
    ds = PackedDataset(torch.arange(16 * 4 + 1), seq_len=4)
    s = stream(ds)
    epoch0 = [step_samples(s.next_step()) for _ in range(2)]
    epoch1 = [step_samples(s.next_step()) for _ in range(2)]
    assert s.epoch == 1
    assert sorted(sum(epoch0, [])) == sorted(sum(epoch1, [])) and epoch0 != epoch1


def test_resume_gives_the_same_batches():
    ds = PackedDataset(torch.arange(40 * 4 + 1), seq_len=4)
    original = stream(ds)
    for _ in range(3):
        original.next_step()
    state = original.state_dict()
    expected = [original.next_step() for _ in range(6)]  # 5 steps per epoch: crosses into epoch 1
    resumed = stream(ds)
    resumed.load_state_dict(state)
    got = [resumed.next_step() for _ in range(6)]
    for e, g in zip(expected, got):
        for (ex, ey), (gx, gy) in zip(e, g):
            assert torch.equal(ex, gx) and torch.equal(ey, gy)


def test_resume_under_another_global_batch_keeps_the_position_in_samples():
    """8 samples a step, 2 steps taken: a 16-sample stream continues at step 1 of the same epoch and
    reads exactly the samples the 8-sample stream would have read next; 24 is refused by name."""
    ds = PackedDataset(torch.arange(80 * 4 + 1), seq_len=4)
    original = stream(ds)
    for _ in range(2):
        original.next_step()
    state = original.state_dict()
    following = [step_samples(original.next_step()) for _ in range(4)]
    wider = stream(ds, global_batch=16)
    note = wider.load_state_dict(state)
    assert note == ("data: continues at epoch 0, sample 16 (the position is kept in samples: "
                    "train.global_batch_size 8 -> 16, step 2 -> 1 of the epoch)")
    assert [step_samples(wider.next_step()) for _ in range(2)] == [sorted(following[0] + following[1]),
                                                                   sorted(following[2] + following[3])]
    with pytest.raises(DataError, match=r"stopped after sample 16 of epoch 0 \(step 2 x train.global_batch_size=8\), "
                                        r"which is not a whole number of train.global_batch_size=24 batches"):
        stream(ds, global_batch=24).load_state_dict(state)


def test_resume_under_another_seq_len_is_refused_naming_both():
    from meshtrain.checkpoint.checkpointer import check_sequence_length
    from meshtrain.errors import CheckpointError

    check_sequence_length({"seq_len": 64}, 64, "ckpt")
    with pytest.raises(CheckpointError, match="its data position counts samples of train.seq_len=64; this run has "
                                              "train.seq_len=128.*Fix: resume with train.seq_len=64"):
        check_sequence_length({"seq_len": 64}, 128, "ckpt")


def test_a_data_error_in_a_loader_worker_is_its_own_one_line_message():
    """torch re-raises a worker's exception wrapped in "Caught DataError in DataLoader worker
    process 0. Original Traceback ..."; the stream gives back the worker's own message."""
    ds = PackedDataset(torch.arange(40 * 4 + 1), seq_len=4, vocab_size=128, source="tokens.bin")
    messages = []
    for workers in (0, 1):
        s = BatchStream(ds, global_batch=8, micro_batch=2, dp_size=1, dp_rank=0, shuffle=False, seed=0,
                        num_workers=workers)
        with pytest.raises(DataError) as raised:
            for _ in range(5):
                s.next_step()
        messages.append(str(raised.value))
    assert messages[1] == messages[0] and messages[0].startswith("tokens.bin: token id ")
    assert "Traceback" not in messages[1] and "\n" not in messages[1]
