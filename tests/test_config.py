"""Config: strict YAML, aliases, precedence defaults < YAML < CLI, and clear errors."""

import re

import pytest

from meshtrain.cli import parse
from meshtrain.config import JobConfig
from meshtrain.config_files import dump_yaml, from_dict, load_yaml
from meshtrain.errors import ConfigError
from meshtrain.models import families
from meshtrain.parallel.layout import plan_layout
from meshtrain.validation import check_ranges
from tests.conftest import ROOT


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_defaults_are_the_embedded_tiny_llama():
    cfg = parse(JobConfig, [], "t")
    assert cfg == JobConfig()
    assert cfg.model.family == "llama" and cfg.data.tokenizer == "byte"
    assert cfg.data.path.endswith("python_stdlib_docstrings.txt")


def test_precedence_defaults_then_yaml_then_cli(tmp_path):
    path = write(tmp_path, "train:\n  steps: 7\n  seed: 3\nmodel:\n  hidden_size: 96\n")
    cfg = parse(JobConfig, ["--config", path, "--train.steps", "9"], "t")
    assert cfg.train.steps == 9          # CLI beats YAML
    assert cfg.train.seed == 3           # YAML beats default
    assert cfg.model.hidden_size == 96
    assert cfg.train.micro_batch_size == JobConfig().train.micro_batch_size  # default kept


def test_cli_bools_and_optionals(tmp_path):
    cfg = parse(JobConfig, ["--parallel.sp", "True", "--model.head-dim", "16", "--logging.peak-tflops", "None"], "t")
    assert cfg.parallel.sp is True and cfg.model.head_dim == 16 and cfg.logging.peak_tflops is None


def test_megatron_aliases(tmp_path):
    path = write(tmp_path, "parallel:\n  tensor_model_parallel_size: 2\n  pipeline_model_parallel_size: 4\n"
                           "  sequence_parallel: true\n  context_parallel_size: 2\n"
                           "  virtual_pipeline_model_parallel_size: 2\n  expert_model_parallel_size: 8\n"
                           "  expert_tensor_parallel_size: 1\n")
    p = load_yaml(path).parallel
    assert (p.tp, p.pp, p.sp, p.cp, p.vpp, p.ep, p.etp) == (2, 4, True, 2, 2, 8, 1)


def test_alias_and_name_together_is_an_error():
    with pytest.raises(ConfigError, match="set twice"):
        from_dict(JobConfig, {"parallel": {"tp": 2, "tensor_model_parallel_size": 2}})


def test_unknown_key_names_the_key_and_suggests(tmp_path):
    path = write(tmp_path, "train:\n  stpes: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train.stpes'; did you mean 'steps'"):
        load_yaml(path)
    with pytest.raises(ConfigError, match="unknown config key 'trian'"):
        from_dict(JobConfig, {"trian": {}})


@pytest.mark.parametrize("section,key,value,message", [
    ("train", "steps", "ten", "train.steps: expected an integer, got 'ten'"),
    ("train", "steps", True, "train.steps: expected an integer"),
    ("parallel", "sp", "yes", "parallel.sp: expected true or false"),
    ("optimizer", "lr", "fast", "optimizer.lr: expected a number"),
    # every module of meshtrain/models/families, listed
    ("model", "family", "gpt2", "model.family: 'gpt2' is not one of " + re.escape(str(list(families.names())))),
    ("model", "head_dim", "x", "model.head_dim"),
    ("model", "rope_scaling", 3, "model.rope_scaling: expected a mapping"),
])
def test_wrong_types_name_the_key(section, key, value, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(JobConfig, {section: {key: value}})


def test_nested_section_and_int_to_float():
    cfg = from_dict(JobConfig, {"model": {"rope_scaling": {"type": "llama3", "factor": 8}}, "optimizer": {"lr": 1}})
    assert cfg.model.rope_scaling.type == "llama3" and cfg.model.rope_scaling.factor == 8.0
    assert isinstance(cfg.optimizer.lr, float)


def test_missing_and_invalid_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_yaml(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(write(tmp_path, "train: [unclosed\n"))
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_yaml(write(tmp_path, "- a\n- b\n"))


def test_resolved_config_round_trips(tmp_path):
    cfg = parse(JobConfig, ["--train.steps", "11", "--parallel.tp", "2"], "t")
    path = write(tmp_path, dump_yaml(cfg))
    assert load_yaml(path) == cfg


def test_every_bundled_config_loads():
    import pathlib
    configs = sorted((pathlib.Path(__file__).parents[1] / "configs").glob("*.yaml"))
    assert configs
    for c in configs:
        load_yaml(str(c))


@pytest.mark.parametrize("options, message", [
    (["--eval.data", "held.txt", "--eval.split", "0.1"],
     r"eval.data=held.txt and eval.split=0.1 both choose the held-out data.*Fix: set one of them"),
    (["--peft.export-adapter", "out"], r"peft.export_adapter=out with peft.method=none: there are no adapters"),
    (["--eval.split", "0.1", "--data.blend", "1", "a", "1", "b"],
     r"eval.split=0.1 with data.blend: a blend repeats its smaller datasets.*Fix: give held-out data as eval.data"),
    (["--data.chat-template", "t.jinja"],
     r"data.chat_template=t.jinja with data.format=pretrain: only chat data.*Fix: set data.format=chat"),
    (["--preference.beta", "0.3"],
     r"preference.beta=0.3 with data.format=pretrain: the preference section sets the loss of preference pairs"),
    (["--data.format", "preference", "--data.document-mask", "off"],
     r"data.document_mask=off with data.format=preference: a pair's chosen and rejected sequences share a sample"),
])
def test_options_that_would_do_nothing_beside_another_are_errors_naming_both(options, message):
    from meshtrain.validation import check_ranges

    with pytest.raises(ConfigError, match=message):
        check_ranges(parse(JobConfig, options, "train"))


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_loads_and_its_layout_holds(path):
    """configs/: each file is valid YAML for the schema, within every range, and (where it defines
    its model rather than importing one) a layout the trainer accepts on the ranks it names."""
    cfg = load_yaml(str(path))
    check_ranges(cfg)
    if cfg.model.init_from_hf is None:
        p = cfg.parallel
        plan_layout(cfg, p.pp * p.tp * p.cp * p.dp_replicate * max(p.dp_shard, 1))
