from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "params", "lease_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    lease_ms: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "num_cached_blocks", "block_size", "layout", "lease_expires_unix", "block_ids", "transport_info")
    class TransportInfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_INFO_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    num_cached_blocks: int
    block_size: int
    layout: _common_pb2.PageLayout
    lease_expires_unix: float
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    transport_info: _containers.ScalarMap[str, str]
    def __init__(self, reservation_id: _Optional[str] = ..., num_cached_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., layout: _Optional[_Union[_common_pb2.PageLayout, _Mapping]] = ..., lease_expires_unix: _Optional[float] = ..., block_ids: _Optional[_Iterable[int]] = ..., transport_info: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DecodeGenerateRequest(_message.Message):
    __slots__ = ("reservation_id", "request_id", "token_ids", "params")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    def __init__(self, reservation_id: _Optional[str] = ..., request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("chunks_received", "bytes_received")
    CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    chunks_received: int
    bytes_received: int
    def __init__(self, chunks_received: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...
