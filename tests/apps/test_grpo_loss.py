"""The GRPO app's loss (apps/grpo/loss.py) against its docstring's formula, token by token, and
the docstring examples of the app's modules that have them."""

from __future__ import annotations

import doctest
import importlib
import math

import pytest
import torch

from apps.grpo.loss import grpo_loss, k3_kl


def formula(lp: list[list[float]], ref: list[list[float]], adv: list[float], lens: list[int], beta: float) -> float:
    """The docstring's formula, written out per token."""
    per_seq = []
    for i, n in enumerate(lens):
        total = 0.0
        for t in range(n):
            d = ref[i][t] - lp[i][t]
            total += -(1.0 * adv[i] - beta * (math.exp(d) - d - 1))
        per_seq.append(total / max(1, n))
    return sum(per_seq) / len(per_seq)


def test_grpo_loss_is_the_formula_and_its_gradient_the_policy_gradient():
    g = torch.Generator().manual_seed(0)
    lens = [3, 1, 4, 2]
    lp = -torch.rand(4, 4, generator=g) * 3
    ref = -torch.rand(4, 4, generator=g) * 3
    adv = torch.randn(4, generator=g)
    mask = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in lens])
    lp_var = lp.clone().requires_grad_(True)
    loss = grpo_loss(lp_var, ref, adv, mask, kl_beta=0.1)
    assert float(loss.detach()) == pytest.approx(formula(lp.tolist(), ref.tolist(), adv.tolist(), lens, 0.1), rel=1e-5)
    loss.backward()
    # d/dlogp of -(ratio * A - beta * kl) is -A - beta * (exp(ref - logp) - 1), per token, / (len * batch)
    want = (-adv.unsqueeze(1) - 0.1 * (torch.exp(ref - lp) - 1)) * mask / (mask.sum(1, keepdim=True) * 4)
    assert torch.allclose(lp_var.grad, want, atol=1e-6)
    assert bool((k3_kl(lp, ref) >= 0).all())  # the k3 estimator is never negative


@pytest.mark.parametrize("name", ["apps.grpo.loss", "apps.grpo.faults", "apps.grpo.workers", "apps.grpo.task"])
def test_module_examples(name):
    res = doctest.testmod(importlib.import_module(name))
    assert res.attempted > 0 and res.failed == 0, res
