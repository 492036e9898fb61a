"""The GRPO loss, as in torchforge's GRPO: a policy-gradient term weighted by the group-normalised
advantage, and a KL penalty to the frozen reference model.

    >>> import torch
    >>> lp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    >>> mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # the second completion has one token
    >>> loss = grpo_loss(lp, lp.detach(), torch.tensor([2.0, -1.0]), mask, kl_beta=0.1)
    >>> float(loss.detach())  # policy = reference: no KL; the ratio is 1 in value: -mean(advantages)
    -0.5
    >>> loss.backward(); lp.grad  # d loss / d logp = -advantage / (tokens of the sequence * batch)
    tensor([[-0.5000, -0.5000],
            [ 0.5000,  0.0000]])
"""

from __future__ import annotations

import torch


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): ``exp(ref - logp) - (ref - logp) - 1``
    (non-negative, unbiased for samples of the policy)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def grpo_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              kl_beta: float) -> torch.Tensor:
    """The GRPO loss of a batch of completions (scalar; differentiable in ``logprobs``).

    Per completion token t of sequence i, with A_i its advantage and logp its log-probability
    under the policy (ref: under the reference model)::

        ratio  = exp(logp - stop_grad(logp))                # 1 in value, the policy gradient in grad
        kl     = exp(ref - logp) - (ref - logp) - 1         # k3 estimator of KL(policy || reference)
        l[i,t] = -(ratio * A_i - kl_beta * kl)
        loss   = mean_i( sum_t mask[i,t] * l[i,t] / max(1, sum_t mask[i,t]) )

    ``logprobs``, ``ref_logprobs`` and ``mask`` are [B, T] (mask 1 on completion tokens, 0 on
    padding); ``advantages`` is [B]."""
    kl = k3_kl(logprobs, ref_logprobs)
    per_token = -(torch.exp(logprobs - logprobs.detach()) * advantages.unsqueeze(1) - kl_beta * kl)
    lengths = mask.sum(1).clamp(min=1)
    return ((per_token * mask).sum(1) / lengths).mean()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (every token of the batch alike)."""
    return (x * mask).sum() / mask.sum()
