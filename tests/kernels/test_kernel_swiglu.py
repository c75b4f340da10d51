import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEVICE, assert_matches, launched, leaf_pair

from fabriclite.kernels import fused_swiglu, swiglu

FORWARD = "_swiglu_forward_kernel"
BACKWARD = "_swiglu_backward_kernel"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swiglu_and_its_gradients_match_torch(dtype):
    torch.manual_seed(0)
    a, a_ref = leaf_pair(3 * torch.randn(2, 3, 37), dtype)  # wide enough a range to reach both tails of silu
    b, b_ref = leaf_pair(torch.randn(2, 3, 37), dtype)
    upstream = torch.randn(37, 3, 2, dtype=dtype, device=DEVICE).transpose(0, 2)  # not contiguous

    with launched(FORWARD, BACKWARD):
        y = swiglu(a, b)
        y.backward(upstream)
    expected = F.silu(a_ref) * b_ref
    expected.backward(upstream.double())

    assert_matches(y, expected, dtype)
    assert_matches(a.grad, a_ref.grad, dtype)
    assert_matches(b.grad, b_ref.grad, dtype)


# exp(90) overflows to inf in the interpreter's numpy, which says so; sigmoid(-90) = 1 / (1 + inf) = 0 is right.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_halves_of_one_fused_projection_are_read_in_place_over_many_tiles(monkeypatch, dtype):
    # a and b as h.chunk(2, dim=-1) of a fused gate-and-up output: rows 2 * 37 apart. 4 x 8 tiles over 11 rows of
    # 37: three tile rows (the last partial) by five tile columns (the last partial).
    monkeypatch.setattr(fused_swiglu, "BLOCK_N_MAX", 8)
    monkeypatch.setattr(fused_swiglu, "TILE", 32)
    torch.manual_seed(1)
    fused = 2 * torch.randn(11, 2 * 37)
    fused[0, :3] = torch.tensor([-90.0, 90.0, 0.0])  # silu's far tails and its zero: finite values and gradients
    h, h_ref = leaf_pair(fused, dtype)

    with launched(FORWARD, BACKWARD):
        y = swiglu(*h.chunk(2, dim=-1))
        y.sum().backward()  # an expanded, stride-0 upstream gradient
    a_ref, b_ref = h_ref.chunk(2, dim=-1)
    expected = F.silu(a_ref) * b_ref
    expected.sum().backward()

    assert_matches(y, expected, dtype)
    assert_matches(h.grad, h_ref.grad, dtype)


def test_a_wider_dtype_of_b_promotes_like_torch_and_each_gradient_keeps_its_inputs_dtype():
    torch.manual_seed(2)
    a, a_ref = leaf_pair(torch.randn(1, 23), torch.bfloat16)
    b, b_ref = leaf_pair(torch.randn(1, 23), torch.float32)

    with launched(FORWARD, BACKWARD):
        y = swiglu(a, b)
        y.square().sum().backward()
    assert y.dtype == (F.silu(a.detach()) * b.detach()).dtype == torch.float32
    expected = F.silu(a_ref) * b_ref
    expected.square().sum().backward()

    assert_matches(y, expected, torch.float32)
    assert_matches(a.grad, a_ref.grad, torch.bfloat16)
    assert_matches(b.grad, b_ref.grad, torch.float32)


def test_bad_arguments_are_refused_saying_what_fits():
    a = torch.randn(2, 5, device=DEVICE)
    with pytest.raises(ValueError, match="one shape"):
        swiglu(a, torch.randn(5, device=DEVICE))
    with pytest.raises(TypeError, match=r"got a torch\.float64 tensor.*float32, bfloat16 and float16"):
        swiglu(a, a.double())


def test_opcheck_passes_for_swiglu_and_its_backward():
    torch.manual_seed(3)
    fused = torch.randn(3, 14, device=DEVICE)
    cases = [
        (torch.ops.fabriclite.swiglu, (torch.randn(2, 3, 7, requires_grad=True), torch.randn(2, 3, 7))),
        (torch.ops.fabriclite.swiglu, tuple(fused.requires_grad_().chunk(2, dim=-1))),
        (torch.ops.fabriclite.swiglu_backward, (torch.randn(3, 7), torch.randn(3, 7), torch.randn(3, 7))),
    ]
    with launched(FORWARD, BACKWARD):
        for op, args in cases:
            results = torch.library.opcheck(op, tuple(arg.to(DEVICE) for arg in args), raise_exception=False)
            assert results == dict.fromkeys(results, "SUCCESS"), results


def _gated_mlp(x, gate_up, down):
    return (swiglu(*(x @ gate_up.T).chunk(2, dim=-1)) @ down.T).square().sum()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_traces_swiglu_into_one_graph_with_its_backward(backend):
    torch.manual_seed(4)
    leaves = [torch.randn(*shape, device=DEVICE, requires_grad=True) for shape in ((4, 6), (2 * 10, 6), (6, 10))]
    expected = _gated_mlp(*leaves)
    expected_grads = torch.autograd.grad(expected, leaves)

    torch._dynamo.reset()
    compiled = torch.compile(_gated_mlp, backend=backend, fullgraph=True)  # a graph break raises here
    with launched(FORWARD, BACKWARD):
        loss = compiled(*leaves)
        grads = torch.autograd.grad(loss, leaves)

    torch.testing.assert_close(loss, expected)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad)
