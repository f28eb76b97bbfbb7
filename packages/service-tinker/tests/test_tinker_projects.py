"""Projects (labels inside one tenant), session search, session traces and copy_weights through the real tinker SDK on
a tiny Qwen3 folder: a session's project, display name and metadata find it again, pages follow their cursor, runs
list by project, a session's trace holds its own requests, and a copied checkpoint (hard links, no bytes copied)
samples like its source and outlives it."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker_testlib import KEYS, serving_tiny_qwen

from rota_tinker import TinkerService

QWEN = "acme/Qwen3-Tiny"
TIMEOUT = 180
PROMPT = types.ModelInput.from_ints([17, 42, 99, 5, 230, 61, 7])


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerService]:
    with serving_tiny_qwen(tmp_path_factory.mktemp("projects"), "tinker-projects", seed=8) as s:
        yield s


def search(rest: tinker.RestClient, **kw: object) -> types.SessionSearchResponse:
    return rest.search_sessions(types.SessionSearchRequest(**kw)).result(timeout=TIMEOUT)


def trained(sc: tinker.ServiceClient) -> tinker.TrainingClient:
    tc = sc.create_lora_training_client(base_model=QWEN, rank=2, seed=4).result(timeout=TIMEOUT)
    ids = list(range(3, 20))
    tc.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                     loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64)})],
                        "cross_entropy").result(timeout=TIMEOUT)
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=TIMEOUT)
    return tc


def test_sessions_are_found_by_project_name_metadata_and_paged(svc: TinkerService) -> None:
    sc = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["alice"], project_id="proj-a",
                              display_name="Alpha sweep 3", user_metadata={"lr": "1e-3"})
    rest = tinker.RestClient(base_url=svc.url, api_key=KEYS["alice"])
    tc = trained(sc)
    tc.save_state("s1").result(timeout=TIMEOUT)
    sid = sc.holder.get_session_id()
    [found] = search(rest, display_name="sweep alpha").sessions
    assert (found.session_id, found.project_id, found.display_name, found.user_metadata, found.checkpoints_count,
            found.owner) == (sid, "proj-a", "Alpha sweep 3", {"lr": "1e-3"}, 1, "alice")
    assert [s.session_id for s in search(rest, user_metadata={"lr": "1e-3"}).sessions] == [sid]
    assert search(rest, user_metadata={"lr": "1e-2"}).sessions == []
    assert search(rest, session_id=sid, project_ids=["proj-b"]).sessions == []
    rest.assign_session_project(sid, "proj-b").result(timeout=TIMEOUT)
    assert [s.project_id for s in search(rest, session_id=sid, project_ids=["proj-b"]).sessions] == ["proj-b"]
    runs = rest.list_training_runs(limit=100, project_id="proj-a").result(timeout=TIMEOUT).training_runs
    assert [r.training_run_id for r in runs] == [tc.model_id]  # a run keeps the project it was created in
    assert rest.list_training_runs(project_id="proj-z").result(timeout=TIMEOUT).training_runs == []
    others = [tinker.ServiceClient(base_url=svc.url, api_key=KEYS["alice"], display_name=f"paged {i}")
              for i in range(3)]
    for other in others:
        other.create_rest_client()  # no request yet: the session starts with the first one
        other.holder.get_session_id()
    first = search(rest, display_name="paged", limit=2)
    assert len(first.sessions) == 2 and first.next_cursor is not None
    second = search(rest, display_name="paged", limit=2, cursor=first.next_cursor)
    assert len(second.sessions) == 1 and second.next_cursor is None
    assert ({s.session_id for s in first.sessions + second.sessions}
            == {o.holder.get_session_id() for o in others})
    assert [s.created_at for s in first.sessions] == sorted((s.created_at for s in first.sessions), reverse=True)


def test_copy_weights_links_a_checkpoint_into_a_project(svc: TinkerService) -> None:
    sc = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["bob"])
    rest = tinker.RestClient(base_url=svc.url, api_key=KEYS["bob"])
    tc = trained(sc)
    state = tc.save_state("src").result(timeout=TIMEOUT).path
    weights = tc.save_weights_for_sampler("src").result(timeout=TIMEOUT).path
    copy = rest.copy_weights(state, "archive", ttl_seconds=7200).result(timeout=TIMEOUT)
    weights_copy = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["bob"], project_id="archive").copy_weights(
        weights).result(timeout=TIMEOUT)
    assert copy.endswith("/weights/src") and weights_copy.endswith("/sampler_weights/src")
    src_folder = Path(svc.state.runs.checkpoints[state].folder)
    copy_folder = Path(svc.state.runs.checkpoints[copy].folder)
    for f in os.listdir(src_folder):
        assert os.stat(src_folder / f).st_ino == os.stat(copy_folder / f).st_ino  # linked, not copied
    archived = rest.list_training_runs(limit=100, project_id="archive").result(timeout=TIMEOUT).training_runs
    assert {r.training_run_id for r in archived} == {copy.split("/")[2], weights_copy.split("/")[2]}
    cks = rest.list_checkpoints(copy.split("/")[2]).result(timeout=TIMEOUT).checkpoints
    assert [c.tinker_path for c in cks] == [copy] and cks[0].expires_at is not None
    want = sc.create_sampling_client(model_path=weights).result(timeout=TIMEOUT).compute_logprobs(
        PROMPT).result(timeout=TIMEOUT)
    rest.delete_checkpoint_from_tinker_path(state).result(timeout=TIMEOUT)
    rest.delete_checkpoint_from_tinker_path(weights).result(timeout=TIMEOUT)
    for path in (copy, weights_copy):  # the copies outlive their sources
        got = sc.create_sampling_client(model_path=path).result(timeout=TIMEOUT).compute_logprobs(
            PROMPT).result(timeout=TIMEOUT)
        assert got == want, path
    with pytest.raises(tinker.BadRequestError, match="source_path"):
        rest.copy_weights("tinker://nope", "archive").result(timeout=30)


def test_session_trace_holds_the_sessions_requests(svc: TinkerService) -> None:
    sc = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["carol"])
    rest = tinker.RestClient(base_url=svc.url, api_key=KEYS["carol"])
    tc = trained(sc)  # create, one forward_backward, one optim_step
    path = tc.save_weights_for_sampler("traced").result(timeout=TIMEOUT).path
    sc.create_sampling_client(model_path=path).result(timeout=TIMEOUT).sample(
        PROMPT, 1, types.SamplingParams(max_tokens=3, seed=1)).result(timeout=TIMEOUT)
    trained(tinker.ServiceClient(base_url=svc.url, api_key=KEYS["carol"]))  # another session's requests
    sid = sc.holder.get_session_id()
    url = rest.export_session_trace(sid).result(timeout=TIMEOUT)
    with urllib.request.urlopen(url) as r:  # a plain GET, as the SDK's docstring shows
        trace = json.load(r)
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    kinds = sorted(e["name"] for e in slices)
    assert kinds == ["CreateModel", "ForwardBackward", "OptimStep", "Sample", "SaveWeightsForSampler"], kinds
    assert all(e["dur"] > 0 and "compute_s" in e["args"] for e in slices if e["name"] != "CreateModel")
    assert [e["ts"] for e in slices] == sorted(e["ts"] for e in slices)
    with pytest.raises(tinker.PermissionDeniedError):
        tinker.RestClient(base_url=svc.url, api_key=KEYS["dave"]).export_session_trace(sid).result(timeout=TIMEOUT)
    assert httpx.get(url, headers={"X-API-Key": KEYS["dave"]}, timeout=30).status_code == 403
    assert httpx.get(url.replace("sig=", "sig=0"), timeout=30).status_code == 403
    assert httpx.get(url.split("?")[0], timeout=30).status_code == 403
