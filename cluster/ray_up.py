"""`raylm up CLUSTER.yaml [ray up options]`: Ray's own cluster launcher, after checks
that make bad cluster files fail in seconds instead of minutes.

Why a wrapper: `ray up` (Ray 2.60) retries SSH to the head for up to 15 minutes
(AUTOSCALER_NODE_START_WAIT_S) when the connection is refused or the key is wrong,
printing only "SSH still not available". raylm up first
  1. runs Ray's own config preparation and validation (what `ray up` does before SSH),
  2. checks that the auth key file exists,
  3. runs one `ssh ... true` to the head with the options Ray uses, plus BatchMode and a
     connect timeout, and on failure raises ValueError naming the field, its value and
     ssh's own error text (e.g. "Permission denied (publickey)", "Connection refused"),
then runs `ray up` itself, whose output (a failing setup or start command, Ray's error
for it) goes straight to the user. Only the head is checked: the launcher need not be
able to reach the workers, the head must.

It also runs `ray up` with autoscaler v1 (RAY_UP_enable_autoscaler_v2=0) unless the
caller set that variable: with the local provider, Ray 2.60's default v2 autoscaler
was seen never to start the workers listed in worker_ips (deploy/README.md).
"""

from __future__ import annotations

import copy
import os
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

SSH_CONNECT_TIMEOUT_S = 10


def load_cluster_config(path: str) -> dict:
    """The YAML as `ray up` reads it, through Ray's own preparation and validation."""
    from ray.autoscaler._private.commands import _bootstrap_config

    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"cluster config {path!r}: {e.strerror}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"cluster config {path!r} is not a YAML mapping")
    try:
        return _bootstrap_config(copy.deepcopy(raw), no_config_cache=True)
    except Exception as e:  # jsonschema / click errors: Ray's own words
        raise ValueError(f"cluster config {path!r} fails Ray's validation: {e}") from None


def ssh_command(auth: dict, host: str) -> list[str]:
    """`ssh ... true` with the options Ray's SSH command runner uses, never prompting."""
    cmd = ["ssh", "-i", os.path.expanduser(auth["ssh_private_key"]),
           "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no",
           "-o", f"UserKnownHostsFile={os.devnull}", "-o", "BatchMode=yes",
           "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}", "-o", "LogLevel=ERROR"]
    if auth.get("ssh_proxy_command"):
        cmd += ["-o", f"ProxyCommand={auth['ssh_proxy_command']}"]
    return cmd + [f"{auth['ssh_user']}@{host}", "true"]


def check_head_ssh(config: dict) -> None:
    """ValueError (field, value, ssh's message) unless the head accepts our key."""
    auth, head = config["auth"], config["provider"]["head_ip"]
    key = auth.get("ssh_private_key")
    if not key:
        raise ValueError("auth.ssh_private_key is not set: raylm up needs the key ray up will use")
    if not Path(os.path.expanduser(key)).is_file():
        raise ValueError(f"auth.ssh_private_key {key!r}: no such file")
    cmd = ssh_command(auth, head)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                           timeout=SSH_CONNECT_TIMEOUT_S + 20)
    except subprocess.TimeoutExpired:
        raise ValueError(f"provider.head_ip {head!r}: `ssh` as {auth['ssh_user']!r} did not answer in "
                         f"{SSH_CONNECT_TIMEOUT_S + 20}s") from None
    if r.returncode != 0:
        detail = (r.stderr or r.stdout).strip() or f"exit status {r.returncode}"
        raise ValueError(f"provider.head_ip {head!r}: cannot SSH as auth.ssh_user {auth['ssh_user']!r} with "
                         f"auth.ssh_private_key {key!r}: {detail}\n  (tried: {shlex.join(cmd)})")


def ray_executable() -> str:
    beside = Path(sys.executable).parent / "ray"  # the Ray of this environment, as `raylm` is
    return str(beside) if beside.exists() else "ray"


def up(config_path: str, ray_up_args: list[str]) -> int:
    """Check, then `ray up`; returns ray up's exit status."""
    check_head_ssh(load_cluster_config(config_path))
    env = dict(os.environ)
    env.setdefault("RAY_UP_enable_autoscaler_v2", "0")
    rc = subprocess.call([ray_executable(), "up", config_path, *ray_up_args], env=env)
    if rc != 0:
        print(f"raylm: error: `ray up {config_path}` failed (exit {rc}); Ray's message for the failing "
              "step is above", file=sys.stderr)
    return rc
