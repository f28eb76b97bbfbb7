"""Every public method of the tinker 0.38 SDK's clients (ServiceClient, TrainingClient, SamplingClient, RestClient,
AdminClient, async twins included) against the real service on a tiny Qwen3 folder, each under a deadline: none may
hang (the SDK retries 408/409/429/5xx for minutes, so a refusal must be another 4xx), none may answer 5xx. The
outcomes make the README's compatibility table: ``ROTA_WRITE_SDK_TABLE=1`` rewrites it, otherwise the test fails
when the README's table differs from what the service does now."""

from __future__ import annotations

import asyncio
import datetime
import inspect
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.lib.public_interfaces.admin_client import AdminClient
from tinker_testlib import KEYS, serving_hf_models

from rota_tinker import TinkerService
from rota_tinker.testing import hub_cache_snapshot

QWEN = "acme/Qwen3-Tiny"
DEADLINE_S = 120.0  # a hang guard, not a threshold: the SDK's shortest retry loop on a refusal lasts 5 minutes
README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- sdk-table:begin (tests/test_tinker_sdk_surface.py writes it) -->", "<!-- sdk-table:end -->"
CLASSES = {"ServiceClient": tinker.ServiceClient, "TrainingClient": tinker.TrainingClient,
           "SamplingClient": tinker.SamplingClient, "RestClient": tinker.RestClient, "AdminClient": AdminClient}
# methods that answer, with what they leave out (the table's "partial"; written by hand: a call that answers cannot
# show what it leaves out)
_USAGE = "the caller's own checkpoints' count and bytes; no costs, no projects"
_PUBLIC = "marks the caller's checkpoint public in listings; no other tenant can read it (no sharing here)"
_ADAM = "AdamW only: other optimizer configs are refused"
PARTIAL: dict[str, str] = {
    **{f"{c}.get_current_checkpoint_storage_usage{a}": _USAGE for c in ("RestClient", "AdminClient")
       for a in ("", "_async")},
    **{f"RestClient.publish_checkpoint_from_tinker_path{a}": _PUBLIC for a in ("", "_async")},
    **{f"ServiceClient.create_lora_training_client{a}": _ADAM for a in ("", "_async")},
    **{f"TrainingClient.optim_step{a}": "AdamParams only: other optimizers are refused" for a in ("", "_async")},
    **{m: "the caller's own checkpoints (weights_access_token is refused)"
       for m in ("ServiceClient.copy_weights", "RestClient.copy_weights", "RestClient.copy_weights_async")},
    "RestClient.search_sessions": "the caller's live sessions (ended ones are not kept; owner 'user' is refused)",
    **{f"RestClient.export_session_trace{a}": "Chrome JSON trace (Perfetto opens it) of the requests still kept"
       for a in ("", "_async")},
    **{f"{c}.get_billing_usage{a}": "token and checkpoint counts by the hour; no costs, no storage GB-hours"
       for c in ("RestClient", "AdminClient") for a in ("", "_async")},
}


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerService]:
    """The service on a hub-cache snapshot that this process's Hugging Face hub also reads (offline), as a user
    sharing the service's cache has it: the SDK's get_tokenizer loads the tokenizer by the model's hub name."""
    import huggingface_hub.constants

    root = tmp_path_factory.mktemp("surface")
    hub_cache_snapshot(root / "cache", QWEN, seed=1)
    with (pytest.MonkeyPatch.context() as mp,
          serving_hf_models([str(root / "cache")], str(root / "data"), "tinker-surface") as service):
        mp.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root / "cache"))
        yield service


def _datum(n: int = 8) -> types.Datum:
    ids = list(range(5, 5 + n + 1))
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64),
                                       "weights": np.ones(n, np.float32)})


def _custom_loss(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    loss = -sum(lp.sum() for lp in logprobs)
    return loss, {"custom": float(loss)}


def _server_loss(logprobs: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = -(logprobs * weights).sum()
    return loss, {"custom/loss:sum": loss}


PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])
PARAMS = types.SamplingParams(max_tokens=4, seed=1)


def _calls(c: SimpleNamespace) -> dict[str, Callable[[], Any]]:
    """Class.method -> a call of it with arguments a user would pass; ``c`` holds the clients and paths made so far."""
    sc, rest, admin = c.sc, c.rest, c.admin
    day = datetime.date.today()
    start, end = datetime.datetime.now() - datetime.timedelta(days=1), datetime.datetime.now()
    search = types.SessionSearchRequest() if hasattr(types, "SessionSearchRequest") else None
    return {
        "ServiceClient.get_server_capabilities": lambda: sc.get_server_capabilities(),
        "ServiceClient.get_server_capabilities_async": lambda: sc.get_server_capabilities_async(),
        "ServiceClient.get_console_url": lambda: sc.get_console_url(),
        "ServiceClient.get_telemetry": lambda: sc.get_telemetry(),
        "ServiceClient.create_rest_client": lambda: sc.create_rest_client(),
        "ServiceClient.create_lora_training_client": lambda: sc.create_lora_training_client(base_model=QWEN, rank=2),
        "ServiceClient.create_lora_training_client_async":
            lambda: sc.create_lora_training_client_async(base_model=QWEN, rank=2),
        "TrainingClient.get_info": lambda: c.tc.get_info(),
        "TrainingClient.get_info_async": lambda: c.tc.get_info_async(),
        "TrainingClient.get_tokenizer": lambda: c.tc.get_tokenizer(),
        "TrainingClient.get_console_url": lambda: c.tc.get_console_url(),
        "TrainingClient.get_telemetry": lambda: c.tc.get_telemetry(),
        "TrainingClient.forward": lambda: c.tc.forward([_datum()], "cross_entropy"),
        "TrainingClient.forward_async": lambda: c.tc.forward_async([_datum()], "cross_entropy"),
        "TrainingClient.forward_backward": lambda: c.tc.forward_backward([_datum()], "cross_entropy"),
        "TrainingClient.forward_backward_async": lambda: c.tc.forward_backward_async([_datum()], "cross_entropy"),
        "TrainingClient.forward_backward_custom": lambda: c.tc.forward_backward_custom([_datum()], _custom_loss),
        "TrainingClient.forward_backward_custom_async":
            lambda: c.tc.forward_backward_custom_async([_datum()], _custom_loss),
        "TrainingClient.optim_step": lambda: c.tc.optim_step(types.AdamParams(learning_rate=1e-3)),
        "TrainingClient.optim_step_async": lambda: c.tc.optim_step_async(types.AdamParams(learning_rate=1e-3)),
        "TrainingClient.save_state": lambda: c.tc.save_state("surface-state"),
        "TrainingClient.save_state_async": lambda: c.tc.save_state_async("surface-state-2"),
        "TrainingClient.load_state": lambda: c.tc.load_state(c.state_path),
        "TrainingClient.load_state_async": lambda: c.tc.load_state_async(c.state_path),
        "TrainingClient.load_state_with_optimizer": lambda: c.tc.load_state_with_optimizer(c.state_path),
        "TrainingClient.load_state_with_optimizer_async": lambda: c.tc.load_state_with_optimizer_async(c.state_path),
        "TrainingClient.save_weights_for_sampler": lambda: c.tc.save_weights_for_sampler("surface-sampler"),
        "TrainingClient.save_weights_for_sampler_async":
            lambda: c.tc.save_weights_for_sampler_async("surface-sampler-2"),
        "TrainingClient.save_weights_external": lambda: c.tc.save_weights_external("surface-external"),
        "TrainingClient.save_weights_external_async": lambda: c.tc.save_weights_external_async("surface-external-2"),
        "TrainingClient.create_sampling_client": lambda: c.tc.create_sampling_client(c.sampler_path),
        "TrainingClient.create_sampling_client_async": lambda: c.tc.create_sampling_client_async(c.sampler_path),
        "TrainingClient.save_weights_and_get_sampling_client": lambda: c.tc.save_weights_and_get_sampling_client(),
        "TrainingClient.save_weights_and_get_sampling_client_async":
            lambda: c.tc.save_weights_and_get_sampling_client_async(),
        "ServiceClient.create_sampling_client": lambda: sc.create_sampling_client(model_path=c.sampler_path),
        "ServiceClient.create_sampling_client_async":
            lambda: sc.create_sampling_client_async(model_path=c.sampler_path),
        "ServiceClient.create_training_client_from_state": lambda: sc.create_training_client_from_state(c.state_path),
        "ServiceClient.create_training_client_from_state_async":
            lambda: sc.create_training_client_from_state_async(c.state_path),
        "ServiceClient.create_training_client_from_state_with_optimizer":
            lambda: sc.create_training_client_from_state_with_optimizer(c.state_path),
        "ServiceClient.create_training_client_from_state_with_optimizer_async":
            lambda: sc.create_training_client_from_state_with_optimizer_async(c.state_path),
        "ServiceClient.copy_weights": lambda: tinker.ServiceClient(base_url=c.url, api_key=KEYS["alice"],
                                                                     project_id="p1").copy_weights(c.state_path),
        "ServiceClient.create_custom_loss": lambda: sc.create_custom_loss(_server_loss, {"logprobs": 1, "weights": 1}),
        "SamplingClient.sample": lambda: c.sampler.sample(PROMPT, 1, PARAMS),
        "SamplingClient.sample_async": lambda: c.sampler.sample_async(PROMPT, 1, PARAMS),
        "SamplingClient.compute_logprobs": lambda: c.sampler.compute_logprobs(PROMPT),
        "SamplingClient.compute_logprobs_async": lambda: c.sampler.compute_logprobs_async(PROMPT),
        "SamplingClient.get_tokenizer": lambda: c.sampler.get_tokenizer(),
        "SamplingClient.get_base_model": lambda: c.sampler.get_base_model(),
        "SamplingClient.get_base_model_async": lambda: c.sampler.get_base_model_async(),
        "SamplingClient.get_telemetry": lambda: c.sampler.get_telemetry(),
        "SamplingClient.get_sampler_handle": lambda: c.sampler.get_sampler_handle(),
        "SamplingClient.from_sampler_handle":
            lambda: tinker.SamplingClient.from_sampler_handle(c.sampler.get_sampler_handle(), api_key=KEYS["alice"]),
        "SamplingClient.create": lambda: tinker.SamplingClient.create(sc.holder, model_path=c.sampler_path),
        "SamplingClient.on_queue_state_change": lambda: c.sampler.on_queue_state_change(
            tinker.lib.queue_state_logger.QueueState.ACTIVE if hasattr(tinker.lib, "queue_state_logger")
            else "active", None),
        "RestClient.get_server_capabilities": lambda: rest.get_server_capabilities(),
        "RestClient.get_telemetry": lambda: rest.get_telemetry(),
        "RestClient.whoami": lambda: rest.whoami(),
        "RestClient.get_training_run": lambda: rest.get_training_run(c.tc.model_id),
        "RestClient.get_training_run_async": lambda: rest.get_training_run_async(c.tc.model_id),
        "RestClient.get_training_run_by_tinker_path": lambda: rest.get_training_run_by_tinker_path(c.state_path),
        "RestClient.get_training_run_by_tinker_path_async":
            lambda: rest.get_training_run_by_tinker_path_async(c.state_path),
        "RestClient.get_weights_info_by_tinker_path": lambda: rest.get_weights_info_by_tinker_path(c.state_path),
        "RestClient.list_training_runs": lambda: rest.list_training_runs(),
        "RestClient.list_training_runs_async": lambda: rest.list_training_runs_async(),
        "RestClient.list_checkpoints": lambda: rest.list_checkpoints(c.tc.model_id),
        "RestClient.list_checkpoints_async": lambda: rest.list_checkpoints_async(c.tc.model_id),
        "RestClient.list_user_checkpoints": lambda: rest.list_user_checkpoints(),
        "RestClient.list_user_checkpoints_async": lambda: rest.list_user_checkpoints_async(),
        "RestClient.get_session": lambda: rest.get_session(sc.holder.get_session_id()),
        "RestClient.get_session_async": lambda: rest.get_session_async(sc.holder.get_session_id()),
        "RestClient.list_sessions": lambda: rest.list_sessions(),
        "RestClient.list_sessions_async": lambda: rest.list_sessions_async(),
        "RestClient.search_sessions": lambda: rest.search_sessions(search),
        "RestClient.get_sampler": lambda: rest.get_sampler(c.sampler_id),
        "RestClient.get_sampler_async": lambda: rest.get_sampler_async(c.sampler_id),
        "RestClient.publish_checkpoint_from_tinker_path":
            lambda: rest.publish_checkpoint_from_tinker_path(c.state_path),
        "RestClient.publish_checkpoint_from_tinker_path_async":
            lambda: rest.publish_checkpoint_from_tinker_path_async(c.state_path),
        "RestClient.unpublish_checkpoint_from_tinker_path":
            lambda: rest.unpublish_checkpoint_from_tinker_path(c.state_path),
        "RestClient.unpublish_checkpoint_from_tinker_path_async":
            lambda: rest.unpublish_checkpoint_from_tinker_path_async(c.state_path),
        "RestClient.set_checkpoint_ttl_from_tinker_path":
            lambda: rest.set_checkpoint_ttl_from_tinker_path(c.state_path, 7200),
        "RestClient.set_checkpoint_ttl_from_tinker_path_async":
            lambda: rest.set_checkpoint_ttl_from_tinker_path_async(c.state_path, None),
        "RestClient.get_external_weights_urls": lambda: rest.get_external_weights_urls(c.external_path),
        "RestClient.get_external_weights_urls_async": lambda: rest.get_external_weights_urls_async(c.external_path),
        "RestClient.copy_weights": lambda: rest.copy_weights(c.state_path, "p1"),
        "RestClient.copy_weights_async": lambda: rest.copy_weights_async(c.state_path, "p1"),
        "RestClient.assign_session_project": lambda: rest.assign_session_project(sc.holder.get_session_id(), "p1"),
        "RestClient.assign_session_project_async":
            lambda: rest.assign_session_project_async(sc.holder.get_session_id(), "p1"),
        "RestClient.export_session_trace": lambda: rest.export_session_trace(sc.holder.get_session_id()),
        "RestClient.export_session_trace_async": lambda: rest.export_session_trace_async(sc.holder.get_session_id()),
        "RestClient.get_audit_log": lambda: rest.get_audit_log(day=day),
        "RestClient.get_audit_log_async": lambda: rest.get_audit_log_async(day=day),
        "RestClient.get_billing_usage": lambda: rest.get_billing_usage(start, end),
        "RestClient.get_billing_usage_async": lambda: rest.get_billing_usage_async(start, end),
        "RestClient.get_current_checkpoint_storage_usage": lambda: rest.get_current_checkpoint_storage_usage(),
        "RestClient.get_current_checkpoint_storage_usage_async":
            lambda: rest.get_current_checkpoint_storage_usage_async(),
        "AdminClient.get_telemetry": lambda: admin.get_telemetry(),
        "AdminClient.get_audit_log": lambda: admin.get_audit_log(day=day),
        "AdminClient.get_audit_log_async": lambda: admin.get_audit_log_async(day=day),
        "AdminClient.get_billing_usage": lambda: admin.get_billing_usage(start, end),
        "AdminClient.get_billing_usage_async": lambda: admin.get_billing_usage_async(start, end),
        "AdminClient.get_current_checkpoint_storage_usage": lambda: admin.get_current_checkpoint_storage_usage(),
        "AdminClient.get_current_checkpoint_storage_usage_async":
            lambda: admin.get_current_checkpoint_storage_usage_async(),
        "RestClient.delete_checkpoint": lambda: rest.delete_checkpoint(c.tc.model_id, "weights/surface-state-2"),
        "RestClient.delete_checkpoint_async":
            lambda: rest.delete_checkpoint_async(c.tc.model_id, "sampler_weights/surface-sampler-2"),
        "RestClient.delete_checkpoint_from_tinker_path":
            lambda: rest.delete_checkpoint_from_tinker_path(f"tinker://{c.tc.model_id}/weights/surface-state"),
        "RestClient.delete_checkpoint_from_tinker_path_async":
            lambda: rest.delete_checkpoint_from_tinker_path_async(c.sampler_path),
        "ServiceClient.close": lambda: c.spare.close("success", detail="surface test done"),
    }


async def _settle(value: Any) -> Any:
    while inspect.isawaitable(value):
        value = await value
    return value


def _finish(value: Any) -> Any:
    """The call's result: coroutines awaited (in a fresh loop), futures waited for."""
    if inspect.isawaitable(value) and not hasattr(value, "result"):
        return asyncio.run(_settle(value))
    if hasattr(value, "result") and callable(value.result) and not isinstance(value, types.SampleResponse):
        return value.result()
    return value


def _why(e: BaseException) -> str:
    """A refusal's reason, one line: the service's detail (or the SDK's own message)."""
    body = getattr(e, "body", None)
    detail = body.get("detail") if isinstance(body, dict) else None
    text = str(detail or e).splitlines()[0] if str(detail or e) else type(e).__name__
    return re.sub(r"\s+", " ", text)[:200]


def _run(name: str, call: Callable[[], Any]) -> tuple[str, Any]:
    """("works", result) or ("refused", reason); fails the test on a hang or a server error."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = _finish(call())
        except BaseException as e:  # the outcome is recorded, the thread must not die silently
            box["error"] = e

    t = threading.Thread(target=target, name=f"surface-{name}", daemon=True)
    t.start()
    t.join(DEADLINE_S)
    if t.is_alive():
        pytest.fail(f"{name} did not return within {DEADLINE_S:g} s: it hangs")
    e = box.get("error")
    if e is None:
        return "works", box.get("result")
    status = getattr(e, "status_code", None)
    assert status is None or (400 <= status < 500 and status not in (408, 409, 429)), (name, status, _why(e))
    assert "internal error" not in str(e), (name, str(e))
    return "refused", _why(e)


def public_methods() -> list[str]:
    return sorted(f"{cname}.{n}" for cname, cls in CLASSES.items() for n in dir(cls)
                  if not n.startswith("_") and callable(inspect.getattr_static(cls, n)))


def table(outcomes: dict[str, tuple[str, str]]) -> str:
    counts = {k: sum(1 for o, _ in outcomes.values() if o == k) for k in ("works", "partial", "refused")}
    lines = [f"{len(outcomes)} public methods of tinker {tinker.__version__}: {counts['works']} work, "
             f"{counts['partial']} partly, {counts['refused']} {'is' if counts['refused'] == 1 else 'are'} refused at "
             "once (a 4xx the SDK does not retry), "
             "none hangs.", "", "| method | outcome | what is missing / why |", "|---|---|---|"]
    lines += [f"| `{name}` | {o} | {why.replace('|', '/')} |" for name, (o, why) in sorted(outcomes.items())]
    return "\n".join(lines)


def test_every_public_sdk_method_answers_without_hanging(svc: TinkerService) -> None:
    sc = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["alice"])
    c = SimpleNamespace(url=svc.url, sc=sc, rest=sc.create_rest_client(), spare=tinker.ServiceClient(base_url=svc.url,
                                                                                         api_key=KEYS["alice"]))
    c.admin = AdminClient(c.rest.holder)
    c.tc = sc.create_lora_training_client(base_model=QWEN, rank=2, seed=0).result(timeout=DEADLINE_S)
    c.state_path = c.tc.save_state("surface-setup").result(timeout=DEADLINE_S).path
    c.sampler_path = c.tc.save_weights_for_sampler("surface-setup").result(timeout=DEADLINE_S).path
    c.sampler = sc.create_sampling_client(model_path=c.sampler_path).result(timeout=DEADLINE_S)
    c.sampler_id = c.sampler._sampling_session_id
    c.external_path = f"tinker://{c.tc.model_id}/external_weights/surface-external"
    calls = _calls(c)
    assert sorted(calls) == public_methods(), "a public SDK method is not driven here (or no longer exists)"
    outcomes: dict[str, tuple[str, str]] = {}
    for name, call in calls.items():
        outcome, detail = _run(name, call)
        if outcome == "works" and name in PARTIAL:
            outcome, detail = "partial", PARTIAL[name]
        outcomes[name] = (outcome, detail if outcome != "works" else "")
    sc.close("success").result(timeout=DEADLINE_S)
    text = table(outcomes)
    readme = README.read_text()
    start, stop = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    if os.environ.get("ROTA_WRITE_SDK_TABLE") == "1":
        README.write_text(readme[:start] + "\n" + text + "\n" + readme[stop:])
        return
    assert readme[start:stop].strip() == text, (
        "the README's SDK table differs from what the service does now; rerun with ROTA_WRITE_SDK_TABLE=1:\n" + text)
