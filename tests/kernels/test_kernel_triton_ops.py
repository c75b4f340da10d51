"""With the kernels compiled, every library op is a ``torch.library.triton_op``: torch.compile traces into it and
finds the Triton kernels themselves (``wrap_triton`` nodes, which Inductor launches from its own code), with no
fabriclite op left opaque in the graph. Traced on fake tensors in a process of its own (``traced_ops.py``): the
kernels compiled cannot run on a machine without a GPU, the GPU tests run them."""

from pathlib import Path

from helpers import run_python

SCRIPT = Path(__file__).with_name("traced_ops.py")


def _kernels(op: str) -> list[str]:
    """The Triton kernels an op's graph launches: one for each input it rotates (rope), else one."""
    direction = "backward" if op.endswith("_backward") else "forward"
    kernel = f"_{op.removesuffix('_backward')}_{direction}_kernel"
    return [kernel, kernel] if op.startswith("rope") else [kernel]


def test_every_library_op_traces_into_its_triton_kernels_with_nothing_opaque_left():
    out = run_python(str(SCRIPT), timeout=600).stdout
    assert "TRITON_OPS True" in out, out
    lines = [line.split(" ", 2)[1:] for line in out.splitlines() if line.startswith("OP ")]
    ops = {name for name, _ in lines}
    assert ops == {
        "cross_entropy", "cross_entropy_backward", "norm", "norm_backward", "bias_gelu", "bias_gelu_backward",
        "rope", "rope_backward", "swiglu", "swiglu_backward", "linear_cross_entropy", "linear_cross_entropy_backward",
    }  # fmt: skip
    for name, rest in lines:
        assert "error=" not in rest, (name, rest)
        fields = dict(field.split("=", 1) for field in rest.split(" "))
        assert fields["kernels"].split(",") == _kernels(name), (name, rest)
        assert fields["opaque"] == "", (name, rest)
