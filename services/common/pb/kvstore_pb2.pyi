from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("layout_fingerprint", "block_hashes")
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    layout_fingerprint: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, layout_fingerprint: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_present", "tiers")
    NUM_PRESENT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    num_present: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, num_present: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("layout_fingerprint", "block_hashes")
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    layout_fingerprint: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, layout_fingerprint: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Page(_message.Message):
    __slots__ = ("layout_fingerprint", "block_hash", "payload", "checksum", "offset", "total_size", "last_piece")
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_PIECE_FIELD_NUMBER: _ClassVar[int]
    layout_fingerprint: str
    block_hash: bytes
    payload: bytes
    checksum: int
    offset: int
    total_size: int
    last_piece: bool
    def __init__(self, layout_fingerprint: _Optional[str] = ..., block_hash: _Optional[bytes] = ..., payload: _Optional[bytes] = ..., checksum: _Optional[int] = ..., offset: _Optional[int] = ..., total_size: _Optional[int] = ..., last_piece: _Optional[bool] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "skipped_existing")
    STORED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_EXISTING_FIELD_NUMBER: _ClassVar[int]
    stored: int
    skipped_existing: int
    def __init__(self, stored: _Optional[int] = ..., skipped_existing: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("layout_fingerprint", "block_hashes", "all_for_layout")
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    ALL_FOR_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    layout_fingerprint: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    all_for_layout: bool
    def __init__(self, layout_fingerprint: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., all_for_layout: _Optional[bool] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "bytes", "capacity_bytes", "entries", "hits", "misses", "evictions", "corrupt")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    name: str
    bytes: int
    capacity_bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int
    corrupt: int
    def __init__(self, name: _Optional[str] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., entries: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., corrupt: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ...) -> None: ...
