"""The Tinker API's request and result formats this service reads and writes, checked field by field.

``forward_backward`` bodies arrive as the SDK's protobuf (``application/x-protobuf``,
optionally ``Content-Encoding: zstd``) and are parsed with the SDK's own bundled
schema, ``tinker.proto.tinker_public_pb2``. ``ForwardBackwardOutput`` and
``SampleResponse`` results go back as that protobuf too (the SDK 0.38 refuses JSON for
them). Everything else is JSON. Called by :mod:`rota_tinker._http.service`; no torch here.

Every parse error is a :class:`BadRequest` whose message names the field and the fix.
Numbers are checked where they are read: JSON ``NaN``/``Infinity`` and nesting deeper
than :data:`MAX_JSON_DEPTH` are refused, integers must fit their field's range, floats
must be finite, token ids must be whole numbers inside the vocabulary.
"""

from __future__ import annotations

import io
import itertools
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

_RL_INPUTS = (("target_tokens", "logprobs", "advantages"), ())
# loss_fn -> (required inputs, optional inputs); all per-token tensors of the target length
LOSS_INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cross_entropy": (("target_tokens",), ("weights",)),
    "importance_sampling": _RL_INPUTS, "ppo": _RL_INPUTS, "cispo": _RL_INPUTS, "dro": _RL_INPUTS,
    "gspo": (_RL_INPUTS[0], ("sequence_ratio_mask",)),  # the mask: tokens of the sequence ratio (default: all)
    # the sampler's logprobs come from the service's own records (rota_tinker._http.stability); the caller's copy, which
    # the cookbook sends, is taken and not used
    "stable_reinforce": (("target_tokens", "advantages"), ("logprobs",)),
}
LOSS_FNS = tuple(LOSS_INPUTS)
# loss_fn -> the loss_fn_config keys it takes (see rota_tinker._worker.models.LOSS_CONFIG for their defaults)
_CLIP = ("clip_low_threshold", "clip_high_threshold")
LOSS_CONFIG_KEYS = {"cross_entropy": (), "importance_sampling": (), "ppo": _CLIP, "cispo": _CLIP, "gspo": _CLIP,
                    "dro": ("beta",), "stable_reinforce": ("kl_coeff",)}
MAX_SPANS = 4096  # provenance runs per datum field (a multi-turn datum has two per turn)
MAX_SEQUENCE_ID = 128  # characters of a sequence_id (this service's are about 40)
_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
MAX_JSON_DEPTH = 32  # the SDK's bodies nest 5 deep at most
INT64 = (-(2**63), 2**63 - 1)


# Refusals the tinker SDK must not retry. Its 0.38 client retries 408, 409, 429 and every 5xx for minutes whatever
# x-should-retry says, so a missing feature (501) or a name already taken (409) left the caller hanging: both are a
# plain 400 whose message names the feature or the name.
NOT_IMPLEMENTED = 400
CONFLICT = 400


class BadRequest(ValueError):
    """A request the service refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class QuotaExceeded(BadRequest):
    """A per-key quota refused the request (429): how the SDK hears it depends on the route
    (:data:`rota_tinker._http.service.QUOTA_AS_429`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=429)


@dataclass(frozen=True)
class Span:
    """One provenance run (the SDK's ``PromptProvenanceSpan`` / ``SampledProvenanceSpan``): ``length`` datum positions
    are positions ``[offset, offset + length)`` of sequence ``sequence_id``'s prompt or sampled tokens."""

    sampled: bool  # False: prompt tokens
    sequence_id: str
    offset: int
    length: int


@dataclass
class Datum:
    """One training example: input tokens and per-token loss inputs (numpy arrays)."""

    tokens: np.ndarray  # int64 [T]
    inputs: dict[str, np.ndarray]  # name -> [T]
    # provenance (Datum.with_provenance): runs tiling model_input, and runs tiling the target rows; None: none given
    provenance: tuple[list[Span], list[Span]] | None = None


@dataclass
class FwdBwd:
    """A parsed forward_backward request."""

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    data: list[Datum]
    loss_config: dict[str, float]


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """Undo ``Content-Encoding`` (identity or zstd); a body that inflates past ``limit`` bytes is refused (413)."""
    enc = encoding.strip().lower()
    if enc in ("", "identity"):
        return body
    if enc == "zstd":
        import zstandard

        try:  # streamed: a frame that claims (or inflates to) a huge size never gets that much memory
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
                out = reader.read(limit + 1)
        except zstandard.ZstdError as e:
            raise BadRequest(f"body is not valid zstd ({e}); send it uncompressed or compress it with zstd") from e
        if len(out) > limit:
            raise BadRequest(f"body inflates to more than {limit} bytes; send less per request", status=413)
        return out
    raise BadRequest(f"Content-Encoding {encoding!r} is not supported; use zstd or none", status=415)


def _no_constant(name: str) -> Any:
    raise BadRequest(f"body has {name}, which is not a number here; send finite numbers only")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest(f"body has the number {text[:40]!r}, too large for a float; send finite numbers only")
    return value


def parse_json(body: bytes) -> dict[str, Any]:
    """A JSON object with finite numbers, nested at most :data:`MAX_JSON_DEPTH` deep; BadRequest otherwise."""
    try:
        obj = json.loads(body or b"{}", parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise BadRequest(f"body nests deeper than {MAX_JSON_DEPTH} levels; the tinker SDK's requests nest "
                         "5 deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        if isinstance(e, BadRequest):
            raise
        raise BadRequest(f"body is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"body must be a JSON object, got {type(obj).__name__}")
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:  # iterative: the check itself must not recurse
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"body nests deeper than {MAX_JSON_DEPTH} levels; the tinker SDK's requests nest "
                             "5 deep")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return obj


def _tensor(msg: Any, where: str) -> np.ndarray:
    encoding = msg.WhichOneof("encoding")
    if encoding != "dense":
        raise BadRequest(f"{where}: only dense tensors are implemented by this service (got {encoding}); send a "
                         "dense TensorData")
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise BadRequest(f"{where}: dtype {pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype} "
                         "not supported; use float32 or int64")
    if len(msg.dense) % np.dtype(dtype).itemsize:
        raise BadRequest(f"{where}: {len(msg.dense)} bytes is not a whole number of {np.dtype(dtype).name} values")
    arr = np.frombuffer(msg.dense, dtype=dtype)
    shape = list(msg.shape)
    if shape and int(np.prod(shape)) != arr.size:
        raise BadRequest(f"{where}: shape {shape} does not match its {arr.size} values")
    if arr.ndim != 1 and len(shape) > 1:
        raise BadRequest(f"{where}: shape {shape} must be 1-D (one value per target token)")
    return arr


def token_ids(arr: np.ndarray, vocab: int, where: str) -> np.ndarray:
    """``arr`` as int64 token ids in ``[0, vocab)``; floats only when every value is finite and whole."""
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.floor(arr))
        if bad.any():
            i = int(np.argmax(bad))
            raise BadRequest(f"{where}[{i}] is {float(arr[i])!r}, not a token id; send whole numbers (int64)")
    outside = (arr < 0) | (arr >= vocab)
    if outside.any():
        i = int(np.argmax(outside))
        raise BadRequest(f"{where}[{i}] is {arr[i].item()!r}, outside the base model's vocabulary of {vocab} tokens "
                         f"[0, {vocab})")
    return arr.astype(np.int64)


def finite_values(arr: np.ndarray, where: str) -> np.ndarray:
    """``arr`` as float32, every value finite (a NaN weight or advantage would poison the model)."""
    out = arr.astype(np.float32)
    bad = ~np.isfinite(out)
    if bad.any():
        i = int(np.argmax(bad))
        raise BadRequest(f"{where}[{i}] is {float(arr[i])!r}; send finite numbers")
    return out


def parse_forward_backward(body: bytes) -> FwdBwd:
    """Parse a ``tinker_public_pb2.ForwardBackwardRequest``; raises BadRequest naming the bad field."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # DecodeError, or a RuntimeWarning-turned-error on garbage
        raise BadRequest(f"body is not a tinker ForwardBackwardRequest protobuf ({e}); send what the tinker SDK "
                         "sends (Content-Type: application/x-protobuf)") from e
    if not msg.model_id:
        raise BadRequest("model_id is empty; pass the model_id returned by create_model")
    if msg.loss_fn not in LOSS_FNS:
        status = NOT_IMPLEMENTED if msg.loss_fn == "custom" else 400
        raise BadRequest(f"loss_fn {msg.loss_fn[:60]!r} is not supported by this service; use one of {list(LOSS_FNS)} "
                         "(forward_backward_custom works: the SDK computes a custom loss on the client)", status=status)
    loss_config = _loss_config(msg)
    if not msg.data:
        raise BadRequest("data is empty; send at least one Datum")
    required, optional = LOSS_INPUTS[msg.loss_fn]
    data = []
    for i, d in enumerate(msg.data):
        parts = []
        for j, chunk in enumerate(d.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise BadRequest(f"data[{i}].model_input[{j}] is a {kind} chunk; this service implements only "
                                 "encoded_text (text models)", status=NOT_IMPLEMENTED)
            if len(chunk.encoded_text.tokens) % 4:
                raise BadRequest(f"data[{i}].model_input[{j}].tokens is not int32-packed")
            parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        if tokens.size == 0:
            raise BadRequest(f"data[{i}].model_input is empty; give at least one token")
        names = set(d.loss_fn_inputs)
        missing = [n for n in required if n not in names]
        extra = sorted(names - set(required) - set(optional))
        if missing:
            raise BadRequest(f"data[{i}].loss_fn_inputs lacks {missing} needed by loss_fn {msg.loss_fn!r}")
        if extra:
            raise BadRequest(f"data[{i}].loss_fn_inputs has {extra}, not used by loss_fn {msg.loss_fn!r}; "
                             f"allowed: {list(required + optional)}")
        inputs = {n: _tensor(d.loss_fn_inputs[n], f"data[{i}].loss_fn_inputs[{n!r}]") for n in sorted(names)}
        for n, arr in inputs.items():
            if arr.size != tokens.size:
                raise BadRequest(f"data[{i}].loss_fn_inputs[{n!r}] has {arr.size} values but model_input has "
                                 f"{tokens.size} tokens; give one value per input position")
            if n != "target_tokens":  # token ids are checked against the model's vocabulary by the caller
                inputs[n] = finite_values(arr, f"data[{i}].loss_fn_inputs[{n!r}]")
        data.append(Datum(tokens=tokens, inputs=inputs, provenance=_provenance(d, i, tokens.size)))
    return FwdBwd(model_id=msg.model_id, seq_id=msg.seq_id, loss_fn=msg.loss_fn, forward_only=msg.forward_only,
                  data=data, loss_config=loss_config)


def _loss_config(msg: Any) -> dict[str, float]:
    """``loss_fn_config_v2`` when set (the SDK mirrors its numbers into the legacy map), else ``loss_fn_config``."""
    if msg.loss_fn_config_v2:
        items = []
        for key, value in msg.loss_fn_config_v2.items():
            if value.WhichOneof("value") != "number":
                raise BadRequest(f"loss_fn_config[{key[:60]!r}] is text; loss_fn {msg.loss_fn!r} takes numbers only")
            items.append((key, value.number))
    else:
        items = list(msg.loss_fn_config.items())
    out: dict[str, float] = {}
    for key, value in items:
        if key not in LOSS_CONFIG_KEYS[msg.loss_fn]:
            raise BadRequest(f"loss_fn_config key {key[:60]!r} is not one of {list(LOSS_CONFIG_KEYS[msg.loss_fn])} "
                             f"taken by loss_fn {msg.loss_fn!r}")
        if not math.isfinite(value):
            raise BadRequest(f"loss_fn_config[{key!r}] is {value!r}; send a finite number")
        out[key] = float(value)
    return out


def _spans(runs: Any, where: str, positions: int) -> list[Span]:
    """A field's provenance runs, checked: known arms, ids of at most :data:`MAX_SEQUENCE_ID` characters, offsets
    and lengths >= 0, and lengths that tile the ``positions`` of the field exactly."""
    if len(runs) > MAX_SPANS:
        raise BadRequest(f"{where} has {len(runs)} runs; this service takes at most {MAX_SPANS} per datum field")
    out = []
    for k, run in enumerate(runs):
        arm = run.WhichOneof("span")
        if arm is None:
            raise BadRequest(f"{where}[{k}] is empty; give a PromptProvenanceSpan or a SampledProvenanceSpan")
        span = getattr(run, arm)
        if not span.sequence_id or len(span.sequence_id) > MAX_SEQUENCE_ID:
            raise BadRequest(f"{where}[{k}].sequence_id must be 1-{MAX_SEQUENCE_ID} characters; give a "
                             "SampledSequence.sequence_id")
        if span.offset < 0 or span.length < 0:
            raise BadRequest(f"{where}[{k}] has offset {span.offset} and length {span.length}; both must be >= 0")
        out.append(Span(arm == "sampled_tokens", span.sequence_id, int(span.offset), int(span.length)))
    covered = sum(s.length for s in out)
    if covered != positions:
        raise BadRequest(f"{where} covers {covered} positions but the field has {positions}; the runs must tile it "
                         "exactly (Datum.with_provenance checks this)")
    return out


def _provenance(d: Any, i: int, positions: int) -> tuple[list[Span], list[Span]] | None:
    """A datum's provenance: both span lists or neither (as ``Datum`` asserts)."""
    if not d.model_input_spans and not d.loss_fn_input_spans:
        return None
    if not d.model_input_spans or not d.loss_fn_input_spans:
        raise BadRequest(f"data[{i}] has provenance for one field only; set model_input_spans and "
                         "loss_fn_input_spans together (Datum.with_provenance)")
    return (_spans(d.model_input_spans, f"data[{i}].model_input_spans", positions),
            _spans(d.loss_fn_input_spans, f"data[{i}].loss_fn_input_spans", positions))


def forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """``ForwardBackwardOutput`` protobuf: one ArrayRecord with a per-datum ``logprobs`` field."""
    out = pb.ForwardBackwardOutput()
    out.loss_fn_output_type = "ArrayRecord"
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    rec = out.loss_fn_outputs.add()
    rec.num_datums = len(logprobs)
    bt = rec.fields["logprobs"]
    bt.dtype = pb.DTYPE_FLOAT32
    arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in logprobs]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.nbytes for a in arrays])
    bt.offsets = offsets.tobytes()
    bt.data = b"".join(a.tobytes() for a in arrays)
    return out.SerializeToString()


def sample_response(result: dict[str, Any]) -> bytes:
    """``SampleResponse`` protobuf from a :func:`rota_tinker._worker.sampling.sample` result: ``sequences`` ((tokens,
    logprobs, stop_reason, top-k or None) each) and what the request asked for at its prompt."""
    out = pb.SampleResponse()
    if result.get("prompt_logprobs") is not None:
        out.prompt_logprobs = np.asarray(result["prompt_logprobs"], dtype=np.float32).tobytes()
    if result.get("topk_prompt") is not None:
        _topk_message(out.topk_prompt_logprobs, *result["topk_prompt"])
    if result.get("target_prompt_logprobs") is not None:
        _dense(out.target_prompt_logprobs, np.asarray(result["target_prompt_logprobs"], np.float32))
    if result.get("prompt_alt") is not None:
        tokens, logprobs = result["prompt_alt"]
        _dense(out.prompt_alt_tokens.tokens, np.asarray(tokens, np.int64))
        _dense(out.prompt_alt_tokens.logprobs, np.asarray(logprobs, np.float32))
    for tokens, logprobs, stop, *topk in result["sequences"]:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if stop == "stop" else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
        if topk and topk[0] is not None:
            _topk_message(seq.topk_sampled_logprobs, *topk[0])
    return out.SerializeToString()


def _topk_message(msg: Any, ids: np.ndarray, logprobs: np.ndarray) -> None:
    """A ``TopkLogprobs``: ``[length, k]`` ids (int32) and logprobs (float32), row-major."""
    msg.length, msg.k = int(ids.shape[0]), int(ids.shape[1])
    msg.token_ids = np.ascontiguousarray(ids, np.int32).tobytes()
    msg.logprobs = np.ascontiguousarray(logprobs, np.float32).tobytes()


def _dense(msg: Any, arr: np.ndarray) -> None:
    msg.dtype = pb.DTYPE_INT64 if arr.dtype == np.int64 else pb.DTYPE_FLOAT32
    msg.shape.extend(arr.shape)
    msg.dense = np.ascontiguousarray(arr).tobytes()


def target_ids(value: Any, prompt_len: int, vocab: int, max_k: int) -> np.ndarray:
    """``target_prompt_logprobs`` of a sample request (JSON ``TensorData``, dense or sparse CSR): ``[prompt_len - 1,
    K]`` int64 token ids, -1 where nothing is asked (a sparse tensor's unlisted cells); BadRequest naming the fault."""
    where = "target_prompt_logprobs"
    if not isinstance(value, dict) or not isinstance(value.get("data"), list):
        raise BadRequest(f"{where} must be a TensorData object with a 'data' list")
    if value.get("dtype") != "int64":
        raise BadRequest(f"{where} must be int64 token ids, got dtype {_short(value.get('dtype'))}")
    shape = value.get("shape")
    if (not isinstance(shape, list) or len(shape) != 2 or not all(isinstance(d, int) for d in shape)
            or shape[0] != prompt_len - 1 or not 1 <= shape[1] <= max_k):
        raise BadRequest(f"{where} shape {_short(shape)} must be [len(prompt) - 1, K] = [{prompt_len - 1}, K] with "
                         f"1 <= K <= {max_k}")
    rows, k = shape
    data = value["data"]
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
        raise BadRequest(f"{where} data must be integers (token ids, -1 for none)")
    crow, col = value.get("sparse_crow_indices"), value.get("sparse_col_indices")
    if crow is None and col is None:
        if len(data) != rows * k:
            raise BadRequest(f"{where} has {len(data)} values; shape {shape} needs {rows * k}")
        ids = np.asarray(data, np.int64).reshape(rows, k)
    else:
        ok = (isinstance(crow, list) and isinstance(col, list) and len(crow) == rows + 1 and len(col) == len(data)
              and all(isinstance(x, int) for x in crow + col) and crow[0] == 0 and crow[-1] == len(data)
              and all(a <= b for a, b in itertools.pairwise(crow)) and all(0 <= c < k for c in col))
        if not ok:
            raise BadRequest(f"{where} is not a valid sparse CSR tensor of shape {shape} (crow_indices of "
                             f"{rows + 1} non-decreasing pointers from 0 to len(data), col_indices in [0, {k}))")
        ids = np.full((rows, k), -1, np.int64)
        for r in range(rows):
            ids[r, col[crow[r]:crow[r + 1]]] = data[crow[r]:crow[r + 1]]
    bad = (ids < -1) | (ids >= vocab)
    if bad.any():
        r, c = (int(x) for x in np.argwhere(bad)[0])
        raise BadRequest(f"{where}[{r}][{c}] is {int(ids[r, c])}, outside the vocabulary of {vocab} tokens (-1: none)")
    return ids


# ------------------------------------------------------------------ JSON fields


def field_of(body: dict[str, Any], name: str, kind: type | tuple[type, ...], *, required: bool = True,
             default: Any = None, bounds: tuple[float, float] | None = None) -> Any:
    """``body[name]`` checked against ``kind``; BadRequest naming the field otherwise.

    Integers must lie within ``bounds`` (default: int64), floats must be finite (and
    within ``bounds`` when given).
    """
    if name not in body or body[name] is None:
        if required:
            raise BadRequest(f"field {name!r} is missing; see the tinker SDK's request types")
        return default
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise BadRequest(f"field {name!r} must be {'/'.join(k.__name__ for k in kinds)}, not a boolean")
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > 2**1023:
            raise BadRequest(f"field {name!r} is {_short(value)}, too large for a float; send a finite number")
        value = float(value)
    if not isinstance(value, kinds):
        raise BadRequest(f"field {name!r} must be {'/'.join(k.__name__ for k in kinds)}, "
                         f"got {type(value).__name__} {_short(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"field {name!r} is {value!r}; send a finite number")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        lo, hi = bounds if bounds is not None else (INT64 if isinstance(value, int) else (-math.inf, math.inf))
        if not lo <= value <= hi:
            raise BadRequest(f"field {name!r} is {_short(value)}, outside [{lo:g}, {hi:g}]")
    return value


def _short(value: Any) -> str:
    """``repr`` of a caller's value cut short (a 10,000-digit integer is not echoed back whole)."""
    if isinstance(value, int) and abs(value) >= 10**30:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}..."


def prompt_tokens(prompt: Any, vocab: int) -> np.ndarray:
    """Tokens of a JSON ``ModelInput`` (``{"chunks": [{"type": "encoded_text", "tokens": [...]}]}``), each in
    ``[0, vocab)``."""
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise BadRequest("field 'prompt' must be a ModelInput object with a 'chunks' list")
    tokens: list[int] = []
    for j, chunk in enumerate(prompt["chunks"]):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
            raise BadRequest(f"prompt.chunks[{j}] is a {_short(kind)} chunk; this service implements only "
                             "encoded_text (text models)", status=NOT_IMPLEMENTED)
        toks = chunk.get("tokens")
        if not isinstance(toks, list):
            raise BadRequest(f"prompt.chunks[{j}].tokens must be a list of integers")
        for i, t in enumerate(toks):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise BadRequest(f"prompt.chunks[{j}].tokens[{i}] is {_short(t)}, not a token id of the base model's "
                                 f"vocabulary of {vocab} tokens [0, {vocab})")
        tokens.extend(toks)
    if not tokens:
        raise BadRequest("prompt has no tokens; give at least one")
    return np.asarray(tokens, dtype=np.int64)
