"""GPU checks (run on a CUDA host: python -m pytest -m gpu). Flex attention with the block mask
must agree with SDPA on the dense mask, forward and backward."""

from __future__ import annotations

import pytest
import torch

from dflash.attention import BlockLayout, attend, dense_block_mask, flex_block_mask

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_flex_matches_dense_sdpa(dtype, tol):
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    torch.manual_seed(0)
    b, s, n, bs, hq, hkv, d = 2, 300, 24, 16, 8, 2, 64
    anchors = torch.stack([torch.randperm(s - 2)[:n].sort().values for _ in range(b)]).cuda()
    valid = torch.ones(b, n, dtype=torch.bool, device="cuda")
    valid[1, -5:] = False  # padding blocks
    layout = BlockLayout(anchors, valid, s, bs)
    q = torch.randn(b, hq, n * bs, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, s + n * bs, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, s + n * bs, d, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn(b, hq, n * bs, d, device="cuda", dtype=dtype)

    def run(mask):
        for t in (q, k, v):
            t.grad = None
        out = attend(q, k, v, mask)
        out.backward(grad)
        return out.detach().float(), [t.grad.float() for t in (q, k, v)]

    dense_out, dense_grads = run(dense_block_mask(layout))
    flex_out, flex_grads = run(flex_block_mask(layout, n * bs))
    real = valid.repeat_interleave(bs, dim=1)[:, None, :, None]
    torch.testing.assert_close(flex_out * real, dense_out * real, rtol=tol, atol=tol)
    for a, b_ in zip(flex_grads, dense_grads):
        torch.testing.assert_close(a, b_, rtol=tol, atol=tol * 10)
