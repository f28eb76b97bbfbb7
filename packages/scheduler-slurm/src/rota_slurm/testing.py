"""A real, throw-away Slurm cluster on this host, for tests of rota on Slurm.

Public on purpose: rota_slurm's tests (and any package that wants to test its jobs
under Slurm) start one with :class:`SlurmCluster`. Everything lives under one
directory: its own munged (own key and socket, so a system munged is left alone),
slurmctld and one slurmd per node (``slurmd -N nK`` on loopback ports), fake GPUs made
with ``mknod`` (Slurm refuses plain files and then sets no CUDA_VISIBLE_DEVICES), a
gres.conf with shards, and rota's SPANK plugin built from this package. Daemons run in
the foreground as children of the test process and are stopped by pid, nothing else.

Needs root and the Debian packages munge, slurmctld, slurmd, slurm-client,
libslurm-dev and gcc (``scripts/services.sh install``).

Slurm 22.05 facts this relies on: ``batch_sched_delay=0,bf_interval=1`` brings
submit-to-start under a second; jobs run as root here; ``squeue --json`` works.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rota.rpc import free_port
from rota_slurm._conf import GresLayout, gres_conf, node_line
from rota_slurm._spank import PlugstackLine, build, default_rota_executable, write_plugstack

log = logging.getLogger(__name__)

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "gcc")


def _bin(name: str) -> str | None:
    """Full path of a binary, looking in /usr/sbin too (not always in a CI user's PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")


def missing_binaries() -> list[str]:
    """Binaries a cluster needs that are not installed (empty when it can start)."""
    return [b for b in BINARIES if _bin(b) is None]


@dataclass
class SlurmCluster:
    """A one-host Slurm cluster under ``root``; ``start()`` it, ``stop()`` it (idempotent)."""

    root: Path
    nodes: Sequence[str] = ("n1",)
    gpus_per_node: int = 2
    shards_per_gpu: int = 4
    cpus_per_node: int = 4
    orchestrator: str = ""
    auth_key: str = ""  # the orchestrator's key: jobs get ROTA_TOKEN, the epilog an admin token
    max_priority: int = 1000  # plugstack.conf max_priority=: the highest priority a job's token may carry
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    # ------------------------------------------------------------ paths, env

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm clients (sbatch, squeue...) talking to this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}  # jobs inherit it
        env["SLURM_CONF"] = str(self.conf)
        return env

    def log_text(self, name: str) -> str:
        """Contents of a daemon log (``slurmctld``, ``slurmd-n1``, ``munged``)."""
        path = self.root / "log" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -------------------------------------------------------------- running

    def run(self, *args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        res = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout, check=False)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def sbatch(self, *args: str, timeout: float = 60.0) -> str:
        """Submit a batch job; return its job id."""
        return self.run("sbatch", "--parsable", *args, timeout=timeout).stdout.strip().split(";")[0]

    def wait_jobs(self, job_ids: Sequence[str], timeout: float = 180.0) -> None:
        """Block until none of ``job_ids`` is pending, running or completing."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            res = self.run("squeue", "-h", "-j", ",".join(job_ids), "-t", "PD,R,CG,CF", "-o", "%i", check=False)
            if res.returncode == 0 and not res.stdout.strip():
                return
            time.sleep(0.3)
        raise TimeoutError(f"jobs {','.join(job_ids)} still queued or running after {timeout:.0f} s:\n"
                           + self.run("squeue", check=False).stdout)

    def job_state(self, job_id: str) -> str:
        """Slurm's state of a job (RUNNING, COMPLETED, CANCELLED, FAILED...)."""
        res = self.run("scontrol", "show", "job", job_id, "-o", check=False)
        for part in res.stdout.split():
            if part.startswith("JobState="):
                return part.split("=", 1)[1]
        return ""

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        """Write the configuration, build the SPANK plugin, start the daemons, wait for idle nodes."""
        if os.geteuid() != 0:
            raise PermissionError("a test Slurm cluster needs root (slurmd, mknod)")
        try:
            self._write_config()
            self._start_munged()
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            for n in self.nodes:
                (self.root / "spool" / n).mkdir(parents=True, exist_ok=True)
                self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-f", str(self.conf), "-N", n])
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel this cluster's jobs, then stop the daemons it started (by pid)."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                ids = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split()
                if ids:
                    self.run("scancel", *ids, check=False, timeout=10)
                    self.wait_jobs(ids, timeout=30)
        for name in [*[f"slurmd-{n}" for n in self.nodes], "slurmctld", "munged"]:
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            log.info("stopped %s (pid %d)", name, proc.pid)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ internals

    def _write_config(self) -> None:
        for d in ("etc", "state", "spool", "log", "run", "dev", "munge"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        host = socket.gethostname().split(".")[0]
        ctld_port, first_node_port = free_port(), free_port()
        layout = GresLayout(gpus=self.gpus_per_node, shards_per_gpu=self.shards_per_gpu,
                            device_glob=str(self.root / "dev" / "nvidia"))
        for i in range(self.gpus_per_node):  # fake GPUs: character devices, major 195 like nvidia's
            dev = self.root / "dev" / f"nvidia{i}"
            if not dev.is_char_device():
                dev.unlink(missing_ok=True)
                os.mknod(dev, 0o666 | 0o020000, os.makedev(195, i))
        (self.root / "etc" / "gres.conf").write_text(gres_conf(layout))
        so = build(self.root / "lib" / "rota_spank.so")
        write_plugstack(self.root / "etc" / "plugstack.conf",
                        PlugstackLine(so, orchestrator=self.orchestrator, rota=default_rota_executable(),
                                      python=sys.executable, auth_key=self.auth_key,
                                      max_priority=self.max_priority))
        r = self.root
        ports = [first_node_port] + [free_port() for _ in self.nodes[1:]]
        nodes = "\n".join(
            node_line(n, layout, cpus=self.cpus_per_node, memory_mb=2000,
                      extra=f"NodeHostname={host} NodeAddr=127.0.0.1 Port={port}")
            for n, port in zip(self.nodes, ports, strict=True))
        self.conf.write_text(f"""\
ClusterName=rota
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=2
PlugStackConfig={r}/etc/plugstack.conf
GresTypes={layout.gres_types}
{nodes}
PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")

    def _start_munged(self) -> None:
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            os.chmod(key, 0o400)
        m = self.root / "munge"
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={m}/munge.socket", f"--key-file={key}",
                               f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed",
                               f"--log-file={self.root}/log/munged.log"])
        deadline = time.monotonic() + 20
        while not (m / "munge.socket").exists():
            if self._procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{self.log_text('munged')[-2000:]}")
            time.sleep(0.05)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.out", "ab")  # closed below; the child keeps its copy
        try:
            self._procs[name] = subprocess.Popen([_bin(cmd[0]) or cmd[0], *cmd[1:]], stdout=out,
                                                 stderr=subprocess.STDOUT, env=self.env, stdin=subprocess.DEVNULL)
        finally:
            out.close()
        log.info("started %s (pid %d)", name, self._procs[name].pid)

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self._tail(name)}")
            res = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10)
            states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
            if res.returncode == 0 and set(states) == set(self.nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.2)
        raise TimeoutError(f"Slurm nodes not idle after {timeout:.0f} s:\n{self._tail('slurmctld')}")

    def _tail(self, name: str) -> str:
        text = self.log_text(name) + (self.root / "log" / f"{name}.out").read_text(errors="replace") \
            if (self.root / "log" / f"{name}.out").exists() else self.log_text(name)
        return text[-3000:]


@contextlib.contextmanager
def slurm_cluster(root: Path, **kw: object) -> Iterator[SlurmCluster]:
    """``with slurm_cluster(tmp) as c:`` — start a cluster, always stop it."""
    cluster = SlurmCluster(Path(root), **kw)  # type: ignore[arg-type]
    with cluster:
        yield cluster
