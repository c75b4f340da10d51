"""Traces every fabriclite library op as torch.compile's AOT stage does (functionalized, on fake tensors) with the
kernels compiled (``TRITON_INTERPRET=0``, set here before triton is imported), and prints, per op, the Triton
kernels its graph launches as ``torch.library.wrap_triton`` nodes (what Inductor then launches from its own code)
and any fabriclite op left opaque in it: ``OP <name> kernels=<k1,k2> opaque=<ops>``.

Fake tensors on the CPU stand in for CUDA ones: a machine without a GPU can trace the ops but not run them (the
GPU tests run them). Usage: ``python tests/kernels/traced_ops.py``.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from torch._functorch.aot_autograd import aot_function  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from fabriclite.kernels import _common  # noqa: E402


def cases() -> list:
    """(op name, arguments) for every forward and backward library op, on fake tensors."""
    from test_kernel_library_ops import _cases

    from fabriclite.kernels import linear_cross_entropy, rope, swiglu  # noqa: F401 - registers their ops

    t = torch.randn
    target = torch.tensor([0, 6, -100])
    more = [
        ("rope", (t(2, 5, 4, 8), t(2, 5, 2, 8), t(5, 8), t(5, 8))),
        ("rope_backward", (t(2, 5, 4, 8), t(2, 5, 2, 8), t(5, 8), t(5, 8))),
        ("swiglu", (t(3, 7), t(3, 7))),
        ("swiglu_backward", (t(3, 7), t(3, 7), t(3, 7))),
        ("linear_cross_entropy", (t(3, 16), t(7, 16), target, t(7), -100, 0.1, "mean", 30.0, 1e-4)),
        ("linear_cross_entropy_backward",
         (t(()), t(3, 16), t(7, 16), target, t(7), t(15), target.new_tensor(2), -100, 0.1, 30.0, 1e-4,
          [True, True, True])),
    ]  # fmt: skip
    return [
        (name, tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)) for name, args in _cases()
    ] + more


def trace(op, args: tuple) -> torch.fx.GraphModule:
    """The graph torch.compile's AOT stage makes of ``op(*args)`` (functionalized; inference, no backward)."""
    graphs = []

    def capture(gm, inputs):
        graphs.append(gm)
        return gm

    aot_function(lambda *a: op(*a), fw_compiler=capture)(*args)
    return graphs[0]


def main() -> int:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    print(f"TRITON_OPS {_common.TRITON_OPS}")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        for name, args in cases():
            args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            try:
                graph = trace(getattr(torch.ops.fabriclite, name), args)
            except Exception as exc:  # noqa: BLE001 - one op failing to trace is that op's line
                print(f"OP {name} error={type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
                continue
            nodes = [node for node in graph.graph.nodes if node.op == "call_function"]
            kernels = [
                kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__
                for node in nodes
                if "triton_kernel_wrapper" in str(node.target)
            ]
            opaque = [str(node.target) for node in nodes if "fabriclite" in str(node.target)]
            print(f"OP {name} kernels={','.join(kernels)} opaque={','.join(opaque)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
