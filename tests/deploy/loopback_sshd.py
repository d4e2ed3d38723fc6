"""OpenSSH's server as the test's "nodes": one sshd of our own on 127.0.0.1 and 127.0.0.2.

It has its own host key, config, authorized key and pid file in a temp dir and runs as a
child of the test (never the system's ssh service, whose config is not read). What
its sessions get, so that the cluster stays apart from other Ray users of this machine:
  - RAY_TMPDIR, a temp dir: the cluster keeps ray_current_cluster and its sessions out of
    /tmp/ray, where other processes' (and later runs') plain `ray.init()` would look;
  - RAY_AUTH_MODE=disabled, as on a fresh node: left unset, `ray start --head` turns
    token auth on whenever ~/.ray/auth_token exists (any local ray.init() on the machine
    makes one), and then `ray status` without RAY_AUTH_MODE=token cannot reach the GCS;
  - a PID namespace of their own (`unshare`): `ray stop` run there (Ray's way to stop a
    node, which kills every Ray process it can see) sees only this cluster's processes,
    and stopping sshd ends every process of the cluster with it.
The SSH user's home is the real one (sshd takes it from passwd, and so does ssh for
`-i ~/...`): `ray up` leaves ray_bootstrap_config.yaml and ray_bootstrap_key.pem there,
which the test removes.
RAY_TMPDIR also marks the launcher-side processes (`ray up`, its ssh clients):
`kill_marked` stops those by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"
ADDRESSES = ("127.0.0.1", "127.0.0.2")
PORT = 22  # Ray's SSH command runner has no port option
PACKAGES = ("openssh-server", "rsync")  # rsync: `ray up` copies its bootstrap config with it
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def install() -> str | None:
    """Install the packages if missing. None when ready, else why not (the skip reason)."""
    if os.path.exists(SSHD) and shutil.which("rsync"):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"{SSHD} or rsync is missing and cannot be installed here (needs root and apt-get)"
    if os.path.isdir("/run/systemd/system") and not os.path.exists("/usr/sbin/policy-rc.d"):
        # With a live init, the package's postinst would start the system sshd on every interface.
        return ("installing openssh-server here would start the system's sshd on all interfaces; "
                "install openssh-server and rsync yourself to run this test")
    for cmd, timeout in ((["apt-get", "update", "-qq"], 180),
                         (["apt-get", "install", "-y", "-qq", *PACKAGES], 300)):
        try:
            r = _run(cmd, timeout)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(cmd)}` did not finish in {timeout}s"
        if r.returncode != 0:
            return f"`{' '.join(cmd)}` failed ({r.returncode}): {(r.stderr or r.stdout)[-500:]}"
    return None if os.path.exists(SSHD) else f"apt-get installed openssh-server but {SSHD} is missing"


def namespace_problem() -> str | None:
    """None if `unshare` can give sshd its own PID namespace here, else why not."""
    try:
        r = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run unshare: {e}"
    if r.returncode != 0:
        return f"`unshare --pid` is not allowed here ({r.stderr.strip()})"
    return None


def port_taken(address: str) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, PORT))
        except OSError:
            return True
    return False


def keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "raylm-deploy-test", "-f", str(path)],
                   check=True, capture_output=True)
    return path


class LoopbackSshd:
    def __init__(self, workdir: Path, ray_tmpdir: Path, user_key: Path):
        self.dir = workdir
        self.ray_tmpdir = ray_tmpdir
        self.user_key = user_key
        self.config = workdir / "sshd_config"
        self.log = workdir / "sshd.log"
        self.proc: subprocess.Popen | None = None
        self._made_privsep_dir = False

    def write_config(self) -> None:
        host_key = keygen(self.dir / "host_ed25519")
        (self.dir / "authorized_keys").write_text(Path(f"{self.user_key}.pub").read_text())
        lines = [f"ListenAddress {a}:{PORT}" for a in ADDRESSES] + [
            f"HostKey {host_key}",
            "PidFile none",  # its pid inside the namespace is 1; the test has the outside one
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
            "PermitRootLogin prohibit-password",  # keys only, also for root
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",  # the key files live in a temp dir, not ~/.ssh
            "MaxStartups 64",  # ray up and the head's autoscaler open several at once
            "MaxSessions 64",
            f"SetEnv RAY_TMPDIR={self.ray_tmpdir} RAY_AUTH_MODE=disabled",
            "LogLevel VERBOSE",
        ]
        self.config.write_text("\n".join(lines) + "\n")

    def start(self, timeout: float = 15.0) -> None:
        self.write_config()
        if not os.path.isdir("/run/sshd"):  # privilege separation dir; the ssh service makes it at boot
            os.makedirs("/run/sshd", mode=0o755)
            self._made_privsep_dir = True
        check = subprocess.run([SSHD, "-t", "-f", str(self.config)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"sshd rejected its config: {check.stderr}")
        env = dict(os.environ, RAY_TMPDIR=str(self.ray_tmpdir))
        self.proc = subprocess.Popen([*UNSHARE, SSHD, "-D", "-f", str(self.config), "-E", str(self.log)],
                                     env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not all(self._accepts(a) for a in ADDRESSES):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd did not come up on {ADDRESSES}: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    @staticmethod
    def _accepts(address: str) -> bool:
        try:
            with socket.create_connection((address, PORT), timeout=1):
                return True
        except OSError:
            return False

    def processes(self) -> list[int]:
        """Every process in the nodes' PID namespace (sshd's own included)."""
        return descendants(self.proc.pid) if self.proc is not None else []

    def cluster_processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of what runs on the nodes besides sshd itself."""
        out = []
        for pid in self.processes():
            cmd = _cmdline(pid)
            if cmd and not cmd.startswith("sshd"):
                out.append((pid, cmd))
        return out

    def kill_cluster_processes(self) -> list[int]:
        """What `ray stop` does on the nodes, by pid (SIGKILL): every process there but sshd."""
        pids = [pid for pid, _ in self.cluster_processes()]
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        return pids

    def stop(self) -> list[int]:
        """Ends sshd's namespace, so every process in it; returns pids still alive after."""
        inside = self.processes()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # unshare --kill-child: SIGKILL to sshd, the namespace's init
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in inside:  # belt and braces: by pid, should the kernel not have yet
            _signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while [p for p in inside if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._made_privsep_dir:
            shutil.rmtree("/run/sshd", ignore_errors=True)
        return [p for p in inside if _alive(p)]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """Every live process below root, from /proc's parent links."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], {root}
    while frontier:
        kids = {p for p, pp in parent.items() if pp in frontier}
        found += [p for p in kids if _alive(p)]
        frontier = kids
    return found


def marked_pids(marker: str) -> list[int]:
    """Every process whose environment holds RAY_TMPDIR=marker (ours, and nobody else's)."""
    needle = f"RAY_TMPDIR={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if needle in env:
            found.append(int(entry))
    return found


def kill_marked(marker: str, grace_s: float = 10.0) -> list[int]:
    """SIGTERM, then SIGKILL after grace_s, every marked process; returns those it found."""
    pids = marked_pids(marker)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in marked_pids(marker):
            _signal(pid, sig)
        deadline = time.monotonic() + grace_s
        while marked_pids(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not marked_pids(marker):
            break
    return pids
