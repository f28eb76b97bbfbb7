"""Whose server is at an address: the kernel's word, read from ``/proc``.

The ``app_endpoint`` backend calls a job's inference server. A URL the job names proves
nothing: it could point at another tenant's server, a node service, or a port to scan.
So an endpoint is accepted only when the job's proven process owns what listens there:

* the URL's host is an IP address in its one canonical spelling (``localhost`` counts as
  127.0.0.1); ``127.1``, ``2130706433``, ``0x7f000001`` and host names are refused;
* the address is local to the process's network namespace: loopback when that is the
  agent's own namespace (elsewhere 127.0.0.1 would reach the agent's own loopback, not
  the pod's), else one of that namespace's own addresses (its pod IP);
* every listening TCP socket in that namespace that could take a connection to it
  (``/proc/PID/net/tcp``/``tcp6``: the exact address or a wildcard, on that port) is one
  of the sockets the process or a descendant of the same uid holds open
  (``/proc/PID/fd`` links ``socket:[INODE]``).

The check runs when the job registers and again before every call, so a port the job
closed and someone else took is not called.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator
from dataclasses import dataclass

from rota import proc as _proc

LISTEN = "0A"  # TCP state in /proc/net/tcp
MAX_FDS = 1 << 16  # file descriptors of one process looked at
MAX_PROCS = 1 << 16  # processes looked at for descendants
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Target:
    """Where a URL's calls go: the canonical address and port (the key of per-server limits)."""

    ip: Address
    port: int

    def __str__(self) -> str:
        return f"[{self.ip}]:{self.port}" if self.ip.version == 6 else f"{self.ip}:{self.port}"


def target(host: str, port: int) -> Target | None:
    """The address a URL host spells in canonical form, or None (a name, or a non-canonical number)."""
    if host.lower() == "localhost":
        return Target(ipaddress.IPv4Address("127.0.0.1"), port)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified or ip.is_multicast or str(ip) != host.lower():
        return None
    return Target(ip, port)


def _hex_ip(raw: str) -> Address:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in host (little-endian) order."""
    words = [bytes.fromhex(raw[i:i + 8])[::-1] for i in range(0, len(raw), 8)]
    packed = b"".join(words)
    ip = ipaddress.ip_address(packed)
    return ip.ipv4_mapped or ip if ip.version == 6 else ip


def listeners(pid: int, port: int, proc_root: str = "/proc") -> list[tuple[Address, int]]:
    """(local address, inode) of every listening TCP socket on ``port`` in ``pid``'s network namespace."""
    out = []
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc_root, str(pid), "net", name), encoding="ascii", errors="replace") as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) < 10 or fields[3] != LISTEN:
                        continue
                    addr, _, hex_port = fields[1].partition(":")
                    if int(hex_port, 16) == port:
                        out.append((_hex_ip(addr), int(fields[9])))
        except (OSError, ValueError):
            continue
    return out


def socket_inodes(pid: int, proc_root: str = "/proc") -> set[int]:
    """Inodes of the sockets ``pid`` holds open (empty when it cannot be read)."""
    found = set()
    try:
        with os.scandir(os.path.join(proc_root, str(pid), "fd")) as it:
            for n, entry in enumerate(it):
                if n >= MAX_FDS:
                    break
                try:
                    link = os.readlink(entry.path)
                except OSError:
                    continue
                if link.startswith("socket:["):
                    found.add(int(link[8:-1]))
    except OSError:
        pass
    return found


def local_addresses(pid: int, proc_root: str = "/proc") -> set[Address]:
    """The addresses of ``pid``'s network namespace's own interfaces (fib_trie LOCAL entries, if_inet6)."""
    out: set[Address] = set()
    base = os.path.join(proc_root, str(pid), "net")
    try:
        with open(os.path.join(base, "fib_trie"), encoding="ascii", errors="replace") as f:
            last = ""
            for line in f:
                s = line.strip()
                if s.startswith("|-- "):
                    last = s[4:]
                elif s.startswith("/32 host LOCAL") and last:
                    out.add(ipaddress.IPv4Address(last))
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(base, "if_inet6"), encoding="ascii", errors="replace") as f:
            for line in f:
                raw = line.split()[:1]
                if raw and len(raw[0]) == 32:
                    out.add(ipaddress.IPv6Address(bytes.fromhex(raw[0])))
    except (OSError, ValueError):
        pass
    return out


def _netns(pid: int | str, proc_root: str) -> str:
    try:
        return os.readlink(os.path.join(proc_root, str(pid), "ns", "net"))
    except OSError:
        return ""


def _family(roots: list[int], proc_root: str) -> Iterator[int]:
    """``roots``, then their live descendants of the same uid (a setuid child is not the job's)."""
    yield from roots
    uids = {_proc.uid(p, proc_root) for p in roots} - {None}
    try:
        names = os.listdir(proc_root)
    except OSError:
        return
    for name in names[:MAX_PROCS]:
        if name.isdigit() and int(name) not in roots and _proc.descends(int(name), set(roots), proc_root) \
                and _proc.uid(int(name), proc_root) in uids:
            yield int(name)


def owned(t: Target, pids: dict[int, int], proc_root: str = "/proc") -> str:
    """"" when the process(es) ``pids`` (pid -> start time) own every listener that takes calls to ``t``;
    else why not, in words that hold nothing of the network (the same for a free port and another's)."""
    roots = [p for p, start in pids.items() if _proc.alive(p, start, proc_root)]
    if not roots:
        return "the job has no live process that proved which it is (register through the agent's pid door)"
    ns = _netns(roots[0], proc_root)
    if t.ip.is_loopback:
        if ns != _netns("self", proc_root):
            return ("the job's process is in another network namespace, where loopback is not the agent's: "
                    "register its pod IP instead")
    elif t.ip not in local_addresses(roots[0], proc_root):
        return "the address is not one of the job's own (loopback, or its pod's IP)"
    wild = ipaddress.IPv4Address("0.0.0.0") if t.ip.version == 4 else ipaddress.IPv6Address("::")
    takers = {inode for ip, inode in listeners(roots[0], t.port, proc_root)
              if ip in (t.ip, wild, ipaddress.IPv6Address("::"))}
    if not takers:
        return "the job's process does not listen there"
    mine: set[int] = set()
    for p in _family(roots, proc_root):
        mine |= socket_inodes(p, proc_root)
        if takers <= mine:
            return ""
    return "the job's process does not listen there"


__all__ = ["Target", "listeners", "local_addresses", "owned", "socket_inodes", "target"]
