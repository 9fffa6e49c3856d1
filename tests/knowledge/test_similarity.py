from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from egeria import sp_loss


def oracle_sp(a: np.ndarray, b: np.ndarray) -> float:
    """Tung & Mori's SP loss written out in numpy, independently of the library."""
    n = a.shape[0]
    fa, fb = a.reshape(n, -1).astype(np.float64), b.reshape(n, -1).astype(np.float64)
    ga, gb = fa @ fa.T, fb @ fb.T
    ga /= np.linalg.norm(ga, axis=1, keepdims=True)
    gb /= np.linalg.norm(gb, axis=1, keepdims=True)
    return float(((ga - gb) ** 2).sum() / n**2)


@pytest.mark.parametrize("shape_a,shape_b", [((8, 4, 5, 5), (8, 4, 5, 5)), ((6, 10), (6, 3, 7)), ((16, 35, 32), (16, 35, 32))])
def test_sp_loss_matches_oracle_formula(shape_a, shape_b):
    a, b = torch.randn(shape_a), torch.randn(shape_b)
    assert_close(sp_loss(a, b).item(), oracle_sp(a.numpy(), b.numpy()), rtol=1e-4, atol=1e-7)


def test_sp_loss_is_zero_for_identical_inputs_and_positive_otherwise():
    a = torch.randn(8, 3, 4, 4)
    assert sp_loss(a, a.clone()).item() == pytest.approx(0.0, abs=1e-7)
    assert sp_loss(a, torch.randn(8, 3, 4, 4)).item() > 1e-3


def test_sp_loss_ignores_activation_scale_and_computes_in_fp32():
    a = torch.randn(8, 20)
    assert sp_loss(a, 3.0 * a).item() == pytest.approx(0.0, abs=1e-7)
    loss = sp_loss(a.bfloat16(), torch.randn(8, 20).half())
    assert loss.dtype == torch.float32


def test_sp_loss_rejects_different_batch_sizes():
    with pytest.raises(ValueError, match="batch sizes differ: 4 and 5"):
        sp_loss(torch.randn(4, 3), torch.randn(5, 3))
