from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Backend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_UNSPECIFIED: _ClassVar[Backend]
    BACKEND_CUDA: _ClassVar[Backend]

class App(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    APP_UNSPECIFIED: _ClassVar[App]
    APP_VLLM: _ClassVar[App]
    APP_SGLANG: _ClassVar[App]

class SuspendMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SUSPEND_MODE_UNSPECIFIED: _ClassVar[SuspendMode]
    SUSPEND_MODE_OFFLOAD: _ClassVar[SuspendMode]
    SUSPEND_MODE_DISCARD: _ClassVar[SuspendMode]

class OperationStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERATION_STATUS_UNSPECIFIED: _ClassVar[OperationStatus]
    OPERATION_STATUS_PENDING: _ClassVar[OperationStatus]
    OPERATION_STATUS_COMPLETE: _ClassVar[OperationStatus]
    OPERATION_STATUS_FAILED: _ClassVar[OperationStatus]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_IDLE: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_TRANSITIONING: _ClassVar[JobState]
    JOB_STATE_SAVED: _ClassVar[JobState]
    JOB_STATE_FAULTED: _ClassVar[JobState]
BACKEND_UNSPECIFIED: Backend
BACKEND_CUDA: Backend
APP_UNSPECIFIED: App
APP_VLLM: App
APP_SGLANG: App
SUSPEND_MODE_UNSPECIFIED: SuspendMode
SUSPEND_MODE_OFFLOAD: SuspendMode
SUSPEND_MODE_DISCARD: SuspendMode
OPERATION_STATUS_UNSPECIFIED: OperationStatus
OPERATION_STATUS_PENDING: OperationStatus
OPERATION_STATUS_COMPLETE: OperationStatus
OPERATION_STATUS_FAILED: OperationStatus
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_IDLE: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_TRANSITIONING: JobState
JOB_STATE_SAVED: JobState
JOB_STATE_FAULTED: JobState

class ProcessTarget(_message.Message):
    __slots__ = ("pids",)
    PIDS_FIELD_NUMBER: _ClassVar[int]
    pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pids: _Optional[_Iterable[int]] = ...) -> None: ...

class CudaBackendConfig(_message.Message):
    __slots__ = ("explicit_target",)
    EXPLICIT_TARGET_FIELD_NUMBER: _ClassVar[int]
    explicit_target: ProcessTarget
    def __init__(self, explicit_target: _Optional[_Union[ProcessTarget, _Mapping]] = ...) -> None: ...

class DirectMemoryBackendConfig(_message.Message):
    __slots__ = ("explicit_target",)
    EXPLICIT_TARGET_FIELD_NUMBER: _ClassVar[int]
    explicit_target: ProcessTarget
    def __init__(self, explicit_target: _Optional[_Union[ProcessTarget, _Mapping]] = ...) -> None: ...

class AppEndpointConfig(_message.Message):
    __slots__ = ("app", "endpoints", "mode", "tags")
    APP_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    app: App
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    mode: SuspendMode
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, app: _Optional[_Union[App, str]] = ..., endpoints: _Optional[_Iterable[str]] = ..., mode: _Optional[_Union[SuspendMode, str]] = ..., tags: _Optional[_Iterable[str]] = ...) -> None: ...

class AppChannelConfig(_message.Message):
    __slots__ = ("mode", "tags")
    MODE_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    mode: SuspendMode
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, mode: _Optional[_Union[SuspendMode, str]] = ..., tags: _Optional[_Iterable[str]] = ...) -> None: ...

class MemoryRegion(_message.Message):
    __slots__ = ("pid", "address", "size_bytes")
    PID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    pid: int
    address: int
    size_bytes: int
    def __init__(self, pid: _Optional[int] = ..., address: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class MemoryRegionsBackendConfig(_message.Message):
    __slots__ = ("regions", "snapshot_name")
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_NAME_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[MemoryRegion]
    snapshot_name: str
    def __init__(self, regions: _Optional[_Iterable[_Union[MemoryRegion, _Mapping]]] = ..., snapshot_name: _Optional[str] = ...) -> None: ...

class BackendConfig(_message.Message):
    __slots__ = ("cuda", "app_endpoint", "app_channel", "direct_memory", "memory_regions")
    CUDA_FIELD_NUMBER: _ClassVar[int]
    APP_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    APP_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    DIRECT_MEMORY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_REGIONS_FIELD_NUMBER: _ClassVar[int]
    cuda: CudaBackendConfig
    app_endpoint: AppEndpointConfig
    app_channel: AppChannelConfig
    direct_memory: DirectMemoryBackendConfig
    memory_regions: MemoryRegionsBackendConfig
    def __init__(self, cuda: _Optional[_Union[CudaBackendConfig, _Mapping]] = ..., app_endpoint: _Optional[_Union[AppEndpointConfig, _Mapping]] = ..., app_channel: _Optional[_Union[AppChannelConfig, _Mapping]] = ..., direct_memory: _Optional[_Union[DirectMemoryBackendConfig, _Mapping]] = ..., memory_regions: _Optional[_Union[MemoryRegionsBackendConfig, _Mapping]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("job_id", "group", "backend", "backend_config")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_CONFIG_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group: str
    backend: Backend
    backend_config: BackendConfig
    def __init__(self, job_id: _Optional[str] = ..., group: _Optional[str] = ..., backend: _Optional[_Union[Backend, str]] = ..., backend_config: _Optional[_Union[BackendConfig, _Mapping]] = ...) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("operation_id",)
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    def __init__(self, operation_id: _Optional[str] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("job_id", "group", "backend", "backend_config")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_CONFIG_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group: str
    backend: Backend
    backend_config: BackendConfig
    def __init__(self, job_id: _Optional[str] = ..., group: _Optional[str] = ..., backend: _Optional[_Union[Backend, str]] = ..., backend_config: _Optional[_Union[BackendConfig, _Mapping]] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("operation_id",)
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    def __init__(self, operation_id: _Optional[str] = ...) -> None: ...

class GetOperationRequest(_message.Message):
    __slots__ = ("operation_id",)
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    def __init__(self, operation_id: _Optional[str] = ...) -> None: ...

class GetOperationResponse(_message.Message):
    __slots__ = ("status", "storage_bytes", "snapshot_device_bytes", "elapsed_ms", "error")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    status: OperationStatus
    storage_bytes: int
    snapshot_device_bytes: int
    elapsed_ms: int
    error: str
    def __init__(self, status: _Optional[_Union[OperationStatus, str]] = ..., storage_bytes: _Optional[int] = ..., snapshot_device_bytes: _Optional[int] = ..., elapsed_ms: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "state")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ...) -> None: ...

class AcceleratorStatus(_message.Message):
    __slots__ = ("id", "memory_used_bytes", "memory_total_bytes")
    ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    id: str
    memory_used_bytes: int
    memory_total_bytes: int
    def __init__(self, id: _Optional[str] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("job_statuses", "accelerator_statuses")
    JOB_STATUSES_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_STATUSES_FIELD_NUMBER: _ClassVar[int]
    job_statuses: _containers.RepeatedCompositeFieldContainer[JobStatus]
    accelerator_statuses: _containers.RepeatedCompositeFieldContainer[AcceleratorStatus]
    def __init__(self, job_statuses: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ..., accelerator_statuses: _Optional[_Iterable[_Union[AcceleratorStatus, _Mapping]]] = ...) -> None: ...

class WorkloadCapabilities(_message.Message):
    __slots__ = ("supported_modes", "default_mode", "tags")
    SUPPORTED_MODES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODE_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    supported_modes: _containers.RepeatedScalarFieldContainer[SuspendMode]
    default_mode: SuspendMode
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, supported_modes: _Optional[_Iterable[_Union[SuspendMode, str]]] = ..., default_mode: _Optional[_Union[SuspendMode, str]] = ..., tags: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterWorkload(_message.Message):
    __slots__ = ("job_id", "group", "capabilities")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group: str
    capabilities: WorkloadCapabilities
    def __init__(self, job_id: _Optional[str] = ..., group: _Optional[str] = ..., capabilities: _Optional[_Union[WorkloadCapabilities, _Mapping]] = ...) -> None: ...

class CommandResult(_message.Message):
    __slots__ = ("command_id", "ok", "error")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    ok: bool
    error: str
    def __init__(self, command_id: _Optional[str] = ..., ok: bool = ..., error: _Optional[str] = ...) -> None: ...

class WorkloadMessage(_message.Message):
    __slots__ = ("register", "result")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    register: RegisterWorkload
    result: CommandResult
    def __init__(self, register: _Optional[_Union[RegisterWorkload, _Mapping]] = ..., result: _Optional[_Union[CommandResult, _Mapping]] = ...) -> None: ...

class SnapshotCommand(_message.Message):
    __slots__ = ("mode", "tags")
    MODE_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    mode: SuspendMode
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, mode: _Optional[_Union[SuspendMode, str]] = ..., tags: _Optional[_Iterable[str]] = ...) -> None: ...

class RestoreCommand(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class AgentCommand(_message.Message):
    __slots__ = ("command_id", "snapshot", "restore")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    snapshot: SnapshotCommand
    restore: RestoreCommand
    def __init__(self, command_id: _Optional[str] = ..., snapshot: _Optional[_Union[SnapshotCommand, _Mapping]] = ..., restore: _Optional[_Union[RestoreCommand, _Mapping]] = ...) -> None: ...
