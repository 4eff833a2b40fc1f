"""``ckptstore.testing.ports.free_port``: ports that outgoing connections never take."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ckptstore.errors import CkptError
from ckptstore.testing import ports


def test_a_port_is_below_the_ephemeral_range_and_bindable() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picked = {ports.free_port() for _ in range(20)}
    assert all(10_000 <= p < low for p in picked)
    assert len(picked) > 1  # random, so two pickers rarely meet
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", picked.pop()))


def test_connections_do_not_take_the_picked_port() -> None:
    # What went wrong with port 0: the kernel hands the same range to outgoing connections.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        target = server.getsockname()
        port = ports.free_port()
        clients = [socket.create_connection(target) for _ in range(50)]
        try:
            assert port not in {c.getsockname()[1] for c in clients}
        finally:
            for c in clients:
                c.close()


def test_a_taken_port_is_skipped_and_all_taken_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import random

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy: int = taken.getsockname()[1]
        first = [busy, busy]

        class BusyFirst:
            """Picks the taken port twice, then anything."""

            def randrange(self, lo: int, hi: int) -> int:
                return first.pop() if first else random.randrange(lo, hi)

        class AlwaysBusy:
            def randrange(self, lo: int, hi: int) -> int:
                return busy

        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65_535)
        monkeypatch.setattr(ports.random, "SystemRandom", BusyFirst)
        assert ports.free_port() != busy
        assert not first
        monkeypatch.setattr(ports.random, "SystemRandom", AlwaysBusy)
        with pytest.raises(CkptError, match="none of 3 random ports"):
            ports.free_port(attempts=3)


def test_no_room_below_the_ephemeral_range_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 9_000)
    with pytest.raises(CkptError, match="ephemeral range"):
        ports.free_port()
