"""`ray up` for real: deploy/ascend-cluster.yaml, with deploy/loopback-overlay.yaml, on two
loopback "nodes" of this machine reached through an sshd of the test's own; then
`raylm serve` on the head through `ray exec`, a completion from here, `ray down`.

Run with `make test-deploy` (`pytest -m deploy`; plain `pytest` leaves these out, see
tests/conftest.py). Needs root and apt (openssh-server and rsync are installed once if
missing) and `unshare`; skips, saying why, where they are not there. It starts only
loopback services and stops them itself (loopback_sshd.py): the nodes' processes live in
sshd's PID namespace and end with it, the launcher's carry the test's RAY_TMPDIR and are
killed by pid, and the teardown fails if any is left. Nothing is written to /tmp/ray, so
no later `ray.init()` on this machine can find this cluster; what `ray up` writes to the
SSH user's home is removed.
"""

from __future__ import annotations

import copy
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from . import loopback_sshd as sshd_mod

pytestmark = pytest.mark.deploy

CHECKOUT = Path(__file__).resolve().parents[2]
BASE_YAML = CHECKOUT / "deploy" / "ascend-cluster.yaml"
OVERLAY = CHECKOUT / "deploy" / "loopback-overlay.yaml"
BIN = Path(sys.executable).parent  # the venv running the tests: the checkout's .venv under make
HOME_FILES = [Path.home() / "ray_bootstrap_config.yaml", Path.home() / "ray_bootstrap_key.pem"]
DEFAULT_ADDRESS_FILE = Path("/tmp/ray/ray_current_cluster")  # where a plain ray.init() looks
RAYLET_STARTUP_TIMEOUT = "The current node timed out during startup"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))  # Ray's GCS listens on every interface, so the port must be free on all
        return s.getsockname()[1]


@dataclass
class Loopback:
    dir: Path
    ray_tmpdir: Path
    key: Path
    wrong_key: Path
    env: dict
    sshd: sshd_mod.LoopbackSshd

    def render(self, name: str, **sets: str) -> tuple[Path, dict, dict]:
        """The user's render step (deploy/overlay.py), with free ports: (path, config, values)."""
        values = dict(cluster_name=f"raylm-loopback-{name}-{uuid.uuid4().hex[:6]}", ssh_user="root",
                      ssh_key=str(self.key), venv=sys.prefix, gcs_port=free_port(), dashboard_port=free_port(),
                      client_port=free_port())
        for node in ("head", "worker"):
            for port in ("agent_port", "agent_grpc_port", "metrics_port", "runtime_env_port"):
                values[f"{node}_{port}"] = free_port()
        values.update(sets)
        out = self.dir / f"{name}.yaml"
        cmd = [sys.executable, str(CHECKOUT / "deploy" / "overlay.py"), str(BASE_YAML), str(OVERLAY), "-o", str(out)]
        for k, v in values.items():
            cmd += ["--set", f"{k}={v}"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        return out, yaml.safe_load(out.read_text()), values

    def monitor_logs(self, n: int = 3000) -> str:
        """The autoscaler's (it starts the workers) and raylet / GCS logs, for a failure message."""
        out = ""
        for path in sorted(glob.glob(f"{self.ray_tmpdir}/ray/session_*/logs/*")):
            if not any(w in path for w in ("monitor.", "raylet.", "gcs_server.")):
                continue
            text = Path(path).read_text(errors="replace")
            if text.strip():
                out += f"\n--- {path}\n{text[-n:]}"
        return out

    def run(self, args: list, timeout: float) -> subprocess.CompletedProcess:
        """A launcher-side command (raylm up, ray exec, ray down) as the user types it."""
        try:
            return subprocess.run([str(a) for a in args], capture_output=True, text=True, env=self.env,
                                  timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
            pytest.fail(f"`{' '.join(map(str, args))}` did not finish in {timeout}s:\n{out[-4000:]}")


def _leftover_dirs() -> None:
    """Stop what an earlier, killed run of this module left: its sshd (the unshare holding
    its namespace, found by its config path) and its marked launcher processes."""
    for old in glob.glob("/tmp/raylm-deploy-*"):
        config = f"{old}/sshd_config"
        for entry in os.listdir("/proc"):
            if entry.isdigit() and config in sshd_mod._cmdline(int(entry)):
                sshd_mod._signal(int(entry), 9)
        sshd_mod.kill_marked(os.path.join(old, "rt"))
        shutil.rmtree(old, ignore_errors=True)


@pytest.fixture(scope="module")
def loopback():
    reason = sshd_mod.install() or sshd_mod.namespace_problem()
    if reason:
        pytest.skip(reason)
    _leftover_dirs()
    taken = [a for a in sshd_mod.ADDRESSES if sshd_mod.port_taken(a)]
    if taken:
        pytest.skip(f"port {sshd_mod.PORT} is already taken on {taken} (another sshd?); "
                    "Ray's SSH runner cannot use another port")
    work = Path(tempfile.mkdtemp(prefix="raylm-deploy-", dir="/tmp"))  # short: Ray's socket paths
    ray_tmpdir = work / "rt"
    ray_tmpdir.mkdir()
    key = sshd_mod.keygen(work / "id_ed25519")
    wrong_key = sshd_mod.keygen(work / "not_authorized")
    home_before = {p: p.read_bytes() if p.exists() else None for p in HOME_FILES}
    address_before = DEFAULT_ADDRESS_FILE.read_bytes() if DEFAULT_ADDRESS_FILE.exists() else None
    caches_before = set(glob.glob("/tmp/ray-config-*"))
    env = dict(os.environ, RAY_TMPDIR=str(ray_tmpdir), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("RAY_ADDRESS", None)
    server = sshd_mod.LoopbackSshd(work, ray_tmpdir, key)
    try:
        server.start()
        yield Loopback(work, ray_tmpdir, key, wrong_key, env, server)
    finally:
        left = server.stop()
        killed = sshd_mod.kill_marked(str(ray_tmpdir))  # launcher side: ray up / exec, their ssh
        left += sshd_mod.marked_pids(str(ray_tmpdir))
        for p, content in home_before.items():  # what `ray up` put in the SSH user's home
            if content is None:
                p.unlink(missing_ok=True)
            else:
                p.write_bytes(content)
        for cache in set(glob.glob("/tmp/ray-config-*")) - caches_before:
            os.unlink(cache)  # `ray up`'s cache of the bootstrapped config (our cluster names only)
        address_after = DEFAULT_ADDRESS_FILE.read_bytes() if DEFAULT_ADDRESS_FILE.exists() else None
        shutil.rmtree(work, ignore_errors=True)
        print(f"\n[deploy] teardown stopped {len(killed)} launcher-side processes by pid")
        assert not left, f"processes left behind: {left}"
        assert address_after == address_before, "the test touched /tmp/ray/ray_current_cluster"


def _tail(r: subprocess.CompletedProcess, n: int = 6000) -> str:
    return f"exit {r.returncode}\n--- stdout\n{r.stdout[-n:]}\n--- stderr\n{r.stderr[-n:]}"


def _poll(what: str, fn, timeout: float, interval: float = 2.0, logs=lambda: ""):
    """fn() until it returns something truthy; fails naming `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            got = fn()
            if got:
                return got
            last = got
        except (httpx.HTTPError, ValueError, KeyError) as e:
            last = e
        time.sleep(interval)
    pytest.fail(f"{what}: not within {timeout}s (last: {last!r}){logs()}")


def _state(dashboard: str, kind: str) -> list[dict]:
    """Ray's state API (the dashboard's /api/v0), as `ray list nodes|actors` reads it."""
    r = httpx.get(f"{dashboard}/api/v0/{kind}", params={"limit": 1000, "detail": "true"}, timeout=10)
    r.raise_for_status()
    return r.json()["data"]["result"]["result"]


@pytest.mark.timeout(600)  # the 300 s default is about this test's length on a loaded 2-core machine
def test_ray_up_joins_both_nodes_serves_a_completion_and_ray_down(loopback):
    t0 = time.monotonic()
    timings = {}
    cfg, config, values = loopback.render("serve")
    dashboard = f"http://127.0.0.1:{values['dashboard_port']}"
    venv = values["venv"]
    port = free_port()
    serve = None
    serve_log = loopback.dir / "serve.log"
    try:
        up = loopback.run([BIN / "raylm", "up", cfg, "-y"], timeout=240)
        if up.returncode != 0 and RAYLET_STARTUP_TIMEOUT in up.stdout + up.stderr:
            # Ray's raylet gives its agents ~15 s to start; on a loaded machine they can miss
            # it. What a user would do: stop what the failed start left (its GCS lives on),
            # then start Ray again without the setup commands.
            print(f"\n[deploy] head raylet startup timed out (machine load {os.getloadavg()[0]:.0f}); "
                  "ray up --restart-only once more")
            loopback.sshd.kill_cluster_processes()
            up = loopback.run([BIN / "raylm", "up", cfg, "-y", "--restart-only"], timeout=240)
        assert up.returncode == 0, _tail(up) + loopback.monitor_logs()
        timings["raylm up"] = time.monotonic() - t0

        def both_alive():
            alive = [n for n in _state(dashboard, "nodes") if n["state"] == "ALIVE"]
            return alive if len(alive) == 2 else None

        nodes = _poll("the worker joining the head", both_alive, timeout=180, logs=loopback.monitor_logs)
        timings["worker joined"] = time.monotonic() - t0
        head = [n for n in nodes if n["is_head_node"]]
        workers = [n for n in nodes if not n["is_head_node"]]
        assert len(head) == 1 and [n["node_ip"] for n in workers] == ["127.0.0.2"]
        assert [n["resources_total"].get("NPU") for n in nodes] == [8.0, 8.0]  # declared in the start commands

        serve_cmd = (f"source {venv}/bin/activate && raylm serve --address auto --device cpu "
                     f"--accelerator-resource NPU --replicas 2 --threads-per-worker 1 --port {port}")
        with open(serve_log, "w") as log:
            serve = subprocess.Popen([str(BIN / "ray"), "exec", str(cfg), serve_cmd], stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=loopback.env)

        def healthy():
            if serve.poll() is not None:
                pytest.fail(f"`ray exec ... raylm serve` exited {serve.returncode}:\n{serve_log.read_text()[-4000:]}")
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            if r.status_code == 200:
                return True
            if "failed" in r.text:
                pytest.fail(f"/health: {r.text}")
            return None

        _poll("raylm serve on the head answering /health", healthy, timeout=180)
        timings["serving"] = time.monotonic() - t0
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "model": "tiny-qwen3", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["choices"]) == 1 and isinstance(body["choices"][0]["text"], str)
        assert 1 <= body["usage"]["completion_tokens"] <= 8

        # Placed as on NPUs: each replica's worker holds one declared NPU, one replica per node.
        worker_nodes = sorted(a["node_id"] for a in _state(dashboard, "actors")
                              if a["class_name"] == "WorkerActor" and a["state"] == "ALIVE")
        assert worker_nodes == sorted(n["node_id"] for n in nodes)
        status = loopback.run([BIN / "ray", "exec", cfg, f"source {venv}/bin/activate && ray status"], timeout=120)
        assert status.returncode == 0, _tail(status)
        assert "2.0/16.0 NPU" in status.stdout, _tail(status)
        timings["checked"] = time.monotonic() - t0
    finally:
        if serve is not None:
            # Ctrl-C on the head, as a user stops `raylm serve`: ending the local `ray exec`
            # (its ssh client) does not reach the remote process.
            loopback.run([BIN / "ray", "exec", cfg, f"pkill -INT -f '[r]aylm serve .*--port {port}' || true"],
                         timeout=60)
            if serve.poll() is None:
                serve.terminate()
                serve.wait(10)
        # As the README's one-machine steps: Ray's `ray stop` on the head first (ray down runs
        # it too, but in a login shell, where the venv's `ray` is not on PATH), then ray down.
        stop = loopback.run([BIN / "ray", "exec", cfg, f"source {venv}/bin/activate && ray stop"], timeout=120)
        timings["ray stop"] = time.monotonic() - t0
        down = loopback.run([BIN / "ray", "down", "-y", cfg], timeout=120)
        timings["ray down"] = time.monotonic() - t0
        print("\n[deploy] seconds since start: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
    assert stop.returncode == 0, _tail(stop)
    assert down.returncode == 0, _tail(down)
    assert "No nodes remaining" in down.stdout + down.stderr, _tail(down)
    # `ray stop` on the head of this one machine stopped both nodes' Ray.
    leftover = _poll_empty(loopback.sshd.cluster_processes, timeout=60)
    assert not leftover, f"still running on the nodes after ray stop + ray down: {leftover}"


def _poll_empty(fn, timeout: float):
    deadline = time.monotonic() + timeout
    while (got := fn()) and time.monotonic() < deadline:
        time.sleep(1)
    return got


def _break_start_command(config: dict) -> dict:
    broken = copy.deepcopy(config)
    broken["head_start_ray_commands"] = [c.replace('{"NPU": 8}', '{"NPU": 8')
                                         for c in config["head_start_ray_commands"]]
    assert broken != config
    return broken


@pytest.mark.parametrize("case, expected", [
    ("unreachable_head", ["provider.head_ip '127.0.0.3'", "Connection refused"]),
    ("wrong_key", ["auth.ssh_private_key", "Permission denied (publickey)"]),
    ("failing_start_command", ["is not a valid JSON string", "Failed to setup head node", "raylm: error: `ray up"]),
])
def test_bad_cluster_file_fails_fast_with_rays_error(loopback, case, expected):
    sets = {"ssh_key": str(loopback.wrong_key)} if case == "wrong_key" else {}
    cfg, config, _ = loopback.render(case, **sets)
    if case == "unreachable_head":
        config["provider"]["head_ip"] = "127.0.0.3"  # loopback, but nothing listens there
    if case == "failing_start_command":
        config = _break_start_command(config)
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    # --restart-only: straight to the start commands (the setup commands are the happy path's).
    extra = ["--restart-only"] if case == "failing_start_command" else []
    t0 = time.monotonic()
    try:
        # The bound is that it gives up at all: plain `ray up` retries SSH for 15 minutes.
        r = loopback.run([BIN / "raylm", "up", cfg, "-y", *extra], timeout=150)
    finally:
        if case == "failing_start_command":
            loopback.run([BIN / "ray", "down", "-y", cfg], timeout=120)
    print(f"\n[deploy] {case}: raylm up exited {r.returncode} after {time.monotonic() - t0:.0f}s")
    assert r.returncode != 0
    for text in expected:
        assert text in r.stdout + r.stderr, _tail(r)
