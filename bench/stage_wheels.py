#!/usr/bin/env python3
"""Stage an inference engine's wheels (vLLM, SGLang) on the H200 device machine, in pieces.

Why: that machine has no PyPI and one run carries at most 64 MiB of files (the working tree included), while
vllm 0.26.0's wheel alone is 304 MB. Files under /tmp there survive while the machine stays warm (about 30 s
after a run), so the wheels travel as a bundle split into pieces, one piece per back-to-back run.

Here (CPU machine, PyPI reachable)::

    python3 bench/stage_wheels.py prepare bench/engines/vllm-0.26.0.toml      # downloads, prunes, splits

It downloads the spec's wheels for the device's Python and platform (``--no-deps``: the spec lists every one),
removes the files the spec's ``prune`` names from them (kernels an H200 never loads) and rewrites their RECORD,
packs them into one bundle and splits it into ``.stage/<name>/piece-NN`` with a ``manifest.json`` of sha256s;
then it prints the device runs, each carrying the manifest and one piece. On the device machine::

    python3 bench/stage_wheels.py put .stage/vllm-0.26.0 --piece 0     # one run per piece, back to back
    python3 bench/stage_wheels.py install .stage/vllm-0.26.0           # the last run: join, check, install
    eval "$(python3 bench/stage_wheels.py env .stage/vllm-0.26.0)"     # PYTHONPATH and the spec's env

``put`` checks its piece and every earlier one already there; if the machine was recycled mid-way (the earlier
pieces are gone) it says so and exits 3: start again at piece 0. ``install`` checks every piece, the bundle and
each wheel against the manifest, installs with ``pip --no-index --no-deps --target`` and is a no-op when the same
bundle is installed already. The standard library only: the device side runs before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import tomllib

MIB = 1 << 20
DEFAULT_DEST = "/tmp/rota-stage"
DEFAULT_TARGET = "/tmp/rota-engines"
RECYCLED = 3  # exit status of put/install when pieces staged by earlier runs are gone


class StageError(Exception):
    """A bad spec, a failed download or a check that failed: the message names the fix."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(8 * MIB):
            h.update(block)
    return h.hexdigest()


def load_spec(path: Path) -> dict:
    """The spec (a TOML file of ``name``, ``python``, ``platforms``, ``wheels``, ``prune``, ``env``), checked."""
    try:
        spec = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise StageError(f"spec {path}: {e}; pass a TOML file like bench/engines/vllm-0.26.0.toml") from None
    for key, kind in (("name", str), ("python", str), ("platforms", list), ("wheels", list)):
        if not isinstance(spec.get(key), kind) or not spec[key]:
            raise StageError(f"spec {path}: {key!r} must be a non-empty {kind.__name__}")
    if not all(isinstance(w, str) and "==" in w for w in spec["wheels"]):
        raise StageError(f"spec {path}: every entry of 'wheels' must pin a version (name==version)")
    if not spec["name"].replace("-", "").replace(".", "").replace("_", "").isalnum():
        raise StageError(f"spec {path}: name {spec['name']!r} may hold only letters, digits, '.', '-' and '_'")
    spec.setdefault("prune", [])
    spec.setdefault("env", {})
    return spec


def _key(name: str, version: str) -> tuple[str, str]:
    """A distribution's name as pip compares it (``Foo_bar`` is ``foo-bar``) and its version."""
    return re.sub(r"[-_.]+", "-", name).lower(), version


def download(spec: dict, into: Path) -> list[Path]:
    """pip download of the spec's wheels for the device's interpreter and platforms (no dependencies)."""
    into.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           spec["python"], "--implementation", "cp", "-d", str(into)]
    for plat in spec["platforms"]:
        cmd += ["--platform", plat]
    print(f"stage: downloading {len(spec['wheels'])} wheels into {into}", file=sys.stderr)
    if subprocess.run(cmd + spec["wheels"]).returncode:
        raise StageError("pip download failed (above); a platform tag may be missing from the spec's platforms")
    return sorted(into.glob("*.whl"))


def prune(wheel: Path, patterns: list[str], out: Path) -> list[str]:
    """Copy ``wheel`` to ``out`` without the members named in ``patterns``, its RECORD rewritten; the names removed."""
    with zipfile.ZipFile(wheel) as src:
        drop = [n for n in src.namelist() if n in patterns]
        if not drop:
            shutil.copyfile(wheel, out)
            return []
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                if info.filename in drop:
                    continue
                data = src.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    data = b"".join(line for line in data.splitlines(keepends=True)
                                    if line.split(b",", 1)[0].decode() not in drop)
                dst.writestr(info, data, compress_type=info.compress_type)
    return drop


def prepare(args: argparse.Namespace) -> int:
    spec = load_spec(Path(args.spec))
    stage = Path(args.stage) / spec["name"]
    if args.piece_mib < 1 or args.piece_mib > 60:
        raise StageError(f"--piece-mib {args.piece_mib}: pass 1..60 (a run carries 64 MiB with the working tree)")
    wheels = sorted(Path(args.wheels_dir).glob("*.whl")) if args.wheels_dir else download(spec, stage / "download")
    if not args.wheels_dir:  # the download folder may still hold wheels of an earlier version of the spec
        pinned = {_key(*w.split("==", 1)) for w in spec["wheels"]}
        wheels = [w for w in wheels if _key(*w.name.split("-")[:2]) in pinned]
    if not wheels:
        raise StageError(f"no wheels found in {args.wheels_dir or stage / 'download'}")
    shutil.rmtree(stage / "wheels", ignore_errors=True)
    (stage / "wheels").mkdir(parents=True)
    listed, unused = [], set(spec["prune"])
    for w in wheels:
        out = stage / "wheels" / w.name
        dropped = [] if args.no_prune else prune(w, spec["prune"], out)
        if args.no_prune:
            shutil.copyfile(w, out)
        unused -= set(dropped)
        listed.append({"file": w.name, "bytes": out.stat().st_size, "sha256": sha256(out), "pruned": dropped,
                       "bytes_before_prune": w.stat().st_size})
    if unused and not args.no_prune:
        raise StageError(f"prune names {sorted(unused)}, found in no wheel: fix the spec's prune list")
    bundle = stage / "bundle.tar"
    with tarfile.open(bundle, "w") as tar:
        for w in listed:
            tar.add(stage / "wheels" / w["file"], arcname=w["file"])
    for old in stage.glob("piece-*"):
        old.unlink()
    pieces, size = [], args.piece_mib * MIB
    with bundle.open("rb") as f:
        while block := f.read(size):
            p = stage / f"piece-{len(pieces):02d}"
            p.write_bytes(block)
            pieces.append({"file": p.name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {"name": spec["name"], "bundle_sha256": sha256(bundle), "bundle_bytes": bundle.stat().st_size,
                "pieces": pieces, "wheels": listed, "env": spec["env"]}
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    bundle.unlink()
    saved = sum(w["bytes_before_prune"] - w["bytes"] for w in listed)
    print(f"stage: {len(listed)} wheels, {manifest['bundle_bytes'] / MIB:.0f} MiB ({saved / MIB:.0f} MiB pruned) in "
          f"{len(pieces)} pieces under {stage}; the device runs, back to back (the machine keeps /tmp ~30 s):")
    rel = os.path.relpath(stage)
    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        cmd = f"python3 bench/stage_wheels.py put {rel} --piece {i}"
        if last:
            cmd += f" && python3 bench/stage_wheels.py install {rel}"
        print(f'  run {i + 1}: carry ["{rel}/manifest.json", "{rel}/{p["file"]}"]  command: {cmd}')
    print(f'  then, in each later run: eval "$(python3 bench/stage_wheels.py env {rel})"')
    return 0


def read_manifest(stage: Path) -> dict:
    try:
        return json.loads((stage / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise StageError(f"{stage}/manifest.json: {e}; carry it in every run (prepare printed the carry list)") \
            from None


def missing_pieces(manifest: dict, dest: Path, upto: int) -> list[int]:
    """Indexes below ``upto`` whose piece is not in ``dest`` with the manifest's size and sha256."""
    gone = []
    for i, p in enumerate(manifest["pieces"][:upto]):
        f = dest / p["file"]
        if not f.is_file() or f.stat().st_size != p["bytes"] or sha256(f) != p["sha256"]:
            gone.append(i)
    return gone


def put(args: argparse.Namespace) -> int:
    stage, dest = Path(args.stage), Path(args.dest) / Path(args.stage).name
    manifest = read_manifest(stage)
    n = len(manifest["pieces"])
    if not 0 <= args.piece < n:
        raise StageError(f"--piece {args.piece}: this bundle has pieces 0..{n - 1}")
    gone = missing_pieces(manifest, dest, args.piece)
    if gone:
        print(f"stage: the machine was recycled (or a run was skipped): {dest} lacks pieces {gone} of {n}; start "
              f"again at piece 0, each run right after the last", file=sys.stderr)
        return RECYCLED
    p = manifest["pieces"][args.piece]
    src = stage / p["file"]
    if not src.is_file():
        raise StageError(f"{src} did not travel: carry it in this run")
    if sha256(src) != p["sha256"]:
        raise StageError(f"{src}: sha256 differs from the manifest; run prepare again here")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest / p["file"])
    shutil.copyfile(stage / "manifest.json", dest / "manifest.json")
    left = n - args.piece - 1
    print(f"stage: piece {args.piece + 1}/{n} of {manifest['name']} in {dest}; "
          + (f"{left} to go: next --piece {args.piece + 1}" if left else "all there: run install"))
    return 0


def installed_paths(args: argparse.Namespace) -> tuple[dict, Path, Path]:
    """The manifest (carried, or put in ``--dest`` by an earlier run), the pieces' folder and the install root."""
    stage = Path(args.stage)
    dest = Path(args.dest) / stage.name
    manifest = read_manifest(stage if (stage / "manifest.json").exists() else dest)
    return manifest, dest, Path(args.target) / manifest["name"]


def install(args: argparse.Namespace) -> int:
    manifest, dest, target = installed_paths(args)
    done = target / ".rota-staged"
    if done.is_file() and done.read_text().strip() == manifest["bundle_sha256"]:
        print(f"stage: {manifest['name']} already installed in {target}")
        return 0
    gone = missing_pieces(manifest, dest, len(manifest["pieces"]))
    if gone:
        print(f"stage: {dest} lacks pieces {gone} of {len(manifest['pieces'])} (the machine was recycled, or they "
              f"were never put); start again at piece 0", file=sys.stderr)
        return RECYCLED
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        bundle = Path(tmp) / "bundle.tar"
        with bundle.open("wb") as out:
            for p in manifest["pieces"]:
                with (dest / p["file"]).open("rb") as f:
                    shutil.copyfileobj(f, out, 8 * MIB)
        if sha256(bundle) != manifest["bundle_sha256"]:
            raise StageError("the joined bundle's sha256 differs from the manifest; start again at piece 0")
        with tarfile.open(bundle) as tar:
            tar.extractall(tmp, filter="data")
        files = []
        for w in manifest["wheels"]:
            f = Path(tmp) / w["file"]
            if sha256(f) != w["sha256"]:
                raise StageError(f"{w['file']}: sha256 differs from the manifest; start again at piece 0")
            files.append(str(f))
        shutil.rmtree(target, ignore_errors=True)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--target", str(target), *files])
        if r.returncode:
            raise StageError(f"pip install into {target} failed (above)")
    done.write_text(manifest["bundle_sha256"] + "\n")
    print(f"stage: {manifest['name']} installed in {target} ({len(files)} wheels, sha256 checked); "
          f'eval "$(python3 bench/stage_wheels.py env {args.stage})"')
    return 0


def env(args: argparse.Namespace) -> int:
    manifest, _dest, target = installed_paths(args)
    if not (target / ".rota-staged").is_file():
        raise StageError(f"{manifest['name']} is not installed in {target}: run put and install first")
    print(f'export PYTHONPATH="{target}${{PYTHONPATH:+:$PYTHONPATH}}" PATH="{target}/bin:$PATH"')
    for k, v in manifest["env"].items():
        print(f"export {k}={json.dumps(str(v))}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="here: download, prune and split a spec's wheels into pieces")
    p.add_argument("spec", help="TOML spec, e.g. bench/engines/vllm-0.26.0.toml")
    p.add_argument("--stage", default=".stage", help="git-ignored folder for the pieces (default .stage)")
    p.add_argument("--piece-mib", type=int, default=48, help="MiB per piece (default 48: the tree travels too)")
    p.add_argument("--wheels-dir", help="take the wheels from this folder instead of downloading them")
    p.add_argument("--no-prune", action="store_true", help="ship every file of every wheel")
    for name, text in (("put", "device: copy one carried piece into --dest, checking it and the earlier ones"),
                       ("install", "device: join the pieces, check every sha256, pip install into --target"),
                       ("env", "device: print the shell exports (PYTHONPATH, the spec's env) for eval")):
        p = sub.add_parser(name, help=text)
        p.add_argument("stage", help="the stage folder prepare made, e.g. .stage/vllm-0.26.0")
        p.add_argument("--dest", default=DEFAULT_DEST, help=f"where pieces wait between runs (default {DEFAULT_DEST})")
        if name == "put":
            p.add_argument("--piece", type=int, required=True, help="index of the piece this run carries")
        else:
            p.add_argument("--target", default=DEFAULT_TARGET, help=f"install root (default {DEFAULT_TARGET})")
    args = ap.parse_args(argv)
    try:
        return {"prepare": prepare, "put": put, "install": install, "env": env}[args.cmd](args)
    except StageError as e:
        print(f"stage: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
