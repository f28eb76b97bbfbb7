"""bench/check_spec_deps.py on wheels built here: requirements met by the spec or the machine's list, versions,
markers that do not apply on Linux x86_64 CPython 3.12, extras taken only when asked for, and the exit status."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "check_spec_deps.py"


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    dist = f"{name}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    out = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{dist}/METADATA", meta)
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return out


def _check(tmp: Path, wheels: list[str]) -> subprocess.CompletedProcess[str]:
    spec = tmp / "spec.toml"
    spec.write_text('name = "toy"\npython = "3.12"\nplatforms = ["any"]\nwheels = ['
                    + ", ".join(f'"{w}"' for w in wheels) + "]\n")
    return subprocess.run([sys.executable, str(SCRIPT), str(spec), "--wheels-dir", str(tmp / "w"),
                           "--device", str(tmp / "device.txt")], capture_output=True, text=True, timeout=60)


def test_a_closed_spec_passes_and_lists_what_it_cannot_verify(tmp_path: Path) -> None:
    w = tmp_path / "w"
    w.mkdir()
    (tmp_path / "device.txt").write_text("# the machine\ntorch==2.11.0\nPyYAML\n")
    _wheel(w, "engine", "1.0", [
        "helper_lib>=0.3,<0.5", "torch==2.11.*", "pyyaml>=6", "kernels[cu13]==2.0.post1",
        'winonly; sys_platform == "win32"', 'oldpy; python_version < "3.10"',
        'armonly; platform_machine == "aarch64" or platform_machine == "arm64"',
        'testing-dep; extra == "test"', 'needed-here; sys_platform == "linux" and (python_version >= "3.11")'])
    _wheel(w, "helper_lib", "0.4.1", [])
    _wheel(w, "kernels", "2.0.post1", ['cu13-libs~=1.2; extra == "cu13"', 'cu12-libs; extra == "cu12"'])
    _wheel(w, "cu13_libs", "1.2.5", [])
    _wheel(w, "needed_here", "3.0", [])
    r = _check(tmp_path, ["engine==1.0", "helper-lib==0.4.1", "kernels==2.0.post1", "cu13-libs==1.2.5",
                          "needed-here==3.0"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "UNMET" not in r.stdout
    assert "unverified: engine==1.0 needs pyyaml>=6: on the machine, version unknown" in r.stdout
    assert "0 unmet, 1 unverified" in r.stdout


def test_missing_wrong_versions_and_requested_extras_are_unmet(tmp_path: Path) -> None:
    w = tmp_path / "w"
    w.mkdir()
    (tmp_path / "device.txt").write_text("torch==2.11.0\ntransformers==5.17.0\n")
    _wheel(w, "engine", "1.0", ["helper-lib>=0.5", "torch==2.10.0", "kernels[cu13]", "absent-lib",
                                "transformers==5.12.1"])
    _wheel(w, "helper_lib", "0.4.1", [])
    _wheel(w, "kernels", "2.0", ['cu13-libs; extra == "cu13"'])
    _wheel(w, "transformers", "5.12.1", [])
    r = _check(tmp_path, ["engine==1.0", "helper-lib==0.4.1", "kernels==2.0", "transformers==5.12.1",
                          "pinned-only==1.0"])
    assert r.returncode == 1
    out = r.stdout
    assert "engine==1.0 needs helper-lib>=0.5: the spec ships 0.4.1" in out
    assert "engine==1.0 needs torch==2.10.0: the machine has 2.11.0, not shipped" in out
    assert "kernels==2.0[cu13] needs cu13-libs: neither in the spec nor on the machine" in out
    assert "engine==1.0 needs absent-lib: neither in the spec nor on the machine" in out
    assert "pinned-only==1.0: pinned by the spec, no wheel" in out
    assert "shadows: transformers==5.12.1 shadows the machine's transformers 5.17.0" in out
    assert "5 unmet" in out


def test_versions_and_markers() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import check_spec_deps as c

    assert c.satisfies("0.6.15.post1", "==0.6.15.post1") and not c.satisfies("0.6.15", "==0.6.15.post1")
    assert c.satisfies("4.0.0b18", ">=4.0.0b18") and not c.satisfies("4.0.0b17", ">=4.0.0b18")
    assert c.satisfies("2.11.0", "==2.11") and c.satisfies("13.2.1", "~=13.2") and not c.satisfies("14.0", "~=13.2")
    assert c.satisfies("0.14.2", "<0.15,>=0.14.1") and not c.satisfies("1.0.dev1", ">=1.0")
    assert c.parse_req("flashinfer_python[cu13]==0.6.15.post1") == ("flashinfer-python", {"cu13"},
                                                                     "==0.6.15.post1", "")
    env = c.marker_env("3.12")
    assert c.eval_marker('sys_platform != "linux" or (sys_platform == "linux" and platform_machine != "aarch64")',
                         env, None)
    assert not c.eval_marker('python_version < "3.10" and extra == "x"', env, "x")
    assert c.eval_marker('extra == "Cu_13"', env, "cu-13") and not c.eval_marker('extra == "cu13"', env, None)


def test_constraints_on_a_machine_package_that_no_version_meets_are_unmet(tmp_path: Path) -> None:
    w = tmp_path / "w"
    w.mkdir()
    (tmp_path / "device.txt").write_text("protobuf\n")
    _wheel(w, "dsl", "4.6.0", ["protobuf<7,>=6.30.2"])
    _wheel(w, "reflection", "1.85.1", ["protobuf<8.0.0,>=7.35.1"])
    _wheel(w, "reflection", "1.81.1", ["protobuf<7.0.0,>=6.33.5"])  # the pinned one of two in the folder wins
    r = _check(tmp_path, ["dsl==4.6.0", "reflection==1.81.1"])
    assert r.returncode == 0 and "2 unverified" in r.stdout, r.stdout
    (w / "reflection-1.81.1-py3-none-any.whl").unlink()
    r = _check(tmp_path, ["dsl==4.6.0", "reflection==1.85.1"])
    assert r.returncode == 1
    assert "no version of protobuf meets all of: " in r.stdout
    assert "reflection==1.85.1 needs <8.0.0,>=7.35.1" in r.stdout
