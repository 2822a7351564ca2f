"""Fixtures of the proxy's tests."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.proxy import bodies


@pytest.fixture
def whole_reads(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The bodies ``appliance.proxy.bodies`` reads whole from now on, in order (every body,
    however short, remembered as a conversation's head)."""
    read: list[bytes] = []
    parse_body = bodies.parse_body

    def counted(raw: bytes) -> dict[str, Any]:
        read.append(raw)
        return parse_body(raw)

    monkeypatch.setattr(bodies, "parse_body", counted)
    monkeypatch.setattr(bodies, "SMALL_BODY", 0)
    return read
