"""``cuda``: whole-process park through the CUDA driver's checkpoint API (driver >= 570).

For tenants with no adapter: the driver locks the process (no new CUDA work), copies
all of its device memory into the process's own host memory and releases the device
(``cuCheckpointProcessLock`` → ``cuCheckpointProcessCheckpoint``); restore reverses it
(``cuCheckpointProcessRestore`` → ``cuCheckpointProcessUnlock``). The process keeps
running its CPU threads throughout; its CUDA calls block while it is locked.

What is refused up front (UNIMPLEMENTED: non-x86-64, drivers without the API, live NCCL
communicators) and which pids may be named is in the package README. (Merely having
libnccl loaded, as every CUDA torch process does, is not refused.) CUDA IPC and UVM
memory cannot be seen from outside the process and may stall a step, so every step runs
in a worker thread under a deadline; the driver call itself cannot be interrupted and
may still finish later. Multi-process jobs: every pid is locked before any is
checkpointed (and every one restored before any is unlocked); each step runs for up to
``parallel`` pids at once, so that ranks on several GPUs copy over their own links at the
same time; a failure part-way rolls back what was done (restore + unlock).

The driver sits behind :class:`CudaDriver`; :class:`LibCudaDriver` is the real one
(ctypes on ``libcuda.so.1``), tests use ``FakeCudaDriver`` from the test suite.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import os
import platform
import time
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from rota import proc as _proc
from rota.errors import PermissionDenied
from rota.wire import snapshot_agent_pb2 as pb
from rota_agent.backends._base import Job, Moved
from rota_agent.errors import BackendFailed, BadBackendConfig, UnknownJob, Unsupported, WrongState

log = logging.getLogger(__name__)

MIN_DRIVER = 12080  # cuDriverGetVersion() of the first driver with the checkpoint API (r570)
RUNNING, LOCKED, CHECKPOINTED, FAILED = 0, 1, 2, 3  # CUprocessState
STATE_NAMES = {RUNNING: "RUNNING", LOCKED: "LOCKED", CHECKPOINTED: "CHECKPOINTED", FAILED: "FAILED"}
CUDA_ERROR_NOT_SUPPORTED = 801
MAX_PIDS = 256  # explicit pids in one request
THREADS = 16  # driver calls in flight at once, all jobs together (a call past its deadline keeps its thread)


class CudaError(RuntimeError):
    """A driver call returned an error code."""

    def __init__(self, call: str, code: int, name: str = "") -> None:
        super().__init__(f"{call} returned {name or 'CUDA error'} ({code})")
        self.call, self.code, self.name = call, code, name


class CudaDriver(Protocol):
    """The six driver entry points the backend uses (pid-level, no context needed)."""

    def driver_version(self) -> int: ...
    def get_state(self, pid: int) -> int: ...
    def lock(self, pid: int, timeout_ms: int) -> None: ...
    def checkpoint(self, pid: int) -> None: ...
    def restore(self, pid: int) -> None: ...
    def unlock(self, pid: int) -> None: ...


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class LibCudaDriver:
    """ctypes binding of the checkpoint API in ``libcuda.so.1``."""

    def __init__(self, path: str = "libcuda.so.1") -> None:
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as exc:
            raise Unsupported(f"no CUDA driver on this node ({path}: {exc}); the cuda backend needs an NVIDIA "
                              "driver >= 570") from None
        for fn in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
                   "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState"):
            if not hasattr(self.lib, fn):
                raise Unsupported(f"the CUDA driver has no {fn} (driver {self.driver_version()}); the cuda "
                                  "backend needs driver >= 570 (CUDA 12.8)")
        self._call("cuInit", self.lib.cuInit, 0)

    def _call(self, name: str, fn: Any, *args: Any) -> None:
        rc = fn(*args)
        if rc != 0:
            s = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(s))
            raise CudaError(name, rc, (s.value or b"").decode())

    def driver_version(self) -> int:
        v = ctypes.c_int()
        self._call("cuDriverGetVersion", self.lib.cuDriverGetVersion, ctypes.byref(v))
        return v.value

    def get_state(self, pid: int) -> int:
        st = ctypes.c_int()
        self._call("cuCheckpointProcessGetState", self.lib.cuCheckpointProcessGetState, pid, ctypes.byref(st))
        return st.value

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = _LockArgs(timeoutMs=timeout_ms)
        self._call("cuCheckpointProcessLock", self.lib.cuCheckpointProcessLock, pid, ctypes.byref(args))

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", self.lib.cuCheckpointProcessCheckpoint, pid, None)

    def restore(self, pid: int) -> None:
        self._call("cuCheckpointProcessRestore", self.lib.cuCheckpointProcessRestore, pid, None)

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", self.lib.cuCheckpointProcessUnlock, pid, None)


def _nccl_threads(task_dir: str) -> bool:
    """True if a thread of the process is named by NCCL (its proxy/progress threads)."""
    if not os.path.isdir(task_dir):
        return False
    for tid in os.listdir(task_dir):
        try:
            with open(os.path.join(task_dir, tid, "comm"), encoding="utf-8", errors="replace") as f:
                if f.read().startswith("NCCL"):
                    return True
        except OSError:
            continue
    return False


class CudaBackend:
    """Whole-process checkpoint of a job's pids; see the module docs for limits."""

    name: ClassVar[str] = "cuda"
    whole_process: ClassVar[bool] = True

    def __init__(self, driver: Callable[[], CudaDriver] = LibCudaDriver, *, step_timeout_s: float = 120.0,
                 machine: str | None = None, proc_root: str = "/proc",
                 device_bytes: Callable[[tuple[int, ...]], int | None] | None = None,
                 parallel: int = 8) -> None:
        """``parallel``: how many of one job's pids each step (lock, checkpoint, restore, unlock) drives at
        once; 1 = one after another."""
        if step_timeout_s <= 0:
            raise BadBackendConfig(f"cuda step timeout {step_timeout_s!r} must be > 0 seconds")
        if isinstance(parallel, bool) or not isinstance(parallel, int) or not 1 <= parallel <= THREADS:
            raise BadBackendConfig(f"cuda parallel={parallel!r} must be a whole number of pids from 1 (one after "
                                   f"another) to {THREADS}")
        self.parallel = parallel
        self._make_driver = driver
        self._driver: CudaDriver | None = None
        self.step_timeout_s = step_timeout_s
        self.machine = machine or platform.machine()
        self.proc_root = proc_root
        self.device_bytes = device_bytes
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="rota-cuda")

    @property
    def driver(self) -> CudaDriver:
        if self._driver is None:
            drv = self._make_driver()
            version = drv.driver_version()
            if version < MIN_DRIVER:
                raise Unsupported(f"CUDA driver API version {version} has no process checkpoint API; the cuda "
                                  f"backend needs >= {MIN_DRIVER} (driver 570 or newer): upgrade the driver or use "
                                  "the app_channel backend")
            self._driver = drv
        return self._driver

    # ---------------------------------------------------------- validation

    def parse(self, job: Job | None, job_id: str, config: pb.CudaBackendConfig | None) -> tuple[int, ...]:
        """The pids to park: the job's own proven ones, or explicit ones tied to them.

        An explicit pid is taken only when it is a process the job proved (through the
        agent's pid door) or a descendant of one. Any other pid, existing or not, gets
        the same answer, so a caller learns nothing about the node's processes.
        """
        explicit = tuple(config.explicit_target.pids) if config is not None else ()
        if len(explicit) > MAX_PIDS:
            raise BadBackendConfig(f"cuda config of job {job_id!r} names {len(explicit)} pids; at most {MAX_PIDS}",
                                   job_id=job_id)
        for pid in explicit:
            if pid <= 0:
                raise BadBackendConfig(f"cuda config of job {job_id!r}: pid {pid} is not a process id; give "
                                       "positive pids in explicit_target.pids (or none to use the job's "
                                       "registered pids)", job_id=job_id)
        if job is None:
            raise UnknownJob(f"job {job_id!r} is not registered with this agent; the cuda backend parks only the "
                             "processes of a registered job: register the job's WorkloadChannel (through the "
                             "agent's Unix socket, so its pid is proven)", job_id=job_id)
        own = {pid: start for pid, start in job.proven.items() if _proc.alive(pid, start, self.proc_root)}
        if not own:
            raise BadBackendConfig(f"job {job_id!r} has no proven process on this node: its WorkloadChannel "
                                   "did not come through the agent's pid door (connect with ROTA_AGENT=unix:"
                                   "<socket dir>/agent.sock, or set ROTA_AGENT_PROOF=<socket dir>/pid.sock)",
                                   job_id=job_id)
        uids = {_proc.uid(p, self.proc_root) for p in own}
        for pid in explicit:  # a setuid child acts with another uid's rights: it is not the job's
            if not _proc.descends(pid, set(own), self.proc_root) or _proc.uid(pid, self.proc_root) not in uids:
                raise PermissionDenied(f"pid {pid} is not a process of job {job_id!r} (neither a process that "
                                       "registered it nor a descendant of one running as its uid); the agent parks "
                                       "only its registered jobs' own processes", job_id=job_id)
        pids = explicit or tuple(sorted(own))
        if self.machine not in ("x86_64", "AMD64"):
            raise Unsupported(f"whole-process CUDA checkpoint is x86-64 only (this node is {self.machine}); "
                              "use the app_channel backend with an adapter", job_id=job_id)
        for pid in pids:
            maps = os.path.join(self.proc_root, str(pid), "maps")
            try:
                with open(maps, encoding="utf-8", errors="replace") as f:
                    nccl = any("/dev/shm/nccl-" in line for line in f)
                nccl = nccl or _nccl_threads(os.path.join(self.proc_root, str(pid), "task"))
            except OSError as exc:
                raise Unsupported(f"cannot read {maps} ({exc.strerror}): the agent needs the host PID namespace "
                                  "and CAP_SYS_PTRACE to checkpoint other processes", job_id=job_id) from None
            if nccl:
                raise Unsupported(f"pid {pid} of job {job_id!r} has live NCCL communicators, which cannot be "
                                  "checkpointed by the CUDA driver; destroy them before parking or use the "
                                  "app_channel backend with an adapter", job_id=job_id)
        _ = self.driver  # driver present and new enough, or a clear error now
        return pids

    # ------------------------------------------------------------- steps

    async def _step(self, what: str, fn: Callable[..., Any], pid: int, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            got = await asyncio.wait_for(loop.run_in_executor(self._pool, fn, pid, *args), self.step_timeout_s)
        except asyncio.TimeoutError:
            raise BackendFailed(
                f"{what} of pid {pid} did not finish within {self.step_timeout_s:g} s; common causes are CUDA IPC "
                "or UVM (managed) memory, which the driver cannot checkpoint, or a kernel that never ends. The "
                "driver call may still complete in the background") from None
        except CudaError as exc:
            hint = (" (the process uses something the driver cannot checkpoint: CUDA IPC, UVM/managed memory "
                    "or NCCL)" if exc.code == CUDA_ERROR_NOT_SUPPORTED else "")
            raise BackendFailed(f"{what} of pid {pid} failed: {exc}{hint}") from None
        log.debug("%s pid %d: %.3f s", what, pid, time.perf_counter() - t0)
        return got

    async def _each(self, what: str, fn: Callable[..., Any], pids: list[int], *args: Any) -> list[Any]:
        """``fn`` for every pid, ``parallel`` at a time; each pid's result or the exception it raised."""
        gate = asyncio.Semaphore(self.parallel)

        async def one(pid: int) -> Any:
            async with gate:
                return await self._step(what, fn, pid, *args)

        return await asyncio.gather(*(one(pid) for pid in pids), return_exceptions=True)

    @staticmethod
    def _done(pids: list[int], results: list[Any]) -> tuple[list[int], BaseException | None]:
        """The pids whose step succeeded, and the first failure (in pid order), if any."""
        errors = [r for r in results if isinstance(r, BaseException)]
        if len(errors) > 1:
            log.error("%d pids failed the same step; the first is reported: %s", len(errors),
                      "; ".join(str(e) for e in errors[1:]))
        return [p for p, r in zip(pids, results, strict=True) if not isinstance(r, BaseException)], \
            errors[0] if errors else None

    async def _states(self, pids: tuple[int, ...]) -> list[int]:
        """Each pid's CUprocessState, read off the event loop (a driver call may take a while)."""
        got = await self._each("cuCheckpointProcessGetState", self.driver.get_state, list(pids))
        for r in got:
            if isinstance(r, BaseException):
                raise r
        return got

    async def snapshot(self, job: Job, pids: tuple[int, ...]) -> Moved:
        drv = self.driver
        states = await self._states(pids)
        if all(st == CHECKPOINTED for st in states):  # a retry after a residue fault: parked already
            return Moved(pids=pids)
        for pid, st in zip(pids, states, strict=True):
            if st != RUNNING:
                raise WrongState(f"pid {pid} of job {job.job_id!r} is {STATE_NAMES.get(st, st)}, not RUNNING; "
                                 "it was already parked (restore it first)", job_id=job.job_id)
        nbytes = self.device_bytes(pids) if self.device_bytes else None
        locked, failed = self._done(list(pids), await self._each(
            "cuCheckpointProcessLock", drv.lock, list(pids), int(self.step_timeout_s * 1000)))
        saved: list[int] = []
        if failed is None:
            saved, failed = self._done(locked, await self._each("cuCheckpointProcessCheckpoint", drv.checkpoint,
                                                                locked))
        if failed is not None:
            await self._rollback(job, locked, saved)
            raise failed
        return Moved(storage_bytes=nbytes, device_bytes=nbytes, pids=pids)

    async def _rollback(self, job: Job, locked: list[int], saved: list[int]) -> None:
        restored, failed = self._done(saved, await self._each("cuCheckpointProcessRestore (rollback)",
                                                              self.driver.restore, saved))
        if failed is not None:
            log.error("job %s: rollback failed: %s", job.job_id, failed)
        unlock = [p for p in locked if p not in saved or p in restored]
        _, failed = self._done(unlock, await self._each("cuCheckpointProcessUnlock (rollback)", self.driver.unlock,
                                                        unlock))
        if failed is not None:
            log.error("job %s: rollback failed: %s", job.job_id, failed)

    async def restore(self, job: Job, pids: tuple[int, ...]) -> Moved:
        """Every checkpointed pid restored, then every locked one unlocked, so no rank runs while another is
        still parked; a pid whose restore failed stays parked, the others run (the job is FAULTED)."""
        drv = self.driver
        states = await self._states(pids)
        for pid, st in zip(pids, states, strict=True):
            if st not in (CHECKPOINTED, LOCKED, RUNNING):
                raise BackendFailed(f"pid {pid} of job {job.job_id!r} is {STATE_NAMES.get(st, st)}; it cannot be "
                                    "restored", job_id=job.job_id)
        saved = [p for p, st in zip(pids, states, strict=True) if st == CHECKPOINTED]
        restored, failed = self._done(saved, await self._each("cuCheckpointProcessRestore", drv.restore, saved))
        locked = sorted([p for p, st in zip(pids, states, strict=True) if st == LOCKED] + restored)
        _, unlock_failed = self._done(locked, await self._each("cuCheckpointProcessUnlock", drv.unlock, locked))
        if failed is not None or unlock_failed is not None:
            raise failed or unlock_failed  # type: ignore[misc]
        return Moved()
