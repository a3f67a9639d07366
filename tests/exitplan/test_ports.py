"""Free ports for the servers exitplan starts: below the kernel's ephemeral range, never handed out twice."""

from __future__ import annotations

import socket

import pytest

from exitplan import ports
from exitplan.ports import LOWEST, ephemeral_low, free_port, port_is_free


def test_free_ports_lie_below_the_ephemeral_range_and_bind() -> None:
    drawn = [free_port() for _ in range(50)]
    assert len(set(drawn)) == 50
    assert all(LOWEST <= p < ephemeral_low() for p in drawn)
    with socket.socket() as s:
        s.bind(("127.0.0.1", drawn[0]))


def test_a_bound_port_is_not_free_and_an_ephemeral_one_never_drawn() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert not port_is_free(taken)
        assert taken >= ephemeral_low()  # what bind(0) hands out: the range free_port stays out of


def test_an_unreadable_range_falls_back_to_linux_default(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "missing")
    assert ephemeral_low() == 32768
    (tmp_path / "range").write_text("40000\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "range")
    assert ephemeral_low() == 40000
