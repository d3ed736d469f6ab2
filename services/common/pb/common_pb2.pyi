from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVCodec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CODEC_UNSPECIFIED: _ClassVar[KVCodec]
    KV_CODEC_NATIVE: _ClassVar[KVCodec]
    KV_CODEC_FP8_E4M3: _ClassVar[KVCodec]

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_INPUT: _ClassVar[ErrorReason]
    ERROR_REASON_OVERLOADED: _ClassVar[ErrorReason]
    ERROR_REASON_DRAINING: _ClassVar[ErrorReason]
    ERROR_REASON_LOADING: _ClassVar[ErrorReason]
    ERROR_REASON_KV_HANDOFF_FAILED: _ClassVar[ErrorReason]
    ERROR_REASON_RESERVATION_GONE: _ClassVar[ErrorReason]
    ERROR_REASON_PERMISSION: _ClassVar[ErrorReason]
    ERROR_REASON_LAYOUT_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_DEADLINE: _ClassVar[ErrorReason]
    ERROR_REASON_ENGINE_DEAD: _ClassVar[ErrorReason]
    ERROR_REASON_DATA_LOSS: _ClassVar[ErrorReason]
    ERROR_REASON_CANCELLED: _ClassVar[ErrorReason]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
KV_CODEC_UNSPECIFIED: KVCodec
KV_CODEC_NATIVE: KVCodec
KV_CODEC_FP8_E4M3: KVCodec
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_INVALID_INPUT: ErrorReason
ERROR_REASON_OVERLOADED: ErrorReason
ERROR_REASON_DRAINING: ErrorReason
ERROR_REASON_LOADING: ErrorReason
ERROR_REASON_KV_HANDOFF_FAILED: ErrorReason
ERROR_REASON_RESERVATION_GONE: ErrorReason
ERROR_REASON_PERMISSION: ErrorReason
ERROR_REASON_LAYOUT_MISMATCH: ErrorReason
ERROR_REASON_DEADLINE: ErrorReason
ERROR_REASON_ENGINE_DEAD: ErrorReason
ERROR_REASON_DATA_LOSS: ErrorReason
ERROR_REASON_CANCELLED: ErrorReason
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("name", "codec", "bytes_per_page")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_PAGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    codec: str
    bytes_per_page: int
    def __init__(self, name: _Optional[str] = ..., codec: _Optional[str] = ..., bytes_per_page: _Optional[int] = ...) -> None: ...

class PageLayout(_message.Message):
    __slots__ = ("model_id", "num_layers", "num_kv_heads", "head_dim", "block_size", "regions", "page_bytes", "fingerprint", "layer_windows", "attention_sinks", "latent")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYER_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_SINKS_FIELD_NUMBER: _ClassVar[int]
    LATENT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    page_bytes: int
    fingerprint: str
    layer_windows: _containers.RepeatedScalarFieldContainer[int]
    attention_sinks: bool
    latent: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model_id: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., page_bytes: _Optional[int] = ..., fingerprint: _Optional[str] = ..., layer_windows: _Optional[_Iterable[int]] = ..., attention_sinks: _Optional[bool] = ..., latent: _Optional[_Iterable[int]] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("request_id", "reservation_id", "chunk_index", "token_start", "token_end", "first_block", "num_pages", "layout_fingerprint", "checksum", "payload", "transport", "is_last", "first_token", "first_logprob", "prefill_done_unix", "total_chunks", "transport_meta", "reservation_token", "claim", "codec", "first_top_logprobs", "padding")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DONE_UNIX_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_META_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation_id: str
    chunk_index: int
    token_start: int
    token_end: int
    first_block: int
    num_pages: int
    layout_fingerprint: str
    checksum: int
    payload: bytes
    transport: str
    is_last: bool
    first_token: int
    first_logprob: float
    prefill_done_unix: float
    total_chunks: int
    transport_meta: bytes
    reservation_token: bytes
    claim: KVClaim
    codec: KVCodec
    first_top_logprobs: TopLogprobs
    padding: bytes
    def __init__(self, request_id: _Optional[str] = ..., reservation_id: _Optional[str] = ..., chunk_index: _Optional[int] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., first_block: _Optional[int] = ..., num_pages: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., checksum: _Optional[int] = ..., payload: _Optional[bytes] = ..., transport: _Optional[str] = ..., is_last: _Optional[bool] = ..., first_token: _Optional[int] = ..., first_logprob: _Optional[float] = ..., prefill_done_unix: _Optional[float] = ..., total_chunks: _Optional[int] = ..., transport_meta: _Optional[bytes] = ..., reservation_token: _Optional[bytes] = ..., claim: _Optional[_Union[KVClaim, _Mapping]] = ..., codec: _Optional[_Union[KVCodec, str]] = ..., first_top_logprobs: _Optional[_Union[TopLogprobs, _Mapping]] = ..., padding: _Optional[bytes] = ...) -> None: ...

class KVClaim(_message.Message):
    __slots__ = ("transport", "dest_block_ids", "pool_id", "codec", "writer_split", "pool_split")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    WRITER_SPLIT_FIELD_NUMBER: _ClassVar[int]
    POOL_SPLIT_FIELD_NUMBER: _ClassVar[int]
    transport: str
    dest_block_ids: _containers.RepeatedScalarFieldContainer[int]
    pool_id: str
    codec: KVCodec
    writer_split: KVHeadSplit
    pool_split: KVHeadSplit
    def __init__(self, transport: _Optional[str] = ..., dest_block_ids: _Optional[_Iterable[int]] = ..., pool_id: _Optional[str] = ..., codec: _Optional[_Union[KVCodec, str]] = ..., writer_split: _Optional[_Union[KVHeadSplit, _Mapping]] = ..., pool_split: _Optional[_Union[KVHeadSplit, _Mapping]] = ...) -> None: ...

class KVHeadSplit(_message.Message):
    __slots__ = ("tp_size", "kv_heads_per_rank", "replicas")
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    tp_size: int
    kv_heads_per_rank: int
    replicas: int
    def __init__(self, tp_size: _Optional[int] = ..., kv_heads_per_rank: _Optional[int] = ..., replicas: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("running", "waiting", "waiting_for_kv", "free_blocks", "total_blocks", "kv_usage", "published_unix", "step_running_s", "max_waiting", "saturated")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_KV_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    STEP_RUNNING_S_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    SATURATED_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    waiting_for_kv: int
    free_blocks: int
    total_blocks: int
    kv_usage: float
    published_unix: float
    step_running_s: float
    max_waiting: int
    saturated: bool
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., waiting_for_kv: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., kv_usage: _Optional[float] = ..., published_unix: _Optional[float] = ..., step_running_s: _Optional[float] = ..., max_waiting: _Optional[int] = ..., saturated: _Optional[bool] = ...) -> None: ...

class ErrorDetail(_message.Message):
    __slots__ = ("reason", "retryable", "side", "field", "retry_after_ms")
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    reason: ErrorReason
    retryable: bool
    side: str
    field: str
    retry_after_ms: int
    def __init__(self, reason: _Optional[_Union[ErrorReason, str]] = ..., retryable: _Optional[bool] = ..., side: _Optional[str] = ..., field: _Optional[str] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "usage", "top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    usage: Usage
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CaptureTraceRequest(_message.Message):
    __slots__ = ("start_unix", "duration_s", "out_dir")
    START_UNIX_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    OUT_DIR_FIELD_NUMBER: _ClassVar[int]
    start_unix: float
    duration_s: float
    out_dir: str
    def __init__(self, start_unix: _Optional[float] = ..., duration_s: _Optional[float] = ..., out_dir: _Optional[str] = ...) -> None: ...

class CaptureTraceResponse(_message.Message):
    __slots__ = ("path", "service", "instance", "rank_paths")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    RANK_PATHS_FIELD_NUMBER: _ClassVar[int]
    path: str
    service: str
    instance: str
    rank_paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, path: _Optional[str] = ..., service: _Optional[str] = ..., instance: _Optional[str] = ..., rank_paths: _Optional[_Iterable[str]] = ...) -> None: ...
