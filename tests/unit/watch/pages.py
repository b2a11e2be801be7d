"""Checks on the HTML pages watch writes (watch/report.py), shared by the watch tests."""

from __future__ import annotations

import re

_NETWORK = re.compile(r"""(?:src|href)\s*=\s*["'](?!data:|#)""", re.I)


def network_references(page: str) -> list[str]:
    """Attributes of ``page`` that would load something (anything not ``data:`` or ``#``): a
    report must open offline, from a copy sent by mail."""
    return [page[m.start(): m.start() + 80] for m in _NETWORK.finditer(page)]
