from meshrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RolloutInitRequest(_message.Message):
    __slots__ = ("run_id", "model_path", "dtype", "allow_pickle", "lora_rank", "adapter_versions", "return_routed_experts")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PICKLE_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    model_path: str
    dtype: str
    allow_pickle: bool
    lora_rank: int
    adapter_versions: int
    return_routed_experts: bool
    def __init__(self, run_id: _Optional[str] = ..., model_path: _Optional[str] = ..., dtype: _Optional[str] = ..., allow_pickle: _Optional[bool] = ..., lora_rank: _Optional[int] = ..., adapter_versions: _Optional[int] = ..., return_routed_experts: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "max_new_tokens", "seed", "first_index", "stop_token_ids", "seed_indices", "return_routed_experts")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_INDICES_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    first_index: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed_indices: _containers.RepeatedScalarFieldContainer[int]
    return_routed_experts: bool
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., first_index: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed_indices: _Optional[_Iterable[int]] = ..., return_routed_experts: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("params", "chunks")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    params: SamplingParams
    chunks: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorChunk]
    def __init__(self, params: _Optional[_Union[SamplingParams, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[_common_pb2.TensorChunk, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunks", "weight_version")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorChunk]
    weight_version: int
    def __init__(self, chunks: _Optional[_Iterable[_Union[_common_pb2.TensorChunk, _Mapping]]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class ComputeLogProbsRequest(_message.Message):
    __slots__ = ("chunks", "top_k")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorChunk]
    top_k: int
    def __init__(self, chunks: _Optional[_Iterable[_Union[_common_pb2.TensorChunk, _Mapping]]] = ..., top_k: _Optional[int] = ...) -> None: ...

class ComputeLogProbsResponse(_message.Message):
    __slots__ = ("chunks", "weight_version")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorChunk]
    weight_version: int
    def __init__(self, chunks: _Optional[_Iterable[_Union[_common_pb2.TensorChunk, _Mapping]]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class ReceiveWeightsRequest(_message.Message):
    __slots__ = ("channel_id", "timeout_s", "restart_in_flight", "keep_in_flight")
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RESTART_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    KEEP_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    timeout_s: float
    restart_in_flight: bool
    keep_in_flight: bool
    def __init__(self, channel_id: _Optional[str] = ..., timeout_s: _Optional[float] = ..., restart_in_flight: _Optional[bool] = ..., keep_in_flight: _Optional[bool] = ...) -> None: ...
