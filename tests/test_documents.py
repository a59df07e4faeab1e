"""Document masking: ids, masks and positions from EOS, and a packed sample computing exactly what
its documents compute one by one (loss and gradients)."""

import json
import pathlib

import pytest
import torch
import torch.nn.functional as F

from meshtrain.config import ModelConfig
from meshtrain.models.documents import block_causal_mask, document_ids, positions_in_document
from meshtrain.models.initialize import init_weights
from meshtrain.models.transformer import Transformer
from tests.batch import Job, jobs
from tests.parity import MOE_ARGS, PP_MODEL, TINY, assert_matches_reference, reference, run_layout

EOS = 9


def test_ids_masks_and_positions_follow_the_eos():
    x = torch.tensor([[1, 2, EOS, 3, EOS, EOS, 4], [5, 6, 7, 8, 1, 2, 3]])
    ids = document_ids(x, EOS)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 3], [0] * 7]
    assert positions_in_document(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0], list(range(7))]
    mask = block_causal_mask(ids)[:, 0]
    assert mask[0, 3].tolist() == [False, False, False, True, False, False, False]  # a new document starts
    assert mask[0, 4].tolist() == [False, False, False, True, True, False, False]
    assert torch.equal(mask[1], torch.ones(7, 7, dtype=torch.bool).tril())


def model(family: str, **fields) -> Transformer:
    cfg = ModelConfig(family=family, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64, **fields)
    m = Transformer(cfg)
    init_weights(m, 0)
    m.reset_position_ids = True
    return m


WINDOWED = {"mistral": dict(sliding_window=5),
            "gemma3": dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"], local_rope_theta=1e4,
                           tie_word_embeddings=True, query_pre_attn_scalar=10),
            "gemma2": dict(sliding_window=5, tie_word_embeddings=True, query_pre_attn_scalar=10,
                           attn_logit_softcapping=2.0, final_logit_softcapping=3.0)}


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral", "gemma3", "gemma2"])
def test_a_packed_sample_equals_its_documents_run_one_by_one(family):
    # mistral, gemma2/3: a window of 5 inside documents of 5 to 12 tokens, so both masks cut
    m = model(family, **WINDOWED.get(family, {}))
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, EOS, (n,), generator=g).tolist() + [EOS] for n in (6, 11, 4)]
    packed = torch.tensor([sum(docs, [])])
    labels = torch.randint(0, 64, packed.shape, generator=g)
    logits = m(packed, document_ids(packed, EOS))
    F.cross_entropy(logits[0], labels[0], reduction="sum").backward()
    packed_grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    start, alone = 0, []
    for doc in docs:
        x = torch.tensor([doc])
        out = m(x)  # no mask, positions from 0: the document on its own
        F.cross_entropy(out[0], labels[0, start:start + len(doc)], reduction="sum").backward()
        alone.append(out[0])
        start += len(doc)
    torch.testing.assert_close(logits[0], torch.cat(alone), rtol=1e-5, atol=1e-5)
    for name, p in m.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # without the mask the later documents see the earlier ones: the comparison can fail
    assert not torch.allclose(m(packed)[0], torch.cat(alone), atol=1e-3)


def test_a_batch_of_single_documents_takes_the_plain_causal_path():
    m = model("llama")
    x = torch.randint(0, EOS, (2, 12))
    x[:, -1] = EOS  # an EOS that ends the sample starts no document inside it
    torch.testing.assert_close(m(x, document_ids(x, EOS)), m(x), rtol=0, atol=0)


# ---- every layout equals the single-process run on many short documents -------------------------


def short_documents(directory: pathlib.Path) -> tuple[str, ...]:
    """Documents of 3-40 bytes: a 32-token sample holds several, so masking changes every step."""
    path = directory / "short_docs.jsonl"
    words = "ab cde fgh ij klmno pq rstu vw xyz".split()
    with open(path, "w") as f:
        for i in range(3000):
            f.write(json.dumps({"text": " ".join(words[(i * k) % 9] for k in range(1 + i % 8))}) + "\n")
    return ("--data.path", str(path))


RESET = ("--data.reset-position-ids", "True")
LAYOUTS = {  # name: (ranks, layout, options)
    "dp2-reset-positions": (2, ["--parallel.dp-shard", "2"], RESET),
    "tp2-sp-reset-positions": (2, ["--parallel.tp", "2", "--parallel.sp", "True"], RESET),
    "pp2-interleaved": (2, ["--parallel.pp", "2", "--parallel.vpp", "2"], PP_MODEL + RESET),
    "moe-ep2": (2, ["--parallel.ep", "2"], MOE_ARGS),
    # cp: keys and values all-gathered, the mask built for the load-balanced chunks
    "cp2-reset-positions": (2, ["--parallel.cp", "2"], RESET),
    "cp2-tp2-sp": (4, ["--parallel.cp", "2", "--parallel.tp", "2", "--parallel.sp", "True"], RESET),
    "pp2-cp2": (4, ["--parallel.pp", "2", "--parallel.cp", "2"], PP_MODEL + RESET),
}
JOBS = {name: Job(f"documents/{name}", nproc, "train", (*TINY, *extra, *layout), prepare=short_documents)
        for name, (nproc, layout, extra) in LAYOUTS.items()}


@pytest.mark.slow
@jobs("name", JOBS)
def test_document_masked_layouts_equal_single_rank(batches, name, tmp_path):
    nproc, layout, extra = LAYOUTS[name]
    got = run_layout(batches, JOBS[name])
    data = short_documents(tmp_path)
    ref = reference(extra + data)
    assert_matches_reference(got, ref)
    if name == "dp2-reset-positions":  # masking changed what was computed: the comparison can fail
        unmasked = reference(extra + data + ("--data.document-mask", "off"))
        assert abs(unmasked["losses"][0] - ref["losses"][0]) > 1e-4
