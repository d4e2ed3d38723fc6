"""A Ray address that points nowhere (a cluster that stopped without `ray stop` leaves its
address file; a stale RAY_ADDRESS) is a prompt, clear error, not minutes of ray.init retries; a Ray
nothing points to (another program's own) is never joined."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from cluster import _check_reachable


def _closed_port() -> int:
    with socket.socket() as s:  # bound and closed again: nothing listens there now
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_nothing_answers_at_is_refused_naming_it_and_its_source(monkeypatch):
    port = _closed_port()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port} \\(from the address given\\) does not answer"):
        _check_reachable(f"127.0.0.1:{port}")
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(ConnectionError, match=f"{port} \\(from RAY_ADDRESS\\) does not answer.*address local"):
        _check_reachable("auto")


def test_a_listening_address_and_ray_client_addresses_pass():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        _check_reachable(f"127.0.0.1:{s.getsockname()[1]}")
    _check_reachable(f"ray://127.0.0.1:{_closed_port()}")  # Ray Client: ray.init connects and reports
    if socket.has_ipv6:
        try:
            s6 = socket.create_server(("::1", 0), family=socket.AF_INET6)
        except OSError:  # no IPv6 loopback here
            return
        with s6:
            _check_reachable(f"[::1]:{s6.getsockname()[1]}")


def test_raylm_serve_at_a_dead_address_exits_2_at_once_with_the_reason():
    port = _closed_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "serve", "--address", f"127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"raylm: error: the Ray cluster at 127.0.0.1:{port} (from the address given) does not answer" in proc.stderr
    assert time.monotonic() - t0 < 60  # ray.init alone retries such an address for minutes


@pytest.mark.ray
def test_with_no_address_a_stale_one_is_skipped_for_a_ray_of_our_own():
    """cluster.launch()'s way in (no address): a stale RAY_ADDRESS is reported and a local Ray started."""
    code = ("import cluster, ray; assert cluster.ensure_ray(); "
            "print('nodes', len(ray.nodes())); ray.shutdown()")
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{_closed_port()}"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nodes 1" in proc.stdout
    assert "does not answer" in proc.stderr and "starting a Ray of this process's own" in proc.stderr


@pytest.mark.ray
def test_joining_a_running_ray_says_which_and_how_it_was_found(ray_session):
    """A process that finds a Ray through RAY_ADDRESS joins it, warning where it is and how it was found, and
    that address='local' keeps to a private one; with address='local' it starts its own."""
    address = ray_session.get_runtime_context().gcs_address
    code = ("import logging, cluster, ray; logging.basicConfig(); assert cluster.ensure_ray(); "
            "print('joined', ray.get_runtime_context().gcs_address); ray.shutdown(); "
            "assert cluster.ensure_ray('local'); print('private', ray.get_runtime_context().gcs_address); "
            "ray.shutdown()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "RAY_ADDRESS": address})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"joined {address}" in proc.stdout and f"private {address}" not in proc.stdout
    assert f"joined the running Ray at {address} (from RAY_ADDRESS)" in proc.stderr
    assert "address='local'" in proc.stderr


@pytest.mark.ray
def test_workers_that_cannot_be_placed_fail_in_bounded_time_saying_what_they_asked_for(ray_session, caplog):
    import cluster

    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:  # 64 threads each: more CPUs than this Ray has
        cluster.launch(threads_per_worker=64, placement_timeout_s=7)
    elapsed = time.monotonic() - t0
    message = str(e.value)
    assert "could not place replica 0 within 7 s" in message and "CPU: asks 64, free" in message
    assert "address='local'" in message and ray_session.get_runtime_context().gcs_address in message
    assert any("waiting up to 7 s to place replica 0" in r.getMessage() for r in caplog.records)
    assert elapsed < 60


@pytest.mark.ray
def test_a_ray_nothing_points_to_is_not_joined(ray_session, tmp_path):
    """This test's own Ray runs (ray.init, no `ray start`): a process with no address, no RAY_ADDRESS and
    no address file starts a private Ray instead of joining it, and says so."""
    address = ray_session.get_runtime_context().gcs_address
    code = ("import logging, ray, ray._private.utils as u, cluster; logging.basicConfig(level=logging.INFO); "
            f"u.get_ray_address_file = lambda temp_dir=None: {str(tmp_path / 'no_such_file')!r}; "
            "assert cluster.ensure_ray(); print('at', ray.get_runtime_context().gcs_address); ray.shutdown()")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "at " in proc.stdout and f"at {address}" not in proc.stdout
    assert ("no Ray pointed to (RAY_ADDRESS, `ray start`'s address file); started one of this process's own"
            in proc.stderr)
