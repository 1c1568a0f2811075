"""The load tools' target: a loopback-only address check, and the server process's resident memory.

Contract: `loopback_target` accepts only 127.0.0.0/8, ::1 and `localhost` (never resolved through DNS) and raises
TargetError for anything else, so no load can be pointed at another machine. `listening_pid` finds the process that
listens on a local TCP port through /proc (Linux); `resident_bytes` reads a process's VmRSS.
"""
from __future__ import annotations

import ipaddress
import os
from pathlib import Path


class TargetError(ValueError):
    """An address the load tools refuse, or a server process they cannot find."""


def loopback_target(addr: str) -> tuple[str, int]:
    """(host, port) of "HOST:PORT" or "[V6]:PORT" when HOST is loopback; TargetError otherwise."""
    host, sep, port_text = addr.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise TargetError(f"--addr {addr!r}: expected HOST:PORT with a loopback HOST (127.0.0.1, [::1] or "
                          f"localhost) and a port in 1..65535")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if bare.lower() != "localhost":
        try:
            ip = ipaddress.ip_address(bare)
        except ValueError:
            ip = None
        if ip is None or not ip.is_loopback:
            raise TargetError(f"--addr {addr!r}: refusing a non-loopback target; the load tools only send traffic "
                              f"to this machine (127.0.0.0/8, ::1 or localhost)")
    return host, int(port_text)


def resident_bytes(pid: int) -> int | None:
    """The process's resident set size (VmRSS) in bytes, or None when it has exited or cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def listening_pid(port: int) -> int | None:
    """The pid of the process with a TCP socket listening on `port` (IPv4 or IPv6), or None if not found."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in wanted:
                    return int(entry.name)
            except OSError:
                continue
    return None


def _listening_inodes(port: int) -> set[str]:
    listen_state = "0A"
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == listen_state and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes
