"""The repository's Dockerfile builds what the rendered manifests run.

No container engine runs on the test machines, so the image itself is not built here;
these checks read the Dockerfile: a pinned Python, two stages, a non-root user that
matches the pods' runAsUser, and every rota package whose command the manifests run
installed from this repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
from k8s_checks import pod_specs

from rota_k8s import load_values, render

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
# what each rendered rota command needs installed, by the package folder that provides it
NEEDS = {"agent": "packages/agent", "k8s": "packages/k8s-controller", "--etcd": "packages/orchestrator-etcd"}


def with_local_dependencies(folders: set[str]) -> set[str]:
    """``folders`` and every package of this repository they depend on (pip finds those only in the build)."""
    names = {}
    for pyproject in ROOT.glob("packages/*/pyproject.toml"):
        project = tomllib.loads(pyproject.read_text())["project"]
        names[project["name"]] = (pyproject.parent.relative_to(ROOT).as_posix(), project.get("dependencies", []))
    by_folder = {folder: deps for folder, deps in names.values()}
    out, todo = set(), list(folders)
    while todo:
        folder = todo.pop()
        if folder in out:
            continue
        out.add(folder)
        for dep in by_folder[folder]:
            name = re.match(r"[A-Za-z0-9_.-]+", dep).group(0)
            if name in names:
                todo.append(names[name][0])
    return out


def instructions(name: str) -> list[str]:
    joined = DOCKERFILE.replace("\\\n", " ")
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.split(None, 1)[:1] == [name]]


def test_python_is_pinned_and_the_build_has_two_stages() -> None:
    (version,) = [a.split("=", 1)[1] for a in instructions("ARG") if a.startswith("PYTHON_VERSION=")]
    assert re.fullmatch(r"3\.1[0-9]\.[0-9]+", version), version  # an exact patch release
    froms = instructions("FROM")
    assert len(froms) == 2 and all(f.startswith("python:${PYTHON_VERSION}-slim-") for f in froms)
    assert froms[0].endswith(" AS build")
    assert "--from=build /opt/rota /opt/rota" in instructions("COPY")[-1]


def test_runs_as_the_non_root_user_the_pods_declare() -> None:
    (user,) = instructions("USER")
    uid = int(user.split(":")[0])
    assert uid != 0
    objs = render(load_values())
    for name, _, spec in pod_specs(objs):
        for c in spec["containers"]:
            if c["image"] == load_values().image and name != "rota-agent":  # the agent runs as root on purpose
                assert c["securityContext"]["runAsUser"] == uid, (name, c["name"])


def test_every_package_the_manifests_run_is_installed_from_the_repository() -> None:
    objs = render(load_values())
    commands = [c["command"] for _, _, spec in pod_specs(objs)
                for c in [*spec.get("initContainers", []), *spec["containers"]] if c["command"][0] == "rota"]
    used = {"packages/core"} | {folder for cmd in commands for word, folder in NEEDS.items() if word in cmd}
    assert used == {"packages/core", *NEEDS.values()}
    needed = with_local_dependencies(used)
    assert "packages/agent-client" in needed  # rota-agent's tenant half, a dependency found in its pyproject
    copied = {c.split()[0] for c in instructions("COPY") if c.startswith("packages/")}
    (install,) = [r for r in instructions("RUN") if "pip install" in r]
    assert needed <= copied
    for folder in needed:
        assert re.search(rf"\./{folder}(\[\w+\])?\"?(\s|$)", install), folder
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert all(f"!{folder}" in ignore for folder in needed)


def test_the_image_installs_with_the_dependency_lock() -> None:
    """image.lock pins every third-party distribution (scripts/lock_image.py resolves them with pip); the
    Dockerfile installs with it as constraints, and each pin satisfies what the image's packages ask for."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    lock = (ROOT / "image.lock").read_text().splitlines()
    pins = {}
    for line in (ln for ln in lock if ln and not ln.startswith("#")):
        name, sep, version = line.partition("==")
        assert sep and re.fullmatch(r"[A-Za-z0-9_.-]+", name) and version, line
        assert canonicalize_name(name) not in pins, f"{name} pinned twice"
        pins[canonicalize_name(name)] = version
    (install,) = [r for r in instructions("RUN") if "pip install" in r]
    assert "pip install -c image.lock " in install and "pip check" in install
    assert "image.lock image.lock" in instructions("COPY")
    assert "!image.lock" in (ROOT / ".dockerignore").read_text().splitlines()
    local = {tomllib.loads(p.read_text())["project"]["name"] for p in ROOT.glob("packages/*/pyproject.toml")}
    env = {"python_version": "3.11", "sys_platform": "linux", "platform_system": "Linux"}
    for folder in with_local_dependencies(set(NEEDS.values()) | {"packages/core"}):
        project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
        wanted = list(project.get("dependencies", []))
        if folder == "packages/agent":  # the Dockerfile installs rota-agent[gpu]
            wanted += project.get("optional-dependencies", {}).get("gpu", [])
        for text in wanted:
            req = Requirement(text)
            if req.name in local or (req.marker is not None and not req.marker.evaluate(env)):
                continue
            pinned = pins.get(canonicalize_name(req.name))
            assert pinned is not None, f"{req.name} ({folder}) is not in image.lock: run scripts/lock_image.py"
            assert req.specifier.contains(pinned, prereleases=True), f"image.lock pins {req.name}=={pinned}, but " \
                f"{folder} asks for {req.specifier}: run scripts/lock_image.py"
