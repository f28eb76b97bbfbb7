from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Residue(_message.Message):
    __slots__ = ("bytes", "counted_bytes", "limit_bytes")
    class BytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BYTES_FIELD_NUMBER: _ClassVar[int]
    COUNTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: _containers.ScalarMap[str, int]
    counted_bytes: int
    limit_bytes: int
    def __init__(self, bytes: _Optional[_Mapping[str, int]] = ..., counted_bytes: _Optional[int] = ..., limit_bytes: _Optional[int] = ...) -> None: ...

class CommandResultExt(_message.Message):
    __slots__ = ("residue",)
    RESIDUE_FIELD_NUMBER: _ClassVar[int]
    residue: Residue
    def __init__(self, residue: _Optional[_Union[Residue, _Mapping]] = ...) -> None: ...

class GetOperationResponseExt(_message.Message):
    __slots__ = ("residue",)
    RESIDUE_FIELD_NUMBER: _ClassVar[int]
    residue: Residue
    def __init__(self, residue: _Optional[_Union[Residue, _Mapping]] = ...) -> None: ...

class JobStatusExt(_message.Message):
    __slots__ = ("residue", "fault")
    RESIDUE_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    residue: Residue
    fault: str
    def __init__(self, residue: _Optional[_Union[Residue, _Mapping]] = ..., fault: _Optional[str] = ...) -> None: ...

class RegisterWorkloadExt(_message.Message):
    __slots__ = ("app", "endpoints")
    APP_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    app: int
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, app: _Optional[int] = ..., endpoints: _Optional[_Iterable[str]] = ...) -> None: ...
