"""Generated protobuf/gRPC modules for pdserve.v1 (scripts/gen_protos.py; do not edit)."""

from __future__ import annotations

from . import common_pb2
from . import common_pb2_grpc
from . import decode_pb2
from . import decode_pb2_grpc
from . import kvstore_pb2
from . import kvstore_pb2_grpc
from . import prefill_pb2
from . import prefill_pb2_grpc
from . import router_pb2
from . import router_pb2_grpc

__all__ = [
    "common_pb2",
    "common_pb2_grpc",
    "decode_pb2",
    "decode_pb2_grpc",
    "kvstore_pb2",
    "kvstore_pb2_grpc",
    "prefill_pb2",
    "prefill_pb2_grpc",
    "router_pb2",
    "router_pb2_grpc",
]
