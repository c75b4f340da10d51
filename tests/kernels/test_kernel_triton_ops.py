"""With the kernels compiled, every library op is a ``torch.library.triton_op``: torch.compile traces into it and
finds the Triton kernels themselves (``wrap_triton`` nodes, which Inductor launches from its own code), with no
fabriclite op left opaque in the graph, with static shapes and with dynamic ones (``opcheck``'s AOT test, Dynamo's
``dynamic=True`` and its automatic dynamic shapes). Traced on meta tensors in a process of its own
(``traced_ops.py``): the kernels compiled cannot run on a machine without a GPU, the GPU tests run them. The
interpreter's tests take the other registration (a custom op), so without this file CI never traced the launch code
a GPU runs: a width cached with ``functools.lru_cache`` crashed every op but the norms on an H200 once a shape was
dynamic (``unhashable type: non-nested SymInt``)."""

from pathlib import Path

import pytest
from helpers import run_python

pytestmark = pytest.mark.torch_versions  # the tracing code differs between torch versions

SCRIPT = Path(__file__).with_name("traced_ops.py")
OPS = {
    "cross_entropy", "cross_entropy_backward", "norm", "norm_backward", "bias_gelu", "bias_gelu_backward",
    "rope", "rope_backward", "swiglu", "swiglu_backward", "linear_cross_entropy", "linear_cross_entropy_backward",
}  # fmt: skip


def _kernels(op: str) -> list[str]:
    """The Triton kernels an op's graph launches: one for each input it rotates (rope), else one."""
    direction = "backward" if op.endswith("_backward") else "forward"
    kernel = f"_{op.removesuffix('_backward')}_{direction}_kernel"
    return [kernel, kernel] if op.startswith("rope") else [kernel]


def _fields(rest: str) -> dict[str, str]:
    assert "error=" not in rest, rest
    return dict(field.split("=", 1) for field in rest.split(" "))


@pytest.fixture(scope="module")
def traced() -> str:
    return run_python(str(SCRIPT), timeout=600).stdout


@pytest.mark.parametrize("shapes", ["static", "dynamic"])
def test_every_library_op_traces_into_its_triton_kernels_with_nothing_opaque_left(traced, shapes):
    assert "TRITON_OPS True" in traced, traced
    lines = [line.split(" ", 3)[2:] for line in traced.splitlines() if line.startswith(f"OP {shapes} ")]
    assert {name for name, _ in lines} == OPS, traced
    for name, rest in lines:
        fields = _fields(rest)
        assert fields["kernels"].split(",") == _kernels(name), (name, rest)
        assert fields["opaque"] == "", (name, rest)


@pytest.mark.parametrize("how", ["dynamic=True", "automatic"])
def test_a_step_of_every_public_op_compiles_whole_with_dynamic_shapes_forward_and_backward(traced, how):
    line = next((line for line in traced.splitlines() if line.startswith(f"STEP {how} ")), None)
    assert line is not None, traced
    fields = _fields(line.split(" ", 2)[2])
    assert fields["graphs"] == "2", line  # one forward graph, one backward graph: no graph break
    assert int(fields["symbolic"]) > 0, line  # the batch (at least) stayed symbolic
    assert set(fields["kernels"].split(",")) == {kernel for op in OPS for kernel in _kernels(op)}, line
    assert fields["opaque"] == "", line
