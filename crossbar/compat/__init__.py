"""The one place for each library whose private names crossbar touches.

One module per library (:mod:`crossbar.compat.twisted`, ...), each with the versions it
was checked against (the same bound as ``pyproject.toml``'s), a start-up check that
falls back to the library's own behaviour when its internals are not as expected, and a
test (``tests/test_compat_*.py``) that names what moved. The bottom floor of the
package: the wings import it; it imports none of them.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from typing import Callable

__all__ = ["Range", "distribution_check", "start_up_check", "within"]

Range = tuple[tuple[int, int], tuple[int, int]]
"""The oldest and the newest (major, minor) of a library a fence was checked against."""


def within(checked: Range, major: int, minor: int) -> bool:
    """Whether ``major.minor`` is within ``checked`` (compared as numbers: 26.1 is older
    than 26.10), both ends included."""
    return checked[0] <= (major, minor) <= checked[1]


def start_up_check(library: str, installed: str, checked: Range, moved: Callable[[], list[str]]) -> str | None:
    """A fence's start-up check: None when ``library`` ``installed`` (its version text)
    is within ``checked`` and ``moved()`` finds every private name as expected; else one
    line saying why its touchpoints must do what the library itself does."""
    found = re.match(r"(\d+)\.(\d+)", installed)
    if found is None or not within(checked, int(found[1]), int(found[2])):
        (low_major, low_minor), (high_major, high_minor) = checked
        return (f"{library} {installed} is outside the range crossbar's touchpoints were checked against"
                f" ({low_major}.{low_minor} to {high_major}.{high_minor})")
    try:
        gone = moved()
    except Exception as e:  # an internal so changed that probing it fails
        gone = [f"probing failed: {e!r}"]
    return f"{library} {installed} moved what crossbar relies on: {'; '.join(gone)}" if gone else None


def distribution_check(distribution: str, checked: Range, moved: Callable[[], list[str]]) -> str | None:
    """:func:`start_up_check` for the installed ``distribution`` (its version read from
    its metadata; an unknown version fails the check)."""
    try:
        installed = version(distribution)
    except PackageNotFoundError:
        return f"{distribution}'s version is unknown"
    return start_up_check(distribution, installed, checked, moved)
