"""Pipeline stage planning: which stages a rank runs, which layers a stage holds, and that the
stages' parameter names are the whole model's (so checkpoints see one global model)."""

import pytest
import torch
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from meshtrain.models.transformer import Transformer
from meshtrain.parallel.pipeline import layer_range, split_for_stage, stage_ids_for_rank
from tests.conftest import tiny_config


@pytest.mark.parametrize("pp,vpp,schedule,style", [
    (2, 1, "1F1B", "loop"), (4, 1, "GPipe", "loop"), (2, 2, "Interleaved1F1B", "loop"),
    (4, 3, "LoopedBFS", "loop"), (2, 2, "ZBVZeroBubble", "v"), (4, 2, "DualPipeV", "v"),
])
def test_stage_placement_matches_torch(pp, vpp, schedule, style):
    torch_map = generate_stage_to_rank_mapping(pp, pp * vpp, style=style)
    ours = {s: r for r in range(pp) for s in stage_ids_for_rank(r, pp, vpp, schedule)}
    assert ours == torch_map


def test_v_shape_puts_first_and_last_stage_on_rank_zero():
    assert stage_ids_for_rank(0, 4, 2, "ZBVZeroBubble") == [0, 7]
    assert stage_ids_for_rank(3, 4, 2, "DualPipeV") == [3, 4]


def test_layer_ranges_cover_the_model_in_order():
    counts = (1, 3, 3, 1)
    assert [list(layer_range(s, counts)) for s in range(4)] == [[0], [1, 2, 3], [4, 5, 6], [7]]


@pytest.mark.parametrize("counts", [(2, 2), (1, 3), (0, 2, 2, 0), (1, 1, 1, 1)])
def test_stages_partition_the_global_parameter_names(counts):
    cfg = tiny_config(model={"num_hidden_layers": 4}).model
    with torch.device("meta"):
        whole = set(Transformer(cfg).state_dict())
        names = []
        for stage in range(len(counts)):
            model = Transformer(cfg)
            split_for_stage(model, stage, counts)
            names += list(model.state_dict())
            assert (model.embed_tokens is not None) == (stage == 0)
            assert (model.lm_head is not None) == (stage == len(counts) - 1)
    assert sorted(names) == sorted(whole)  # each name exactly once, with its global layer index


def test_a_stage_chain_computes_the_whole_model():
    cfg = tiny_config(model={"num_hidden_layers": 4}).model
    torch.manual_seed(0)
    whole = Transformer(cfg)
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.05)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    h = tokens
    for stage, counts in enumerate([(1, 2, 1)] * 3):
        part = Transformer(cfg)
        split_for_stage(part, stage, counts)
        part.load_state_dict({k: v for k, v in whole.state_dict().items() if k in part.state_dict()})
        h = part(h)
    torch.testing.assert_close(h, whole(tokens), rtol=0, atol=0)
