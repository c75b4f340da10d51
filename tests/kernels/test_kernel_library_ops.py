"""The ops as torch.library custom ops: opcheck's schema, fake-tensor, autograd and AOT-dispatch tests, and
torch.compile with fullgraph=True (which fails on any graph break) over a function using all of them."""

import pytest
import torch
from kernel_checks import DEVICE, launched

from fabriclite.kernels import add_layer_norm, bias_gelu, cross_entropy, layer_norm, rms_norm

pytestmark = pytest.mark.torch_versions  # also run on the other torch versions CI tests


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, requires_grad=True)


def _plain(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE)


def _cases() -> list:
    """(op name, arguments) pairs: every forward op with its optional parts present and absent, every backward op."""
    torch.manual_seed(0)
    target = torch.tensor([0, 6, -100], device=DEVICE)
    rows = torch.tensor([0.5, 1.0, 2.0], device=DEVICE)
    stats = torch.cat([rows, torch.zeros(3, device=DEVICE)])
    ce_stats = torch.cat([rows, rows + 1])
    return [
        ("cross_entropy", (_leaf(3, 7), target, -100, 0.1, "mean")),
        ("cross_entropy", (_leaf(3, 7), target, -100, 0.0, "none")),
        ("cross_entropy", (_plain(3, 7), target, -100, 0.0, "sum")),
        # (grad_loss, logits, target, stats: the rows' max then sum of exp, n_valid, ignore_index, label_smoothing)
        ("cross_entropy_backward", (_plain(3), _plain(3, 7), target, ce_stats, _plain(0), -100, 0.1)),
        ("cross_entropy_backward", (_plain(3)[0], _plain(3, 7), target, ce_stats, target.new_tensor(2), -100, 0.0)),
        # fabriclite::norm(x, residual, weight, bias, n_cols, eps, rms): layer norm, RMS norm, with a residual
        ("norm", (_leaf(2, 3, 7), None, _leaf(7), _leaf(7), 7, 1e-5, False)),
        ("norm", (_leaf(3, 7), None, None, None, 7, 1e-5, False)),
        ("norm", (_leaf(3, 7), _leaf(3, 7), _leaf(7), _leaf(7), 7, 1e-5, False)),
        ("norm", (_leaf(3, 7), _leaf(3, 7), None, None, 7, 1e-5, False)),
        ("norm", (_leaf(2, 3, 7), None, _leaf(7), None, 7, 1e-6, True)),
        ("norm", (_leaf(2, 3, 7), _leaf(2, 3, 7), _leaf(7), None, 7, 1e-6, True)),
        # stats: the rows' rstd, then (layer norm) their means
        ("norm_backward", (_plain(3, 7), _plain(3, 7), _plain(3, 7), 7, _plain(7), True, stats, False)),
        ("norm_backward", (_plain(3, 7), None, _plain(3, 7), 7, None, False, stats, False)),
        ("norm_backward", (_plain(3, 7), None, _plain(3, 7), 7, _plain(7), False, rows, True)),
        ("bias_gelu", (_leaf(2, 3, 7), _leaf(7), "none")),
        ("bias_gelu", (_leaf(3, 7), _leaf(7), "tanh")),
        ("bias_gelu_backward", (_plain(3, 7), _plain(3, 7), _plain(7), "tanh")),
    ]


def _case_id(case) -> str:
    name, args = case
    absent = sum(arg is None for arg in args)
    return f"{name}-{absent}-absent" if absent else name


def _kernel(op: str) -> str:
    """The Triton kernel an op launches: fabriclite::norm -> _norm_forward_kernel, and so on."""
    direction = "backward" if op.endswith("_backward") else "forward"
    return f"_{op.removesuffix('_backward')}_{direction}_kernel"


@pytest.mark.parametrize("case", _cases(), ids=_case_id)
def test_opcheck_passes_for_every_op(case):
    name, args = case
    with launched(_kernel(name)):
        results = torch.library.opcheck(getattr(torch.ops.fabriclite, name), args, raise_exception=False)
    assert results == dict.fromkeys(results, "SUCCESS"), results


def _step(x, residual, weight, bias, weight2, bias2, target):
    y, hidden = add_layer_norm(x, residual, weight, bias)
    h = bias_gelu(layer_norm(hidden, (x.shape[-1],), weight, bias) + y, bias2, "tanh")
    h = rms_norm(h, weight2, 1e-6)
    return cross_entropy(h, target, label_smoothing=0.1)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_traces_all_ops_into_one_graph_with_their_backward(backend):
    torch.manual_seed(1)
    leaves = [_leaf(4, 9), _leaf(4, 9), _leaf(9), _leaf(9), _leaf(9), _leaf(9)]
    target = torch.tensor([0, 3, -100, 8], device=DEVICE)
    expected = _step(*leaves, target)
    expected.backward()
    expected_grads = [leaf.grad for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None

    torch._dynamo.reset()
    compiled = torch.compile(_step, backend=backend, fullgraph=True)  # a graph break raises here
    kernels = [
        f"_{op}_{direction}_kernel"
        for op in ("norm", "bias_gelu", "cross_entropy")
        for direction in ("forward", "backward")
    ]
    with launched(*kernels):
        loss = compiled(*leaves, target)
        loss.backward()

    torch.testing.assert_close(loss, expected)
    for leaf, grad in zip(leaves, expected_grads):
        torch.testing.assert_close(leaf.grad, grad)
