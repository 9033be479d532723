from meshrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("identity", "weight_version")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    identity: _common_pb2.ServiceIdentity
    weight_version: int
    def __init__(self, identity: _Optional[_Union[_common_pb2.ServiceIdentity, _Mapping]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s",)
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("service_id", "weight_version")
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    service_id: str
    weight_version: int
    def __init__(self, service_id: _Optional[str] = ..., weight_version: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class ListServicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceStatus(_message.Message):
    __slots__ = ("identity", "state", "last_seen_s", "weight_version")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    identity: _common_pb2.ServiceIdentity
    state: str
    last_seen_s: float
    weight_version: int
    def __init__(self, identity: _Optional[_Union[_common_pb2.ServiceIdentity, _Mapping]] = ..., state: _Optional[str] = ..., last_seen_s: _Optional[float] = ..., weight_version: _Optional[int] = ...) -> None: ...

class ListServicesResponse(_message.Message):
    __slots__ = ("services", "adv_estimators")
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    ADV_ESTIMATORS_FIELD_NUMBER: _ClassVar[int]
    services: _containers.RepeatedCompositeFieldContainer[ServiceStatus]
    adv_estimators: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, services: _Optional[_Iterable[_Union[ServiceStatus, _Mapping]]] = ..., adv_estimators: _Optional[_Iterable[str]] = ...) -> None: ...

class StartRunRequest(_message.Message):
    __slots__ = ("config_yaml",)
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    config_yaml: str
    def __init__(self, config_yaml: _Optional[str] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id", "after_event_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    after_event_id: int
    def __init__(self, run_id: _Optional[str] = ..., after_event_id: _Optional[int] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetRewardRequest(_message.Message):
    __slots__ = ("run_id", "group", "address")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    group: str
    address: str
    def __init__(self, run_id: _Optional[str] = ..., group: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class SetEnvRequest(_message.Message):
    __slots__ = ("run_id", "group", "address")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    group: str
    address: str
    def __init__(self, run_id: _Optional[str] = ..., group: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class RunInfo(_message.Message):
    __slots__ = ("run_id", "name", "state", "step", "total_steps", "run_dir", "error", "created_at", "metrics", "last_event_id")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    name: str
    state: str
    step: int
    total_steps: int
    run_dir: str
    error: str
    created_at: float
    metrics: _containers.ScalarMap[str, float]
    last_event_id: int
    def __init__(self, run_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[str] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., run_dir: _Optional[str] = ..., error: _Optional[str] = ..., created_at: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., last_event_id: _Optional[int] = ...) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunInfo]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunInfo, _Mapping]]] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("run_id", "kind", "step", "state", "metrics", "message", "time")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    kind: str
    step: int
    state: str
    metrics: _containers.ScalarMap[str, float]
    message: str
    time: float
    def __init__(self, run_id: _Optional[str] = ..., kind: _Optional[str] = ..., step: _Optional[int] = ..., state: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., message: _Optional[str] = ..., time: _Optional[float] = ...) -> None: ...
