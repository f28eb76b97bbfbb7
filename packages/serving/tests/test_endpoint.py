"""EndpointClient's sleep/wake protocol and version check against the fake engines (real HTTP on loopback)."""

from __future__ import annotations

import pytest

from rota import ParkMode
from rota.errors import InvalidArgument, UnsupportedVersion
from rota_serving import EndpointClient, check_server_version
from rota_serving.testing import get_json


def test_vllm_sleep_levels_follow_the_mode_and_each_step_is_checked(fake_vllm):
    c = EndpointClient("vllm", fake_vllm.url)
    c.sleep(ParkMode.DISCARD)
    assert fake_vllm.level == 2 and c.is_sleeping() is True
    c.wake(["weights"])  # partial: the server still sleeps until every tag is back
    assert fake_vllm.asleep == {"kv_cache"}
    c.wake()
    assert c.is_sleeping() is False
    c.sleep()
    assert fake_vllm.level == 1
    calls = get_json(fake_vllm.url + "/fake/calls")["calls"]
    assert calls[:3] == ["POST /sleep?level=2", "GET /is_sleeping", "GET /is_sleeping"]
    assert "POST /wake_up?tags=weights" in calls and "POST /wake_up" in calls


def test_sglang_release_and_resume_carry_the_tags(fake_sglang):
    c = EndpointClient("sglang", fake_sglang.url + "/")
    c.sleep(ParkMode.OFFLOAD, ["kv_cache"])
    assert fake_sglang.released == {"kv_cache"}
    c.wake()
    assert fake_sglang.released == set() and c.is_sleeping() is None
    assert fake_sglang.calls[-2:] == ['POST /release_memory_occupation {"tags": ["kv_cache"]}',
                                      "POST /resume_memory_occupation {}"]
    with pytest.raises(InvalidArgument, match="'activations' is not a sglang memory tag; use one of weights"):
        c.sleep(ParkMode.OFFLOAD, ["activations"])


def test_bad_client_arguments_name_the_fix():
    with pytest.raises(InvalidArgument, match="app 'trt' is not one of vllm, sglang"):
        EndpointClient("trt", "http://127.0.0.1:1")
    with pytest.raises(InvalidArgument, match=r"is not a base URL like http://127\.0\.0\.1:8000"):
        EndpointClient("vllm", "http://127.0.0.1:1/v1")
    with pytest.raises(InvalidArgument, match="timeout_s=0 must be > 0 seconds"):
        EndpointClient("vllm", "http://127.0.0.1:1", timeout_s=0)


def test_server_version_is_checked_with_the_fix(fake_vllm, fake_sglang):
    fake_vllm.version = "0.9.2"
    with pytest.raises(UnsupportedVersion, match=r"vllm 0\.9\.2 \(server at http://127.*Fix: pip x"):
        check_server_version(EndpointClient("vllm", fake_vllm.url), "/version", ">=0.10", "pip x", needed_by="t")
    assert check_server_version(EndpointClient("sglang", fake_sglang.url), "/get_server_info", ">=0.4.6,<0.6",
                                "pip x", needed_by="t") == "0.5.2"
    with pytest.raises(UnsupportedVersion, match=r"/is_sleeping answered .*not \{\"version\""):
        check_server_version(EndpointClient("vllm", fake_vllm.url), "/is_sleeping", ">=0.10", "pip x", needed_by="t")
