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


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama3-8b", 4096, 32, 8, 128, 14336, aliases=("llama-3-8b", "llama3.1-8b", "llama-3.1-8b")),
        ModelSpec("llama3-70b", 8192, 64, 8, 128, 28672, aliases=("llama-3-70b", "llama3.1-70b", "llama-3.1-70b")),
        ModelSpec("llama3-405b", 16384, 128, 8, 128, 53248, aliases=("llama-3.1-405b", "llama3.1-405b")),
        ModelSpec("llama2-7b", 4096, 32, 32, 128, 11008, aliases=("llama-2-7b",)),
        ModelSpec("mistral-7b", 4096, 32, 8, 128, 14336, aliases=("mistral-7b-v0.3",)),
        ModelSpec("qwen2-7b", 3584, 28, 4, 128, 18944, qkv_bias=True, aliases=("qwen2.5-7b",)),
        ModelSpec("qwen2-72b", 8192, 64, 8, 128, 29568, qkv_bias=True, aliases=("qwen2.5-72b",)),
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
