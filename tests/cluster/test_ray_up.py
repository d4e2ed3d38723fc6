"""`raylm up`'s checks before `ray up`: each bad cluster file stops in seconds with the field,
its value and Ray's or ssh's own words. No sshd is needed: nothing listens on 127.0.0.3:22.
(The checks against a real sshd, and `ray up` itself: tests/deploy/test_loopback_cluster.py.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster.cli import main
from cluster.ray_up import check_head_ssh, load_cluster_config

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "deploy" / "ascend-cluster.yaml"


def write_config(tmp_path: Path, **changes) -> Path:
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[last] = value
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def key(tmp_path) -> Path:
    if not shutil.which("ssh-keygen") or not shutil.which("ssh"):
        pytest.skip("needs the OpenSSH client (ssh, ssh-keygen)")
    path = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


def test_missing_key_file_names_the_field_and_path(tmp_path):
    cfg = write_config(tmp_path, **{"auth.ssh_private_key": str(tmp_path / "nope")})
    with pytest.raises(ValueError, match=r"auth.ssh_private_key '.*nope': no such file"):
        check_head_ssh(load_cluster_config(str(cfg)))


def test_refused_head_reports_ssh_words_and_the_head_ip(tmp_path, key):
    cfg = write_config(tmp_path, **{"provider.head_ip": "127.0.0.3", "auth.ssh_private_key": str(key)})
    with pytest.raises(ValueError) as info:
        check_head_ssh(load_cluster_config(str(cfg)))
    assert "provider.head_ip '127.0.0.3'" in str(info.value)
    assert "Connection refused" in str(info.value)


def test_schema_error_is_rays_own_message(tmp_path):
    cfg = write_config(tmp_path, **{"provider.worker_ips": "192.0.2.11,192.0.2.12"})
    with pytest.raises(ValueError, match="fails Ray's validation.*is not of type 'array'"):
        load_cluster_config(str(cfg))


def test_raylm_up_exits_2_with_the_message_and_never_runs_ray_up(tmp_path, key, capsys):
    cfg = write_config(tmp_path, **{"provider.head_ip": "127.0.0.3", "auth.ssh_private_key": str(key)})
    assert main(["up", str(cfg), "-y"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raylm: error: provider.head_ip '127.0.0.3'")
    assert "Connection refused" in err
