"""The plan on every torch CI tests: torch's fake process group, fake tensors and DTensor are private or young parts
that change between versions (torch 2.8 gives c10d's collectives no fake kernels of its own). The examples' GPT
planned in this process under each layout the plan knows, its parameters counted to the byte."""

import pytest
from helpers import ROOT

from fabriclite.plan import plan_script

pytestmark = pytest.mark.torch_versions

GPT = str(ROOT / "examples" / "gpt" / "train.py")
QUICK_PARAMETERS = 120_576  # examples/gpt/train.py --quick


@pytest.mark.parametrize(
    "layout, devices, share",
    [
        (("--strategy", "ddp"), 2, 1),
        (("--strategy", "fsdp"), 2, 2),
        (("--hsdp", "2"), 4, 2),  # 2 replicas of 2 shards
    ],
    ids=["ddp", "fsdp", "hsdp"],
)
def test_the_gpt_is_planned_and_its_parameters_counted_on_this_torch(tmp_path, layout, devices, share):
    plan = plan_script(GPT, ["--quick", *layout, "--out-dir", str(tmp_path)], devices=devices)
    assert plan.ok and plan.steps == 2, (plan.error, plan.limit)
    assert plan.memory["parameters"] == 4 * QUICK_PARAMETERS // share  # fp32
    assert [kind["ranks"] for kind in plan.kinds] == [list(range(devices))]


def test_tensor_parallel_x_fsdp_is_planned_on_this_torch(tmp_path):
    plan = plan_script(GPT, ["--quick", "--tp", "2", "--out-dir", str(tmp_path)], devices=4)
    assert plan.ok and plan.steps == 2, (plan.error, plan.limit)
    assert dict(plan.configuration)["device mesh"] == "data_parallel 2 x tensor_parallel 2"
    # The blocks' matrices split in two, the embeddings whole; then FSDP halves everything: less than FSDP's half
    # alone, more than a quarter.
    assert 4 * QUICK_PARAMETERS // 4 < plan.memory["parameters"] < 4 * QUICK_PARAMETERS // 2
