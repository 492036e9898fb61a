"""The verifiable task: two-number addition, answered as digits then end-of-text.

    >>> from apps.grpo.task import make_prompts, score
    >>> make_prompts(2, seed=0)
    [Problem(prompt='6+6=', answer=12), Problem(prompt='0+4=', answer=4)]
    >>> [round(score(s, 12), 2) for s in ("12", "13", "20", "x")]
    [1.0, 0.42, 0.1, 0.0]

The reward is checked by code: 1.0 for the exact sum, a well-formed wrong number gets 0.1 plus
up to 0.4 the closer it is (within 5), anything else 0.0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

MAX_OPERAND = 9


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: int


def problem(a: int, b: int) -> Problem:
    return Problem(f"{a}+{b}=", a + b)


def make_prompts(n: int, seed: int | None = None, rng: random.Random | None = None) -> list[Problem]:
    r = rng or random.Random(seed)
    return [problem(r.randint(0, MAX_OPERAND), r.randint(0, MAX_OPERAND)) for _ in range(n)]


def sft_corpus(n: int, seed: int = 1234) -> list[str]:
    """Supervised warm-start text: ``"a+b=c"`` lines (the tokenizer adds end-of-text)."""
    return [p.prompt + str(p.answer) for p in make_prompts(n, seed=seed)]


def parse(completion: str) -> int | None:
    s = completion.strip()
    if not s or not s.isdigit() or len(s) > 4:
        return None
    return int(s)


def score(completion: str, answer: int) -> float:
    got = parse(completion)
    if got is None:
        return 0.0
    if got == answer:
        return 1.0
    return 0.1 + 0.4 * max(0.0, 1.0 - abs(got - answer) / 5.0)  # closer is better
