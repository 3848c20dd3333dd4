"""Seeded byte-level mutations of a GGUF file, shared by the reader fuzzer (tests/test_fuzz.py) and
the load fuzzer (tests/load_fuzz.py)."""
from __future__ import annotations

import random
from typing import Callable, Optional, Sequence


def mutate(raw: bytes, header_end: int, rng: random.Random, *, kinds: Sequence[str], widths: Sequence[int],
           smash: Sequence[int], extra: Optional[dict[str, Callable[[bytearray], tuple[bytes, str]]]] = None
           ) -> tuple[bytes, str]:
    """One mutation of ``raw`` drawn from ``kinds`` ("byte", "bits", "int", "truncate", "insert",
    "delete", or a key of ``extra``); 90% of positions fall in the header (``[0, header_end)``).

    "int" overwrites a little-endian integer of a width from ``widths`` with a value from ``smash``
    or a random one. Returns ``(mutated bytes, a label saying what was done)``.
    """
    buf = bytearray(raw)
    kind = rng.choice(list(kinds))
    hot = lambda: rng.randrange(header_end) if rng.random() < 0.9 else rng.randrange(len(buf))  # noqa: E731
    if extra and kind in extra:
        return extra[kind](buf)
    if kind == "byte":
        spots = [hot() for _ in range(rng.randint(1, 4))]
        for i in spots:
            buf[i] = rng.randrange(256)
        return bytes(buf), f"byte@{spots}"
    if kind == "bits":
        i = hot()
        buf[i] ^= 1 << rng.randrange(8)
        return bytes(buf), f"bitflip@{i}"
    if kind == "int":
        i = hot()
        width = rng.choice(list(widths))
        v = rng.choice(list(smash) + [rng.randrange(2 ** (8 * width))]) % 2 ** (8 * width)
        buf[i: i + width] = v.to_bytes(width, "little")
        return bytes(buf[: len(raw)]), f"u{8 * width}={v}@{i}"
    if kind == "truncate":
        n = rng.randrange(len(raw))
        return bytes(buf[:n]), f"truncate@{n}"
    i, n = hot(), rng.randint(1, 16)
    if kind == "insert":
        buf[i:i] = bytes(rng.randrange(256) for _ in range(n))
        return bytes(buf), f"insert{n}@{i}"
    del buf[i: i + n]
    return bytes(buf), f"delete{n}@{i}"
