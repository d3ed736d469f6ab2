"""The committed services/common/pb/ matches a fresh generation from protos/."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_protos() -> None:
    # The test extra pins grpcio-tools==1.84.0: without it the drift check cannot run, which must not
    # pass silently.
    try:
        tools = metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        pytest.fail("grpcio-tools is not installed (pip install grpcio-tools==1.84.0): cannot check for drift")
    assert tools == "1.84.0", f"gen_protos needs grpcio-tools==1.84.0 (the version the code was made with), found {tools}"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_generated_modules_import_relative() -> None:
    from services.common.pb import (
        common_pb2,
        decode_pb2,
        decode_pb2_grpc,
        kvstore_pb2,
        prefill_pb2,
        router_pb2,
    )

    assert decode_pb2.ReserveResponse.DESCRIPTOR.fields_by_name["layout"].message_type is common_pb2.PageLayout.DESCRIPTOR
    assert hasattr(decode_pb2_grpc, "DecodeServicer")
    for mod in (common_pb2, decode_pb2, kvstore_pb2, prefill_pb2, router_pb2):
        assert mod.DESCRIPTOR.package == "pdserve.v1"
    text = (ROOT / "services/common/pb/decode_pb2_grpc.py").read_text()
    assert "from pdserve" not in text and "from . import common_pb2" in text


def test_schema_round_trip() -> None:
    from services.common.pb import common_pb2, prefill_pb2, router_pb2

    req = router_pb2.GenerateRequest(
        request_id="r1", token_ids=router_pb2.TokenIds(ids=[1, 2, 3]),
        params=common_pb2.SamplingParams(max_tokens=8, seed=7, stop=["\n"]),
    )
    back = router_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back.WhichOneof("prompt") == "token_ids" and list(back.token_ids.ids) == [1, 2, 3]
    assert back.params.HasField("seed") and not back.params.HasField("temperature")
    pre = prefill_pb2.PrefillRequest(request_id="r1")
    assert not pre.HasField("chunked_transfer")
    chunk = common_pb2.KVChunk(request_id="r1", payload=b"x" * 10, is_last=True, prefill_done_unix=1.5)
    assert common_pb2.KVChunk.FromString(chunk.SerializeToString()) == chunk
