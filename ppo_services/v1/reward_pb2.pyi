from ppo_services.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreRequest(_message.Message):
    __slots__ = ("tokens", "lengths", "prompt_lengths", "texts", "prompts", "labels", "conversations")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CONVERSATIONS_FIELD_NUMBER: _ClassVar[int]
    tokens: _common_pb2.Tensor
    lengths: _common_pb2.Tensor
    prompt_lengths: _common_pb2.Tensor
    texts: _containers.RepeatedScalarFieldContainer[str]
    prompts: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.RepeatedScalarFieldContainer[str]
    conversations: _containers.RepeatedCompositeFieldContainer[Conversation]
    def __init__(self, tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., lengths: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., prompt_lengths: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., texts: _Optional[_Iterable[str]] = ..., prompts: _Optional[_Iterable[str]] = ..., labels: _Optional[_Iterable[str]] = ..., conversations: _Optional[_Iterable[_Union[Conversation, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Conversation(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("rewards", "components")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    rewards: _common_pb2.Tensor
    components: _containers.MessageMap[str, _common_pb2.Tensor]
    def __init__(self, rewards: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., components: _Optional[_Mapping[str, _common_pb2.Tensor]] = ...) -> None: ...

class RewardInfo(_message.Message):
    __slots__ = ("model", "kind", "vocab_size", "max_length", "vocab_sha256", "components", "needs_labels", "chat_template", "reward_normalization")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SHA256_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    NEEDS_LABELS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    REWARD_NORMALIZATION_FIELD_NUMBER: _ClassVar[int]
    model: str
    kind: str
    vocab_size: int
    max_length: int
    vocab_sha256: str
    components: _containers.RepeatedScalarFieldContainer[str]
    needs_labels: bool
    chat_template: bool
    reward_normalization: str
    def __init__(self, model: _Optional[str] = ..., kind: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_length: _Optional[int] = ..., vocab_sha256: _Optional[str] = ..., components: _Optional[_Iterable[str]] = ..., needs_labels: _Optional[bool] = ..., chat_template: _Optional[bool] = ..., reward_normalization: _Optional[str] = ...) -> None: ...
