from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "params", "lease_ms", "deadline_unix", "block_wait_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    lease_ms: int
    deadline_unix: float
    block_wait_ms: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., lease_ms: _Optional[int] = ..., deadline_unix: _Optional[float] = ..., block_wait_ms: _Optional[int] = ...) -> None: ...

class ShmPool(_message.Message):
    __slots__ = ("name", "shape", "dtype", "host_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    host_id: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., host_id: _Optional[str] = ...) -> None: ...

class CudaIpcPool(_message.Message):
    __slots__ = ("host_id", "device", "handle", "storage_bytes", "storage_offset", "shape", "dtype", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, host_id: _Optional[str] = ..., device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class MooncakePool(_message.Message):
    __slots__ = ("segment", "base_address", "pool_bytes", "shape", "dtype", "protocol", "page_major", "extra_segments", "regions", "slot_bytes")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PAGE_MAJOR_FIELD_NUMBER: _ClassVar[int]
    EXTRA_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    segment: str
    base_address: int
    pool_bytes: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    protocol: str
    page_major: bool
    extra_segments: _containers.RepeatedScalarFieldContainer[str]
    regions: _containers.RepeatedScalarFieldContainer[str]
    slot_bytes: int
    def __init__(self, segment: _Optional[str] = ..., base_address: _Optional[int] = ..., pool_bytes: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., protocol: _Optional[str] = ..., page_major: _Optional[bool] = ..., extra_segments: _Optional[_Iterable[str]] = ..., regions: _Optional[_Iterable[str]] = ..., slot_bytes: _Optional[int] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("shm", "cuda_ipc", "mooncake", "sharded", "draft", "index")
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_FIELD_NUMBER: _ClassVar[int]
    SHARDED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    shm: ShmPool
    cuda_ipc: CudaIpcPool
    mooncake: MooncakePool
    sharded: ShardedPool
    draft: DraftPool
    index: DraftPool
    def __init__(self, shm: _Optional[_Union[ShmPool, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcPool, _Mapping]] = ..., mooncake: _Optional[_Union[MooncakePool, _Mapping]] = ..., sharded: _Optional[_Union[ShardedPool, _Mapping]] = ..., draft: _Optional[_Union[DraftPool, _Mapping]] = ..., index: _Optional[_Union[DraftPool, _Mapping]] = ...) -> None: ...

class DraftPool(_message.Message):
    __slots__ = ("shm", "cuda_ipc", "mooncake", "region")
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    shm: ShmPool
    cuda_ipc: CudaIpcPool
    mooncake: MooncakePool
    region: str
    def __init__(self, shm: _Optional[_Union[ShmPool, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcPool, _Mapping]] = ..., mooncake: _Optional[_Union[MooncakePool, _Mapping]] = ..., region: _Optional[str] = ...) -> None: ...

class ShardedPool(_message.Message):
    __slots__ = ("tp_size", "num_kv_heads", "kv_replicas", "ranks")
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    KV_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    tp_size: int
    num_kv_heads: int
    kv_replicas: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankPool]
    def __init__(self, tp_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., kv_replicas: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankPool, _Mapping]]] = ...) -> None: ...

class RankPool(_message.Message):
    __slots__ = ("rank", "kv_head_start", "kv_head_end", "pool")
    RANK_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_END_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    rank: int
    kv_head_start: int
    kv_head_end: int
    pool: KVDestination
    def __init__(self, rank: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., kv_head_end: _Optional[int] = ..., pool: _Optional[_Union[KVDestination, _Mapping]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "num_cached_blocks", "block_size", "layout", "lease_expires_unix", "block_ids", "reservation_token", "destination", "accepted_wire_fingerprints")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_WIRE_FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    num_cached_blocks: int
    block_size: int
    layout: _common_pb2.PageLayout
    lease_expires_unix: float
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    reservation_token: bytes
    destination: KVDestination
    accepted_wire_fingerprints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, reservation_id: _Optional[str] = ..., num_cached_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., layout: _Optional[_Union[_common_pb2.PageLayout, _Mapping]] = ..., lease_expires_unix: _Optional[float] = ..., block_ids: _Optional[_Iterable[int]] = ..., reservation_token: _Optional[bytes] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ..., accepted_wire_fingerprints: _Optional[_Iterable[str]] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("reservation_id", "reservation_token", "lease_ms")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    reservation_token: bytes
    lease_ms: int
    def __init__(self, reservation_id: _Optional[str] = ..., reservation_token: _Optional[bytes] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("lease_expires_unix",)
    LEASE_EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    lease_expires_unix: float
    def __init__(self, lease_expires_unix: _Optional[float] = ...) -> None: ...

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

class StreamStart(_message.Message):
    __slots__ = ("key", "request", "trace")
    class TraceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    key: int
    request: DecodeGenerateRequest
    trace: _containers.ScalarMap[str, str]
    def __init__(self, key: _Optional[int] = ..., request: _Optional[_Union[DecodeGenerateRequest, _Mapping]] = ..., trace: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StreamCancel(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: int
    def __init__(self, key: _Optional[int] = ...) -> None: ...

class StreamControl(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: StreamStart
    cancel: StreamCancel
    def __init__(self, start: _Optional[_Union[StreamStart, _Mapping]] = ..., cancel: _Optional[_Union[StreamCancel, _Mapping]] = ...) -> None: ...

class StreamTokens(_message.Message):
    __slots__ = ("key", "response")
    KEY_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    key: int
    response: _common_pb2.GenerateResponse
    def __init__(self, key: _Optional[int] = ..., response: _Optional[_Union[_common_pb2.GenerateResponse, _Mapping]] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("key", "code", "message", "detail")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    key: int
    code: int
    message: str
    detail: _common_pb2.ErrorDetail
    def __init__(self, key: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., detail: _Optional[_Union[_common_pb2.ErrorDetail, _Mapping]] = ...) -> None: ...

class StreamStep(_message.Message):
    __slots__ = ("tokens", "errors")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[StreamTokens]
    errors: _containers.RepeatedCompositeFieldContainer[StreamError]
    def __init__(self, tokens: _Optional[_Iterable[_Union[StreamTokens, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[StreamError, _Mapping]]] = ...) -> None: ...
