from meshrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerInitRequest(_message.Message):
    __slots__ = ("run_id", "run_config_yaml", "seed", "roles")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    run_config_yaml: str
    seed: int
    roles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., run_config_yaml: _Optional[str] = ..., seed: _Optional[int] = ..., roles: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("step", "chunks", "role", "temperature", "top_k")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    step: int
    chunks: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorChunk]
    role: str
    temperature: float
    top_k: int
    def __init__(self, step: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[_common_pb2.TensorChunk, _Mapping]]] = ..., role: _Optional[str] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ...) -> None: ...

class BatchResponse(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[_common_pb2.TensorChunk, _Mapping]]] = ...) -> None: ...

class UpdateResponse(_message.Message):
    __slots__ = ("metrics", "weight_version")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    weight_version: int
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class PrepareChannelRequest(_message.Message):
    __slots__ = ("channel_id", "backend", "world_size", "keep_joined")
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    KEEP_JOINED_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    backend: str
    world_size: int
    keep_joined: bool
    def __init__(self, channel_id: _Optional[str] = ..., backend: _Optional[str] = ..., world_size: _Optional[int] = ..., keep_joined: _Optional[bool] = ...) -> None: ...

class PrepareChannelResponse(_message.Message):
    __slots__ = ("rendezvous",)
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    rendezvous: bytes
    def __init__(self, rendezvous: _Optional[bytes] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("run_id", "path")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    path: str
    def __init__(self, run_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "total_bytes", "seconds", "weight_version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    total_bytes: int
    seconds: float
    weight_version: int
    def __init__(self, path: _Optional[str] = ..., total_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., weight_version: _Optional[int] = ...) -> None: ...

class BroadcastWeightsRequest(_message.Message):
    __slots__ = ("channel_id", "bucket_bytes", "timeout_s")
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    bucket_bytes: int
    timeout_s: float
    def __init__(self, channel_id: _Optional[str] = ..., bucket_bytes: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class BroadcastWeightsResponse(_message.Message):
    __slots__ = ("weight_version", "total_bytes", "buckets", "seconds")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    total_bytes: int
    buckets: int
    seconds: float
    def __init__(self, weight_version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., buckets: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
