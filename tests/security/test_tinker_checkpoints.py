"""Training checkpoints, runs and archives of the Tinker service against callers who reach for what is not theirs.

The service runs as users run it: ``python -m rota serve tinker --model-dir DIR`` in its own
process, serving a tiny real Hugging Face model (built here, never downloaded) under its hub
name. One tenant saves a checkpoint and sampler weights; another tries to list, read, load, sample
from, download and delete them, and anyone tries names and paths that would leave the service's
data directory. Each attack fails with a clear status and the victim's files and records are unchanged.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("peft")
from tinker import types  # noqa: E402

from rota_tinker.testing import hub_cache_snapshot, serving_process  # noqa: E402

KEYS = {  # 128 random bits and more: the service refuses guessable keys
    "alice": "tml-UtdhWBIzffN1T63MOCt5cwe5g_JMUkzULV3i334Iq5o",
    "mallory": "tml-HBI_lwl5LK5gJxw5FA2vrYe8ePVBUoL7lLJ7ecbkEsk",
}
MODEL = "acme/Qwen3-Tiny"
TIMEOUT = 180


@dataclass
class Served:
    proc: subprocess.Popen
    url: str
    data_dir: Path

    def get(self, route: str, key: str | None, **kw: object) -> httpx.Response:
        headers = {"X-API-Key": key} if key else {}
        return httpx.get(f"{self.url}/api/v1/{route}", headers=headers, timeout=60, **kw)

    def post(self, route: str, key: str, body: object) -> httpx.Response:
        return httpx.post(f"{self.url}/api/v1/{route}", json=body, headers={"X-API-Key": key}, timeout=60)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("tinker-ck")
    hub_cache_snapshot(root / "models", MODEL)
    data = root / "data"
    args = ["--listen", "127.0.0.1:0", "--data-dir", str(data), "--model-dir", str(root / "models"), "--long-poll",
            "2", *(a for name, key in KEYS.items() for a in ("--tenant", f"{name}={key}"))]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROTA_", "TINKER_", "HF_"))}
    env.update(TINKER_TELEMETRY="0", HF_HUB_CACHE=str(root / "empty-cache"), HF_HUB_OFFLINE="1")
    with serving_process(args, env) as (proc, head, _):
        assert MODEL in head, head
        yield Served(proc, re.search(r"serving (http://\S+) ", head).group(1), data)


@pytest.fixture(scope="module")
def victim(served: Served) -> dict[str, str]:
    """alice's model, trained a step and saved as checkpoint ``good``: its run id and tinker path."""
    sc = tinker.ServiceClient(base_url=served.url, api_key=KEYS["alice"])
    tc = sc.create_lora_training_client(base_model=MODEL, rank=2, seed=1).result(timeout=TIMEOUT)
    ids = list(range(3, 20))
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64)})
    tc.forward_backward([datum], "cross_entropy").result(timeout=TIMEOUT)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT)
    path = tc.save_state("good").result(timeout=TIMEOUT).path
    sampler_path = tc.save_weights_for_sampler("good").result(timeout=TIMEOUT).path
    return {"run": tc.model_id, "path": path, "sampler_path": sampler_path, "session": sc.holder.get_session_id()}


def _files(served: Served) -> list[str]:
    return sorted(str(p.relative_to(served.data_dir)) for p in served.data_dir.rglob("*"))


def test_another_tenant_cannot_list_read_load_download_or_delete(served: Served, victim: dict) -> None:
    before = _files(served)
    run, path, mallory = victim["run"], victim["path"], KEYS["mallory"]
    listed = served.get("training_runs", mallory).json()
    assert listed["training_runs"] == [] and listed["cursor"]["total_count"] == 0
    assert served.get("checkpoints", mallory).json()["checkpoints"] == []
    assert victim["session"] not in served.get("sessions", mallory).json()["sessions"]
    for route in (f"training_runs/{run}", f"training_runs/{run}/checkpoints",
                  f"training_runs/{run}/checkpoints/weights/good/archive",
                  f"training_runs/{run}/checkpoints/sampler_weights/good/archive", f"sessions/{victim['session']}"):
        r = served.get(route, mallory)
        assert r.status_code == 403 and "another tenant" in r.json()["detail"], (route, r.text)
    for kind in ("weights", "sampler_weights"):
        r = httpx.delete(f"{served.url}/api/v1/training_runs/{run}/checkpoints/{kind}/good",
                         headers={"X-API-Key": mallory}, timeout=30)
        assert r.status_code == 403, kind
    with pytest.raises(tinker.PermissionDeniedError):
        tinker.ServiceClient(base_url=served.url, api_key=mallory).create_sampling_client(
            model_path=victim["sampler_path"]).sample(types.ModelInput.from_ints([3, 4]), 1,
                                                      types.SamplingParams(max_tokens=2)).result(timeout=TIMEOUT)
    sc = tinker.ServiceClient(base_url=served.url, api_key=mallory)
    with pytest.raises(tinker.PermissionDeniedError):
        sc.create_training_client_from_state_with_optimizer(path).result(timeout=TIMEOUT)
    assert served.get(f"training_runs/{run}/checkpoints", KEYS["alice"]).json()["checkpoints"][0]["tinker_path"] == path
    assert _files(served) == before
    for kind in ("weights", "sampler_weights"):
        assert served.get(f"training_runs/{run}/checkpoints/{kind}/good/archive", None).status_code == 401, kind


def test_another_tenant_cannot_describe_publish_expire_or_sample_a_checkpoint(served: Served, victim: dict) -> None:
    """The metadata routes (weights_info, publish/unpublish, TTL) and sampling from a training checkpoint are the
    owner's alone; the storage usage counts the caller's own checkpoints; the victim's records stay as they were."""
    run, mallory, alice = victim["run"], KEYS["mallory"], KEYS["alice"]
    before_files, before = _files(served), served.get(f"training_runs/{run}/checkpoints", alice).json()
    headers = {"X-API-Key": mallory}
    for kind, path in (("weights", victim["path"]), ("sampler_weights", victim["sampler_path"])):
        r = served.post("weights_info", mallory, {"tinker_path": path})
        assert r.status_code == 403 and "another tenant" in r.json()["detail"], r.text
        route = f"{served.url}/api/v1/training_runs/{run}/checkpoints/{kind}/good"
        for r in (httpx.post(f"{route}/publish", headers=headers, timeout=30),
                  httpx.delete(f"{route}/publish", headers=headers, timeout=30),
                  httpx.put(f"{route}/ttl", headers=headers, json={"ttl_seconds": 5}, timeout=30),
                  httpx.put(f"{route}/ttl", headers={"X-API-Key": "tml-NGEsg2qb_At9X7WxtR1k5SEAH1bPpgitaDQCruhC_Rg"},
                            json={"ttl_seconds": 5}, timeout=30)):
            assert r.status_code in (401, 403), (r.request.method, r.request.url, r.text)
    sc = tinker.ServiceClient(base_url=served.url, api_key=mallory)
    with pytest.raises(tinker.PermissionDeniedError):
        sc.create_sampling_client(model_path=victim["path"]).result(timeout=TIMEOUT)
    r = served.post("asample", mallory, {"model_path": victim["path"], "sampling_params": {},
                                         "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]}})
    assert r.status_code == 403, r.text
    usage = served.get("billing/usage/checkpoints/current", mallory).json()["data"]
    assert [(u["checkpoint_count"], u["size_bytes"]) for u in usage] == [(0, 0)]
    r = served.get("audit", mallory)  # her own events only: alice's checkpoints never show there
    assert r.status_code == 200 and run not in r.text and "alice" not in r.text, r.text
    assert victim["path"] in served.get("audit", alice).text
    for query in ({"event_type": "everything"}, {"day": "yesterday"}):
        assert served.get("audit", mallory, params=query).status_code == 400, query
    hour = int(time.time() // 3600) * 3600
    window = {"starting_on": datetime.datetime.fromtimestamp(hour - 3600, datetime.timezone.utc).isoformat(),
              "ending_before": datetime.datetime.fromtimestamp(hour + 7200, datetime.timezone.utc).isoformat()}
    r = served.get("billing/usage/events", mallory, params=window)  # her usage only
    assert r.status_code == 200 and victim["session"] not in r.text and run not in r.text, r.text
    assert victim["session"] in served.get("billing/usage/events", alice, params=window).text
    assert served.get(f"training_runs/{run}/checkpoints", alice).json() == before  # not public, no expiry
    assert _files(served) == before_files


def test_another_tenant_cannot_export_or_fetch_external_weights(served: Served, victim: dict) -> None:
    """alice's external weights: mallory can neither export alice's model, nor get its signed URLs, nor fetch one
    with her own key, nor forge one; alice's plain GET of her own URL works without a key."""
    alice = tinker.ServiceClient(base_url=served.url, api_key=KEYS["alice"])
    tc = alice.create_training_client_from_state(victim["path"]).result(timeout=TIMEOUT)
    path = tc.save_weights_external("ext").result(timeout=TIMEOUT).path
    urls = tinker.RestClient(base_url=served.url, api_key=KEYS["alice"]).get_external_weights_urls(path).result(
        timeout=TIMEOUT).urls
    url = urls["adapter_model.safetensors"]
    assert httpx.get(url, timeout=30).status_code == 200
    mallory = KEYS["mallory"]
    r = served.post("save_weights_external", mallory, {"model_id": tc.model_id, "path": "mine"})
    assert r.status_code == 403, r.text
    r = served.get(f"training_runs/{tc.model_id}/checkpoints/external_weights/ext/external_weights_urls", mallory)
    assert r.status_code == 403 and "another tenant" in r.json()["detail"], r.text
    assert httpx.get(url, headers={"X-API-Key": mallory}, timeout=30).status_code == 403
    forged = url.split("?")[0] + "?expires=9999999999&sig=" + "ab" * 32
    assert httpx.get(forged, timeout=30).status_code == 403
    for route in ("external_weights/x/../../etc/passwd", f"external_weights/{tc.model_id}/ext/..",
                  f"external_weights/{tc.model_id}/ext/.hidden"):
        assert served.get(route, None).status_code in (403, 404), route
    r = httpx.delete(f"{served.url}/api/v1/training_runs/{tc.model_id}/checkpoints/external_weights/ext",
                     headers={"X-API-Key": mallory}, timeout=30)
    assert r.status_code == 403
    assert httpx.get(url, timeout=30).status_code == 200  # still alice's, still there


def test_another_tenant_cannot_copy_label_or_find_sessions(served: Served, victim: dict) -> None:
    """copy_weights of alice's checkpoints, a project on alice's session and session search are the owner's alone;
    alice's checkpoint files keep their link count (nothing was linked into mallory's folders)."""
    mallory = KEYS["mallory"]
    links = {p: p.stat().st_nlink for p in served.data_dir.rglob("*") if p.is_file()}
    for path in (victim["path"], victim["sampler_path"]):
        r = served.post("copy_weights", mallory, {"source_path": path, "destination_project_id": "loot"})
        assert r.status_code == 403 and "another tenant" in r.json()["detail"], r.text
    r = httpx.put(f"{served.url}/api/v1/sessions/{victim['session']}/project", headers={"X-API-Key": mallory},
                  json={"project_id": "loot"}, timeout=30)
    assert r.status_code == 403, r.text
    for body in ({"session_id": victim["session"]}, {"owner": {"type": "accessible"}}, {}):
        r = served.post("sessions/search", mallory, body)
        assert r.status_code == 200 and victim["session"] not in r.text, (body, r.text)
    r = served.post("sessions/search", mallory, {"owner": {"type": "user", "owner_urns": ["alice"]}})
    assert r.status_code == 400, r.text
    r = served.get(f"sessions/{victim['session']}/trace_export", mallory)
    assert r.status_code == 403 and "url" not in r.json(), r.text
    r = served.get(f"session_traces/{victim['session']}", None, params={"expires": "9999999999", "sig": "ab" * 32})
    assert r.status_code == 403, r.text
    assert {p: p.stat().st_nlink for p in served.data_dir.rglob("*") if p.is_file()} == links


@pytest.mark.parametrize("name", ["../../mallory", "..", "a/b", "ok\n", ".hidden", "x" * 65, "con:1"])
def test_checkpoint_names_that_leave_the_folder_are_refused(served: Served, victim: dict, name: str) -> None:
    before = _files(served)
    r = served.post("save_weights", KEYS["alice"], {"model_id": victim["run"], "path": name})
    assert r.status_code == 400 and "not a valid checkpoint name" in r.json()["detail"], r.text
    assert _files(served) == before


@pytest.mark.parametrize("path", ["tinker://{run}/weights/../../../etc", "tinker://{run}/weights/good/../x",
                                  "tinker://../weights/good", "file:///etc/passwd", "tinker://{run}/weights/good\n",
                                  "/tmp/{run}"])
def test_load_paths_are_checked_whole(served: Served, victim: dict, path: str) -> None:
    r = served.post("load_weights", KEYS["alice"], {"model_id": victim["run"], "path": path.format(run=victim["run"]),
                                                    "optimizer": True})
    assert r.status_code == 400 and "not a training checkpoint" in r.json()["detail"], r.text


def test_archive_and_listing_routes_take_no_traversal(served: Served, victim: dict) -> None:
    alice, run = KEYS["alice"], victim["run"]
    for route in (f"training_runs/{run}/checkpoints/weights/..%2F..%2Fdata/archive",
                  f"training_runs/{run}/checkpoints/weights/../archive", "training_runs/..%2Fmallory/checkpoints",
                  f"training_runs/{run}/checkpoints/sampler_weights/..%2Fweights%2Fgood/archive",
                  f"training_runs/{run}/checkpoints/sampler_weights/good%0A/archive",
                  f"training_runs/{run}/checkpoints/sampler_weights/../../weights/good/archive"):
        assert served.get(route, alice).status_code in (400, 404), route
    for query in ("limit=0", "limit=100000", "offset=-1", "limit=abc"):
        r = served.get(f"training_runs?{query}", alice)
        assert r.status_code == 400 and "limit" in r.json()["detail"], (query, r.text)
    for kind in ("weights", "sampler_weights"):
        r = served.get(f"training_runs/{run}/checkpoints/{kind}/good/archive", alice)
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar", kind


def test_one_tenant_cannot_push_out_another_tenants_runs() -> None:
    """Run records are capped per tenant: a tenant creating models without end forgets only its own oldest runs."""
    from rota_tinker import DEFAULT_BASE_MODELS
    from rota_tinker._http.checkpoints import MAX_RUNS, Runs
    from rota_tinker._http.state import _Model

    runs, base = Runs(), DEFAULT_BASE_MODELS["rota/tiny"]
    runs.record(_Model("victim-run", "alice", base, None, "s1", 0), None)
    for i in range(MAX_RUNS + 5):
        runs.record(_Model(f"flood-{i}", "mallory", base, None, "s2", 0), None)
    assert "victim-run" in runs.runs
    flood = [k for k, r in runs.runs.items() if r.tenant == "mallory"]
    assert len(flood) == MAX_RUNS and flood[0] == "flood-5"


def test_hostile_query_strings_are_400(served: Served, victim: dict) -> None:
    many = "&".join(f"k{i}=1" for i in range(50))
    for query in (many, "limit=1e3", "offset=" + "9" * 5000):
        r = served.get(f"training_runs?{query}", KEYS["alice"])
        assert r.status_code == 400, (query[:40], r.text)


def test_bad_user_metadata_is_refused_before_anything_starts(served: Served, victim: dict) -> None:
    sid = victim["session"]
    for meta in ({"k": "v" * 300}, {str(i): "v" for i in range(40)}, {"k": 1}, ["k"]):
        r = served.post("create_model", KEYS["alice"], {"session_id": sid, "model_seq_id": 99, "base_model": MODEL,
                                                        "lora_config": {"rank": 2}, "user_metadata": meta})
        assert r.status_code == 400 and "user_metadata" in r.json()["detail"], (meta, r.text)
