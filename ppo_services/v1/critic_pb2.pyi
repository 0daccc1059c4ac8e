from ppo_services.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InferRequest(_message.Message):
    __slots__ = ("tokens", "lengths")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    tokens: _common_pb2.Tensor
    lengths: _common_pb2.Tensor
    def __init__(self, tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., lengths: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class InferResponse(_message.Message):
    __slots__ = ("values", "rewards")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    values: _common_pb2.Tensor
    rewards: _common_pb2.Tensor
    def __init__(self, values: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., rewards: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class TrainRequest(_message.Message):
    __slots__ = ("tokens", "returns", "old_values", "mask", "lengths", "value_clip", "loss_scale", "request_id", "epochs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    OLD_VALUES_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    VALUE_CLIP_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    tokens: _common_pb2.Tensor
    returns: _common_pb2.Tensor
    old_values: _common_pb2.Tensor
    mask: _common_pb2.Tensor
    lengths: _common_pb2.Tensor
    value_clip: float
    loss_scale: float
    request_id: str
    epochs: int
    def __init__(self, tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., returns: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., old_values: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., mask: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., lengths: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., value_clip: _Optional[float] = ..., loss_scale: _Optional[float] = ..., request_id: _Optional[str] = ..., epochs: _Optional[int] = ...) -> None: ...

class TrainResponse(_message.Message):
    __slots__ = ("loss", "metrics", "train_step", "instance_id", "repeated")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOSS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_STEP_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REPEATED_FIELD_NUMBER: _ClassVar[int]
    loss: float
    metrics: _containers.ScalarMap[str, float]
    train_step: int
    instance_id: str
    repeated: bool
    def __init__(self, loss: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., train_step: _Optional[int] = ..., instance_id: _Optional[str] = ..., repeated: _Optional[bool] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("tag",)
    TAG_FIELD_NUMBER: _ClassVar[int]
    tag: str
    def __init__(self, tag: _Optional[str] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("path", "train_step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TRAIN_STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    train_step: int
    def __init__(self, path: _Optional[str] = ..., train_step: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("tag",)
    TAG_FIELD_NUMBER: _ClassVar[int]
    tag: str
    def __init__(self, tag: _Optional[str] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("path", "train_step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TRAIN_STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    train_step: int
    def __init__(self, path: _Optional[str] = ..., train_step: _Optional[int] = ...) -> None: ...

class CriticInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "max_length", "train_step", "serves_rewards", "vocab_sha256", "max_batch_size", "instance_id", "reward_model", "reward_normalization")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TRAIN_STEP_FIELD_NUMBER: _ClassVar[int]
    SERVES_REWARDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SHA256_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_MODEL_FIELD_NUMBER: _ClassVar[int]
    REWARD_NORMALIZATION_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_length: int
    train_step: int
    serves_rewards: bool
    vocab_sha256: str
    max_batch_size: int
    instance_id: str
    reward_model: str
    reward_normalization: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_length: _Optional[int] = ..., train_step: _Optional[int] = ..., serves_rewards: _Optional[bool] = ..., vocab_sha256: _Optional[str] = ..., max_batch_size: _Optional[int] = ..., instance_id: _Optional[str] = ..., reward_model: _Optional[str] = ..., reward_normalization: _Optional[str] = ...) -> None: ...
