"""torch.distributed's rendezvous for a cluster's ranks: the master address, and a store that listens there only.

A cluster whose ranks all run on one node meets on the loopback address, and its collectives' own sockets (gloo's,
NCCL's bootstrap) stay on the loopback interface, so nothing outside the machine can reach them; a cluster over
several nodes meets on rank 0's node address, the one the other nodes reach it by. torch's own `env://` store
listens on every interface, unauthenticated, whatever MASTER_ADDR says; `init_process_group` here binds it to
MASTER_ADDR.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import sys

LOOPBACK = "127.0.0.1"
LOOPBACK_INTERFACE = "lo0" if sys.platform == "darwin" else "lo"


def master_address(on_one_node: bool) -> tuple[str, int]:
    """Where a cluster whose rank 0 runs in this process meets: loopback when all its ranks run on this node, else
    this node's address; and a port free there."""
    host = LOOPBACK if on_one_node else node_ip_address()
    try:
        return host, find_free_port(host)
    except OSError as error:
        raise OSError(f"this node's address {host} (Ray's node IP) cannot be listened on here ({error}); start Ray on "
                      "this node with --node-ip-address set to an address of one of its interfaces") from error


def node_ip_address() -> str:
    """This machine's address as other nodes see it (Ray's view when Ray is up)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return LOOPBACK


def find_free_port(host: str) -> int:
    """A TCP port that is free on `host`, the address that will listen on it (OSError if this machine has no such
    address)."""
    with _socket_for(host) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def socket_interface_env(master_addr: str) -> dict[str, str]:
    """The environment that keeps gloo's and NCCL's sockets on the loopback interface where the master is loopback
    (by default they bind the address this machine's host name resolves to); {} otherwise."""
    if not is_loopback(master_addr):
        return {}
    return {"GLOO_SOCKET_IFNAME": LOOPBACK_INTERFACE, "NCCL_SOCKET_IFNAME": LOOPBACK_INTERFACE}


def init_process_group(backend: str) -> None:
    """Join torch.distributed's default group as the cluster set this process up (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT): rank 0 serves the store on MASTER_ADDR only, the other ranks connect to it."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = (serve_store if rank == 0 else connect_store)(host, port, world_size, default_pg_timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def serve_store(host: str, port: int, world_size: int, timeout: datetime.timedelta):
    """A torch.distributed TCPStore served on `host`:`port` only (torch's own binds every interface)."""
    import torch.distributed as dist

    listener = _socket_for(host)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(socket.SOMAXCONN)
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def connect_store(host: str, port: int, world_size: int, timeout: datetime.timedelta):
    """A client of the store `serve_store` serves."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def _socket_for(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.socket(family, socket.SOCK_STREAM)
