"""A small program in LitGPT's shape, written for Lightning Fabric and run through fabriclite by its imports
(tests/scripts/litgpt_style.py: ``L.Fabric``, ``FSDPStrategy`` with LitGPT's FSDP1 keyword arguments, an empty init,
``fabric.load_raw`` of the pretrained weights, ``no_backward_sync`` accumulation, clipping, ``CSVLogger``, a full
checkpoint). On 2 FSDP processes it trains as on 1 process, and LitGPT's own ``test_no_backward_sync[fsdp]``
passes with the gradients read as fabriclite documents them. Every multi-process run carries a timeout."""

import csv
import json

import pytest
import torch
from helpers import SCRIPTS, assert_passed, run_python
from torch import nn


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("litgpt")
    one = run_python(str(SCRIPTS / "litgpt_style.py"), str(out), "1", timeout=300).stdout
    two = run_python(str(SCRIPTS / "litgpt_style.py"), str(out), "2", timeout=300).stdout
    return out, one, two


def test_finetuning_on_two_fsdp_processes_gives_the_losses_and_weights_of_one_process(runs):
    out, _, _ = runs
    one, two = (json.loads((out / f"losses-{n}.json").read_text()) for n in (1, 2))
    assert len(one) == len(two) == 6 and one[0] == pytest.approx(two[0], abs=1e-6)
    assert two == pytest.approx(one, rel=1e-5)  # the order of FSDP's reductions differs, nothing else
    assert max(one) - min(one) > 1e-3  # it trained: the weights changed between steps
    final_one, final_two = (torch.load(out / f"final-{n}.pth", weights_only=True)["model"] for n in (1, 2))
    assert final_one.keys() == final_two.keys()
    assert all(torch.allclose(final_one[k], final_two[k], atol=1e-4) for k in final_one)
    base = torch.load(out / "lit_model.pth", weights_only=True)
    assert not torch.allclose(final_two["wte.weight"], base["wte.weight"], atol=1e-4)
    with open(out / "finetune-2" / "version_0" / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["step"] for row in rows] == ["1", "2", "3", "4", "5", "6"] and list(rows[0]) == ["iter", "loss", "step"]


def test_litgpts_no_backward_sync_test_passes_reading_gradients_as_dtensors(runs):
    assert_passed(runs[2], ["no_backward_sync accumulates and syncs as in LitGPT's test"])


def test_an_empty_init_keeps_tied_weights_tied():
    from fabriclite.strategies.sharding import materialize

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(8, 4)
            self.lm_head = nn.Linear(4, 8, bias=False)
            self.lm_head.weight = self.wte.weight

    with torch.device("meta"):
        model = Tied()
    assert materialize(model, "cpu") == []
    assert model.lm_head.weight is model.wte.weight and not model.wte.weight.is_meta
    assert len(list(model.parameters())) == 1
