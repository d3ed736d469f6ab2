"""services.common.config: flags derived from dataclass fields, env fallback, error messages."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field

import pytest

from services.common.config import (
    ConfigError,
    add_dataclass_args,
    env_flag,
    env_name,
    flag_name,
    from_args,
    opt,
    require,
)


class Transport(enum.Enum):
    GRPC = "grpc"
    CUDA_IPC = "cuda-ipc"


@dataclass
class DemoConfig:
    """Demo subsystem."""

    max_num_seqs: int = opt(256, "Most sequences in one batch.")
    gpu_memory_utilization: float = opt(0.9, "Fraction of device memory for KV.")
    chunked_transfer: bool = opt(True, "Send KV after every prefill chunk.")
    model: str = opt("smollm2", "Model name.")
    decode_addresses: list[str] = field(default_factory=list, metadata={"help": "Decode instances, host:port,..."})
    stop_ids: tuple[int, ...] = opt((), "Token ids.")
    policy: str = opt("round-robin", "Routing policy.", choices=("round-robin", "least-loaded"))
    transport: Transport = field(default=Transport.GRPC, metadata={"help": "KV transport."})
    seed: int | None = opt(None, "Global seed; none: random.")
    kv_dir: str = opt("/tmp/kv", "Disk tier directory.", env="KVSTORE_DIR")

    def __post_init__(self) -> None:
        require(self.max_num_seqs > 0, self, "max_num_seqs", f"must be > 0, got {self.max_num_seqs}")


def parse(argv: list[str], environ: dict[str, str] | None = None, prefix: str = "") -> DemoConfig:
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, DemoConfig, prefix=prefix)
    return from_args(DemoConfig, parser.parse_args(argv), prefix=prefix, environ=environ or {})


def test_names() -> None:
    assert flag_name("max_num_seqs") == "--max-num-seqs"
    assert flag_name("max_num_seqs", "decode-") == "--decode-max-num-seqs"
    assert env_name("max_num_seqs") == "PDSERVE_MAX_NUM_SEQS"
    assert env_name("max_num_seqs", "decode-") == "PDSERVE_DECODE_MAX_NUM_SEQS"


def test_defaults() -> None:
    cfg = parse([])
    assert cfg == DemoConfig()
    assert cfg.decode_addresses == [] and cfg.decode_addresses is not DemoConfig().decode_addresses


def test_flags_parse_every_type() -> None:
    cfg = parse([
        "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5", "--no-chunked-transfer", "--model", "m",
        "--decode-addresses", "a:1, b:2", "--policy", "least-loaded", "--transport", "cuda-ipc", "--seed", "3",
        "--stop-ids", "1,2",
    ])
    assert cfg.max_num_seqs == 8 and cfg.gpu_memory_utilization == 0.5 and cfg.chunked_transfer is False
    assert cfg.model == "m" and cfg.decode_addresses == ["a:1", "b:2"] and cfg.policy == "least-loaded"
    assert cfg.transport is Transport.CUDA_IPC and cfg.seed == 3 and cfg.stop_ids == (1, 2)
    assert parse(["--chunked-transfer=false"]).chunked_transfer is False
    assert parse(["--chunked-transfer"]).chunked_transfer is True
    assert parse(["--seed", "none"]).seed is None


def test_env_fallback() -> None:
    env = {
        "PDSERVE_MAX_NUM_SEQS": "12", "PDSERVE_CHUNKED_TRANSFER": "off", "PDSERVE_DECODE_ADDRESSES": "x:1,y:2",
        "PDSERVE_SEED": "5", "PDSERVE_TRANSPORT": "cuda-ipc", "KVSTORE_DIR": "/data/kv",
    }
    cfg = parse([], env)
    assert cfg.max_num_seqs == 12 and cfg.chunked_transfer is False and cfg.decode_addresses == ["x:1", "y:2"]
    assert cfg.seed == 5 and cfg.transport is Transport.CUDA_IPC and cfg.kv_dir == "/data/kv"


def test_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_MODEL", "from-env")
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, DemoConfig)
    assert from_args(DemoConfig, parser.parse_args([])).model == "from-env"


def test_flag_beats_env() -> None:
    cfg = parse(["--max-num-seqs", "3", "--chunked-transfer"], {"PDSERVE_MAX_NUM_SEQS": "12",
                                                                 "PDSERVE_CHUNKED_TRANSFER": "0"})
    assert cfg.max_num_seqs == 3 and cfg.chunked_transfer is True


def test_prefix_applies_to_flag_and_env() -> None:
    cfg = parse(["--decode-model", "d"], {"PDSERVE_DECODE_MAX_NUM_SEQS": "4", "PDSERVE_MAX_NUM_SEQS": "99"},
                prefix="decode-")
    assert cfg.model == "d" and cfg.max_num_seqs == 4


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--max-num-seqs", "lots"], {}, "expected an integer"),
        ([], {"PDSERVE_MAX_NUM_SEQS": "lots"}, "expected an integer"),
        ([], {"PDSERVE_MAX_NUM_SEQS": "0"}, "must be > 0"),
        (["--max-num-seqs", "-1"], {}, "must be > 0"),
    ],
)
def test_bad_value_names_flag_and_env(argv: list[str], env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse(argv, env)
    msg = str(exc.value)
    assert "--max-num-seqs" in msg and "PDSERVE_MAX_NUM_SEQS" in msg and needle in msg


def test_bad_env_message_says_env() -> None:
    with pytest.raises(ConfigError, match=r"from env PDSERVE_GPU_MEMORY_UTILIZATION"):
        parse([], {"PDSERVE_GPU_MEMORY_UTILIZATION": "most"})


def test_bad_choice_and_bool() -> None:
    with pytest.raises(ConfigError, match=r"--policy / PDSERVE_POLICY: must be one of round-robin, least-loaded"):
        parse(["--policy", "random"])
    with pytest.raises(ConfigError, match=r"--transport / PDSERVE_TRANSPORT: .*expected one of grpc, cuda-ipc"):
        parse([], {"PDSERVE_TRANSPORT": "rdma"})
    with pytest.raises(ConfigError, match=r"--chunked-transfer / PDSERVE_CHUNKED_TRANSFER: expected a boolean"):
        parse([], {"PDSERVE_CHUNKED_TRANSFER": "maybe"})


def test_validation_error_uses_prefix() -> None:
    with pytest.raises(ConfigError, match=r"--decode-max-num-seqs / PDSERVE_DECODE_MAX_NUM_SEQS: must be > 0"):
        parse(["--decode-max-num-seqs", "0"], prefix="decode-")


def test_direct_construction_validates() -> None:
    with pytest.raises(ConfigError, match="--max-num-seqs / PDSERVE_MAX_NUM_SEQS"):
        DemoConfig(max_num_seqs=0)


def test_help_lists_env_and_default() -> None:
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, DemoConfig)
    text = parser.format_help()
    assert "PDSERVE_MAX_NUM_SEQS" in text and "default: 256" in text and "--no-chunked-transfer" in text


def test_env_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_flag("DEBUG_KV") is False
    monkeypatch.setenv("PDSERVE_DEBUG_KV", "yes")
    assert env_flag("DEBUG_KV") is True
    monkeypatch.setenv("PDSERVE_DEBUG_KV", "perhaps")
    with pytest.raises(ConfigError, match="PDSERVE_DEBUG_KV"):
        env_flag("DEBUG_KV")
