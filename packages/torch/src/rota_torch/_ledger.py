"""The node's host-memory ledger: pinned bytes of every rota process on this host.

A per-process budget cannot stop five tenants on one node from pinning 40 GB each on
a 128 GB host: the node swaps, then the OOM killer picks one. So every host pool also
records its process's in-memory bytes in the node ledger, and a pool that grows checks
the sum of every *live* process's entry against the node budget
(``ROTA_NODE_HOST_BUDGET_BYTES``; 0 or unset = none). No server is needed, so
rota_torch alone enforces it.

Every local user may be another tenant, so nobody writes where another uid writes, and
nobody can make a path that locks another out:

* The node's root is ``/dev/shm/rota-host-ledger``, made ``1777`` by root (a root rota
  process, or an admin: ``install -d -m 1777 -o root``, e.g. from systemd-tmpfiles). A
  non-root process never creates it; while it is missing, or owned by another user, each
  user's processes count only each other, in a private ledger of that user
  (``$XDG_RUNTIME_DIR/rota-host-ledger``, else ``~/.cache/rota/host-ledger-<host>``), and
  say so once. ``ROTA_NODE_LEDGER_DIR`` names another root, checked strictly: owned by
  root or this user, sticky if others may write it, not a link.
* Each uid records only in its own directory ``<root>/<uid>``, owned by it, mode 0755:
  only that uid writes there; every rota process reads every uid's entries, so the node
  budget counts all users (an entry tells no more than ``/proc`` already does). Where
  another uid made ``<root>/<uid>`` first, the uid uses ``<root>/<uid>.<random>`` instead
  (the first such directory of its own, by name); readers take a directory only from
  the uid that owns it.
* A process locks only its own uid's ``lock`` (mode 0600: no other uid can open it,
  so none can block it), waits at most ``LOCK_TIMEOUT_S`` and then names the holder;
  writes its entry through an ``O_EXCL|O_NOFOLLOW`` temp file; prunes dead or bad
  entries of its own uid.
* Another uid's entry counts only if it is a regular file owned by that uid (read with
  ``O_NOFOLLOW|O_NONBLOCK``, at most 64 bytes), names a live process of that uid (pid
  and start time) and holds a byte count between 0 and the node's memory plus swap.
  Anything else is ignored and logged once. It counts at most the memory that process
  really holds: its proportional share (``Pss`` in ``/proc/PID/smaps_rollup``), so pages
  that several processes map (one page-cache file mapped by six processes, memory shared
  after a fork) count once across them, not once in each; a ``sleep`` claiming 25 GB
  counts its few kB. A uid's total is thus at most what its live processes hold together.
  Where this process may not read that file (a non-root reader of another uid's process:
  the kernel shows it only to its own uid and to root), ``VmRSS`` of ``/proc/PID/status``,
  which counts a shared page in every process that maps it, is the bound instead.

The locks are per uid, so across uids check-and-record is not atomic: a pool that
grows records its claim, reads the others again and shrinks its claim if they grew
meanwhile (:meth:`rota_torch._pool.HostPool._plan`): two uids racing for the last
room may both get less, never both the last room.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Iterator

from rota import proc
from rota.config import env_bytes
from rota.errors import ConfigError, TransientError

log = logging.getLogger(__name__)

DEFAULT_DIR = "/dev/shm/rota-host-ledger"
LOCK = "lock"
LOCK_TIMEOUT_S = 10.0  # the lock is held for a check and a record only, never an allocation
MAX_ENTRY_BYTES = 64  # "<start time> <bytes>\n" is far shorter
MAX_ENTRIES = 4096  # entries read per uid: a uid cannot make every reader walk a huge directory
MAX_WARNED = 256
_ENTRY = re.compile(r"([0-9]{1,20}) ([0-9]{1,20})\n?")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_warned: set[tuple[str, str, str]] = set()


class LedgerBusy(TransientError):
    """The ledger's lock of this uid stayed held past the timeout (a stuck rota process of this user)."""


def node_budget() -> int:
    """``ROTA_NODE_HOST_BUDGET_BYTES`` (0 = no node budget), validated."""
    return env_bytes("ROTA_NODE_HOST_BUDGET_BYTES", 0)


def _fix(path: str) -> str:
    return (f"ask an admin to create it as root (install -d -m 1777 -o root {path}, e.g. from systemd-tmpfiles), "
            "or set ROTA_NODE_LEDGER_DIR to a directory of your own")


def _private_root() -> str:
    """This user's own ledger root, used while the node's is missing or not root's (see the module docs)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "rota-host-ledger")
    cache = os.path.join(os.path.expanduser("~"), ".cache", "rota")
    os.makedirs(cache, mode=0o700, exist_ok=True)
    return os.path.join(cache, f"host-ledger-{socket.gethostname()}")


def _root_path() -> str:
    """ROTA_NODE_LEDGER_DIR, else the node's root when root made it, else this user's private root."""
    explicit = os.environ.get("ROTA_NODE_LEDGER_DIR")
    if explicit:
        return explicit
    try:
        st = os.lstat(DEFAULT_DIR)
    except FileNotFoundError:
        if os.geteuid() == 0:
            return DEFAULT_DIR  # root makes it, 1777
        why = "does not exist"
    except OSError as exc:
        why = f"cannot be read ({exc.strerror})"
    else:
        ok = stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and (st.st_mode & stat.S_ISVTX or not st.st_mode & 0o022)
        if ok:
            return DEFAULT_DIR
        why = f"is uid {st.st_uid}'s, mode {stat.S_IMODE(st.st_mode):o}, not root's"
    private = _private_root()
    if ("root", DEFAULT_DIR, why) not in _warned:
        _warned.add(("root", DEFAULT_DIR, why))
        log.warning("node ledger: %s %s: this user's rota processes count only each other against "
                    "ROTA_NODE_HOST_BUDGET_BYTES (ledger %s); %s", DEFAULT_DIR, why, private, _fix(DEFAULT_DIR))
    return private


def _open_root() -> tuple[str, int]:
    """The ledger root (created if missing: see the module docs), opened without following a link and checked."""
    path = _root_path()
    uid = os.geteuid()
    try:
        created = _mkdir(path, 0o1777 if uid == 0 else 0o755)
    except OSError as exc:
        raise ConfigError(f"ROTA_NODE_LEDGER_DIR={path!r} cannot be created ({exc.strerror}); point it at a "
                          "node-local directory") from None
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        why = "is a symbolic link or not a directory" if exc.errno in (errno.ENOTDIR, errno.ELOOP) else \
            f"cannot be opened ({exc.strerror})"
        raise ConfigError(f"ROTA_NODE_LEDGER_DIR={path!r} {why}; point it at a node-local directory") from None
    try:
        st = os.fstat(fd)
        if created:
            os.fchmod(fd, 0o1777 if uid == 0 else 0o755)  # the umask may have narrowed it
        elif st.st_uid not in (0, uid):
            raise ConfigError(f"ROTA_NODE_LEDGER_DIR={path!r} is owned by uid {st.st_uid}, not root or you: "
                              f"another user may have planted it; {_fix(path)}")
        elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise ConfigError(f"ROTA_NODE_LEDGER_DIR={path!r} is writable by others without the sticky bit "
                              f"(mode {stat.S_IMODE(st.st_mode):o}): anyone could replace another user's entries; "
                              f"chmod 1777 {path}")
    except BaseException:
        os.close(fd)
        raise
    return path, fd


def _mkdir(path: str, mode: int, dir_fd: int | None = None) -> bool:
    """Create a directory; False if something (checked by the caller) is already there."""
    try:
        os.mkdir(path, mode, dir_fd=dir_fd)
    except FileExistsError:
        return False
    return True


def _open_dir(name: str, root_fd: int) -> int:
    """``name`` under the root if it is a directory of this uid that only it may write (else -1)."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
    except OSError:
        return -1
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        return -1
    return fd


def _open_own(root: str, root_fd: int) -> int:
    """This uid's directory under the root: ``<uid>`` (created 0755), or where another uid made that name first,
    the first ``<uid>.<random>`` of its own by name (created if there is none)."""
    uid = os.geteuid()
    try:
        if _mkdir(str(uid), 0o755, dir_fd=root_fd):
            os.chmod(str(uid), 0o755, dir_fd=root_fd)  # whatever the umask: other uids' rota reads it
    except PermissionError:
        raise ConfigError(f"the node ledger {root!r} does not let uid {uid} make its directory in it; "
                          f"{_fix(root)} (chmod 1777 {root} if it is root's)") from None
    fd = _open_dir(str(uid), root_fd)
    if fd >= 0:
        return fd
    _ignore(root, str(uid), "made by another uid or writable by others; using a directory of this uid's own")
    for attempt in range(2):  # look for one of ours; make one and look again (two of our processes converge)
        for name in sorted(n for n in os.listdir(root_fd) if n.startswith(f"{uid}."))[:MAX_ENTRIES]:
            fd = _open_dir(name, root_fd)
            if fd >= 0:
                return fd
        if attempt == 0:
            name = f"{uid}.{secrets.token_hex(8)}"
            _mkdir(name, 0o755, dir_fd=root_fd)
            os.chmod(name, 0o755, dir_fd=root_fd)
    raise ConfigError(f"no directory of uid {uid} can be made in the node ledger {root!r}; {_fix(root)}")


def _proc_start_and_uid(pid: int) -> tuple[str, int]:
    """The process's start time in clock ticks and its effective uid (/proc); ("", -1) if it is gone."""
    start = _start_time(pid)
    try:
        with open(f"/proc/{pid}/status") as f:
            uid = next(int(line.split()[2]) for line in f if line.startswith("Uid:"))
    except (OSError, IndexError, ValueError, StopIteration):
        return "", -1
    return (start, uid) if start else ("", -1)


def _start_time(pid: int) -> str:
    """The process's start time, so a reused pid is not mistaken for the old one ("" if it is gone)."""
    start = proc.start_time(pid)
    return "" if start is None else str(start)


def _held_bytes(pid: int) -> int:
    """The memory ``pid`` holds: its proportional set size (``Pss`` of /proc/PID/smaps_rollup), where each
    page shared by N processes counts 1/N in each; ``VmRSS`` of /proc/PID/status where smaps_rollup cannot be
    read (another uid's process, to a non-root reader); 0 if neither can."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except (OSError, IndexError, ValueError, StopIteration):
        pass
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, IndexError, ValueError, StopIteration):
        return 0


def _memory_bound() -> int:
    """No entry may claim more than the node's memory and swap together."""
    total = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(("MemTotal:", "SwapTotal:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total or 1 << 50


def _ignore(where: str, name: str, why: str) -> None:
    """Log a bad entry once (at most MAX_WARNED of them: another uid must not grow this process's memory)."""
    key = (where, name, why)
    if key not in _warned and len(_warned) < MAX_WARNED:
        _warned.add(key)
        log.warning("node ledger: ignoring entry %r in %s: %s%s", name, where, why,
                    "; further bad entries are ignored silently" if len(_warned) == MAX_WARNED else "")


class NodeLedger:
    """The ledger while this uid's lock is held: read every live process's bytes, record this one's."""

    def __init__(self, path: str, root_fd: int, own_fd: int) -> None:
        self.path = path
        self.pid = os.getpid()
        self.uid = os.geteuid()
        self._root_fd, self._own_fd = root_fd, own_fd

    def entries(self) -> dict[int, int]:
        """Bytes per live rota process of every uid; this uid's dead or bad entries are removed."""
        out: dict[int, int] = {}
        bound = _memory_bound()
        uids = sorted(n for n in os.listdir(self._root_fd) if n.partition(".")[0].isdigit())
        if len(uids) > MAX_ENTRIES:
            _ignore(self.path, "*", f"{len(uids)} uid directories; only the first {MAX_ENTRIES} are read")
        own = os.fstat(self._own_fd).st_ino
        for name in uids[:MAX_ENTRIES]:
            try:
                st = os.stat(name, dir_fd=self._root_fd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    continue
                fd = self._own_fd if st.st_ino == own else os.open(name, _DIR_FLAGS, dir_fd=self._root_fd)
            except OSError:
                continue
            try:
                where = os.path.join(self.path, name)
                if name.partition(".")[0] != str(os.fstat(fd).st_uid):
                    _ignore(self.path, name, f"directory owned by uid {os.fstat(fd).st_uid}, not uid {name}")
                    continue
                out.update(self._read_dir(fd, os.fstat(fd).st_uid, where, bound))
            finally:
                if fd != self._own_fd:
                    os.close(fd)
        return out

    def _read_dir(self, fd: int, uid: int, where: str, bound: int) -> dict[int, int]:
        own = uid == self.uid
        out: dict[int, int] = {}
        # another uid's "<pid>.tmp" is its record in progress (it holds its own lock, not ours)
        names = sorted(n for n in os.listdir(fd) if n != LOCK and (own or not n.endswith(".tmp")))
        if len(names) > MAX_ENTRIES:
            _ignore(where, "*", f"{len(names)} entries; only the first {MAX_ENTRIES} are read")
        for name in names[:MAX_ENTRIES]:
            pid, nbytes, why = self._read_entry(fd, name, uid, bound)
            if not why and not own:  # another uid's claim counts up to what its process really holds
                held = _held_bytes(pid)
                if nbytes > held:
                    _ignore(where, name, f"claims {nbytes} bytes but its process holds {held}; {held} counted")
                    nbytes = held
            if not why:
                out[pid] = nbytes
            elif own:  # dead, reused or broken: this uid's own entries are pruned
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=fd)
            elif why != "process gone":
                _ignore(where, name, why)
        return out

    @staticmethod
    def _read_entry(dir_fd: int, name: str, uid: int, bound: int) -> tuple[int, int, str]:
        """(pid, bytes, "") for a valid entry of a live process of ``uid``, else (0, 0, why)."""
        if not name.isdigit() or name != str(int(name)) or int(name) <= 0:
            return 0, 0, "not a pid"
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as exc:
            return 0, 0, f"cannot be opened ({exc.strerror})"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                return 0, 0, f"not a regular file of uid {uid}"
            raw = os.read(fd, MAX_ENTRY_BYTES + 1)
        finally:
            os.close(fd)
        match = _ENTRY.fullmatch(raw.decode("ascii", "replace")) if len(raw) <= MAX_ENTRY_BYTES else None
        if match is None:
            return 0, 0, "malformed (want '<start time> <bytes>')"
        nbytes = int(match.group(2))
        if nbytes > bound:
            return 0, 0, f"claims {nbytes} bytes, more than this node's memory and swap ({bound})"
        pid = int(name)
        start, owner = _proc_start_and_uid(pid)
        if start != match.group(1):
            return 0, 0, "process gone"
        if owner != uid:
            return 0, 0, f"pid {pid} belongs to uid {owner}, not {uid}"
        return pid, nbytes, ""

    def others(self) -> int:
        """In-memory host bytes of every other live rota process on this node."""
        return sum(n for pid, n in self.entries().items() if pid != self.pid)

    def record(self, nbytes: int) -> None:
        """This process now holds ``nbytes`` of host memory in pools (atomic replace, in this uid's directory)."""
        if nbytes < 0:
            raise ValueError(f"host bytes {nbytes} < 0")
        name = str(self.pid)
        tmp = f"{name}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=self._own_fd)  # a reused pid's leftover; only this uid writes here
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=self._own_fd)
        with os.fdopen(fd, "w") as f:
            os.fchmod(fd, 0o644)  # readable by every uid's rota, whatever the umask
            f.write(f"{_start_time(self.pid)} {nbytes}\n")
        os.replace(tmp, name, src_dir_fd=self._own_fd, dst_dir_fd=self._own_fd)


def _lock_holder(fd: int) -> str:
    """Who holds the flock on ``fd``'s file, from /proc/locks ("pid N"), for the error message."""
    ino = os.fstat(fd).st_ino
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].endswith(f":{ino}"):
                    return f"pid {fields[4]}"
    except OSError:
        pass
    return "another process of this user"


def _lock(fd: int, path: str) -> None:
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise LedgerBusy(f"the node ledger's lock {path} has been held by {_lock_holder(fd)} for more "
                                 f"than {LOCK_TIMEOUT_S:g} s; that process of yours is stuck: end it") from None
            time.sleep(0.01)


@contextlib.contextmanager
def locked_ledger() -> Iterator[NodeLedger]:
    """The node ledger under this uid's exclusive lock (held only for a check and a record, never an allocation)."""
    root, root_fd = _open_root()
    own_fd = lock_fd = -1
    try:
        own_fd = _open_own(root, root_fd)
        lock_path = os.path.join(root, str(os.geteuid()), LOCK)
        try:
            lock_fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=own_fd)
        except OSError as exc:
            raise ConfigError(f"node ledger lock {lock_path!r} cannot be opened ({exc.strerror}); remove it") \
                from None
        _lock(lock_fd, lock_path)
        yield NodeLedger(root, root_fd, own_fd)
    finally:
        for fd in (lock_fd, own_fd, root_fd):
            if fd >= 0:
                os.close(fd)  # closing the lock's descriptor releases the lock


def node_host_bytes() -> dict[int, int]:
    """Host bytes per live rota process on this node, from the ledger (for status and tests)."""
    with locked_ledger() as ledger:
        return ledger.entries()
