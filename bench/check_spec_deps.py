#!/usr/bin/env python3
"""Check that an engine spec (bench/engines/*.toml) is closed under its wheels' runtime requirements.

For every wheel the spec pins (read from the folder ``prepare`` downloaded them into, ``.stage/<name>/download``,
or ``--wheels-dir``), each ``Requires-Dist`` of its METADATA whose marker applies on the device machine (Linux
x86_64, CPython of the spec's ``python``; extras only where some requirement asks for them, e.g.
``flashinfer_python[cu13]``) must be met by another spec wheel, whose version is checked, or by a package already
on the machine (bench/engines/device-packages.txt, from KINDS.md): its version is checked where that list gives one,
otherwise the requirement is reported as unverified. Spec wheels that shadow a package of the machine are listed.

    python3 bench/check_spec_deps.py bench/engines/sglang-0.5.17.toml      # exit 1 if any requirement is unmet

The standard library only (tomllib, zipfile, re).
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
DEVICE_LIST = ROOT / "bench" / "engines" / "device-packages.txt"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---- versions (PEP 440, enough for release/pre/post/dev/local and wildcards) ----
_VER = re.compile(r"^\s*v?(?:(\d+)!)?(\d+(?:\.\d+)*)(?:[-_.]?(a|b|c|rc|alpha|beta|pre|preview)[-_.]?(\d*))?"
                  r"(?:-(\d+)|[-_.]?(?:post|rev|r)[-_.]?(\d*))?(?:[-_.]?dev[-_.]?(\d*))?(?:\+[a-z0-9.]+)?\s*$", re.I)


def vkey(v: str) -> tuple:
    m = _VER.match(v)
    if not m:
        raise ValueError(f"not a version: {v!r}")
    epoch, rel, pre_l, pre_n, post1, post2, dev = m.groups()
    release = tuple(int(x) for x in rel.split("."))
    while len(release) > 1 and release[-1] == 0:
        release = release[:-1]
    pre_rank = {"a": 0, "alpha": 0, "b": 1, "beta": 1}.get((pre_l or "").lower(), 2)
    pre = (pre_rank, int(pre_n or 0)) if pre_l else ((-1, 0) if dev is not None and post1 is None
                                                     and post2 is None else (3, 0))
    post = int(post1 or post2 or 0) if (post1 is not None or post2 is not None) else -1
    devk = int(dev or 0) if dev is not None else float("inf")
    return (int(epoch or 0), release, pre, post, devk)


def _release(v: str) -> list[int]:
    m = _VER.match(v)
    return [int(x) for x in m.group(2).split(".")] if m else []


def satisfies(version: str, spec: str) -> bool:
    """``version`` meets every clause of ``spec`` (e.g. ``>=1.2,<2``, ``==0.4.*``, ``~=2.1``)."""
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op, want = re.match(r"(===|~=|==|!=|<=|>=|<|>)\s*(.+)", clause).groups()
        want = want.strip()
        if want.endswith(".*"):
            prefix = _release(want[:-2])
            hit = _release(version)[: len(prefix)] + [0] * max(0, len(prefix) - len(_release(version))) == prefix
            if (op == "==") != hit:
                return False
            continue
        a, b = vkey(version), vkey(want)
        if op == "~=":
            rel = _release(want)[:-1]
            ok = a >= b and _release(version)[: len(rel)] == rel
        else:
            ok = {"==": a == b, "===": version == want, "!=": a != b, "<=": a <= b, ">=": a >= b,
                  "<": a < b, ">": a > b}[op]
        if not ok:
            return False
    return True


def candidates(specs: list[str]) -> list[str]:
    """Versions worth trying against several specifiers: each bound named, and just above it (for ``>``)."""
    out = []
    for s in specs:
        for clause in filter(None, (c.strip() for c in s.split(","))):
            v = re.sub(r"^(===|~=|==|!=|<=|>=|<|>)\s*", "", clause).removesuffix(".*")
            out += [v, v + ".1", v + ".post1"]
    return [v for v in out if _VER.match(v)]


# ---- requirements and markers (PEP 508) ----
_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?\s*(?:\(([^)]*)\)|([^;@]*))?\s*(?:;(.*))?$")


def parse_req(text: str) -> tuple[str, set[str], str, str]:
    """(normalized name, extras, version specifier, marker) of a Requires-Dist line."""
    m = _REQ.match(text)
    if not m:
        raise ValueError(f"cannot parse requirement {text!r}")
    name, extras, paren, bare, marker = m.groups()
    return (norm(name), {norm(e) for e in (extras or "").split(",") if e.strip()},
            (paren or bare or "").strip(), (marker or "").strip())


def marker_env(python: str) -> dict[str, str]:
    return {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "platform_release": "", "platform_version": "", "implementation_version": python + ".0"}


_TOKEN = re.compile(r"\s*(\(|\)|and\b|or\b|not in\b|in\b|===|==|!=|~=|<=|>=|<|>|'[^']*'|\"[^\"]*\"|[A-Za-z_.]+)")


def eval_marker(marker: str, env: dict[str, str], extra: str | None) -> bool:
    """Evaluate a marker; ``extra == "x"`` is true only for ``extra`` (None: no extra requested)."""
    toks, pos = [], 0
    while pos < len(marker):
        m = _TOKEN.match(marker, pos)
        if not m:
            if marker[pos:].strip():
                raise ValueError(f"cannot parse marker {marker!r}")
            break
        toks.append(m.group(1))
        pos = m.end()
    i = 0

    def value(t: str) -> str | None:
        if t[0] in "'\"":
            return t[1:-1]
        if t == "extra":
            return extra
        return env.get(t, "")

    def atom() -> bool:
        nonlocal i
        if toks[i] == "(":
            i += 1
            r = expr()
            i += 1  # ')'
            return r
        left, op, right = toks[i], toks[i + 1], toks[i + 2]
        i += 3
        lv, rv = value(left), value(right)
        if lv is None or rv is None:
            return False
        if left == "extra" or right == "extra":
            lv, rv = norm(lv), norm(rv)
        if op in ("in", "not in"):
            return (lv in rv) == (op == "in")
        try:
            return satisfies(lv, f"{op}{rv}")
        except (ValueError, AttributeError):
            return {"==": lv == rv, "!=": lv != rv}.get(op, False)

    def conj() -> bool:
        nonlocal i
        r = atom()
        while i < len(toks) and toks[i] == "and":
            i += 1
            r = atom() and r
        return r

    def expr() -> bool:
        nonlocal i
        r = conj()
        while i < len(toks) and toks[i] == "or":
            i += 1
            r = conj() or r
        return r

    return expr()


# ---- the check ----
def read_device(path: Path) -> dict[str, str | None]:
    have: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, ver = line.partition("==")
            have[norm(name)] = ver.strip() or None
    return have


def read_wheel(path: Path) -> tuple[str, str, list[str]]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = Parser().parsestr(z.read(meta).decode("utf-8", "replace"))
    return norm(msg["Name"]), msg["Version"], msg.get_all("Requires-Dist") or []


def check(spec_path: Path, wheels_dir: Path | None, device: Path) -> tuple[list[str], list[str], list[str]]:
    """(unmet, unverified, notes): lines to print; the spec is closed when ``unmet`` is empty."""
    spec = tomllib.loads(spec_path.read_text())
    folder = wheels_dir or ROOT / ".stage" / spec["name"] / "download"
    env, have = marker_env(spec["python"]), read_device(device)
    pins = {norm(w.split("==")[0].split("[")[0]): w.split("==", 1)[1].strip() for w in spec["wheels"]}
    wheels: dict[str, tuple[str, list[str]]] = {}
    for f in sorted(folder.glob("*.whl")):  # other versions of a pin may lie there too: the pinned one wins
        name, version, reqs = read_wheel(f)
        if name in pins and (name not in wheels or vkey(version) == vkey(pins[name])):
            wheels[name] = (version, reqs)
    unmet = [f"{n}=={v}: pinned by the spec, no wheel in {folder} (run prepare)" for n, v in pins.items()
             if n not in wheels]
    unmet += [f"{n}: wheel is {wheels[n][0]}, the spec pins {v}" for n, v in pins.items()
              if n in wheels and vkey(wheels[n][0]) != vkey(v)]
    unverified, seen = [], set()
    asked: dict[str, list[tuple[str, str]]] = {}  # unknown-version machine package -> (who, specifier)
    extras: dict[str, set[str]] = {n: set() for n in wheels}
    done: dict[str, set[str | None]] = {n: set() for n in wheels}
    todo = [(n, None) for n in wheels]
    while todo:
        owner, extra = todo.pop()
        if extra in done[owner]:
            continue
        done[owner].add(extra)
        version, reqs = wheels[owner]
        for text in reqs:
            name, want_extras, vspec, marker = parse_req(text)
            if marker and not eval_marker(marker, env, extra):
                continue
            if extra is not None and "extra" not in marker:
                continue  # already taken with no extra
            who = f"{owner}=={version}" + (f"[{extra}]" if extra else "")
            if name in wheels:
                if vspec and not satisfies(wheels[name][0], vspec):
                    unmet.append(f"{who} needs {name}{vspec}: the spec ships {wheels[name][0]}")
                for e in want_extras - extras[name]:
                    extras[name].add(e)
                    todo.append((name, e))
            elif name in have:
                got = have[name]
                if vspec and got is None:
                    asked.setdefault(name, []).append((who, vspec))
                if vspec and got is None and (name, vspec) not in seen:
                    seen.add((name, vspec))
                    unverified.append(f"{who} needs {name}{vspec}: on the machine, version unknown")
                elif vspec and got is not None and not satisfies(got, vspec):
                    unmet.append(f"{who} needs {name}{vspec}: the machine has {got}, not shipped")
                if want_extras:
                    unverified.append(f"{who} needs {name}[{','.join(sorted(want_extras))}]: on the machine, "
                                      "its extras' requirements not checked")
            else:
                unmet.append(f"{who} needs {name}{vspec}: neither in the spec nor on the machine")
    for name, wants in sorted(asked.items()):
        if len({s for _, s in wants}) > 1 and not any(all(satisfies(v, s) for _, s in wants)
                                                      for v in candidates([s for _, s in wants])):
            unmet.append(f"no version of {name} meets all of: " + "; ".join(f"{w} needs {s}" for w, s in wants)
                         + " (the machine's is unknown: one of these must change)")
    notes = [f"{n}=={wheels[n][0]} shadows the machine's {n}" + (f" {have[n]}" if have[n] else "")
             for n in sorted(wheels) if n in have]
    return unmet, unverified, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", help="a spec, e.g. bench/engines/vllm-0.26.0.toml")
    ap.add_argument("--wheels-dir", type=Path, help="the spec's wheels (default .stage/<name>/download)")
    ap.add_argument("--device", type=Path, default=DEVICE_LIST, help=f"the machine's packages (default {DEVICE_LIST})")
    args = ap.parse_args(argv)
    unmet, unverified, notes = check(Path(args.spec), args.wheels_dir, args.device)
    for line in notes:
        print(f"shadows: {line}")
    for line in unverified:
        print(f"unverified: {line}")
    for line in unmet:
        print(f"UNMET: {line}")
    print(f"check_spec_deps: {len(unmet)} unmet, {len(unverified)} unverified, {len(notes)} shadowing")
    return 1 if unmet else 0


if __name__ == "__main__":
    sys.exit(main())
