"""Write image.lock: the exact version of every third-party distribution the Dockerfile installs.

    .venv/bin/python scripts/lock_image.py          # re-resolve and rewrite image.lock
    .venv/bin/python scripts/lock_image.py --check  # exit 1 if a fresh resolution differs from image.lock

The Dockerfile installs rota's packages with ``pip install -c image.lock``, so an image
built later gets the dependencies this lock was tested with, not whatever is newest that
day. The resolution is pip's own (``pip install --dry-run --report``) of the packages the
Dockerfile names, for this Python (the image's minor version: 3.11). Versions only, no
file hashes: the image is built for several platforms, and each has its own files.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOCK = ROOT / "image.lock"
HEADER = ("# The exact versions of the third-party distributions rota's image installs (Dockerfile: pip install\n"
          "# -c image.lock). Written by scripts/lock_image.py; re-run it after changing a package's dependencies.\n")


def dockerfile_packages() -> list[str]:
    """The ``./packages/...`` arguments of the Dockerfile's pip install (extras included)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [p.strip('"') for p in re.findall(r'"?\./packages/[\w-]+(?:\[[\w,]+\])?"?', text)]


def resolve() -> dict[str, str]:
    """name -> version of every non-local distribution pip would install for the Dockerfile's packages."""
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), *dockerfile_packages()], cwd=ROOT, check=True,
                       stderr=subprocess.DEVNULL)
        installs = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"]: i["metadata"]["version"] for i in installs
            if not i["download_info"]["url"].startswith("file://" + str(ROOT))}


def render(pins: dict[str, str]) -> str:
    ordered = sorted(pins.items(), key=lambda pin: pin[0].lower())
    return HEADER + "".join(f"{name}=={version}\n" for name, version in ordered)


def main() -> int:
    text = render(resolve())
    if "--check" in sys.argv[1:]:
        if LOCK.read_text() != text:
            print("image.lock is out of date: run scripts/lock_image.py", file=sys.stderr)
            return 1
        return 0
    LOCK.write_text(text)
    print(f"wrote {LOCK.relative_to(ROOT)} ({text.count('==')} pins)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
