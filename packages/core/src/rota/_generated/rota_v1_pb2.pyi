from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TurnRequest(_message.Message):
    __slots__ = ("job_id", "group_id", "priority", "weight", "world_size", "rank", "footprint_bytes", "devices", "quiet")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    QUIET_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    priority: int
    weight: float
    world_size: int
    rank: int
    footprint_bytes: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    quiet: bool
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., priority: _Optional[int] = ..., weight: _Optional[float] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., footprint_bytes: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ..., quiet: bool = ...) -> None: ...

class Grant(_message.Message):
    __slots__ = ("token", "waited_ms", "context_restored", "ttl_ms", "max_turn_ms", "device")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    WAITED_MS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_RESTORED_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURN_MS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    token: int
    waited_ms: int
    context_restored: bool
    ttl_ms: int
    max_turn_ms: int
    device: str
    def __init__(self, token: _Optional[int] = ..., waited_ms: _Optional[int] = ..., context_restored: bool = ..., ttl_ms: _Optional[int] = ..., max_turn_ms: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("job_id", "group_id", "token", "rank", "footprint_bytes", "restore_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    token: int
    rank: int
    footprint_bytes: int
    restore_seconds: float
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., token: _Optional[int] = ..., rank: _Optional[int] = ..., footprint_bytes: _Optional[int] = ..., restore_seconds: _Optional[float] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("pending_waiters", "snapshot_deferred", "group_released")
    PENDING_WAITERS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DEFERRED_FIELD_NUMBER: _ClassVar[int]
    GROUP_RELEASED_FIELD_NUMBER: _ClassVar[int]
    pending_waiters: int
    snapshot_deferred: bool
    group_released: bool
    def __init__(self, pending_waiters: _Optional[int] = ..., snapshot_deferred: bool = ..., group_released: bool = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("job_id", "group_id", "rank", "world_size", "pid", "footprint_bytes", "can_prefetch", "resume")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAN_PREFETCH_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    rank: int
    world_size: int
    pid: int
    footprint_bytes: int
    can_prefetch: bool
    resume: str
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., pid: _Optional[int] = ..., footprint_bytes: _Optional[int] = ..., can_prefetch: bool = ..., resume: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("footprint_bytes", "host_bytes", "spilled_bytes", "residue_bytes", "memory_unchanged")
    FOOTPRINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPILLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    footprint_bytes: int
    host_bytes: int
    spilled_bytes: int
    residue_bytes: int
    memory_unchanged: bool
    def __init__(self, footprint_bytes: _Optional[int] = ..., host_bytes: _Optional[int] = ..., spilled_bytes: _Optional[int] = ..., residue_bytes: _Optional[int] = ..., memory_unchanged: bool = ...) -> None: ...

class Memory(_message.Message):
    __slots__ = ("host_bytes", "spilled_bytes", "residue_bytes")
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPILLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    host_bytes: int
    spilled_bytes: int
    residue_bytes: int
    def __init__(self, host_bytes: _Optional[int] = ..., spilled_bytes: _Optional[int] = ..., residue_bytes: _Optional[int] = ...) -> None: ...

class CommandResult(_message.Message):
    __slots__ = ("command_id", "ok", "error", "bytes", "seconds", "memory")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    ok: bool
    error: str
    bytes: int
    seconds: float
    memory: Memory
    def __init__(self, command_id: _Optional[str] = ..., ok: bool = ..., error: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., memory: _Optional[_Union[Memory, _Mapping]] = ...) -> None: ...

class RankFault(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TenantMessage(_message.Message):
    __slots__ = ("hello", "heartbeat", "result", "fault", "goodbye")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    heartbeat: Heartbeat
    result: CommandResult
    fault: RankFault
    goodbye: Goodbye
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., result: _Optional[_Union[CommandResult, _Mapping]] = ..., fault: _Optional[_Union[RankFault, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ...) -> None: ...

class ParkCommand(_message.Message):
    __slots__ = ("tags", "mode", "token")
    TAGS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    mode: str
    token: int
    def __init__(self, tags: _Optional[_Iterable[str]] = ..., mode: _Optional[str] = ..., token: _Optional[int] = ...) -> None: ...

class YieldSoon(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class RestoreCommand(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: int
    def __init__(self, token: _Optional[int] = ...) -> None: ...

class AbortJob(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class TenantCommand(_message.Message):
    __slots__ = ("command_id", "park", "yield_soon", "restore", "abort", "resume", "memory_once")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    PARK_FIELD_NUMBER: _ClassVar[int]
    YIELD_SOON_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ONCE_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    park: ParkCommand
    yield_soon: YieldSoon
    restore: RestoreCommand
    abort: AbortJob
    resume: str
    memory_once: bool
    def __init__(self, command_id: _Optional[str] = ..., park: _Optional[_Union[ParkCommand, _Mapping]] = ..., yield_soon: _Optional[_Union[YieldSoon, _Mapping]] = ..., restore: _Optional[_Union[RestoreCommand, _Mapping]] = ..., abort: _Optional[_Union[AbortJob, _Mapping]] = ..., resume: _Optional[str] = ..., memory_once: bool = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("job_id", "group_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class EvictReply(_message.Message):
    __slots__ = ("was_holder", "was_queued")
    WAS_HOLDER_FIELD_NUMBER: _ClassVar[int]
    WAS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    was_holder: bool
    was_queued: bool
    def __init__(self, was_holder: bool = ..., was_queued: bool = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("group_id", "page_size", "page_token")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    page_size: int
    page_token: str
    def __init__(self, group_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class TenantInfo(_message.Message):
    __slots__ = ("job_id", "state", "turns", "gpu_seconds", "wait_p50_ms", "wait_p99_ms", "park_p50_ms", "park_p99_ms", "parked_bytes", "footprint_bytes", "priority", "weight", "host_bytes", "spilled_bytes", "residue_bytes", "fault", "parks_failed", "restores_failed")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    GPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    PARK_P50_MS_FIELD_NUMBER: _ClassVar[int]
    PARK_P99_MS_FIELD_NUMBER: _ClassVar[int]
    PARKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPILLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    PARKS_FAILED_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FAILED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: str
    turns: int
    gpu_seconds: float
    wait_p50_ms: float
    wait_p99_ms: float
    park_p50_ms: float
    park_p99_ms: float
    parked_bytes: int
    footprint_bytes: int
    priority: int
    weight: float
    host_bytes: int
    spilled_bytes: int
    residue_bytes: int
    fault: str
    parks_failed: int
    restores_failed: int
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[str] = ..., turns: _Optional[int] = ..., gpu_seconds: _Optional[float] = ..., wait_p50_ms: _Optional[float] = ..., wait_p99_ms: _Optional[float] = ..., park_p50_ms: _Optional[float] = ..., park_p99_ms: _Optional[float] = ..., parked_bytes: _Optional[int] = ..., footprint_bytes: _Optional[int] = ..., priority: _Optional[int] = ..., weight: _Optional[float] = ..., host_bytes: _Optional[int] = ..., spilled_bytes: _Optional[int] = ..., residue_bytes: _Optional[int] = ..., fault: _Optional[str] = ..., parks_failed: _Optional[int] = ..., restores_failed: _Optional[int] = ...) -> None: ...

class GroupInfo(_message.Message):
    __slots__ = ("group_id", "state", "holder", "token", "queue", "loaded_job", "resident_jobs", "switches", "busy_seconds", "age_seconds", "tenants", "policy", "prefetch_hits", "prefetch_misses", "prefetch_failures", "prefetch_wasted")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    LOADED_JOB_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_JOBS_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_MISSES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_WASTED_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    state: str
    holder: str
    token: int
    queue: _containers.RepeatedScalarFieldContainer[str]
    loaded_job: str
    resident_jobs: _containers.RepeatedScalarFieldContainer[str]
    switches: int
    busy_seconds: float
    age_seconds: float
    tenants: _containers.RepeatedCompositeFieldContainer[TenantInfo]
    policy: str
    prefetch_hits: int
    prefetch_misses: int
    prefetch_failures: int
    prefetch_wasted: int
    def __init__(self, group_id: _Optional[str] = ..., state: _Optional[str] = ..., holder: _Optional[str] = ..., token: _Optional[int] = ..., queue: _Optional[_Iterable[str]] = ..., loaded_job: _Optional[str] = ..., resident_jobs: _Optional[_Iterable[str]] = ..., switches: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., age_seconds: _Optional[float] = ..., tenants: _Optional[_Iterable[_Union[TenantInfo, _Mapping]]] = ..., policy: _Optional[str] = ..., prefetch_hits: _Optional[int] = ..., prefetch_misses: _Optional[int] = ..., prefetch_failures: _Optional[int] = ..., prefetch_wasted: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("groups", "orchestrator", "next_page_token")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    ORCHESTRATOR_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupInfo]
    orchestrator: str
    next_page_token: str
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupInfo, _Mapping]]] = ..., orchestrator: _Optional[str] = ..., next_page_token: _Optional[str] = ...) -> None: ...
