"""Linear-layer shapes of common decoder models, for tuning and benchmarks.

Each model is described by its attention and MLP sizes; :func:`linear_shapes` turns that into the
``[N, K]`` weights one tensor-parallel rank holds (QKV and gate/up column-parallel, O and down
row-parallel; fused QKV and fused gate+up as vLLM and SGLang load them)::

    >>> [(s.name, s.n, s.k) for s in linear_shapes("llama3-8b")]
    [('qkv_proj', 6144, 4096), ('o_proj', 4096, 4096), ('gate_up_proj', 28672, 4096), ('down_proj', 4096, 14336)]

With ``tp`` ranks, heads and the intermediate size are split; KV heads are split while there are at
least ``tp`` of them and replicated (one per rank) otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """Sizes that determine the linear shapes of one decoder layer."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    qkv_bias: bool = False
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class LinearShape:
    """One linear layer's weight on one rank: ``[n, k]`` (``y = x @ w.T``), with or without bias."""

    name: str
    n: int
    k: int
    bias: bool = False


# Sizes from each model's Hugging Face ``config.json`` (hidden_size, num_attention_heads, num_key_value_heads,
# head_dim (hidden / heads where the config has none), intermediate_size; QKV bias: Qwen2 ``attention_bias``
# is implicit True, the others False). The repository each row comes from is named in its comment.
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        # meta-llama/Llama-3.2-1B, meta-llama/Llama-3.2-3B
        ModelSpec("llama3.2-1b", 2048, 32, 8, 64, 8192, aliases=("llama-3.2-1b",)),
        ModelSpec("llama3.2-3b", 3072, 24, 8, 128, 8192, aliases=("llama-3.2-3b",)),
        # meta-llama/Meta-Llama-3-8B (3.1-8B: same sizes), Meta-Llama-3-70B, Llama-3.1-405B
        ModelSpec("llama3-8b", 4096, 32, 8, 128, 14336, aliases=("llama-3-8b", "llama3.1-8b", "llama-3.1-8b")),
        ModelSpec("llama3-70b", 8192, 64, 8, 128, 28672,
                  aliases=("llama-3-70b", "llama3.1-70b", "llama-3.1-70b", "llama3.3-70b", "llama-3.3-70b")),
        ModelSpec("llama3-405b", 16384, 128, 8, 128, 53248, aliases=("llama-3.1-405b", "llama3.1-405b")),
        # meta-llama/Llama-2-7b-hf
        ModelSpec("llama2-7b", 4096, 32, 32, 128, 11008, aliases=("llama-2-7b",)),
        # mistralai/Mistral-7B-v0.3, mistralai/Mistral-Nemo-Base-2407 (head_dim 128 != hidden / heads),
        # mistralai/Mistral-Small-24B-Base-2501 (Mistral Small 3; 3.1 has the same text sizes)
        ModelSpec("mistral-7b", 4096, 32, 8, 128, 14336, aliases=("mistral-7b-v0.3",)),
        ModelSpec("mistral-nemo-12b", 5120, 32, 8, 128, 14336, aliases=("mistral-nemo",)),
        ModelSpec("mistral-small-24b", 5120, 32, 8, 128, 32768, aliases=("mistral-small", "mistral-small-3.1-24b")),
        # Qwen/Qwen2.5-0.5B ... Qwen/Qwen2.5-72B (Qwen2-7B / Qwen2-72B have the same sizes as 2.5)
        ModelSpec("qwen2.5-0.5b", 896, 14, 2, 64, 4864, qkv_bias=True),
        ModelSpec("qwen2.5-1.5b", 1536, 12, 2, 128, 8960, qkv_bias=True),
        ModelSpec("qwen2.5-3b", 2048, 16, 2, 128, 11008, qkv_bias=True),
        ModelSpec("qwen2-7b", 3584, 28, 4, 128, 18944, qkv_bias=True, aliases=("qwen2.5-7b",)),
        ModelSpec("qwen2.5-14b", 5120, 40, 8, 128, 13824, qkv_bias=True),
        ModelSpec("qwen2.5-32b", 5120, 40, 8, 128, 27648, qkv_bias=True),
        ModelSpec("qwen2-72b", 8192, 64, 8, 128, 29568, qkv_bias=True, aliases=("qwen2.5-72b",)),
        # google/gemma-2-2b, gemma-2-9b, gemma-2-27b (head_dim 256, 256, 128)
        ModelSpec("gemma2-2b", 2304, 8, 4, 256, 9216, aliases=("gemma-2-2b",)),
        ModelSpec("gemma2-9b", 3584, 16, 8, 256, 14336, aliases=("gemma-2-9b",)),
        ModelSpec("gemma2-27b", 4608, 32, 16, 128, 36864, aliases=("gemma-2-27b",)),
        # google/gemma-3-1b-pt, gemma-3-4b-pt, gemma-3-12b-pt, gemma-3-27b-pt (text_config)
        ModelSpec("gemma3-1b", 1152, 4, 1, 256, 6912, aliases=("gemma-3-1b",)),
        ModelSpec("gemma3-4b", 2560, 8, 4, 256, 10240, aliases=("gemma-3-4b",)),
        ModelSpec("gemma3-12b", 3840, 16, 8, 256, 15360, aliases=("gemma-3-12b",)),
        ModelSpec("gemma3-27b", 5376, 32, 16, 128, 21504, aliases=("gemma-3-27b",)),
        # microsoft/Phi-3-mini-4k-instruct (Phi-3.5-mini: same sizes), Phi-3-medium-4k-instruct, phi-4,
        # Phi-4-mini-instruct
        ModelSpec("phi3-mini", 3072, 32, 32, 96, 8192, aliases=("phi-3-mini", "phi3.5-mini", "phi-3.5-mini")),
        ModelSpec("phi3-medium", 5120, 40, 10, 128, 17920, aliases=("phi-3-medium",)),
        ModelSpec("phi4", 5120, 40, 10, 128, 17920, aliases=("phi-4",)),
        ModelSpec("phi4-mini", 3072, 24, 8, 128, 8192, aliases=("phi-4-mini",)),
    )
}


def model_spec(name: str) -> ModelSpec:
    """Look a model up by name or alias (case-insensitive)."""
    key = name.strip().lower()
    for spec in MODELS.values():
        if key == spec.name or key in spec.aliases:
            return spec
    names = ", ".join(sorted(MODELS))
    raise ValueError(f"unknown model {name!r}; known: {names}")


def linear_shapes(model: str | ModelSpec, tp: int = 1) -> list[LinearShape]:
    """The four linear weights of one layer of ``model`` on one of ``tp`` tensor-parallel ranks."""
    spec = model if isinstance(model, ModelSpec) else model_spec(model)
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if spec.heads % tp or spec.intermediate % tp:
        raise ValueError(
            f"{spec.name}: tp={tp} does not divide {spec.heads} attention heads and intermediate size "
            f"{spec.intermediate}"
        )
    if spec.kv_heads >= tp and spec.kv_heads % tp:
        raise ValueError(f"{spec.name}: tp={tp} does not divide {spec.kv_heads} KV heads")
    q = spec.heads // tp
    kv = max(1, spec.kv_heads // tp)
    inter = spec.intermediate // tp
    return [
        LinearShape("qkv_proj", (q + 2 * kv) * spec.head_dim, spec.hidden, spec.qkv_bias),
        LinearShape("o_proj", spec.hidden, q * spec.head_dim),
        LinearShape("gate_up_proj", 2 * inter, spec.hidden),
        LinearShape("down_proj", spec.hidden, inter),
    ]


def hidden_size(model: str | ModelSpec) -> int:
    """The model's hidden size (what RMSNorm + quant runs over)."""
    return (model if isinstance(model, ModelSpec) else model_spec(model)).hidden


__all__ = ["MODELS", "LinearShape", "ModelSpec", "hidden_size", "linear_shapes", "model_spec"]
