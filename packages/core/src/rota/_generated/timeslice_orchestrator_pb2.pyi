from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AcquireRequest(_message.Message):
    __slots__ = ("job_id", "group_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("success", "waited_ms", "context_restored")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    WAITED_MS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_RESTORED_FIELD_NUMBER: _ClassVar[int]
    success: bool
    waited_ms: int
    context_restored: bool
    def __init__(self, success: bool = ..., waited_ms: _Optional[int] = ..., context_restored: bool = ...) -> None: ...

class YieldRequest(_message.Message):
    __slots__ = ("job_id", "group_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_id: str
    def __init__(self, job_id: _Optional[str] = ..., group_id: _Optional[str] = ...) -> None: ...

class YieldResponse(_message.Message):
    __slots__ = ("success", "pending_waiters", "snapshot_deferred")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    PENDING_WAITERS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DEFERRED_FIELD_NUMBER: _ClassVar[int]
    success: bool
    pending_waiters: int
    snapshot_deferred: bool
    def __init__(self, success: bool = ..., pending_waiters: _Optional[int] = ..., snapshot_deferred: bool = ...) -> None: ...

class ListGroupsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListGroupsResponse(_message.Message):
    __slots__ = ("group_ids",)
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetGroupStatusRequest(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class GroupStatus(_message.Message):
    __slots__ = ("group_id", "group_state", "state_timestamp", "locking_job", "active_job", "waiter_queue_depth", "loaded_job")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[GroupStatus.State]
        STATE_UNKNOWN: _ClassVar[GroupStatus.State]
        STATE_IDLE: _ClassVar[GroupStatus.State]
        STATE_IDLE_YIELDED: _ClassVar[GroupStatus.State]
        STATE_LOCKED: _ClassVar[GroupStatus.State]
        STATE_SWITCHING: _ClassVar[GroupStatus.State]
    STATE_UNSPECIFIED: GroupStatus.State
    STATE_UNKNOWN: GroupStatus.State
    STATE_IDLE: GroupStatus.State
    STATE_IDLE_YIELDED: GroupStatus.State
    STATE_LOCKED: GroupStatus.State
    STATE_SWITCHING: GroupStatus.State
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    LOCKING_JOB_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_JOB_FIELD_NUMBER: _ClassVar[int]
    WAITER_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    LOADED_JOB_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    group_state: GroupStatus.State
    state_timestamp: _timestamp_pb2.Timestamp
    locking_job: str
    active_job: str
    waiter_queue_depth: int
    loaded_job: str
    def __init__(self, group_id: _Optional[str] = ..., group_state: _Optional[_Union[GroupStatus.State, str]] = ..., state_timestamp: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., locking_job: _Optional[str] = ..., active_job: _Optional[str] = ..., waiter_queue_depth: _Optional[int] = ..., loaded_job: _Optional[str] = ...) -> None: ...

class SnapshotAgentJobState(_message.Message):
    __slots__ = ("agent", "job_state", "job_id")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[SnapshotAgentJobState.State]
        STATE_IDLE: _ClassVar[SnapshotAgentJobState.State]
        STATE_RUNNING: _ClassVar[SnapshotAgentJobState.State]
        STATE_TRANSITIONING: _ClassVar[SnapshotAgentJobState.State]
        STATE_SAVED: _ClassVar[SnapshotAgentJobState.State]
        STATE_FAULTED: _ClassVar[SnapshotAgentJobState.State]
    STATE_UNSPECIFIED: SnapshotAgentJobState.State
    STATE_IDLE: SnapshotAgentJobState.State
    STATE_RUNNING: SnapshotAgentJobState.State
    STATE_TRANSITIONING: SnapshotAgentJobState.State
    STATE_SAVED: SnapshotAgentJobState.State
    STATE_FAULTED: SnapshotAgentJobState.State
    AGENT_FIELD_NUMBER: _ClassVar[int]
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    agent: str
    job_state: SnapshotAgentJobState.State
    job_id: str
    def __init__(self, agent: _Optional[str] = ..., job_state: _Optional[_Union[SnapshotAgentJobState.State, str]] = ..., job_id: _Optional[str] = ...) -> None: ...

class GetGroupStatusResponse(_message.Message):
    __slots__ = ("group", "agent_job_states")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    AGENT_JOB_STATES_FIELD_NUMBER: _ClassVar[int]
    group: GroupStatus
    agent_job_states: _containers.RepeatedCompositeFieldContainer[SnapshotAgentJobState]
    def __init__(self, group: _Optional[_Union[GroupStatus, _Mapping]] = ..., agent_job_states: _Optional[_Iterable[_Union[SnapshotAgentJobState, _Mapping]]] = ...) -> None: ...
