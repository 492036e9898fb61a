"""Small helpers shared by the GRPO actors (process set-up, device, timing)."""

from __future__ import annotations

import os
import time

import torch


def setup_process(threads: int = 1) -> None:
    """Each actor process gets ``threads`` intra-op threads: 7+ processes share a few cores."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars, once per actor
    except Exception:  # noqa: BLE001
        pass
    try:
        torch.set_num_threads(max(1, threads))
    except Exception:  # noqa: BLE001
        pass


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rank_of() -> int:
    """Flat rank of the calling actor in its mesh."""
    from monarch.actor import context

    r = context().actor_instance.rank
    return int(getattr(r, "rank", 0))


class Idle:
    """Time between the end of one unit of work and the start of the next (actor idle time)."""

    def __init__(self) -> None:
        self.last_end: float | None = None

    def start(self) -> float:
        now = time.perf_counter()
        idle = 0.0 if self.last_end is None else now - self.last_end
        return idle

    def end(self) -> None:
        self.last_end = time.perf_counter()


def pad(rows: list[list[int]], value: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(r) for r in rows)
    x = torch.full((len(rows), n), value, dtype=torch.long)
    m = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        x[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        m[i, : len(r)] = 1
    return x, m


def token_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int,
                   with_entropy: bool = False):
    """Per-token log-probabilities of each completion given its prompt (right-padded batch).

    Returns (logprobs [B, T], mask [B, T]) over completion positions, plus the per-token entropy
    [B, T] when ``with_entropy``."""
    dev = next(model.parameters()).device
    rows = [p + c for p, c in zip(prompt_ids, completion_ids)]
    x, m = pad(rows, pad_id)
    x, m = x.to(dev), m.to(dev)
    logits = model(input_ids=x, attention_mask=m).logits[:, :-1].float()
    logp_all = torch.log_softmax(logits, dim=-1)
    tgt = x[:, 1:]
    lp = logp_all.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    T = max(len(c) for c in completion_ids)
    B = len(rows)
    out = torch.zeros((B, T), device=dev)
    mask = torch.zeros((B, T), device=dev)
    ent = torch.zeros((B, T), device=dev) if with_entropy else None
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        s = len(p) - 1  # logits at position s predict token s+1 = first completion token
        out[i, : len(c)] = lp[i, s: s + len(c)]
        mask[i, : len(c)] = 1
        if with_entropy:
            la = logp_all[i, s: s + len(c)]
            ent[i, : len(c)] = -(la.exp() * la).sum(-1)
    if with_entropy:
        return out, mask, ent
    return out, mask
