"""Where a replica's KV events are published: the configured endpoint checked (loopback unless the
operator allows remote subscribers, as everything else of the product listens on localhost) and
moved per replica (replica i binds the port + i, as vLLM moves a data-parallel rank's endpoint)."""

from __future__ import annotations

import ipaddress

SCHEMES = ("tcp://", "ipc://", "inproc://")


def _split_tcp(endpoint: str) -> tuple[str, int]:
    """tcp://HOST:PORT -> (HOST without IPv6 brackets, PORT); ValueError naming what is wrong."""
    address = endpoint[len("tcp://"):]
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"kv_events_endpoint {endpoint!r} must be tcp://HOST:PORT with a port in 1-65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether binding `host` listens on this machine's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name: not known to be loopback
        return False


def check_endpoint(endpoint: str, allow_remote: bool) -> None:
    """Raise ValueError unless `endpoint` ("" = off) is one the publisher may bind: tcp://HOST:PORT
    on a loopback address (any other address, "*" included, only with `allow_remote`), ipc://PATH
    or inproc://NAME."""
    if not isinstance(endpoint, str):
        raise ValueError(f"kv_events_endpoint must be a string, got {endpoint!r}")
    if not endpoint:
        return
    if not endpoint.startswith(SCHEMES) or endpoint.endswith("//"):
        raise ValueError(f"kv_events_endpoint {endpoint!r} must be tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if endpoint.startswith("tcp://"):
        host, _ = _split_tcp(endpoint)
        if not allow_remote and not is_loopback(host):
            raise ValueError(f"kv_events_endpoint {endpoint!r} would publish beyond this machine (KV events carry "
                             "prompts' token ids); bind a loopback address (tcp://127.0.0.1:PORT) or set "
                             "kv_events_allow_remote=true")


def replica_endpoint(endpoint: str, replica: int) -> str:
    """The endpoint replica `replica` binds: a tcp port moved up by `replica`, an ipc path or
    inproc name with "-<replica>" appended (replica 0 keeps the endpoint as configured)."""
    if replica < 0:
        raise ValueError(f"replica index must be >= 0, got {replica}")
    if not replica or not endpoint:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, port = _split_tcp(endpoint)
        if port + replica > 65535:
            raise ValueError(f"kv_events_endpoint {endpoint!r}: replica {replica} would bind port {port + replica}")
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{port + replica}"
    return f"{endpoint}-{replica}"
