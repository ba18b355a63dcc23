"""Linear-layer shapes of common decoder models, for tuning and benchmarks.

Each model is described by its attention and MLP sizes; :func:`linear_shapes` turns that into the
``[N, K]`` weights one tensor-parallel rank holds (QKV and gate/up column-parallel, O and down
row-parallel; fused QKV and fused gate+up as vLLM and SGLang load them)::

    >>> [(s.name, s.n, s.k) for s in linear_shapes("llama3-8b")]
    [('qkv_proj', 6144, 4096), ('o_proj', 4096, 4096), ('gate_up_proj', 28672, 4096), ('down_proj', 4096, 14336)]

With ``tp`` ranks, heads and the intermediate size are split; KV heads are split while there are at
least ``tp`` of them and replicated (one per rank) otherwise.

Models with multi-head latent attention (DeepSeek-V3: :class:`MlaSpec`) have other attention weights: the
replicated low-rank down-projections ``q_a_proj`` and ``kv_a_proj_with_mqa`` (and both fused as
``fused_qkv_a_proj``, as vLLM and SGLang load them), the column-parallel up-projections ``q_b_proj`` and
``kv_b_proj``, and the row-parallel ``o_proj``; their MoE layers' shared expert is a dense MLP of its own
(``shared_experts.gate_up_proj`` / ``shared_experts.down_proj``; the routed experts are grouped GEMMs, not listed).

Each shape records the N extent of each fused part (:attr:`LinearShape.parts`: q / k / v, gate / up), so that a
block-wise FP8 grid can keep only the splits whose parts are whole 128-row weight blocks (:func:`block_aligned`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention sizes (DeepSeek-V2/V3 ``config.json``: ``q_lora_rank``, ``kv_lora_rank``,
    ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelSpec:
    """Sizes that determine the linear shapes of one decoder layer. ``mla``: multi-head latent attention instead of
    q/k/v projections; ``shared_expert_intermediate``: the intermediate size of an MoE layer's shared expert (0: no
    MoE layers); ``block_fp8``: the model ships a block-wise FP8 checkpoint (128x128 weight blocks)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    qkv_bias: bool = False
    aliases: tuple[str, ...] = ()
    mla: MlaSpec | None = None
    shared_expert_intermediate: int = 0
    block_fp8: bool = False


@dataclass(frozen=True)
class LinearShape:
    """One linear layer's weight on one rank: ``[n, k]`` (``y = x @ w.T``), with or without bias. ``parts``: the N
    extents of the weights fused into it (q, k, v or gate, up), ``(n,)`` for one weight. ``split``: how tensor
    parallelism cut the full weight to this rank's: ``"n"`` (column-parallel), ``"k"`` (row-parallel) or ``""`` (not
    cut: TP 1, or a replicated weight)."""

    name: str
    n: int
    k: int
    bias: bool = False
    parts: tuple[int, ...] = ()
    split: str = ""

    def __post_init__(self) -> None:
        if not self.parts:
            object.__setattr__(self, "parts", (self.n,))


def block_misfit(shape: LinearShape, block: tuple[int, int] = (128, 128)) -> str | None:
    """Why a block-wise checkpoint's ``(BN, BK)`` blocks do not map onto ``shape`` (None: they do). Every fused part
    but the last must be whole blocks (a block would hold rows of two weights), and so must the cut dimension of a
    tensor-parallel shard (a block would straddle two ranks). The tensor's own end may be a partial block (DeepSeek-V3's
    ``kv_a_proj_with_mqa``: N = 576 = 4.5 blocks, stored as 5 block rows)."""
    bn, bk = block
    whole = list(shape.parts[:-1]) + (list(shape.parts[-1:]) if shape.split == "n" else [])
    bad = [part for part in whole if part % bn]
    if bad:
        return f"N part {bad[0]} is not whole {bn}-row weight blocks"
    if shape.split == "k" and shape.k % bk:
        return f"K {shape.k} of this rank is not whole {bk}-column weight blocks"
    return None


def block_aligned(shape: LinearShape, block: tuple[int, int] = (128, 128)) -> bool:
    """Whether a block-wise checkpoint's blocks map onto ``shape`` (:func:`block_misfit`)."""
    return block_misfit(shape, block) is None


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
        # Qwen/Qwen3-0.6B ... Qwen/Qwen3-32B (head_dim 128 everywhere, no QKV bias; Qwen/Qwen3-*-FP8 ship 128x128
        # block-wise FP8 checkpoints of the same sizes)
        ModelSpec("qwen3-0.6b", 1024, 16, 8, 128, 3072, block_fp8=True),
        ModelSpec("qwen3-1.7b", 2048, 16, 8, 128, 6144, block_fp8=True),
        ModelSpec("qwen3-4b", 2560, 32, 8, 128, 9728, block_fp8=True),
        ModelSpec("qwen3-8b", 4096, 32, 8, 128, 12288, block_fp8=True),
        ModelSpec("qwen3-14b", 5120, 40, 8, 128, 17408, block_fp8=True),
        ModelSpec("qwen3-32b", 5120, 64, 8, 128, 25600, block_fp8=True),
        # deepseek-ai/DeepSeek-V3 (V3-0324 and R1: same sizes): 128 heads of MLA (q_lora_rank 1536, kv_lora_rank
        # 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128), dense MLP of 18432 in its first three
        # layers, one shared expert of moe_intermediate_size 2048 in the MoE layers; block-wise FP8 as released
        ModelSpec("deepseek-v3", 7168, 128, 128, 192, 18432, mla=MlaSpec(1536, 512, 128, 64, 128),
                  shared_expert_intermediate=2048, block_fp8=True,
                  aliases=("deepseek-v3-0324", "deepseek-r1", "deepseek-v3.1")),
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
    """The linear weights of one layer of ``model`` on one of ``tp`` tensor-parallel ranks: QKV, O, gate/up and down
    (four); for a model with latent attention, its attention projections and shared expert too."""
    spec = model if isinstance(model, ModelSpec) else model_spec(model)
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if spec.mla is not None:
        return _mla_shapes(spec, tp)
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
    col, row = ("n", "k") if tp > 1 else ("", "")
    return [
        LinearShape("qkv_proj", (q + 2 * kv) * spec.head_dim, spec.hidden, spec.qkv_bias,
                    (q * spec.head_dim, kv * spec.head_dim, kv * spec.head_dim), col),
        LinearShape("o_proj", spec.hidden, q * spec.head_dim, split=row),
        LinearShape("gate_up_proj", 2 * inter, spec.hidden, parts=(inter, inter), split=col),
        LinearShape("down_proj", spec.hidden, inter, split=row),
    ]


def _mla_shapes(spec: ModelSpec, tp: int) -> list[LinearShape]:
    """Latent attention (replicated down-projections, split up-projections and O) and the dense and shared-expert
    MLPs, on one of ``tp`` ranks."""
    mla = spec.mla
    assert mla is not None
    splits = {"attention heads": spec.heads, "intermediate size": spec.intermediate}
    if spec.shared_expert_intermediate:
        splits["shared expert intermediate size"] = spec.shared_expert_intermediate
    bad = [f"{v} {what}" for what, v in splits.items() if v % tp]
    if bad:
        raise ValueError(f"{spec.name}: tp={tp} does not divide {' and '.join(bad)}")
    heads, inter, shared = spec.heads // tp, spec.intermediate // tp, spec.shared_expert_intermediate // tp
    kv_a = mla.kv_lora_rank + mla.qk_rope_head_dim
    col, row = ("n", "k") if tp > 1 else ("", "")
    out = [
        LinearShape("fused_qkv_a_proj", mla.q_lora_rank + kv_a, spec.hidden, parts=(mla.q_lora_rank, kv_a)),
        LinearShape("q_a_proj", mla.q_lora_rank, spec.hidden),
        LinearShape("kv_a_proj_with_mqa", kv_a, spec.hidden),
        LinearShape("q_b_proj", heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim), mla.q_lora_rank, split=col),
        LinearShape("kv_b_proj", heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank, split=col),
        LinearShape("o_proj", spec.hidden, heads * mla.v_head_dim, split=row),
        LinearShape("gate_up_proj", 2 * inter, spec.hidden, parts=(inter, inter), split=col),
        LinearShape("down_proj", spec.hidden, inter, split=row),
    ]
    if shared:
        out += [LinearShape("shared_experts.gate_up_proj", 2 * shared, spec.hidden, parts=(shared, shared),
                            split=col),
                LinearShape("shared_experts.down_proj", spec.hidden, shared, split=row)]
    return out


def hidden_size(model: str | ModelSpec) -> int:
    """The model's hidden size (what RMSNorm + quant runs over)."""
    return (model if isinstance(model, ModelSpec) else model_spec(model)).hidden


__all__ = ["MODELS", "LinearShape", "MlaSpec", "ModelSpec", "block_aligned", "block_misfit", "hidden_size",
           "linear_shapes", "model_spec"]
