"""Architecture description shared by the model code, the weight loaders and the KV layout (torch-free: the
router reads a model's description through it too, services/text/model/source.py).

``ModelArchConfig.from_hf_config`` refuses every config.json key that changes the math and is not
implemented (the per-model_type registry is in :mod:`services.text.model.config_fields`).

Attention per layer: ``layer_types[i]`` is "full_attention" or "sliding_attention"; a query at position p
of a sliding layer sees key k iff ``0 <= p - k < sliding_window``. With ``attention_sinks`` each layer has
a learned logit per query head (``self_attn.sinks``) added to the softmax denominator as exp(sink), its
column dropped from the output (gpt-oss). ``layer_window(i)`` is what the attention backends take.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from services.text.model.config_fields import (
    ARCH_SPECS,
    ArchSpec,
    families,
    refuse_value,
    register_architecture,
    unimplemented_field,
)
from services.text.model.mla_config import MLAConfig, MLAConfigError, yarn_softmax_scale
from services.text.model.moe_config import MOE_HF_READS, MoEConfig, MoEConfigError, moe_from_hf_config

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
_QWEN_WINDOW_READS = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})
_YARN_READS = frozenset({"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
                         "attention_factor"})
"""rope_scaling keys of a yarn config that engine/models/rope.py implements."""
_MLA_YARN_READS = _YARN_READS | {"mscale", "mscale_all_dim"}
"""DeepSeek's yarn keys: mscale / mscale_all_dim set the cos/sin factor (rope.attention_factor) and the softmax
scale (mla_config.yarn_softmax_scale)."""
_ROPE_READS: dict[str, frozenset[str]] = {
    "default": frozenset(), "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "yarn": _YARN_READS}
"""Keys each rope type of ``rope_parameters`` / ``rope_scaling`` reads besides rope_type, rope_theta and
partial_rotary_factor (engine/models/rope.py); any other key with a value is refused."""


class ModelConfigError(ValueError):
    """A model configuration is missing a field or holds an invalid or unimplemented value (the one-line
    message names it)."""


@dataclass
class ModelArchConfig:
    architecture: str
    """Model family (``config_fields.families()``): "llama" | "qwen2" | "qwen3" | what other modules register."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Residual stream width."""
    intermediate_size: int
    """SwiGLU inner width."""
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
    original_max_position_embeddings, beta_fast?, beta_slow?, truncate?} (engine/models/rope.py)."""
    max_position_embeddings: int = 2048
    """Longest context the model was trained for (tokens)."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    rotary_dim: int | None = None
    """RoPE rotates the first rotary_dim values of each head (rotate-half layout within them) and passes the rest
    (GLM's ``partial_rotary_factor``); None: the whole head_dim."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id, if any."""
    eos_token_ids: list[int] = field(default_factory=list)
    """Ids that end generation."""
    sliding_window: int | None = None
    """Keys a query of a sliding layer sees (itself included, tokens); None when no layer slides."""
    layer_types: list[str] | None = None
    """Per layer "full_attention" | "sliding_attention"; None: every layer full. Set (and holding at least one
    sliding layer) exactly when sliding_window is set."""
    attention_sinks: bool = False
    """Every layer has a learned sink logit per query head (parameter ``self_attn.sinks`` [num_heads])."""
    moe: MoEConfig | None = None
    """Mixture-of-experts routing and expert shapes; set exactly for the MoE families (moe_config.py)."""
    fp8_weight_block: list[int] | None = None
    """[rows, cols] of the blocks of an FP8 block-scaled checkpoint (``quantization_config`` quant_method fp8 with
    weight_block_size, the DeepSeek-V3 format): its fp8 weights carry one fp32 ``weight_scale_inv`` per block and
    are dequantized at load (weights/fp8_block.py). None: unquantized weights."""
    mla: MLAConfig | None = None
    """Multi-head latent attention (mla_config.py); set exactly for the "deepseek" family, whose pages then hold
    one latent per token: num_kv_heads is 1 and head_dim is half the latent (the K and V planes)."""

    def layer_window(self, layer: int) -> int:
        """Window of layer ``layer`` in tokens; 0: full attention."""
        if self.layer_types is None or self.layer_types[layer] == FULL_ATTENTION:
            return 0
        assert self.sliding_window is not None
        return self.sliding_window

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """layer_window of every layer; empty when every layer is full (the common case costs nothing)."""
        if self.layer_types is None:
            return ()
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # from to_dict()
            self.moe = MoEConfig(**self.moe)
        if isinstance(self.mla, dict):
            self.mla = MLAConfig(**self.mla)
        self.validate()

    def validate(self) -> None:
        if self.architecture not in families():
            raise ModelConfigError(f"architecture={self.architecture!r}: expected one of {families()}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"{name}={value!r}: must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim}: RoPE needs an even head_dim")
        if self.rotary_dim is not None and (not isinstance(self.rotary_dim, int) or self.rotary_dim % 2
                                            or not 0 < self.rotary_dim <= self.head_dim or self.mla is not None):
            raise ModelConfigError(f"rotary_dim={self.rotary_dim!r}: must be even, in (0, head_dim={self.head_dim}] "
                                   "and unset for latent attention")
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
        if (self.moe is not None) != (self.architecture in MOE_ARCHITECTURES):
            raise ModelConfigError(f"architecture={self.architecture!r} with moe={self.moe!r}: experts are set "
                                   f"exactly for {MOE_ARCHITECTURES}")
        if (self.mla is not None) != (self.architecture in MLA_ARCHITECTURES):
            raise ModelConfigError(f"architecture={self.architecture!r} with mla={self.mla!r}: latent attention is "
                                   f"set exactly for {MLA_ARCHITECTURES}")
        if self.mla is not None and (self.num_kv_heads, self.head_dim) != (1, self.mla.latent_dim // 2):
            raise ModelConfigError(f"MLA pages are one latent per token: num_kv_heads must be 1 and head_dim "
                                   f"{self.mla.latent_dim // 2}, got {self.num_kv_heads} and {self.head_dim}")
        self._validate_windows()

    def _validate_windows(self) -> None:
        if (self.sliding_window is None) != (self.layer_types is None):
            raise ModelConfigError(f"sliding_window={self.sliding_window!r} with layer_types={self.layer_types!r}: "
                                   "set both (at least one sliding layer) or neither")
        if self.sliding_window is None or self.layer_types is None:
            return
        if not isinstance(self.sliding_window, int) or self.sliding_window <= 0:
            raise ModelConfigError(f"sliding_window={self.sliding_window!r}: must be a positive integer")
        if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ModelConfigError(f"layer_types={self.layer_types!r}: need {self.num_layers} entries of "
                                   f"{LAYER_TYPES}")
        if SLIDING_ATTENTION not in self.layer_types:
            raise ModelConfigError("layer_types has no sliding layer: leave sliding_window and layer_types None")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelArchConfig:
        """Build from a HF config.json dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x
        `rope_parameters`). Raises ModelConfigError (one line) for a missing key, an unsupported value, or
        a math-changing key the model_type does not implement."""
        model_type = str(cfg.get("model_type"))
        spec = ARCH_SPECS.get(model_type)
        if spec is None:
            raise ModelConfigError(f"model_type={cfg.get('model_type')!r}: supported are {sorted(ARCH_SPECS)}")
        problem = unimplemented_field(model_type, cfg)
        if problem is not None:
            raise ModelConfigError(problem)

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise ModelConfigError(f"config.json lacks {key!r}")
            return cfg[key]

        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(refuse_value("hidden_act", act, model_type, "'silu' (SwiGLU) only"))
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or rope
        scaling = dict(scaling) if scaling else {}
        kind = scaling.pop("rope_type", None) or scaling.pop("type", None)
        scaling.pop("rope_theta", None)
        partial = scaling.pop("partial_rotary_factor", None)
        if partial is None:
            partial = cfg.get("partial_rotary_factor")
        if kind not in (None, "default", "llama3", "linear", "yarn"):
            raise ModelConfigError(refuse_value("rope_scaling.rope_type", kind, model_type,
                                                "'default', 'llama3', 'linear', 'yarn'"))
        reads = _ROPE_READS[kind or "default"]
        if kind == "yarn" and spec.family in MLA_ARCHITECTURES:
            reads = _MLA_YARN_READS  # DeepSeek's mscale / mscale_all_dim (elsewhere they change the attention scale)
        unread = sorted(k for k, v in scaling.items() if k not in reads and v is not None)
        if unread:
            raise ModelConfigError(refuse_value(f"rope_scaling.{unread[0]}", scaling[unread[0]], model_type,
                                                f"{kind or 'default'} RoPE reads {sorted(reads) or 'nothing more'}"))
        rope_scaling = None if kind in (None, "default") else {"rope_type": kind, **scaling}
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        num_layers = int(need("num_hidden_layers"))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        kwargs: dict[str, Any] = dict(
            architecture=spec.family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        if spec.family != "gpt_oss":  # gpt-oss reads its own (MXFP4 experts, moe_config.py)
            kwargs["fp8_weight_block"] = _fp8_block(cfg.get("quantization_config"), model_type)
        if partial is not None and float(partial) != 1.0:
            if "partial_rotary_factor" not in spec.reads:
                raise ModelConfigError(refuse_value("partial_rotary_factor", partial, model_type,
                                                    "1.0 (RoPE over the whole head)"))
            kwargs["rotary_dim"] = int(head_dim * float(partial))
        if spec.parse is not None:
            kwargs.update(spec.parse(cfg))
        if spec.family in MLA_ARCHITECTURES:
            kwargs.update(_mla_fields(cfg, model_type, rope_scaling))
        return cls(**kwargs)


_FP8_QUANT_READS = frozenset({"quant_method", "weight_block_size", "activation_scheme", "fmt"})

INDEXED_LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention")
"""DeepSeek-V3.2's name for a layer with the indexer, as transformers releases spell it (5.25 / 5.17)."""


def _fp8_block(quant: Any, model_type: str) -> list[int] | None:
    """weight_block_size of an FP8 block-scaled quantization_config (dynamic activation scaling, e4m3); None when
    there is none; any other quantization is refused in one line."""
    if not quant:
        return None
    supported = ("{'quant_method': 'fp8', 'weight_block_size': [rows, cols], 'activation_scheme': 'dynamic'} "
                 "(block-scaled e4m3 weights, dequantized at load)")
    block = quant.get("weight_block_size") if isinstance(quant, Mapping) else None
    ok = (isinstance(quant, Mapping) and quant.get("quant_method") == "fp8" and quant.get("fmt", "e4m3") == "e4m3"
          and quant.get("activation_scheme", "dynamic") == "dynamic" and isinstance(block, list | tuple)
          and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
          and not set(quant) - _FP8_QUANT_READS)
    if not ok:
        raise ModelConfigError(refuse_value("quantization_config", quant, model_type, supported))
    return [int(block[0]), int(block[1])]


def _all_sliding(window: Any, num_layers: int) -> dict[str, Any]:
    if window is None:
        return {}
    return {"sliding_window": int(window), "layer_types": [SLIDING_ATTENTION] * num_layers}


def _parse_llama(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"attention_bias": _no_o_proj_bias(cfg, "llama")}


def _parse_mistral(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Mistral slides on every layer when sliding_window is set (transformers' MistralModel ignores layer_types,
    so this parser does not read it: a config.json that has one is refused)."""
    return _all_sliding(cfg.get("sliding_window"), int(cfg["num_hidden_layers"]))


def layer_windows_fields(model_type: str, num_layers: int, window: Any, types: Any) -> dict[str, Any]:
    """``sliding_window`` / ``layer_types`` keyword arguments of ModelArchConfig from a config's window and
    per-layer types (an architecture module's parser calls this too); {} when no layer slides. Raises
    ModelConfigError for an unknown layer type, a wrong count, or sliding layers without a window."""
    types = list(types)
    if any(t not in LAYER_TYPES for t in types) or len(types) != num_layers:
        raise ModelConfigError(refuse_value("layer_types", types, model_type,
                                            f"{num_layers} entries of {LAYER_TYPES}"))
    if SLIDING_ATTENTION not in types:
        return {}
    if window is None:
        raise ModelConfigError(refuse_value("layer_types", types, model_type, "sliding layers need a sliding_window"))
    return {"sliding_window": int(window), "layer_types": types}


def _qwen_windows(cfg: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """transformers' Qwen2Config/Qwen3Config: sliding_window counts only with use_sliding_window; layer_types,
    when config.json omits it, slides on layers i >= max_window_layers (default 28)."""
    n = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    types = cfg.get("layer_types")
    if types is None:
        lowest = int(cfg.get("max_window_layers", 28))
        types = [SLIDING_ATTENTION if window is not None and i >= lowest else FULL_ATTENTION for i in range(n)]
    return layer_windows_fields(model_type, n, window, types)


def _parse_qwen2(cfg: Mapping[str, Any]) -> dict[str, Any]:
    # transformers' Qwen2 gives q/k/v a bias whatever attention_bias says: the key is read and has no effect.
    return {"attention_bias": True, **_qwen_windows(cfg, "qwen2")}


def _parse_qwen3(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"attention_bias": _no_o_proj_bias(cfg, "qwen3"), "qk_norm": True, **_qwen_windows(cfg, "qwen3")}


register_architecture("llama", ArchSpec("llama", frozenset({"attention_bias"}), _parse_llama))
register_architecture("mistral", ArchSpec("llama", frozenset({"sliding_window"}), _parse_mistral))
register_architecture("qwen2", ArchSpec("qwen2", _QWEN_WINDOW_READS | {"attention_bias"}, _parse_qwen2))
register_architecture("qwen3", ArchSpec("qwen3", _QWEN_WINDOW_READS | {"attention_bias"}, _parse_qwen3))



def _moe(cfg: Mapping[str, Any]) -> MoEConfig:
    try:
        moe = moe_from_hf_config(dict(cfg))
    except MoEConfigError as e:
        raise ModelConfigError(str(e)) from e
    assert moe is not None
    return moe


def _no_o_proj_bias(cfg: Mapping[str, Any], model_type: str) -> bool:
    """attention_bias of a family whose transformers module also biases o_proj: only False is implemented."""
    if cfg.get("attention_bias"):
        raise ModelConfigError(refuse_value("attention_bias", cfg["attention_bias"], model_type,
                                            "False (an o_proj bias is not implemented for this model_type)"))
    return False


def _parse_mixtral(cfg: Mapping[str, Any]) -> dict[str, Any]:
    # transformers' Mixtral slides on every layer when sliding_window is set, as Mistral does.
    return {"moe": _moe(cfg), **_all_sliding(cfg.get("sliding_window"), int(cfg["num_hidden_layers"]))}


def _parse_qwen2_moe(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE: q/k/v bias from qkv_bias (default True); layer_types, when config.json omits it, slides on
    the even-numbered (0-based) layers below max_window_layers with use_sliding_window (transformers' rule)."""
    n = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    types = cfg.get("layer_types")
    if types is None:
        lowest = int(cfg.get("max_window_layers", 28))
        types = [SLIDING_ATTENTION if window is not None and (i + 1) % 2 and i < lowest else FULL_ATTENTION
                 for i in range(n)]
    return {"attention_bias": bool(cfg.get("qkv_bias", True)), "moe": _moe(cfg),
            **layer_windows_fields("qwen2_moe", n, window or None, types)}


def _parse_qwen3_moe(cfg: Mapping[str, Any]) -> dict[str, Any]:
    # transformers' Qwen3-MoE: sliding_window counts only with use_sliding_window, then on every layer.
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    return {"attention_bias": _no_o_proj_bias(cfg, "qwen3_moe"), "qk_norm": True, "moe": _moe(cfg),
            **_all_sliding(window, int(cfg["num_hidden_layers"]))}


def _parse_gpt_oss(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """gpt-oss: biased q/k/v/o projections (o_proj's bias lives in engine/models/gpt_oss.py), a sink logit per
    head on every layer, layer_types alternating sliding/full."""
    n = int(cfg["num_hidden_layers"])
    if not cfg.get("attention_bias", True):
        raise ModelConfigError(refuse_value("attention_bias", cfg["attention_bias"], "gpt_oss", "True"))
    types = cfg.get("layer_types") or [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(n)]
    return {"attention_bias": True, "attention_sinks": True, "moe": _moe(cfg),
            **layer_windows_fields("gpt_oss", n, cfg.get("sliding_window"), types)}


register_architecture("mixtral", ArchSpec("mixtral", MOE_HF_READS["mixtral"] | {"sliding_window"}, _parse_mixtral))
register_architecture("qwen2_moe", ArchSpec("qwen2_moe", MOE_HF_READS["qwen2_moe"] | _QWEN_WINDOW_READS,
                                            _parse_qwen2_moe))
register_architecture("qwen3_moe", ArchSpec("qwen3_moe", MOE_HF_READS["qwen3_moe"] | _QWEN_WINDOW_READS
                                            | {"attention_bias"}, _parse_qwen3_moe))
register_architecture("gpt_oss", ArchSpec("gpt_oss", MOE_HF_READS["gpt_oss"] | {"sliding_window", "layer_types",
                                          "attention_bias"}, _parse_gpt_oss))


def _parse_glm4_moe(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """GLM-4.5: Llama attention with q/k/v biases (attention_bias; o_proj never has one), per-head q/k norms with
    use_qk_norm, RoPE over the first partial_rotary_factor of each head (read by from_hf_config), DeepSeek-V3-style
    experts (moe_config._deepseek_moe); the multi-token-prediction layers after the last decoder layer
    (num_nextn_predict_layers) are not part of the forward: their tensors are skipped at load."""
    return {"attention_bias": bool(cfg.get("attention_bias", False)), "qk_norm": bool(cfg.get("use_qk_norm", False)),
            "moe": _moe(cfg)}


register_architecture("glm4_moe", ArchSpec("glm4_moe", MOE_HF_READS["glm4_moe"] | {
    "attention_bias", "use_qk_norm", "partial_rotary_factor", "num_nextn_predict_layers"}, _parse_glm4_moe))


def _parse_deepseek(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V3: MLA attention (the latent fields are added by from_hf_config, which knows the rope
    scaling), dense layers below first_k_dense_replace, routed + shared experts above."""
    model_type = str(cfg.get("model_type"))
    if cfg.get("mlp_bias"):
        raise ModelConfigError(refuse_value("mlp_bias", cfg["mlp_bias"], model_type, "False"))
    return {"attention_bias": bool(cfg.get("attention_bias", False)), "moe": _moe(cfg)}


def _mla_fields(cfg: Mapping[str, Any], model_type: str, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """mla, num_kv_heads=1 and head_dim (half the latent: the K and V planes of a page) of a DeepSeek config."""
    def need(key: str) -> int:
        if cfg.get(key) is None:
            raise ModelConfigError(f"config.json lacks {key!r}")
        return int(cfg[key])

    rope, nope = need("qk_rope_head_dim"), need("qk_nope_head_dim")
    for key, want in (("head_dim", rope), ("qk_head_dim", rope + nope)):
        if cfg.get(key) is not None and int(cfg[key]) != want:
            raise ModelConfigError(refuse_value(key, cfg[key], model_type, f"{want} (derived from the MLA widths)"))
    index: dict[str, int] = {}
    if model_type == "deepseek_v32":  # DeepSeek Sparse Attention: an indexer in every layer
        types = cfg.get("layer_types") or ["indexed_attention"] * int(need("num_hidden_layers"))
        if any(t not in INDEXED_LAYER_TYPES for t in types) or len(types) != int(need("num_hidden_layers")):
            raise ModelConfigError(refuse_value("layer_types", types, model_type,
                                                f"one of {INDEXED_LAYER_TYPES} on every layer"))
        index = {"index_n_heads": need("index_n_heads"), "index_head_dim": need("index_head_dim"),
                 "index_topk": need("index_topk")}
    try:
        mla = MLAConfig(kv_lora_rank=need("kv_lora_rank"), qk_rope_head_dim=rope, qk_nope_head_dim=nope,
                        v_head_dim=need("v_head_dim"), q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                        rope_interleave=bool(cfg.get("rope_interleave", True)) if model_type == "deepseek_v3" else True,
                        softmax_scale=yarn_softmax_scale(rope + nope, rope_scaling), **index)
    except MLAConfigError as e:
        raise ModelConfigError(f"{model_type}: {e}") from e
    return {"mla": mla, "num_kv_heads": 1, "head_dim": mla.latent_dim // 2}


_MLA_READS = frozenset({"kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                        "qk_head_dim", "attention_bias", "mlp_bias", "num_nextn_predict_layers"})
"""MLA keys of DeepSeek configs (num_nextn_predict_layers: the multi-token-prediction layers after the last
decoder layer, not part of the model's forward; their tensors are skipped at load)."""
register_architecture("deepseek_v2", ArchSpec("deepseek", MOE_HF_READS["deepseek_v2"] | _MLA_READS, _parse_deepseek))
register_architecture("deepseek_v3", ArchSpec("deepseek", MOE_HF_READS["deepseek_v3"] | _MLA_READS
                                              | {"rope_interleave"}, _parse_deepseek))
register_architecture("deepseek_v32", ArchSpec("deepseek", MOE_HF_READS["deepseek_v32"] | _MLA_READS
                                               | {"index_n_heads", "index_head_dim", "index_topk", "layer_types"},
                                               _parse_deepseek))
ARCHITECTURES = families()
"""Every family registered here (dense and mixture-of-experts; ``config_fields.families()``)."""
MOE_ARCHITECTURES = ("deepseek", "glm4_moe", "gpt_oss", "mixtral", "qwen2_moe", "qwen3_moe")
"""Families whose layers route tokens through experts (ModelArchConfig.moe is set)."""
MLA_ARCHITECTURES = ("deepseek",)
"""Families whose attention caches a latent per token (ModelArchConfig.mla is set)."""
