from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, assert_matches, launched, leaf_pair

from fabriclite.kernels import rope

FORWARD = "_rope_forward_kernel"
BACKWARD = "_rope_backward_kernel"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's apply_rotary_pos_emb on a (B, T, H, D) tensor, in float64: cos and sin broadcast over the heads."""
    cos, sin = cos.double().unsqueeze(-2), sin.double().unsqueeze(-2)
    return x * cos + _rotate_half(x) * sin


def _tables(seq_len: int, head_dim: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's cos and sin tables, (T, D): the frequencies repeated over both halves."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)


def _heads_first(batch: int, heads: int, seq_len: int, head_dim: int) -> torch.Tensor:
    """A (B, T, H, D) tensor stored as (B, H, T, D), as q and k are when they come from attention's layout."""
    return torch.randn(batch, heads, seq_len, head_dim).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_and_its_gradients_match_llamas_formula_with_fewer_key_heads(dtype):
    torch.manual_seed(0)
    # T = 7 positions, D = 6 (halves of 3, not a power of 2), 6 query heads and 2 key heads (grouped-query).
    q, q_ref = leaf_pair(_heads_first(2, 6, 7, 6), dtype)
    k, k_ref = leaf_pair(_heads_first(2, 2, 7, 6), dtype)
    cos, sin = _tables(7, 6, dtype)  # in q's dtype, as Llama casts them
    dq = torch.randn(2, 6, 7, 6, dtype=dtype, device=DEVICE).transpose(1, 2)  # not contiguous
    dk = torch.randn(2, 7, 2, 6, dtype=dtype, device=DEVICE)

    with launched(FORWARD, BACKWARD):
        q_rot, k_rot = rope(q, k, cos, sin)
        ((q_rot * dq).sum() + (k_rot * dk).sum()).backward()
    q_expected, k_expected = _reference(q_ref, cos, sin), _reference(k_ref, cos, sin)
    ((q_expected * dq.double()).sum() + (k_expected * dk.double()).sum()).backward()

    assert q_rot.is_contiguous() and k_rot.is_contiguous()
    assert_matches(q_rot, q_expected, dtype)
    assert_matches(k_rot, k_expected, dtype)
    assert_matches(q.grad, q_ref.grad, dtype)
    assert_matches(k.grad, k_ref.grad, dtype)


def test_bf16_q_and_k_with_fp32_tables_are_rotated_in_fp32_and_keep_their_dtype():
    torch.manual_seed(1)
    q, q_ref = leaf_pair(torch.randn(1, 9, 3, 16), torch.bfloat16)
    k, k_ref = leaf_pair(torch.randn(1, 9, 1, 16), torch.bfloat16)
    cos, sin = _tables(9, 16, torch.float32)
    dq = torch.randn(1, 9, 3, 16, dtype=torch.bfloat16, device=DEVICE)
    dk = torch.randn(1, 9, 1, 16, dtype=torch.bfloat16, device=DEVICE)

    with launched(FORWARD, BACKWARD):
        q_rot, k_rot = rope(q, k, cos, sin)
        torch.autograd.backward((q_rot, k_rot), (dq, dk))
    q_expected, k_expected = _reference(q_ref, cos, sin), _reference(k_ref, cos, sin)
    torch.autograd.backward((q_expected, k_expected), (dq.double(), dk.double()))

    assert_matches(q_rot, q_expected, torch.bfloat16)
    assert_matches(k_rot, k_expected, torch.bfloat16)
    assert_matches(q.grad, q_ref.grad, torch.bfloat16)
    assert_matches(k.grad, k_ref.grad, torch.bfloat16)


def test_tables_whose_halves_differ_get_the_transposed_rotation_as_gradient():
    # Llama's halves agree, making the backward a rotation by -sin; the formula holds for any table, and so must
    # the kernel: random cos and sin, D = 10 (halves of 5).
    torch.manual_seed(2)
    q, q_ref = leaf_pair(torch.randn(2, 5, 3, 10), torch.float32)
    k, k_ref = leaf_pair(torch.randn(2, 5, 3, 10), torch.float32)
    cos, sin = torch.randn(5, 10, device=DEVICE), torch.randn(5, 10, device=DEVICE)

    with launched(FORWARD, BACKWARD):
        q_rot, k_rot = rope(q, k, cos, sin)
        (q_rot.square().sum() + 3 * k_rot.sum()).backward()  # k's upstream gradient is expanded (strides 0)
    q_expected, k_expected = _reference(q_ref, cos, sin), _reference(k_ref, cos, sin)
    (q_expected.square().sum() + 3 * k_expected.sum()).backward()

    for actual, expected in ((q_rot, q_expected), (k_rot, k_expected), (q.grad, q_ref.grad), (k.grad, k_ref.grad)):
        assert_matches(actual, expected, torch.float32)


@pytest.mark.parametrize("batch_of_tables", [1, 2], ids=["(1, T, D) tables", "(B, T, D) tables"])
def test_tables_per_sequence_rotate_each_sequence_by_its_own_positions(batch_of_tables):
    torch.manual_seed(3)
    q, q_ref = leaf_pair(torch.randn(2, 4, 2, 8), torch.float32)
    k, k_ref = leaf_pair(torch.randn(2, 4, 1, 8), torch.float32)
    positions = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])[:batch_of_tables]  # a second, shifted sequence
    cos_all, sin_all = _tables(9, 8)
    cos, sin = cos_all[positions], sin_all[positions]

    with launched(FORWARD, BACKWARD):
        q_rot, k_rot = rope(q, k, cos, sin)
        (q_rot.square().sum() + k_rot.square().sum()).backward()
    # (B, T, D) tables broadcast over the heads as (B, T, 1, D).
    q_expected, k_expected = _reference(q_ref, cos, sin), _reference(k_ref, cos, sin)
    (q_expected.square().sum() + k_expected.square().sum()).backward()

    for actual, expected in ((q_rot, q_expected), (k_rot, k_expected), (q.grad, q_ref.grad), (k.grad, k_ref.grad)):
        assert_matches(actual, expected, torch.float32)


def test_a_key_output_left_unused_gives_keys_a_zero_gradient():
    torch.manual_seed(4)
    q, q_ref = leaf_pair(torch.randn(1, 3, 2, 4), torch.float32)
    k = torch.randn(1, 3, 2, 4, device=DEVICE, requires_grad=True)
    cos, sin = _tables(3, 4)

    with launched(FORWARD, BACKWARD):
        q_rot, _ = rope(q, k, cos, sin)
        q_rot.sum().backward()
    _reference(q_ref, cos, sin).sum().backward()

    assert_matches(q.grad, q_ref.grad, torch.float32)
    assert torch.equal(k.grad, torch.zeros_like(k))


def test_bad_arguments_are_refused_saying_what_fits():
    q, k = torch.randn(1, 3, 2, 4, device=DEVICE), torch.randn(1, 3, 1, 4, device=DEVICE)
    cos, sin = _tables(3, 4)
    with pytest.raises(ValueError, match=r"\(B, T, H, D\)"):
        rope(q, k[:, :2], cos, sin)
    with pytest.raises(ValueError, match="even D"):
        rope(q[..., :3], k[..., :3], cos[:, :3], sin[:, :3])
    with pytest.raises(ValueError, match=r"cos\[:T\]"):
        rope(q, k, *_tables(5, 4))
    with pytest.raises(ValueError, match="cos.detach"):
        rope(q, k, cos.requires_grad_(), sin)
    with pytest.raises(TypeError, match=r"got a torch\.float64 tensor.*float32, bfloat16 and float16"):
        rope(q.double(), k, cos.detach(), sin)


def test_opcheck_passes_for_rope_and_its_backward():
    torch.manual_seed(5)
    cos, sin = _tables(3, 6)
    cases = [
        (torch.ops.fabriclite.rope, (_heads_first(2, 3, 3, 6).requires_grad_(), torch.randn(2, 3, 1, 6), cos, sin)),
        (torch.ops.fabriclite.rope_backward, (_heads_first(2, 3, 3, 6), torch.randn(2, 3, 1, 6), cos, sin)),
    ]
    with launched(FORWARD, BACKWARD):
        for op, args in cases:
            args = tuple(arg.to(DEVICE) for arg in args)
            results = torch.library.opcheck(op, args, raise_exception=False)
            assert results == dict.fromkeys(results, "SUCCESS"), results


def _attention_scores(q, k, cos, sin):
    q_rot, k_rot = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (B, H, T, D) in, (B, T, H, D) out
    return torch.einsum("bthd,bshd->bhts", q_rot, k_rot.repeat_interleave(2, dim=2)).square().sum()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_traces_rope_into_one_graph_with_its_backward(backend):
    torch.manual_seed(6)
    q = torch.randn(2, 4, 5, 6, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 2, 5, 6, device=DEVICE, requires_grad=True)
    cos, sin = _tables(5, 6)
    expected = _attention_scores(q, k, cos, sin)
    expected_grads = torch.autograd.grad(expected, (q, k))

    torch._dynamo.reset()
    compiled = torch.compile(_attention_scores, backend=backend, fullgraph=True)  # a graph break raises here
    with launched(FORWARD, BACKWARD):
        loss = compiled(q, k, cos, sin)
        grads = torch.autograd.grad(loss, (q, k))

    torch.testing.assert_close(loss, expected)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad)
