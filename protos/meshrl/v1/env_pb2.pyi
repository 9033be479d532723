from meshrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("episode_id", "row_json", "env_name", "max_parallel_calls", "gateway_url", "episode_key", "model")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROW_JSON_FIELD_NUMBER: _ClassVar[int]
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_PARALLEL_CALLS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_URL_FIELD_NUMBER: _ClassVar[int]
    EPISODE_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    row_json: str
    env_name: str
    max_parallel_calls: int
    gateway_url: str
    episode_key: str
    model: str
    def __init__(self, episode_id: _Optional[str] = ..., row_json: _Optional[str] = ..., env_name: _Optional[str] = ..., max_parallel_calls: _Optional[int] = ..., gateway_url: _Optional[str] = ..., episode_key: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("messages", "service_id")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    service_id: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., service_id: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("episode_id", "message")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    message: ChatMessage
    def __init__(self, episode_id: _Optional[str] = ..., message: _Optional[_Union[ChatMessage, _Mapping]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("messages", "reward", "done", "info_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    reward: float
    done: bool
    info_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., info_json: _Optional[str] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("episode_id",)
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    def __init__(self, episode_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class ToolInfo(_message.Message):
    __slots__ = ("name", "schema_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    schema_json: str
    def __init__(self, name: _Optional[str] = ..., schema_json: _Optional[str] = ...) -> None: ...

class EnvironmentInfo(_message.Message):
    __slots__ = ("name", "source", "tools", "runs_agent")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    RUNS_AGENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    tools: _containers.RepeatedCompositeFieldContainer[ToolInfo]
    runs_agent: bool
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[ToolInfo, _Mapping]]] = ..., runs_agent: _Optional[bool] = ...) -> None: ...

class EnvInfo(_message.Message):
    __slots__ = ("identity", "environments", "open_episodes", "workers")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    OPEN_EPISODES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    identity: _common_pb2.ServiceIdentity
    environments: _containers.RepeatedCompositeFieldContainer[EnvironmentInfo]
    open_episodes: int
    workers: int
    def __init__(self, identity: _Optional[_Union[_common_pb2.ServiceIdentity, _Mapping]] = ..., environments: _Optional[_Iterable[_Union[EnvironmentInfo, _Mapping]]] = ..., open_episodes: _Optional[int] = ..., workers: _Optional[int] = ...) -> None: ...
