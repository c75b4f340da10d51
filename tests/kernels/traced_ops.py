"""Traces every fabriclite library op the way torch.compile does on a GPU: with the kernels compiled
(``TRITON_INTERPRET=0``, set here before triton is imported), so that each op is a ``torch.library.triton_op`` whose
body (the launch code) is traced and whose Triton kernels become ``torch.library.wrap_triton`` nodes, which Inductor
then launches from its own code. Prints one line per trace:

- ``OP <shapes> <name> kernels=<k1,k2> opaque=<ops>``: the op alone, traced as torch.compile's AOT stage does
  (functionalized, forward only), with ``static`` shapes, and with ``dynamic`` ones: every dimension of every tensor
  symbolic, the other arguments constants, as ``opcheck``'s ``test_aot_dispatch_dynamic`` traces it.
- ``STEP <how> graphs=<n> symbolic=<dims> kernels=<k1,...> opaque=<ops>``: Dynamo over a training step that calls
  every public op (forward and backward, ``fullgraph=True``): with ``dynamic=True`` (every size symbolic, also the
  widths the public functions pass on as integers), and with Dynamo's automatic dynamic shapes (a second call with
  another batch size recompiles with that dimension symbolic); ``symbolic`` counts the symbolic dimensions of the
  graphs' inputs.

A trace that fails prints ``error=<type>: <message>`` on its line. Tensors on the meta device stand in for CUDA ones
(torch traces them with fake tensors, and runs the graphs on meta tensors, which hold no data): a machine without a
GPU can trace the ops but not run them (the GPU tests run them). Tracing also compiles each kernel to Triton's IR,
for torch to find the tensors it writes (what the graph must treat as mutated): Triton asks its driver for the GPU's
target, so a stand-in driver names an H100/H200's (sm_90) here, the one mock of this script. Without it torch
assumes every tensor argument mutated, and the graphs differ from a GPU's. Usage:
``python tests/kernels/traced_ops.py``.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import triton  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._functorch.aot_autograd import make_boxed_func  # noqa: E402
from torch._functorch.aot_autograd import aot_function  # noqa: E402

from fabriclite.kernels import _common  # noqa: E402


class _Sm90Driver:
    """Stands in for Triton's CUDA driver, which needs a GPU: it answers only which GPU kernels are compiled for."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def cases() -> list:
    """(op name, arguments) for every forward and backward library op."""
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


def graph_summary(graphs: list) -> str:
    """``kernels=<k1,...> opaque=<ops>``: the Triton kernels ``graphs`` launch as ``wrap_triton`` nodes, in order,
    and any fabriclite op left opaque in them."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    kernels, opaque = [], []
    for graph in graphs:
        for node in graph.graph.nodes:
            if node.op != "call_function":
                continue
            if "triton_kernel_wrapper" in str(node.target):
                kernels.append(kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__)
            elif "fabriclite" in str(node.target):
                opaque.append(str(node.target))
    return f"kernels={','.join(kernels)} opaque={','.join(opaque)}"


def symbolic(value) -> bool:
    return isinstance(value, torch.SymInt) and not isinstance(value.node.maybe_as_int(), int)


def trace_op(name: str, args: tuple, dynamic: bool) -> str:
    """The line of one op traced alone (forward only) as torch.compile's AOT stage traces it: the tensors are the
    graph's inputs (every dimension symbolic when ``dynamic``), the other arguments constants, as in ``opcheck``."""
    graphs = []

    def capture(gm, inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    op = getattr(torch.ops.fabriclite, name)
    tensors = [arg.to("meta") for arg in args if isinstance(arg, torch.Tensor)]

    def with_tensors(*inputs):
        inputs = iter(inputs)
        return op(*(next(inputs) if isinstance(arg, torch.Tensor) else arg for arg in args))

    aot_function(with_tensors, fw_compiler=capture, dynamic=dynamic)(*tensors)
    if dynamic:
        inputs = [node.meta.get("val") for node in graphs[0].graph.nodes if node.op == "placeholder"]
        dims = [d for value in inputs if isinstance(value, torch.Tensor) for d in value.shape]
        if not any(symbolic(d) for d in dims):
            raise AssertionError("no input dimension was symbolic")
    return graph_summary(graphs)


def step(x, residual, weight, bias, gate, up, q, k, cos, sin, head, target):
    """A training step's worth of every public op: the norms (with and without the residual add), bias + GELU,
    SwiGLU, RoPE, cross-entropy and linear cross-entropy with every option on."""
    from fabriclite.kernels import (
        add_layer_norm,
        add_rms_norm,
        bias_gelu,
        cross_entropy,
        layer_norm,
        linear_cross_entropy,
        rms_norm,
        rope,
        swiglu,
    )

    y, hidden = add_layer_norm(x, residual, weight, bias)
    h = bias_gelu(layer_norm(hidden, (x.shape[-1],), weight, bias) + y, bias, "tanh")
    h, _ = add_rms_norm(rms_norm(h, weight, 1e-6), swiglu(gate, up), weight)
    q_rot, k_rot = rope(q, k, cos, sin)
    h = h + (q_rot.flatten(2).sum(-1) + k_rot.flatten(2).sum(-1)).flatten()[:, None]
    loss = cross_entropy(h, target, label_smoothing=0.1)
    return loss + linear_cross_entropy(h, head, target, label_smoothing=0.1, softcap=30.0, z_loss=1e-4)


def step_inputs(batch: int) -> list:
    """The step's inputs for ``batch`` sequences of 5 tokens (width 16, 4 query and 2 key heads of size 8, a
    vocabulary of 7), meta tensors, the differentiable ones leaves that need gradients."""
    tokens, width = batch * 5, 16
    with torch.device("meta"):
        shapes = [(tokens, width), (tokens, width), (width,), (width,), (tokens, width), (tokens, width),
                  (batch, 5, 4, 8), (batch, 5, 2, 8)]  # fmt: skip
        leaves = [torch.randn(*shape, requires_grad=True) for shape in shapes]
        tables = [torch.randn(5, 8), torch.randn(5, 8)]
        head = torch.randn(7, width, requires_grad=True)
        target = torch.zeros(tokens, dtype=torch.long)
    return [*leaves, *tables, head, target]


def trace_step(how: str) -> str:
    """The line of the training step compiled by Dynamo (``how``: "dynamic=True" or "automatic")."""
    graphs = []

    def capture(gm, inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=capture, bw_compiler=capture)
    options = {"dynamic": True} if how == "dynamic=True" else {}
    compiled = torch.compile(step, backend=backend, fullgraph=True, **options)  # a graph break raises
    batches = (2,) if how == "dynamic=True" else (2, 3)  # the second batch size: Dynamo recompiles it dynamic
    for batch in batches:
        graphs.clear()  # the last compile's graphs: automatic dynamic's is the second
        compiled(*step_inputs(batch)).backward()
    inputs = [node.meta.get("val") for graph in graphs for node in graph.graph.nodes if node.op == "placeholder"]
    dims = sum(symbolic(d) for value in inputs if isinstance(value, torch.Tensor) for d in value.shape)
    return f"graphs={len(graphs)} symbolic={dims} {graph_summary(graphs)}"


def main() -> int:
    triton.runtime.driver.set_active(_Sm90Driver())
    print(f"TRITON_OPS {_common.TRITON_OPS}")
    for shapes in ("static", "dynamic"):
        for name, args in cases():
            try:
                line = trace_op(name, args, shapes == "dynamic")
            except Exception as exc:  # noqa: BLE001 - one op failing to trace is that op's line
                line = f"error={type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            print(f"OP {shapes} {name} {line}", flush=True)
    for how in ("dynamic=True", "automatic"):
        try:
            line = trace_step(how)
        except Exception as exc:  # noqa: BLE001
            line = f"error={type(exc).__name__}: {' '.join(str(exc).split())[:500]}"
        print(f"STEP {how} {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
