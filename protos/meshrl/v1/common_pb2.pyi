from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ServiceIdentity(_message.Message):
    __slots__ = ("service_id", "kind", "address", "group", "protocol_version", "pid", "hostname", "meshrl_version", "gpu", "limits", "policy_losses")
    class LimitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    MESHRL_VERSION_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    POLICY_LOSSES_FIELD_NUMBER: _ClassVar[int]
    service_id: str
    kind: str
    address: str
    group: str
    protocol_version: int
    pid: int
    hostname: str
    meshrl_version: str
    gpu: str
    limits: _containers.ScalarMap[str, int]
    policy_losses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, service_id: _Optional[str] = ..., kind: _Optional[str] = ..., address: _Optional[str] = ..., group: _Optional[str] = ..., protocol_version: _Optional[int] = ..., pid: _Optional[int] = ..., hostname: _Optional[str] = ..., meshrl_version: _Optional[str] = ..., gpu: _Optional[str] = ..., limits: _Optional[_Mapping[str, int]] = ..., policy_losses: _Optional[_Iterable[str]] = ...) -> None: ...

class WeightVersion(_message.Message):
    __slots__ = ("version", "transfer_s", "pause_s", "memory")
    class MemoryEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    version: int
    transfer_s: float
    pause_s: float
    memory: _containers.ScalarMap[str, float]
    def __init__(self, version: _Optional[int] = ..., transfer_s: _Optional[float] = ..., pause_s: _Optional[float] = ..., memory: _Optional[_Mapping[str, float]] = ...) -> None: ...

class JoinChannelRequest(_message.Message):
    __slots__ = ("channel_id", "backend", "rank", "world_size", "rendezvous", "timeout_s")
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    backend: str
    rank: int
    world_size: int
    rendezvous: bytes
    timeout_s: float
    def __init__(self, channel_id: _Optional[str] = ..., backend: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., rendezvous: _Optional[bytes] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class JoinChannelResponse(_message.Message):
    __slots__ = ("channel_id",)
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    def __init__(self, channel_id: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceInfo(_message.Message):
    __slots__ = ("identity", "weight_version", "run_id", "details")
    class DetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    identity: ServiceIdentity
    weight_version: int
    run_id: str
    details: _containers.ScalarMap[str, str]
    def __init__(self, identity: _Optional[_Union[ServiceIdentity, _Mapping]] = ..., weight_version: _Optional[int] = ..., run_id: _Optional[str] = ..., details: _Optional[_Mapping[str, str]] = ...) -> None: ...
