"""External weights: ``TrainingClient.save_weights_external``, and the signed URLs that
``RestClient.get_external_weights_urls`` gives for them (``tinker_cookbook.weights.download`` fetches
them with a plain ``urllib`` GET).

Routes of :class:`rota_tinker._http.service._Api` (a mixin, like :mod:`rota_tinker._http.checkpoints`):

* ``POST save_weights_external`` (``model_id``, ``path`` = NAME, ``ttl_seconds``,
  ``age_encryption_recipients``): the trainer writes the model as sampler weights do (peft
  ``adapter_model.safetensors`` + ``adapter_config.json``, or ``config.json`` + safetensors +
  tokenizer), moved to ``MODEL/external_weights/NAME``; with age recipients (at most 10, ``age1...``
  or SSH keys; needs ``pyrage``) each file is encrypted to them as ``FILE.age`` and the clear files
  are deleted. The checkpoint is ``tinker://RUN/external_weights/NAME``, listed, deleted and given a
  TTL like the others;
* ``GET training_runs/{run}/checkpoints/external_weights/{name}/external_weights_urls``: the owner
  (its API key checked, like every route) gets one URL per file, valid an hour (:mod:`rota_tinker._http.signed`):
  ``/api/v1/external_weights/RUN/NAME/FILE?expires=T&sig=S``, S an HMAC (a key of this service
  process, so URLs die with it) over owner, checkpoint, file and T. That route needs no API key
  (the signature is the credential, as with any signed URL); one given must be the owner's.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from rota_tinker._http.budget import JSON_RESULT_BYTES
from rota_tinker._http.checkpoints import ID, MAX_ARCHIVE_BYTES, NAME, expired, ttl, user_metadata
from rota_tinker._http.formats import CONFLICT, NOT_IMPLEMENTED, BadRequest, field_of
from rota_tinker._http.server import Reply, Request
from rota_tinker._http.signed import check_caller, expiry, expiry_and_signature, make_url, signed
from rota_tinker._worker.state_files import private_dir

MAX_RECIPIENTS = 10
_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass
class External:
    """External weights ``tinker://RUN/external_weights/NAME``: the files in ``folder``."""

    path: str
    tenant: str
    run: str
    name: str
    base: Any
    lora: dict[str, Any] | None
    folder: str
    files: list[str]
    bytes: int
    created: float = field(default_factory=time.time)
    expires: float | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None


def _recipients(value: Any) -> list[Any] | None:
    """pyrage recipients of ``age_encryption_recipients`` (None when not given); BadRequest naming a bad one."""
    if value is None:
        return None
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_RECIPIENTS or not all(
            isinstance(r, str) and 0 < len(r) <= 16384 for r in value):
        raise BadRequest(f"age_encryption_recipients must be a list of 1-{MAX_RECIPIENTS} age or SSH public keys")
    try:
        import pyrage
    except ImportError:
        raise BadRequest("age_encryption_recipients need the pyrage package on the service (pip install pyrage); "
                         "save without them", status=NOT_IMPLEMENTED) from None
    out = []
    for i, text in enumerate(value):
        kind = pyrage.ssh if text.startswith(("ssh-", "ecdsa-")) else pyrage.x25519
        try:
            out.append(kind.Recipient.from_str(text))
        except Exception:
            raise BadRequest(f"age_encryption_recipients[{i}] is not an age1... or SSH public key") from None
    return out


def _publish(src: str, dest: str, recipients: list[Any] | None) -> tuple[list[str], int]:
    """Move the written folder ``src`` to ``dest`` (encrypting each file to ``recipients``): its files and bytes."""
    if recipients is None:
        os.replace(src, dest)
    else:
        import pyrage

        os.mkdir(dest, 0o700)
        try:
            for entry in sorted(os.listdir(src)):
                pyrage.encrypt_file(os.path.join(src, entry), os.path.join(dest, entry + ".age"), recipients)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(src, ignore_errors=True)
    files = sorted(e for e in os.listdir(dest) if os.path.isfile(os.path.join(dest, e)))
    return files, sum(os.path.getsize(os.path.join(dest, e)) for e in files)


class ExternalRoutes:
    """The external-weights routes of :class:`rota_tinker._http.service._Api`."""

    state: Any
    config: Any
    url_key: bytes  # signs download URLs (set by _Api: one per service process)

    def _save_external(self, tenant: Any, body: dict[str, Any]) -> Reply:
        state = self.state
        m = self._model(tenant, field_of(body, "model_id", str))  # type: ignore[attr-defined]
        name = field_of(body, "path", str)
        if not NAME.fullmatch(name):
            raise BadRequest(f"path {name[:80]!r} is not a valid checkpoint name: use 1-64 letters, digits, '.', '_', "
                             "'-', starting with a letter or digit")
        expires = ttl(body)
        recipients = _recipients(body.get("age_encryption_recipients"))
        path = f"tinker://{m.model_id}/external_weights/{name}"
        with state.lock:
            if path in state.runs.external:
                raise BadRequest(f"{path} exists; save under another name or delete it first", status=CONFLICT)
            state.check_quota(tenant.name, nbytes=m.bytes)
        fut = state.future(tenant.name, "SaveWeightsExternal", m.session_id, result_bytes=JSON_RESULT_BYTES)

        def done(result: Any) -> None:
            src = result["file"]
            dest = os.path.join(private_dir(os.path.join(os.path.dirname(os.path.dirname(src)), "external_weights")),
                                name)
            try:
                files, size = _publish(src, dest, recipients)
            except Exception as e:
                fut.fail(f"writing {path} failed: {type(e).__name__}: {e}", "server")
                return
            ext = External(path, tenant.name, m.model_id, name, m.base, m.lora, dest, files, size, expires=expires,
                           user_metadata=user_metadata(body.get("user_metadata")))
            with state.lock:
                state.runs.external[path] = ext
            state.runs.audit.note(tenant.name, "checkpoint_create", tinker_path=path, model_id=m.model_id)
            state.usage_counts.note(tenant.name, "checkpoint", 1, m.base.name, m.session_id)
            fut.succeed(json={"type": "save_weights_external", "path": path, "size_bytes": size})

        # written as sampler weights under a name no caller can give (names start with a letter or digit)
        state.trainer_of(m).submit(
            fut, "save_for_sampler", {"model_id": m.model_id, "name": f"x-external-{secrets.token_hex(8)}",
                                      "base": m.base}, done)
        return self._future_reply(fut, m.model_id)  # type: ignore[attr-defined]

    def _external(self, tenant: Any, run_id: str, name: str) -> External:
        path = f"tinker://{run_id}/external_weights/{name}"
        ext = self._owned(self.state.runs.external, path, "external weights", tenant)  # type: ignore[attr-defined]
        if expired(ext):
            raise BadRequest(f"external weights {path!r} have expired (their TTL passed)", status=404)
        return ext

    def _external_urls(self, req: Request, tenant: Any, run_id: str, name: str) -> Reply:
        """``get_external_weights_urls``: a signed URL per file, all valid until one expiry."""
        ext = self._external(tenant, run_id, name)
        self.state.runs.audit.note(tenant.name, "checkpoint_read", tinker_path=ext.path,
                                   purpose="external_weights_urls")
        expires = expiry()
        urls = {f: make_url(req, self.config, self.url_key, expires,  # type: ignore[attr-defined]
                            f"/api/v1/external_weights/{quote(run_id)}/{name}/{f}", ext.tenant, ext.path, f)
                for f in ext.files}
        return Reply.json({"urls": urls, "expires": _iso_utc(expires)})

    def download_external(self, req: Request) -> Reply:
        """``GET /api/v1/external_weights/RUN/NAME/FILE?expires=T&sig=S``: the file, when S signs it and T has not
        passed (no API key needed; one given must be the owner's)."""
        m = _DOWNLOAD.fullmatch(req.path)
        if m is None:
            raise BadRequest("no such external weights file; use the URLs get_external_weights_urls gave", status=404)
        run_id, name, file = m.groups()
        expires, sig = expiry_and_signature(req, "URLs get_external_weights_urls")
        with self.state.lock:
            ext = self.state.runs.external.get(f"tinker://{run_id}/external_weights/{name}")
        if (ext is None or file not in ext.files or expired(ext)
                or not signed(self.url_key, expires, sig, ext.tenant, ext.path, file)):
            raise BadRequest("this URL is not valid (expired, deleted, or not signed by this service); ask "
                             "get_external_weights_urls for new ones", status=403)
        check_caller(req, self.config, ext.tenant,  # type: ignore[attr-defined]
                     "these external weights belong to another tenant")
        full = os.path.join(ext.folder, file)
        try:
            size = os.path.getsize(full)
        except OSError:
            raise BadRequest(f"{file} was deleted meanwhile", status=404) from None
        if size > MAX_ARCHIVE_BYTES:
            raise BadRequest(f"{file} has {size} bytes, over the {MAX_ARCHIVE_BYTES}-byte download limit; copy it "
                             "from the service's data directory instead")
        if not self.state.runs.archives.acquire(blocking=False):
            raise BadRequest("too many downloads are being served; try again shortly", status=429)
        try:
            with open(full, "rb") as fh:
                return Reply(200, fh.read(), "application/octet-stream")
        except OSError:
            raise BadRequest(f"{file} was deleted meanwhile", status=404) from None
        finally:
            self.state.runs.archives.release()

    def expire_external(self, now: float) -> None:
        """Delete external weights whose TTL passed (the service's sweep)."""
        with self.state.lock:
            gone = [e for e in self.state.runs.external.values() if expired(e, now)]
            for e in gone:
                self.state.runs.external.pop(e.path, None)
        for e in gone:
            self.state.runs.audit.note(e.tenant, "checkpoint_expire", tinker_path=e.path)
            threading.Thread(target=shutil.rmtree, args=(e.folder, True), daemon=True).start()

    def delete_external(self, tenant: Any, run_id: str, name: str) -> None:
        ext = self._owned(self.state.runs.external,  # type: ignore[attr-defined]
                          f"tinker://{run_id}/external_weights/{name}", "external weights", tenant)
        with self.state.lock:
            self.state.runs.external.pop(ext.path, None)
        threading.Thread(target=shutil.rmtree, args=(ext.folder, True), daemon=True).start()


def _iso_utc(t: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat()


_DOWNLOAD = re.compile(rf"/api/v1/external_weights/({ID})/({NAME.pattern})/({_FILE.pattern})")
PATTERNS = [
    ("GET", re.compile(rf"/api/v1/training_runs/({ID})/checkpoints/external_weights/({NAME.pattern})"
                       r"/external_weights_urls"), ExternalRoutes._external_urls),
]
ROUTES = {"/api/v1/save_weights_external": ("POST", ExternalRoutes._save_external)}
WITH_REQUEST = (ExternalRoutes._external_urls,)  # handlers that read the request's headers
