"""bench/stage_wheels.py end to end on CPU: real wheels (built here), pruned, split, put piece by piece into a
destination as the device runs do, a recycled machine detected, then joined, checked and installed by pip."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "stage_wheels.py"


def _wheel(folder: Path, name: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel: the files, METADATA, WHEEL and a RECORD with their hashes."""
    dist = f"{name}-1.0.dist-info"
    files = {**files, f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    out = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
        z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return out


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture
def staged(tmp_path: Path) -> dict[str, Path]:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    blob = b"k" * (3 * 2**20)  # 3 MiB; the wheels here are stored, not deflated, so the bundle is this large
    _wheel(wheels, "engine_a", {"engine_a/__init__.py": b"VALUE = 41\n", "engine_a/big_kernel.so": blob,
                                "engine_a/data.bin": blob[: 2**20]})
    _wheel(wheels, "engine_b", {"engine_b/__init__.py": b"from engine_a import VALUE\nVALUE += 1\n"})
    spec = tmp_path / "spec.toml"
    spec.write_text('name = "toy-1.0"\npython = "3.11"\nplatforms = ["any"]\n'
                    'wheels = ["engine-a==1.0", "engine-b==1.0"]\nprune = ["engine_a/big_kernel.so"]\n'
                    '[env]\nTOY_FLAG = "0"\n')
    r = _run("prepare", str(spec), "--stage", str(tmp_path / "stage"), "--wheels-dir", str(wheels),
             "--piece-mib", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return {"stage": tmp_path / "stage" / "toy-1.0", "dest": tmp_path / "dest", "target": tmp_path / "target",
            "tmp": tmp_path, "out": Path(r.stdout)}


def test_pieces_put_one_by_one_then_install_and_import(staged: dict[str, Path]) -> None:
    stage, dest, target = staged["stage"], staged["dest"], staged["target"]
    manifest = json.loads((stage / "manifest.json").read_text())
    assert [w["pruned"] for w in manifest["wheels"]] == [["engine_a/big_kernel.so"], []]
    assert len(manifest["pieces"]) >= 2  # ~1 MB of data.bin plus the rest, in 1 MiB pieces
    for i in range(len(manifest["pieces"])):
        r = _run("put", str(stage), "--piece", str(i), "--dest", str(dest), cwd=staged["tmp"])
        assert r.returncode == 0, r.stderr
    r = _run("install", str(stage), "--dest", str(dest), "--target", str(target), cwd=staged["tmp"])
    assert r.returncode == 0, r.stderr
    site = target / "toy-1.0"
    assert not (site / "engine_a" / "big_kernel.so").exists() and (site / "engine_a" / "data.bin").is_file()
    r = subprocess.run([sys.executable, "-c", "import engine_b; print(engine_b.VALUE)"], capture_output=True,
                       text=True, env={"PYTHONPATH": str(site)})
    assert r.stdout.strip() == "42", r.stderr
    env = _run("env", str(stage), "--dest", str(dest), "--target", str(target), cwd=staged["tmp"])
    assert f'PYTHONPATH="{site}' in env.stdout and 'TOY_FLAG="0"' in env.stdout
    again = _run("install", str(stage), "--dest", str(dest), "--target", str(target), cwd=staged["tmp"])
    assert again.returncode == 0 and "already installed" in again.stdout


def test_a_recycled_machine_is_named_and_a_bad_piece_refused(staged: dict[str, Path]) -> None:
    stage, dest = staged["stage"], staged["dest"]
    assert _run("put", str(stage), "--piece", "0", "--dest", str(dest), cwd=staged["tmp"]).returncode == 0
    shutil.rmtree(dest)  # the machine went back between two runs
    r = _run("put", str(stage), "--piece", "1", "--dest", str(dest), cwd=staged["tmp"])
    assert r.returncode == 3 and "recycled" in r.stderr and "lacks pieces [0]" in r.stderr
    r = _run("install", str(stage), "--dest", str(dest), "--target", str(staged["target"]), cwd=staged["tmp"])
    assert r.returncode == 3 and "start again at piece 0" in r.stderr
    piece = stage / "piece-00"
    piece.write_bytes(b"x" + piece.read_bytes()[1:])  # damaged on the way
    r = _run("put", str(stage), "--piece", "0", "--dest", str(dest), cwd=staged["tmp"])
    assert r.returncode == 2 and "sha256 differs" in r.stderr


def test_a_spec_that_prunes_nothing_it_names_or_pins_no_version_is_refused(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "engine_a", {"engine_a/__init__.py": b""})
    spec = tmp_path / "spec.toml"
    spec.write_text('name = "toy"\npython = "3.11"\nplatforms = ["any"]\nwheels = ["engine-a"]\n')
    r = _run("prepare", str(spec), "--wheels-dir", str(wheels), cwd=tmp_path)
    assert r.returncode == 2 and "must pin a version" in r.stderr
    spec.write_text('name = "toy"\npython = "3.11"\nplatforms = ["any"]\nwheels = ["engine-a==1.0"]\n'
                    'prune = ["engine_a/gone.so"]\n')
    r = _run("prepare", str(spec), "--wheels-dir", str(wheels), cwd=tmp_path)
    assert r.returncode == 2 and "found in no wheel" in r.stderr and "engine_a/gone.so" in r.stderr
