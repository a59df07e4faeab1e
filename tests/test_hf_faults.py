"""Unusual Hugging Face inputs and outputs, end to end in one process: NaN weights through convert
and into training, a failed --verify, a tied checkpoint that also stores lm_head.weight, and the
tokenizer that goes with an export."""

import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshtrain.commands import convert as convert_command
from meshtrain.commands.convert import ConvertConfig, convert
from meshtrain.errors import CheckpointError
from meshtrain.hf.io import inspect_hf_dir
from tests.hf_models import assert_same_tensors, hf_shapes_of, imported, read_tensors, write_hf_dir

TRAIN = ["--train.steps", "1", "--train.global-batch-size", "2", "--train.micro-batch-size", "2",
         "--train.seq-len", "32", "--logging.progress", "off"]


def edit_tensor(directory: pathlib.Path, key: str, change) -> pathlib.Path:
    """Rewrite ``key`` in whichever file holds it (as ``change(tensor)``); returns that file."""
    for file in sorted(directory.glob("*.safetensors")):
        tensors = load_file(file)
        if key in tensors:
            tensors[key] = change(tensors[key])
            save_file(tensors, file, metadata={"format": "pt"})
            return file
    raise KeyError(key)


def poison(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0], t.view(-1)[-1] = float("nan"), float("inf")
    return t


def test_convert_copies_nan_weights_bit_exactly_and_verify_agrees(tmp_path):
    src = write_hf_dir(tmp_path / "src")
    edit_tensor(src, "model.layers.0.mlp.up_proj.weight", poison)
    convert(ConvertConfig(src=str(src), dst=str(tmp_path / "dcp")))  # verify on by default
    convert(ConvertConfig(src=str(tmp_path / "dcp"), dst=str(tmp_path / "hf")))
    assert_same_tensors(read_tensors(src), read_tensors(tmp_path / "hf"))


def test_a_failed_verify_leaves_no_output_that_looks_finished(tmp_path, monkeypatch):
    src = write_hf_dir(tmp_path / "src")
    dst = tmp_path / "dcp"
    monkeypatch.setattr(convert_command, "verify", lambda *args: ["model.norm.weight"])
    with pytest.raises(CheckpointError, match=r"differs from .* in 1 tensors: model.norm.weight; it is left in "
                                              r".*dcp.unverified for inspection and .*dcp was not written"):
        convert(ConvertConfig(src=str(src), dst=str(dst)))
    assert not dst.exists() and (tmp_path / "dcp.unverified").is_dir()
    monkeypatch.undo()
    convert(ConvertConfig(src=str(src), dst=str(dst)))  # a retry replaces the unverified debris
    assert (dst / "meshtrain.json").is_file() and not (tmp_path / "dcp.unverified").exists()


def test_training_from_non_finite_weights_names_the_file_and_key(tmp_path, capsys):
    from meshtrain.cli import main

    src = write_hf_dir(tmp_path / "src")
    file = edit_tensor(src, "model.layers.1.self_attn.o_proj.weight", poison)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model.init-from-hf", str(src), *TRAIN, "--train.run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert f"hold NaN or Inf values: {file}: model.layers.1.self_attn.o_proj.weight" in err, err


def with_stored_head(src: pathlib.Path, head) -> None:
    """Add lm_head.weight (``head(embedding)``) to a tied checkpoint, as some exporters write it."""
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    file = src / index["weight_map"]["model.embed_tokens.weight"]
    tensors = load_file(file)
    tensors["lm_head.weight"] = head(tensors["model.embed_tokens.weight"])
    save_file(tensors, file, metadata={"format": "pt"})
    index["weight_map"]["lm_head.weight"] = file.name
    index_path.write_text(json.dumps(index))


def test_a_tied_checkpoint_that_stores_the_head_too_is_accepted_when_it_is_the_embedding(tmp_path):
    import transformers

    src = write_hf_dir(tmp_path / "src", tie_word_embeddings=True)
    with_stored_head(src, torch.clone)
    model = imported(src)
    reference = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tokens = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=1e-5, atol=1e-5)

    other = write_hf_dir(tmp_path / "other", tie_word_embeddings=True)
    with_stored_head(other, lambda e: e + 1)
    with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight, but "
                                              "config.json says tie_word_embeddings=true"):
        inspect_hf_dir(other, hf_shapes_of(other))


def word_level_tokenizer(path: pathlib.Path, size: int) -> pathlib.Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<|endoftext|>": 1} | {f"w{i}": i + 2 for i in range(size - 2)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_export_ships_the_tokenizer_trained_with_as_tokenizer_json(tmp_path):
    import transformers

    from meshtrain.cli import main

    src = write_hf_dir(tmp_path / "src")  # no tokenizer files
    tok = word_level_tokenizer(tmp_path / "my_tokens.json", 300)
    main(["train", "--model.init-from-hf", str(src), "--data.tokenizer", str(tok), *TRAIN,
          "--train.run-dir", str(tmp_path / "run"), "--checkpoint.export-hf", str(tmp_path / "out")])
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == tok.read_bytes()
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert loaded("w5 w7")["input_ids"] == [7, 9]


def test_a_tokenizer_too_big_for_an_imported_model_gets_a_fix_that_works(tmp_path, capsys):
    from meshtrain.cli import main

    src = write_hf_dir(tmp_path / "src")  # vocab_size 384
    big = word_level_tokenizer(tmp_path / "big.json", 500)
    with pytest.raises(SystemExit):
        main(["train", "--model.init-from-hf", str(src), "--data.tokenizer", str(big), *TRAIN,
              "--train.run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert "model.vocab_size=384 is smaller than the vocabulary of data.tokenizer" in err
    assert "Fix: use the tokenizer" in err and "model.vocab_size >=" not in err, err
    word_level_tokenizer(src / "tokenizer.json", 384)
    with pytest.raises(SystemExit):
        main(["train", "--model.init-from-hf", str(src), "--data.tokenizer", str(big), *TRAIN,
              "--train.run-dir", str(tmp_path / "run")])
    assert f"Fix: use the model's own tokenizer, data.tokenizer={src / 'tokenizer.json'}" in capsys.readouterr().err
