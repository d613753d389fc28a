"""The batch loop of the batched stages (``ar_encoder``, ``diffusion``).

Each request is parsed alone, so a bad one fails alone; the valid ones run
together; every request gets one response, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

P = TypeVar("P")  # a parsed request
R = TypeVar("R")  # a result


def run_batch(requests: Sequence[Any], parse: Callable[[Any], P],
              run: Callable[[list[int], list[P]], Sequence[R | Exception]]) -> list[R | Exception]:
    """``parse(request)`` raises for a bad request; ``run(indices, parsed)``
    gets the valid ones (and their positions in ``requests``) and returns one
    result or exception each. The list holds a result or an exception per request."""
    results: list[R | Exception | None] = [None] * len(requests)
    valid: dict[int, P] = {}
    for i, request in enumerate(requests):
        try:
            valid[i] = parse(request)
        except Exception as exc:
            results[i] = exc
    if valid:
        for i, result in zip(valid, run(list(valid), list(valid.values())), strict=True):
            results[i] = result
    return results  # type: ignore[return-value] - every slot is filled above
