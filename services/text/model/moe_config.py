"""Mixture-of-experts description (torch-free): which layers route, how, and the experts' shapes.

Parsed from HF config.json by :func:`moe_from_hf_config` (called by ``ModelArchConfig.from_hf_config``)
for the model types in :data:`MOE_MODEL_TYPES`; GGUF metadata builds it in the GGUF loader.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SCORINGS = ("softmax", "softmax_topk", "sigmoid")
"""Router scoring: "softmax" = softmax over all experts, then the top k (Mixtral, Qwen-MoE);
"softmax_topk" = the top k logits, then softmax over those k (gpt-oss); "sigmoid" = sigmoid of each
logit, then the top k (DeepSeek-V3)."""

GROUP_SCORES = ("max", "top2_sum")
"""How a group of experts is scored for group-limited routing (``n_group`` > 1): "max" = its best expert's
score (DeepSeek-V2 ``group_limited_greedy``), "top2_sum" = the sum of its two best (DeepSeek-V3 ``noaux_tc``,
scores plus the correction bias)."""

ACTIVATIONS = ("silu", "gpt_oss")
"""Expert activation: "silu" = silu(gate) * up; "gpt_oss" = gate clamped to <= limit, up to
[-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""

# HF model_type -> architecture family that routes through experts.
GPT_OSS_SWIGLU = (1.702, 7.0)
"""gpt-oss's expert activation (alpha, limit): its config's defaults, and the constants llama.cpp runs it with
(a GGUF file carries neither)."""
MOE_MODEL_TYPES = {"mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "gpt_oss": "gpt_oss",
                   "deepseek_v2": "deepseek", "deepseek_v3": "deepseek", "deepseek_v32": "deepseek",
                   "glm4_moe": "glm4_moe"}

MOE_HF_READS: dict[str, frozenset[str]] = {
    "mixtral": frozenset({"num_local_experts", "num_experts_per_tok", "intermediate_size", "hidden_act",
                          "router_jitter_noise", "router_aux_loss_coef"}),
    "qwen2_moe": frozenset({"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                            "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
                            "hidden_act", "router_aux_loss_coef", "qkv_bias"}),
    "qwen3_moe": frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                            "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "hidden_act",
                            "router_aux_loss_coef"}),
    "gpt_oss": frozenset({"num_local_experts", "num_experts_per_tok", "intermediate_size", "swiglu_alpha",
                          "swiglu_limit", "hidden_act", "router_aux_loss_coef",
                          "quantization_config"}),
    "deepseek_v2": frozenset({"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                              "first_k_dense_replace", "moe_layer_freq", "routed_scaling_factor", "topk_method",
                              "n_group", "topk_group", "norm_topk_prob", "scoring_func", "hidden_act",
                              "aux_loss_alpha", "seq_aux", "ep_size"}),
    "deepseek_v3": frozenset({"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                              "first_k_dense_replace", "moe_layer_freq", "routed_scaling_factor", "topk_method",
                              "n_group", "topk_group", "norm_topk_prob", "scoring_func", "hidden_act",
                              "aux_loss_alpha", "seq_aux", "ep_size"}),
    "deepseek_v32": frozenset({"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                               "first_k_dense_replace", "mlp_layer_types", "routed_scaling_factor", "topk_method",
                               "n_group", "topk_group", "norm_topk_prob", "scoring_func", "hidden_act",
                               "aux_loss_alpha", "seq_aux", "ep_size"}),
    "glm4_moe": frozenset({"n_routed_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                           "n_shared_experts", "first_k_dense_replace", "routed_scaling_factor", "n_group",
                           "topk_group", "norm_topk_prob", "hidden_act", "router_aux_loss_coef"}),
}
"""The config.json keys of each MoE model type that :func:`moe_from_hf_config` (and, for qkv_bias,
``ModelArchConfig.from_hf_config``) reads, beyond a Llama config's; training-only keys such as
router_aux_loss_coef count as read: they change no inference math."""


class MoEConfigError(ValueError):
    """An MoE configuration holds an invalid or unsupported value (the message names the field)."""


@dataclass
class MoEConfig:
    num_experts: int
    """Routed experts per MoE layer (E)."""
    top_k: int
    """Experts each token is sent to (K <= E)."""
    intermediate_size: int
    """Inner width of one routed expert (I)."""
    scoring: str = "softmax"
    """One of SCORINGS."""
    norm_topk_prob: bool = True
    """Renormalize the k chosen weights to sum to 1 ("softmax", "sigmoid"; "softmax_topk" sums to 1 already)."""
    activation: str = "silu"
    """One of ACTIVATIONS."""
    swiglu_alpha: float | None = None
    """gpt_oss activation: sigmoid slope (1.702 in gpt-oss)."""
    swiglu_limit: float | None = None
    """gpt_oss activation: clamp bound (7.0 in gpt-oss)."""
    router_bias: bool = False
    """The router linear carries a bias (gpt-oss)."""
    expert_bias: bool = False
    """Each expert's gate/up and down projections carry biases (gpt-oss)."""
    shared_expert_intermediate_size: int = 0
    """Inner width of the always-on shared expert (0: none)."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by sigmoid(x @ w_gate) (Qwen2-MoE)."""
    decoder_sparse_step: int = 1
    """Layer i routes through experts iff (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Layers that keep a dense MLP of the model's intermediate_size."""
    n_group: int = 1
    """Expert groups for group-limited routing: a token picks its k experts among the ``topk_group`` best groups
    (1: no groups)."""
    topk_group: int = 1
    """Groups a token may route into (<= n_group)."""
    group_score: str = "max"
    """One of GROUP_SCORES (read when n_group > 1)."""
    score_bias: bool = False
    """The router has a per-expert bias added to the scores for choosing only (DeepSeek-V3
    ``e_score_correction_bias``); the weights are the unbiased scores."""
    routed_scaling_factor: float = 1.0
    """The routed experts' weights are multiplied by this (after any renormalisation)."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise MoEConfigError(f"moe.{name}={value!r}: must be a positive integer")
        if self.top_k > self.num_experts:
            raise MoEConfigError(f"moe.top_k={self.top_k} exceeds moe.num_experts={self.num_experts}")
        if self.scoring not in SCORINGS:
            raise MoEConfigError(f"moe.scoring={self.scoring!r}: expected one of {SCORINGS}")
        if self.activation not in ACTIVATIONS:
            raise MoEConfigError(f"moe.activation={self.activation!r}: expected one of {ACTIVATIONS}")
        if self.activation == "gpt_oss" and (self.swiglu_alpha is None or self.swiglu_limit is None):
            raise MoEConfigError("moe.activation='gpt_oss' needs swiglu_alpha and swiglu_limit")
        if self.shared_expert_intermediate_size < 0:
            raise MoEConfigError(f"moe.shared_expert_intermediate_size={self.shared_expert_intermediate_size}: "
                                 "must be >= 0")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise MoEConfigError(f"moe.n_group={self.n_group}: must divide moe.num_experts={self.num_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise MoEConfigError(f"moe.topk_group={self.topk_group}: must be in [1, n_group={self.n_group}]")
        if self.n_group > 1 and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise MoEConfigError(f"moe.top_k={self.top_k} exceeds the experts of topk_group={self.topk_group} groups")
        if self.group_score not in GROUP_SCORES:
            raise MoEConfigError(f"moe.group_score={self.group_score!r}: expected one of {GROUP_SCORES}")
        if self.group_score == "top2_sum" and self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise MoEConfigError("moe.group_score='top2_sum' needs at least 2 experts per group")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise MoEConfigError("moe.shared_expert_gate needs a shared expert (shared_expert_intermediate_size > 0)")

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` routes through experts (else it keeps a dense MLP)."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0


def _need(cfg: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    raise MoEConfigError(f"config.json lacks {' / '.join(repr(k) for k in keys)}")


def moe_from_hf_config(cfg: dict[str, Any]) -> MoEConfig | None:
    """The MoE part of a HF config.json dict; None for a model type without experts.

    Raises MoEConfigError for an activation or a training-time routing feature we do not run
    (router jitter is training-only and ignored in eval by transformers too, so it is accepted)."""
    kind = MOE_MODEL_TYPES.get(str(cfg.get("model_type")))
    if kind is None:
        return None
    act = cfg.get("hidden_act", "silu")
    if kind != "gpt_oss" and act != "silu":
        raise MoEConfigError(f"hidden_act={act!r}: MoE experts support 'silu'")
    top_k = int(_need(cfg, "num_experts_per_tok"))
    if kind in ("deepseek", "glm4_moe"):
        return _deepseek_moe(cfg, top_k)
    if kind == "mixtral":
        return MoEConfig(num_experts=int(_need(cfg, "num_local_experts")), top_k=top_k,
                         intermediate_size=int(_need(cfg, "intermediate_size")), scoring="softmax",
                         norm_topk_prob=True)
    if kind == "gpt_oss":
        quant = (cfg.get("quantization_config") or {}).get("quant_method")
        if quant not in (None, "mxfp4"):  # MXFP4 experts are dequantized at load; nothing else is read
            raise MoEConfigError(f"quantization_config.quant_method={quant!r}: gpt_oss supports 'mxfp4'")
        return MoEConfig(num_experts=int(_need(cfg, "num_local_experts")), top_k=top_k,
                         intermediate_size=int(_need(cfg, "intermediate_size")), scoring="softmax_topk",
                         norm_topk_prob=False, activation="gpt_oss",
                         swiglu_alpha=float(cfg.get("swiglu_alpha", GPT_OSS_SWIGLU[0])),
                         swiglu_limit=float(cfg.get("swiglu_limit", GPT_OSS_SWIGLU[1])), router_bias=True,
                         expert_bias=True)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if kind == "qwen2_moe" else 0
    return MoEConfig(num_experts=int(_need(cfg, "num_experts", "num_local_experts")), top_k=top_k,
                     intermediate_size=int(_need(cfg, "moe_intermediate_size")), scoring="softmax",
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                     shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0,
                     decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                     mlp_only_layers=[int(i) for i in cfg.get("mlp_only_layers") or []])


def _deepseek_moe(cfg: dict[str, Any], top_k: int) -> MoEConfig:
    """DeepSeek-V2 (softmax scores; ``topk_method`` greedy or group_limited_greedy) and DeepSeek-V3 (sigmoid
    scores plus the correction bias for choosing, groups scored by their two best; ``noaux_tc``), and GLM-4.5, which
    routes as DeepSeek-V3 without naming the method (its config has neither topk_method, scoring_func nor
    moe_layer_freq) and renormalises the top k unless norm_topk_prob says not to. Layer i routes iff
    i >= first_k_dense_replace and i % moe_layer_freq == 0 (the others are dense: mlp_only_layers)."""
    v3 = cfg.get("model_type") in ("deepseek_v3", "deepseek_v32", "glm4_moe")
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in methods:
        raise MoEConfigError(f"config.json field topk_method={method!r} is not supported for model_type="
                             f"{cfg.get('model_type')!r}: {' or '.join(methods)}")
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise MoEConfigError(f"config.json field scoring_func={scoring!r} is not supported for model_type="
                             f"{cfg.get('model_type')!r}: {'sigmoid' if v3 else 'softmax'}")
    grouped = v3 or method == "group_limited_greedy"
    n_group = int(cfg.get("n_group") or 1) if grouped else 1
    layers = int(_need(cfg, "num_hidden_layers"))
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    dense = [i for i in range(layers) if i < first_dense or i % freq]
    kinds = cfg.get("mlp_layer_types")  # DeepSeek-V3.2: "dense" | "sparse" per layer
    if kinds is not None:
        if len(kinds) != layers or any(k not in ("dense", "sparse") for k in kinds):
            raise MoEConfigError(f"config.json field mlp_layer_types={kinds!r}: need {layers} entries of "
                                 "'dense' / 'sparse'")
        dense = [i for i, k in enumerate(kinds) if k == "dense"]
    experts = int(_need(cfg, "n_routed_experts", "num_local_experts"))
    inter = int(_need(cfg, "moe_intermediate_size"))
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=inter, scoring=scoring,
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", cfg.get("model_type") == "glm4_moe")),
                     shared_expert_intermediate_size=inter * int(cfg.get("n_shared_experts") or 0),
                     mlp_only_layers=dense,
                     n_group=n_group, topk_group=int(cfg.get("topk_group") or 1) if n_group > 1 else 1,
                     group_score="top2_sum" if v3 else "max", score_bias=v3,
                     routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0))


_GGUF_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}
"""llama.cpp's renormalisation of the top-k weights per architecture when the file has no expert_weights_norm."""


def moe_from_gguf(arch: str, get: Callable[[str], Any], shapes: dict[str, tuple[int, ...]]) -> MoEConfig | None:
    """The MoE part of a GGUF file (``get(key)`` reads ``{arch}.key``, ``shapes`` are the tensors' GGUF dims,
    innermost first); None without experts.

    A layer routes iff it has ``blk.N.ffn_gate_inp.weight``; the others are mlp_only_layers."""
    count = get("expert_count")
    if not count:
        return None
    if arch == "gpt-oss":
        return _gpt_oss_moe_from_gguf(get)
    if arch not in _GGUF_NORM_TOPK:
        raise MoEConfigError(f"GGUF architecture {arch!r} with experts is not supported")
    gating = get("expert_gating_func")
    if gating not in (None, 1):  # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX = 1
        raise MoEConfigError(f"{arch}.expert_gating_func={gating!r}: supported is 1 (softmax)")
    scale = get("expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise MoEConfigError(f"{arch}.expert_weights_scale={scale!r}: supported is 1")
    layers = int(get("block_count") or 0)
    ffn = get("expert_feed_forward_length") or get("feed_forward_length")
    if ffn is None:
        raise MoEConfigError(f"{arch}.expert_feed_forward_length is missing")
    shexp = shapes.get("blk.0.ffn_gate_shexp.weight")
    shared = int(get("expert_shared_feed_forward_length") or (shexp[1] if shexp else 0))
    norm = get("expert_weights_norm")
    return MoEConfig(num_experts=int(count), top_k=int(get("expert_used_count")), intermediate_size=int(ffn),
                     scoring="softmax", norm_topk_prob=_GGUF_NORM_TOPK[arch] if norm is None else bool(norm),
                     shared_expert_intermediate_size=shared,
                     shared_expert_gate=shared > 0 and "blk.0.ffn_gate_inp_shexp.weight" in shapes,
                     mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in shapes])


_GGUF_SOFTMAX_WEIGHT = 3
"""llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT: softmax over the K chosen logits (gpt-oss)."""


def _gpt_oss_moe_from_gguf(get: Callable[[str], Any]) -> MoEConfig:
    """gpt-oss's experts as llama.cpp runs them: softmax over the top-k logits, biased router and experts,
    the clamped swiglu of GPT_OSS_SWIGLU; every layer routes."""
    gating = get("expert_gating_func")
    if gating not in (None, _GGUF_SOFTMAX_WEIGHT):
        raise MoEConfigError(f"gpt-oss.expert_gating_func={gating!r}: supported is {_GGUF_SOFTMAX_WEIGHT} "
                             "(softmax over the chosen experts' logits)")
    ffn = get("expert_feed_forward_length")
    if ffn is None:
        raise MoEConfigError("gpt-oss.expert_feed_forward_length is missing")
    alpha, limit = GPT_OSS_SWIGLU
    return MoEConfig(num_experts=int(get("expert_count")), top_k=int(get("expert_used_count")),
                     intermediate_size=int(ffn), scoring="softmax_topk", norm_topk_prob=False, activation="gpt_oss",
                     swiglu_alpha=alpha, swiglu_limit=limit, router_bias=True, expert_bias=True)
