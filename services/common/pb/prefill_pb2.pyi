from . import common_pb2 as _common_pb2
from . import decode_pb2 as _decode_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "params", "decode_address", "reservation_id", "num_skip_blocks", "expected_layout_fingerprint", "chunked_transfer", "dest_block_ids", "reservation_token", "destination", "accepted_wire_fingerprints", "deadline_unix", "sent_unix", "attach_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_WIRE_FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_FIELD_NUMBER: _ClassVar[int]
    ATTACH_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    decode_address: str
    reservation_id: str
    num_skip_blocks: int
    expected_layout_fingerprint: str
    chunked_transfer: bool
    dest_block_ids: _containers.RepeatedScalarFieldContainer[int]
    reservation_token: bytes
    destination: _decode_pb2.KVDestination
    accepted_wire_fingerprints: _containers.RepeatedScalarFieldContainer[str]
    deadline_unix: float
    sent_unix: float
    attach_id: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., reservation_id: _Optional[str] = ..., num_skip_blocks: _Optional[int] = ..., expected_layout_fingerprint: _Optional[str] = ..., chunked_transfer: _Optional[bool] = ..., dest_block_ids: _Optional[_Iterable[int]] = ..., reservation_token: _Optional[bytes] = ..., destination: _Optional[_Union[_decode_pb2.KVDestination, _Mapping]] = ..., accepted_wire_fingerprints: _Optional[_Iterable[str]] = ..., deadline_unix: _Optional[float] = ..., sent_unix: _Optional[float] = ..., attach_id: _Optional[str] = ...) -> None: ...

class AttachReservationRequest(_message.Message):
    __slots__ = ("request_id", "attach_id", "decode_address", "reservation_id", "num_skip_blocks", "expected_layout_fingerprint", "dest_block_ids", "reservation_token", "destination", "accepted_wire_fingerprints")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTACH_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_WIRE_FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    attach_id: str
    decode_address: str
    reservation_id: str
    num_skip_blocks: int
    expected_layout_fingerprint: str
    dest_block_ids: _containers.RepeatedScalarFieldContainer[int]
    reservation_token: bytes
    destination: _decode_pb2.KVDestination
    accepted_wire_fingerprints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., attach_id: _Optional[str] = ..., decode_address: _Optional[str] = ..., reservation_id: _Optional[str] = ..., num_skip_blocks: _Optional[int] = ..., expected_layout_fingerprint: _Optional[str] = ..., dest_block_ids: _Optional[_Iterable[int]] = ..., reservation_token: _Optional[bytes] = ..., destination: _Optional[_Union[_decode_pb2.KVDestination, _Mapping]] = ..., accepted_wire_fingerprints: _Optional[_Iterable[str]] = ...) -> None: ...

class AttachReservationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "first_logprob", "num_prompt_tokens", "num_cached_tokens", "num_chunks", "kv_bytes_sent", "queue_s", "compute_s", "first_top_logprobs")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    first_logprob: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_chunks: int
    kv_bytes_sent: int
    queue_s: float
    compute_s: float
    first_top_logprobs: _common_pb2.TopLogprobs
    def __init__(self, first_token: _Optional[int] = ..., first_logprob: _Optional[float] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_chunks: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., queue_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., first_top_logprobs: _Optional[_Union[_common_pb2.TopLogprobs, _Mapping]] = ...) -> None: ...
