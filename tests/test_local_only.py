"""Local means local: what a run opens to the network and to other users of the machine (issue 32).

A cluster on one node rendezvous over loopback only; one over several nodes listens on its master's node address,
never on every interface; a local Ray started by baton keeps its temp directory and token private.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import tempfile

import pytest

from baton import Worker, WorkerConfig, WorkerSpec, create_clusters_parallel, register
from baton.distributed.rendezvous import LOOPBACK_INTERFACE, find_free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_THIS_MACHINE = "203.0.113.7"  # TEST-NET-3 (RFC 5737): an address no interface here has


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on, from /proc (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # state 0A: LISTEN
                    address, port = fields[1].split(":")
                    raw = bytes.fromhex(address)
                    # /proc prints the address as 32-bit words in host (little-endian) order
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


class Rendezvous(Worker):
    """Builds an fsdp2 strategy (whose constructor joins torch.distributed) and reports what that opened."""

    @register()
    def join(self) -> dict:
        from baton.strategy import StrategyConfig
        from baton.strategy.fsdp2 import Fsdp2Strategy

        before = listening_sockets(os.getpid())
        Fsdp2Strategy(StrategyConfig(model="tiny-qwen2"))
        return {"opened": listening_sockets(os.getpid()) - before, "master": (self.master_addr, self.master_port),
                "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME")}


def test_a_free_port_is_found_on_the_address_given():
    port = find_free_port("127.0.0.1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    with pytest.raises(OSError):  # the address itself is bound, not every interface
        find_free_port(NOT_THIS_MACHINE)


@pytest.mark.ray
def test_the_fsdp2_rendezvous_listens_on_loopback_on_one_node_and_on_the_node_address_across_nodes(make_manager):
    import ray

    one_node, two_nodes = create_clusters_parallel([
        (WorkerSpec(Rendezvous), WorkerConfig("one_node", device_mapping=[0, 1], call_timeout_s=120)),
        (WorkerSpec(Rendezvous), WorkerConfig("two_nodes", device_mapping=[2, 3], call_timeout_s=120)),
    ], make_manager("ray", num_nodes=2, num_devices_per_node=3))
    try:
        assert [p.node_index for p in one_node.placements] == [0, 0]
        assert [p.node_index for p in two_nodes.placements] == [0, 1]
        local, spread = one_node.join(), two_nodes.join()
    finally:
        one_node.shutdown()
        two_nodes.shutdown()

    assert local[0]["master"][0] == "127.0.0.1"
    assert local[0]["opened"]  # rank 0 serves the store
    for rank in local:
        assert rank["opened"] and {address for address, _ in rank["opened"]} == {"127.0.0.1"}, rank
        # gloo binds the address the host name resolves to unless told the interface (here both are loopback)
        assert rank["gloo_interface"] == LOOPBACK_INTERFACE

    node_address = ray.util.get_node_ip_address()
    assert spread[0]["master"][0] == node_address
    assert (node_address, spread[0]["master"][1]) in spread[0]["opened"]
    for rank in spread:
        assert not {address for address, _ in rank["opened"]} & {"0.0.0.0", "::"}, rank
        assert rank["gloo_interface"] is None


def run_start_ray(home: str, tmp: str) -> list[str]:
    """Start a local Ray the way a pipeline does, in a process of its own with `home` as HOME and `tmp` as TMPDIR,
    and return its temp directory and RAY_AUTH_MODE."""
    script = ("import os, ray\nfrom baton.pipelines.ray_start import start_ray\nfrom baton.pipelines.config import TrainerConfig\n"
              "start_ray(TrainerConfig(num_cpus=1))\n"
              "print(ray._private.worker._global_node.get_temp_dir_path(), os.environ.get('RAY_AUTH_MODE'))\n"
              "ray.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=home, TMPDIR=tmp)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[-2:]


def mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_local_ray_started_by_baton_keeps_its_temp_directory_and_token_private():
    # Short paths: Ray's socket paths under its temp directory must fit a Unix socket address (107 bytes).
    with tempfile.TemporaryDirectory(prefix="bt") as home, tempfile.TemporaryDirectory(prefix="bt") as tmp:
        temp_dir, auth_mode = run_start_ray(home, tmp)
        assert auth_mode == "token"  # Ray's default for a new local instance, kept
        token = os.path.join(home, ".ray", "auth_token")
        assert mode(token) == 0o600 and mode(os.path.dirname(token)) == 0o700
        # Ray makes its own directories 0777; the directory holding them is the user's alone.
        holder = os.path.dirname(temp_dir)
        assert temp_dir.startswith(tmp + os.sep) and mode(holder) == 0o700 and os.lstat(holder).st_uid == os.getuid()


def test_an_existing_token_is_made_private_and_a_planted_temp_directory_is_refused(tmp_path, monkeypatch):
    from baton.pipelines.ray_start import keep_auth_token_private, private_temp_dir

    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("ab" * 32)
    token.chmod(0o644)
    keep_auth_token_private(starts_instance=True)
    assert mode(str(token)) == 0o600 and token.read_text() == "ab" * 32  # the user's token kept, not replaced

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    (tmp_path / f"baton-ray-{os.getuid()}").symlink_to(tmp_path / ".ray")  # planted ahead of the run
    with pytest.raises(PermissionError, match="set RAY_TMPDIR to a directory of your own"):
        private_temp_dir()
