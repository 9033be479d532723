from meshrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sample(_message.Message):
    __slots__ = ("data_source", "response", "ground_truth", "extra_info_json", "prompt")
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    data_source: str
    response: str
    ground_truth: str
    extra_info_json: str
    prompt: str
    def __init__(self, data_source: _Optional[str] = ..., response: _Optional[str] = ..., ground_truth: _Optional[str] = ..., extra_info_json: _Optional[str] = ..., prompt: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class SampleScore(_message.Message):
    __slots__ = ("score", "valid", "error", "seconds", "pred", "acc", "components", "timed_out")
    SCORE_FIELD_NUMBER: _ClassVar[int]
    VALID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRED_FIELD_NUMBER: _ClassVar[int]
    ACC_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    score: float
    valid: bool
    error: str
    seconds: float
    pred: str
    acc: bool
    components: _containers.RepeatedCompositeFieldContainer[RewardComponent]
    timed_out: bool
    def __init__(self, score: _Optional[float] = ..., valid: _Optional[bool] = ..., error: _Optional[str] = ..., seconds: _Optional[float] = ..., pred: _Optional[str] = ..., acc: _Optional[bool] = ..., components: _Optional[_Iterable[_Union[RewardComponent, _Mapping]]] = ..., timed_out: _Optional[bool] = ...) -> None: ...

class RewardComponent(_message.Message):
    __slots__ = ("name", "weight", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    value: float
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ..., value: _Optional[float] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores", "service_id")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[SampleScore]
    service_id: str
    def __init__(self, scores: _Optional[_Iterable[_Union[SampleScore, _Mapping]]] = ..., service_id: _Optional[str] = ...) -> None: ...
