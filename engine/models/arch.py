"""ModelArch: the few facts of a Hugging Face config that our forward pass needs, read and checked once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # {"rope_type": "linear" | "llama3", ...}; None: plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None

    @classmethod
    def from_hf_config(cls, config: Any, source: str = "config.json") -> ModelArch:
        archs = getattr(config, "architectures", None) or []
        architecture = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or '(none given)'} in {source}; "
                f"loraplex supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act '{config.hidden_act}' in {source}")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        rope_theta, rope_scaling = _rope(config, source)
        use_window = getattr(config, "use_sliding_window", architecture == "MistralForCausalLM")
        return cls(
            architecture=architecture,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=architecture == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=getattr(config, "sliding_window", None) if use_window else None,
        )


def _rope(config: Any, source: str) -> tuple[float, dict[str, Any] | None]:
    """RoPE theta and scaling from either transformers-5 `rope_parameters` or the older top-level keys."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    theta = float(params.pop("rope_theta", None) or getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise UnsupportedModelError(f"unsupported rope_scaling type '{rope_type}' in {source}")
    params["rope_type"] = rope_type
    return theta, params
