"""How far a Ray cluster started or joined by ``verispec serve --ray`` can be reached, and
keeping a local one on loopback (docs/ray.md, "Network exposure").

Ray has no authentication: whoever reaches its ports joins the cluster and runs code. For a
loopback ``--host`` the local Ray instance listens on loopback only (``loopback_ray``) and so do
the Ray Serve replicas' gRPC servers (``replica_grpc_on_loopback``); a joined cluster whose nodes
listen on the network gets a warning (``warn_if_exposed``). Before Ray starts, its usage
statistics are turned off (``no_usage_stats``) and a cluster address must answer
(``check_reachable``). Ray is imported only inside the functions that need it, so this module
loads without the [ray] extra (``ray_serve.py`` uses it).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
from typing import Any

logger = logging.getLogger("ray.serve")


LOOPBACK_RAY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": a single-machine Ray whose node address is loopback


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1 (an IPv4-mapped ``::ffff:127.x`` too)."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host == "localhost"
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def loopback_ray() -> dict[str, Any]:
    """``ray.init`` options for a local Ray instance that listens on loopback only.

    Ray has no authentication: whoever reaches its ports joins the cluster and runs code.
    Its core gRPC servers (GCS, raylet, object manager, every worker) listen on every
    interface unless the node's address is exactly 127.0.0.1, and its agents (dashboard
    agent, runtime-env agent, metrics export) bind the node's address. ``ray.init`` replaces
    a loopback ``_node_ip_address`` with the machine's network address unless Ray runs as a
    single-machine instance, which ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` declares (Ray's
    default on macOS and Windows): set here for the processes Ray starts, which read it at
    import, and in this process, which imported Ray already. The dashboard stays off; the
    replicas' own gRPC servers are ``replica_grpc_on_loopback``'s."""
    from ray._private import ray_constants

    os.environ[LOOPBACK_RAY] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    return {"_node_ip_address": "127.0.0.1", "include_dashboard": False}


def replica_grpc_on_loopback() -> None:
    """In a Ray Serve replica on a loopback node, bind the replica's inter-deployment gRPC
    server to 127.0.0.1 instead of ``[::]`` (Ray Serve 2.60 passes ``[::]:0``, every
    interface, whatever the node's address, and has no setting for it). Called in the
    replica's constructor, which Ray Serve runs before it starts that server; elsewhere
    (a node with a network address) nothing changes."""
    import ray
    from ray.serve._private import replica

    if not is_loopback(ray.util.get_node_ip_address()):
        return
    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None:  # another Ray Serve: tests/server/test_ray_serve.py says what it binds
        logger.warning("verispec: cannot move this Ray Serve replica's gRPC server to loopback")
        return

    def on_loopback(server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        return bind(server, f"127.0.0.1:{port}" if host in ("[::]", "0.0.0.0") else address)

    replica.add_port_to_grpc_server = on_loopback


def warn_if_exposed(host: str, address: str) -> None:
    """One line on stderr when a loopback ``--host`` joins a cluster whose nodes listen on
    network addresses: verispec cannot move that cluster's ports (docs/ray.md)."""
    import ray

    exposed = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")} - {""})
    exposed = [ip for ip in exposed if not is_loopback(ip)]
    if is_loopback(host) and exposed:
        print(f"verispec: warning: --host {host} keeps only the HTTP endpoint on loopback; the Ray cluster at "
              f"{address} listens unauthenticated on {', '.join(exposed)}: firewall its ports "
              "(docs/ray.md, \"Network exposure\")", file=sys.stderr, flush=True)


def no_usage_stats() -> None:
    """Ray reports usage statistics to its authors unless told not to: verispec does not
    phone home (a user who wants it sets RAY_USAGE_STATS_ENABLED=1)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A ``host:port`` cluster address must accept a connection now: Ray itself retries an
    unreachable one for minutes. ``auto`` and ``ray://`` addresses are left to Ray."""
    import socket

    host, sep, port = address.rpartition(":")
    if address == "auto" or "://" in address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout_s).close()
    except OSError as e:
        raise ValueError(f"cannot reach the Ray cluster at {address} (RAY_ADDRESS): {e.strerror or e}") from None

