"""rota.compat against real installed distributions (torch, grpcio), a missing one, and bad ranges."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest

from rota.compat import check, declared, installed, require, warn_if_mismatched
from rota.errors import InvalidArgument, PermanentError, UnsupportedVersion

MISSING = "rota-test-no-such-distribution"
TORCH = importlib.metadata.version("torch")  # 2.13.0+cpu here: a local version part
GRPC = importlib.metadata.version("grpcio")


def test_installed_finds_the_first_installed_alternative():
    assert installed("torch") == ("torch", TORCH)
    assert installed((MISSING, "grpcio")) == ("grpcio", GRPC)
    assert installed(MISSING) is None
    with pytest.raises(InvalidArgument, match=r"distribution \(\) is not a name"):
        installed(())


def test_require_returns_the_installed_version_inside_the_range():
    assert require("torch", "==2.13.0", 'pip install "torch==2.13.0"') == TORCH  # "+cpu" counts as 2.13.0
    major = int(GRPC.split(".")[0])
    assert require(("grpc-no-such", "grpcio"), f">={major},<{major + 1}", "pip install grpcio") == GRPC


def test_a_version_outside_the_range_names_found_range_and_fix():
    with pytest.raises(UnsupportedVersion) as info:
        require("torch", ">=3,<4", 'pip install "torch>=3,<4"', needed_by="rota-adapter-x")
    err = info.value
    assert str(err) == (f"torch {TORCH} (installed) is not supported by rota-adapter-x, which targets torch>=3,<4. "
                        'Fix: pip install "torch>=3,<4"')
    assert (err.dist, err.found, err.spec, err.fix) == ("torch", TORCH, ">=3,<4", 'pip install "torch>=3,<4"')
    assert isinstance(err, PermanentError) and isinstance(err, ImportError)  # one type, both old bases


def test_a_missing_distribution_says_what_to_install():
    with pytest.raises(ImportError, match=rf"{MISSING} is not installed; rota needs {MISSING}>=1\. Fix: pip x"):
        require(MISSING, ">=1", "pip x")
    with pytest.raises(UnsupportedVersion) as info:
        require((MISSING, "another-missing-one"), ">=1", "pip x")
    assert info.value.dist == MISSING and info.value.found is None


def test_bad_specifier_is_refused_naming_it():
    with pytest.raises(InvalidArgument, match=r"version range '>=one' is not a PEP 440 specifier"):
        require("torch", ">=one", "pip x")
    with pytest.raises(InvalidArgument, match="not a PEP 440 specifier"):
        check("x", None, "2.0", "pip x")  # checked even when nothing is installed


def test_release_numbers_decide_and_unparsable_versions_are_refused():
    assert check("megatron-core", "0.16.0rc1", ">=0.16,<0.17", "pip x") == "0.16.0rc1"
    assert check("vllm", "0.32.0+cpu", ">=0.10,<0.33", "pip x") == "0.32.0+cpu"
    for bad in ("0.17.0rc1", "0.15.9", "not-a-version"):
        with pytest.raises(UnsupportedVersion, match=rf"megatron-core {bad} \(server at h\) is not supported"):
            check("megatron-core", bad, ">=0.16,<0.17", "pip x", where="server at h")


def test_warn_if_mismatched_logs_once_and_never_raises(caplog):
    with caplog.at_level(logging.WARNING, logger="rota.compat"):
        assert warn_if_mismatched("torch", "==2.13.0", "pip x") is None
        assert warn_if_mismatched(MISSING, ">=1", "pip x") is None  # absent: a plugin's extra not installed
        said = warn_if_mismatched("torch", "<2", 'pip install "torch<2"')
    assert said is not None and said.startswith(f"torch {TORCH} (installed) is not supported")
    # rota.compat's records only: a Tinker SDK session left by an earlier test in this process once logged its
    # failed heartbeat in the middle (CI at e749a8a)
    assert [r.getMessage() for r in caplog.records if r.name == "rota.compat"] == [said]


def test_declared_reads_a_range_from_the_installed_metadata_lower_bound_first():
    """rota-core declares packaging>=23 and rota-torch the trainer adapters' torch range, each written once."""
    req = next(r for r in importlib.metadata.requires("rota-core") if r.startswith("packaging"))
    assert declared("rota-core", "packaging") == req.split(";")[0].removeprefix("packaging").strip()
    spec = declared("rota-torch", "torch")
    assert spec.startswith(">=") and ",<" in spec  # lower bound first, as people write it
    with pytest.raises(InvalidArgument, match=r"rota-core declares no version range for vllm"):
        declared("rota-core", "vllm")
    with pytest.raises(InvalidArgument, match=rf"{MISSING} is not installed.*pip install {MISSING}"):
        declared(MISSING, "torch")


def test_lazy_getattr_imports_a_name_on_first_use_and_keeps_it(monkeypatch):
    import sys
    import types

    from rota.compat import lazy_getattr

    mod = types.ModuleType("rota_test_lazy")
    mod.__getattr__ = lazy_getattr("rota_test_lazy", {"dumps": "json"})
    monkeypatch.setitem(sys.modules, "rota_test_lazy", mod)
    assert "dumps" not in vars(mod)
    assert mod.dumps is __import__("json").dumps and "dumps" in vars(mod)  # the next lookup is plain
    with pytest.raises(AttributeError, match=r"module 'rota_test_lazy' has no attribute 'loads'"):
        mod.loads  # noqa: B018
