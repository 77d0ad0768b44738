"""Engine release numbers, compared without importing the engine (or ``packaging``)."""

from __future__ import annotations

__all__ = ["release_tuple"]


def release_tuple(version: str, length: int) -> tuple[int, ...] | None:
    """The first ``length`` numbers of ``version`` (missing ones are 0; letters after a number,
    as in ``34rc1``, are dropped), or ``None`` when it has no major.minor."""
    parts = version.split(".")
    if len(parts) < 2:
        return None
    parts += ["0"] * (length - len(parts))
    try:
        numbers = [int(parts[0])]
        numbers += [
            int("".join(ch for ch in part if ch.isdigit()) or "x") for part in parts[1:length]
        ]
    except ValueError:
        return None
    return tuple(numbers)
