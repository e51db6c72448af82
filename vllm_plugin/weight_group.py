"""The torch.distributed group of a weight transfer, as each of its ends forms it: the trainer
(rank 0) and every server's workers, from the same init_info. One definition, for the trainer
(weight_sync.py), the stand-in (local_vllm/engine.py) and our gloo engine in vLLM's workers
(gloo_weight_transfer.py); and where the trainer holds the rendezvous (free_port, host_ip).

Spec: 概要 (Overview: weight_sync_steps), the transfer over NCCL; on a CPU over gloo:

    trainer, rank 0                              a server's worker, rank rank_offset + i
    TCPStore master_address:master_port (owner) ◄── joins it, PrefixStore "weight_transfer"
    gloo listens on master_address only          gloo on this host's default device
    ProcessGroupGloo / ProcessGroupNCCL(store, rank, world_size), timeout on every wait

Departures from the spec, one line each:
- Without CUDA the group is gloo's (vLLM's own engines need NCCL).
"""
import socket
import urllib.parse
from datetime import timedelta

import torch.distributed as dist


def weight_group(address: str, port: int, world_size: int, rank: int, backend: str,
                 timeout_s: float, listen_fd: int | None = None):
    """This end's process group. Rank 0 owns the store, on `listen_fd` (a socket bound to
    `address` only: TCPStore alone listens on every interface), and gloo listens on `address`,
    the one the servers reach; every other rank joins from this host's default device."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout,
                          master_listen_fd=listen_fd)
    store = dist.PrefixStore("weight_transfer", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    gloo = dist.ProcessGroupGloo
    options = gloo._Options()
    options._timeout = timeout
    options._devices = [gloo.create_device(hostname=address) if rank == 0
                        else gloo.create_default_device()]
    return gloo(store, rank, world_size, options)


def free_port() -> int:
    """A port free on this host now (the trainer's master_port)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def host_ip(server_url: str) -> str:
    """An address of this host that the server can reach (the route the OS picks towards it)."""
    host = urllib.parse.urlsplit(server_url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(host), 9))     # UDP connect sends nothing
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
