"""HTTP Range headers of object reads (the one part of a read that is HTTP's, kept out of the core)."""

from __future__ import annotations

import re

from services.registry.errors import BadRange


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """One `bytes=a-b`, `bytes=a-` or `bytes=-n` range → [start, end); None for the whole object."""
    if header is None:
        return None
    match = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)
    if not match or match.group(1) == match.group(2) == "":
        raise BadRange(f"unsupported Range {header!r}: one bytes=start-end range is served", size)
    first, last = match.groups()
    if first == "":
        start, end = max(0, size - int(last)), size
    else:
        start = int(first)
        end = min(size, int(last) + 1) if last else size
    if start >= size or start >= end:
        raise BadRange(f"Range {header!r} is outside the object of {size} bytes", size)
    return start, end
