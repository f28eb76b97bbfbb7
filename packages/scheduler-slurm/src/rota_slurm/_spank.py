"""Build the SPANK plugin shipped with this package and render its plugstack.conf line.

Why compile at install time: a SPANK plugin must be built against the ``slurm/spank.h``
of the Slurm release the cluster runs, so the wheel carries the C source
(``spank/rota_spank.c``) and ``rota slurm install-spank`` compiles it with the system
compiler. The ``.so`` is written beside its final name and renamed into place, because
slurmd and running steps may have the old one mapped.

Environment: ``CC`` picks the compiler (default ``cc``, then ``gcc``).

:func:`read_plugstack` reads rota's arguments back from plugstack.conf: the job epilog
takes the orchestrator and the auth key from there and nowhere else, since the
job-control environment it runs with is the submitting user's.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from rota.config import MAX_PRIORITY, MIN_PRIORITY
from rota.errors import ConfigError

log = logging.getLogger(__name__)

PLUGIN_NAME = "rota_spank.so"
HEADER = "slurm/spank.h"
MARKER = "# rota: time-slice groups (rota slurm install-spank)"


def source_path() -> Path:
    """Path of the plugin's C source inside the installed package."""
    return Path(str(resources.files("rota_slurm").joinpath("spank", "rota_spank.c")))


def find_compiler() -> str:
    """The C compiler to use: $CC, else cc, else gcc."""
    for name in (os.environ.get("CC", ""), "cc", "gcc"):
        if name and shutil.which(name.split()[0]):
            return name
    raise ConfigError("no C compiler found (tried $CC, cc, gcc): install gcc (Debian: apt-get install gcc)")


def default_rota_executable() -> str:
    """The ``rota`` executable next to this Python (what the epilog should run)."""
    candidate = Path(sys.executable).parent / "rota"
    return str(candidate) if candidate.exists() else (shutil.which("rota") or "rota")


def build(dest: Path, *, include_dirs: tuple[str, ...] = (), timeout: float = 120.0) -> Path:
    """Compile the SPANK plugin to ``dest`` (a ``.so`` path, or a directory); return the .so path."""
    dest = Path(dest)
    if dest.suffix != ".so":
        dest = dest / PLUGIN_NAME
    dest.parent.mkdir(parents=True, exist_ok=True)
    cc = find_compiler()
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    cmd = [*cc.split(), "-shared", "-fPIC", "-O2", "-Wall", "-Werror", f"-DROTA_MIN_PRIORITY={MIN_PRIORITY}",
           f"-DROTA_MAX_PRIORITY={MAX_PRIORITY}", "-o", str(tmp), str(source_path())]
    cmd[1:1] = [f"-I{d}" for d in include_dirs]
    log.info("building SPANK plugin: %s", " ".join(cmd))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"compiling the SPANK plugin took longer than {timeout:.0f} s") from None
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        hint = ""
        if HEADER in res.stderr and "No such file" in res.stderr:
            hint = " (slurm/spank.h is missing: install libslurm-dev, or pass --include-dir)"
        raise ConfigError(f"compiling the SPANK plugin failed{hint}:\n{res.stderr.strip()}")
    os.replace(tmp, dest)  # never overwrite a mapped .so in place
    return dest


@dataclass(frozen=True)
class PlugstackLine:
    """One ``plugstack.conf`` line loading the plugin, with its arguments."""

    so_path: Path
    orchestrator: str = ""
    rota: str = ""
    epilog_timeout: int = 20
    required: bool = True
    python: str = ""  # the Python rota is installed in: issues each job's token (with auth_key)
    auth_key: str = ""  # the orchestrator's auth key, readable by root only
    tls_ca: str = ""  # the orchestrator's TLS CA, given to jobs and the epilog
    max_priority: int = 0  # the highest --timeslice-priority a job's token may carry (0: none above 0)

    def render(self) -> str:
        parts = ["required" if self.required else "optional", str(self.so_path)]
        for name in ("orchestrator", "rota", "python", "auth_key", "tls_ca"):
            value = getattr(self, name)
            if any(c.isspace() for c in value):
                raise ConfigError(f"plugstack.conf argument {name}={value!r} contains white space, which "
                                  "plugstack.conf cannot quote; use a path without spaces")
            if value:
                parts.append(f"{name}={value}")
        if self.epilog_timeout != 20:
            parts.append(f"epilog_timeout={self.epilog_timeout}")
        if self.max_priority:
            parts.append(f"max_priority={self.max_priority}")
        return " ".join(parts)


def plugstack_path() -> Path:
    """The plugstack.conf slurmd reads: ``PlugStackConfig`` of slurm.conf ($SLURM_CONF), else beside slurm.conf."""
    conf = Path(os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf")
    try:
        lines = conf.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.split("#", 1)[0].strip().partition("=")
        if key.strip().lower() == "plugstackconfig" and value.strip():
            return Path(value.strip())
    return conf.with_name("plugstack.conf")


def read_plugstack(path: Path) -> dict[str, str]:
    """The ``key=value`` arguments of rota's line in ``path`` ({} if the file or the line is missing)."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return {}
    for line in lines:
        words = line.split("#", 1)[0].split()
        if len(words) >= 2 and words[0] in ("required", "optional") and Path(words[1]).name == PLUGIN_NAME:
            return dict(w.split("=", 1) for w in words[2:] if "=" in w)
    return {}


def write_plugstack(path: Path, line: PlugstackLine) -> None:
    """Add or replace rota's line in ``path`` (other plugins' lines are kept)."""
    path = Path(path)
    old = path.read_text().splitlines() if path.exists() else []
    kept: list[str] = []
    skip_next = False
    for text in old:
        if text.strip() == MARKER:
            skip_next = True
            continue
        if skip_next or PLUGIN_NAME in text:
            skip_next = False
            continue
        kept.append(text)
    kept += [MARKER, line.render()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".rota-tmp")
    tmp.write_text("\n".join(kept) + "\n")
    os.replace(tmp, path)
