"""Architecture description shared by the model code, the weight loaders and the KV layout."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from services.engine.models.moe_config import MOE_MODEL_TYPES, MoEConfig, MoEConfigError, moe_from_hf_config

MOE_ARCHITECTURES = tuple(MOE_MODEL_TYPES.values())
"""Families whose layers route tokens through experts (ModelArchConfig.moe is set)."""
ARCHITECTURES = ("llama", "qwen2", "qwen3", *MOE_ARCHITECTURES)

# HF `model_type` / GGUF `general.architecture` -> our architecture family.
_ARCH_ALIASES = {
    "llama": "llama", "mistral": "llama", "smollm": "llama",
    "qwen2": "qwen2", "qwen3": "qwen3", **MOE_MODEL_TYPES,
}


class ModelConfigError(ValueError):
    """A model configuration is missing a field or holds an invalid value (the message names it)."""


@dataclass
class ModelArchConfig:
    architecture: str
    """Model family: one of ARCHITECTURES."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Residual stream width."""
    intermediate_size: int
    """SwiGLU inner width of a dense MLP (a MoE model's experts have moe.intermediate_size)."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA); divides num_heads."""
    head_dim: int
    """Per-head width; hidden_size // num_heads unless the config says otherwise (Qwen3)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: dict[str, Any] | None = None
    """None, {"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}, {"rope_type": "linear", factor} or {"rope_type": "yarn", factor,
    original_max_position_embeddings, optional beta_fast, beta_slow, truncate, attention_factor, mscale,
    mscale_all_dim}."""
    max_position_embeddings: int = 2048
    """Longest context the model was trained for (tokens)."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id, if any."""
    eos_token_ids: list[int] = field(default_factory=list)
    """Ids that end generation."""
    moe: MoEConfig | None = None
    """Mixture-of-experts routing and expert shapes; set exactly for the MOE_ARCHITECTURES."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ModelConfigError(f"architecture={self.architecture!r}: expected one of {ARCHITECTURES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"{name}={value!r}: must be a positive integer")
        if isinstance(self.moe, dict):  # from to_dict()
            self.moe = MoEConfig(**self.moe)
        if (self.moe is not None) != (self.architecture in MOE_ARCHITECTURES):
            raise ModelConfigError(f"architecture={self.architecture!r} with moe={self.moe!r}: experts are set "
                                   f"exactly for {MOE_ARCHITECTURES}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim}: RoPE needs an even head_dim")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ModelConfigError(
                f"rms_norm_eps={self.rms_norm_eps}, rope_theta={self.rope_theta}: must be positive")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            need = {"llama3": ("factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings"),
                    "linear": ("factor",),
                    "yarn": ("factor", "original_max_position_embeddings")}.get(kind)  # type: ignore[arg-type]
            if need is None:
                raise ModelConfigError(f"rope_scaling.rope_type={kind!r}: supported are 'llama3', 'linear', 'yarn'")
            missing = [k for k in need if k not in self.rope_scaling]
            if missing:
                raise ModelConfigError(f"rope_scaling ({kind}) lacks {missing}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        """Build from a HF config.json dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x
        `rope_parameters`)."""
        model_type = cfg.get("model_type")
        arch = _ARCH_ALIASES.get(str(model_type))
        if arch is None:
            raise ModelConfigError(f"model_type={model_type!r}: supported are {sorted(_ARCH_ALIASES)}")

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise ModelConfigError(f"config.json lacks {key!r}")
            return cfg[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or rope
        scaling = dict(scaling) if scaling else {}
        kind = scaling.pop("rope_type", None) or scaling.pop("type", None)
        scaling.pop("rope_theta", None)
        rope_scaling = None if kind in (None, "default") else {"rope_type": kind, **scaling}
        try:
            moe = moe_from_hf_config(cfg)
        except MoEConfigError as e:
            raise ModelConfigError(str(e)) from e
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", arch in ("qwen2", "qwen2_moe")))),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=moe,
        )
