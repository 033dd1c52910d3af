"""tools/bench.py's full-vocabulary log-probs and entropy (its --logprobs baseline, the path before
rollout's chunked head) against naive float64 ones."""
import pytest
import torch

from tools import bench

def test_token_logprobs_chunked_and_differentiable():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 4, 11, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 11, (5, 4), generator=g)
    expect = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    for chunk in (1, 2, 3, 5, 8):  # 2 and 3 do not divide B = 5
        got = bench.token_logprobs(logits, targets, chunk=chunk)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expect.float())
    w = torch.randn(5, 4, generator=g, dtype=torch.float64)
    g1, = torch.autograd.grad((expect * w).sum(), logits)
    g2, = torch.autograd.grad((bench.token_logprobs(logits, targets, chunk=2).double() * w).sum(), logits)
    torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-6)
    # a non-contiguous bf16 slice, as a model's logits[:, :-1] would be
    half = torch.randn(3, 6, 11, generator=g).bfloat16()[:, :-1]
    tgt = torch.randint(0, 11, (3, 5), generator=g)
    torch.testing.assert_close(bench.token_logprobs(half, tgt, chunk=2),
                               half.float().log_softmax(-1).gather(-1, tgt[..., None])[..., 0])


def test_entropy_against_naive():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 3, 13, generator=g) * 3
    p = logits.double().softmax(-1)
    ent = bench.token_entropy(logits, chunk=2).double()
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert bench.token_entropy(logits).shape == (5, 3)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="targets"):
        bench.token_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="logits"):
        bench.token_entropy(torch.zeros(2, 3))
