"""Checkpoint names a model family renames: :func:`model_names` reads them under the model's names.

Some families' checkpoints name their modules otherwise than the ``transformers`` 5 model does: Mixtral's, MiniMax's
and PhiMoE's MoE blocks are ``block_sparse_moe`` where the model has ``mlp``, and their experts' projections ``w1`` /
``w3`` / ``w2`` where the library's per-expert form (:mod:`.experts`) has ``gate_proj`` / ``up_proj`` /
``down_proj``. ``transformers`` records these differences in its checkpoint conversion mapping (per ``model_type``:
renamings, and the converters that merge experts stored one by one into its 3-D parameters), which it applies when
it loads such a checkpoint itself. :func:`model_names` applies the same mapping to the names of an FP8 checkpoint:
the renamings as ``transformers`` applies them, and, from each converter that merges experts (gate and up sources
into ``gate_up_proj``, a down source into ``down_proj``), the per-expert leaf names, so that each expert's tensors
(weight and scales alike) land on the per-expert linears. Nothing is renamed for families without a mapping, or where
this ``transformers`` has none (older versions).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from .shards import ShardIndex, TensorMeta

logger = logging.getLogger("fp8_backends")

#: the per-expert leaves of the library's experts form, by the merged parameter the converter targets
_MERGED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_SOURCE_LEAF = re.compile(r"experts\.\*\.(\w+)\.weight$")


def conversion_rules(model: Any) -> tuple[list[Any], dict[str, str]]:
    """``(renamings, expert_leaves)`` of ``model``'s family from ``transformers``' checkpoint conversion mapping:
    its ``WeightRenaming`` transforms (in order) and the stored per-expert leaf name -> the library's (``{"w1":
    "gate_proj", "w3": "up_proj", "w2": "down_proj"}`` for Mixtral). Empty where there is no mapping."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # a transformers without conversion mappings
        return [], {}
    config = getattr(model, "config", None)
    transforms = []
    for key in (type(model).__name__, getattr(config, "model_type", None)):
        if key:
            transforms = get_checkpoint_conversion_mapping(key) or []
            if transforms:
                break
    renamings = [t for t in transforms if type(t) is WeightRenaming]
    leaves: dict[str, str] = {}
    for t in transforms:
        if not isinstance(t, WeightConverter) or len(t.target_patterns) != 1:
            continue
        ops = [type(op).__name__ for op in getattr(t, "operations", ())]
        merged = _MERGED.get(t.target_patterns[0].rpartition(".")[2])
        if not ops or ops[0] != "MergeModulelist" or merged is None or len(t.source_patterns) != len(merged):
            continue
        for source, ours in zip(t.source_patterns, merged):
            found = _SOURCE_LEAF.search(source.replace("\\", ""))
            if found and found.group(1) != ours:
                leaves[found.group(1)] = ours
    return renamings, leaves


def model_names(model: Any, index: ShardIndex) -> tuple[ShardIndex, list[str]]:
    """``index`` with every tensor under ``model``'s name for it (module docstring; :attr:`TensorMeta.stored` keeps
    the name in the file) and the summary's notes (empty when nothing was renamed)."""
    renamings, leaves = conversion_rules(model)
    if not renamings and not leaves:
        return index, []
    expert_leaf = (re.compile(r"((?:^|\.)experts\.\d+\.)(" + "|".join(map(re.escape, leaves)) + r")(?=\.)")
                   if leaves else None)
    out = ShardIndex(files=list(index.files))
    renamed = 0
    for stored, meta in index.tensors.items():
        name = stored
        for t in renamings:
            name = t.rename_source_key(name)[0]
        if expert_leaf is not None:
            name = expert_leaf.sub(lambda m: m.group(1) + leaves[m.group(2)], name)
        if name != stored:
            renamed += 1
            if name in index.tensors or name in out.tensors:  # two stored names for one model name: keep both
                logger.warning("checkpoint names: %s would be read as %s, which the checkpoint also holds; kept as "
                               "stored", stored, name)
                name = stored
            else:
                meta = TensorMeta(name, meta.dtype, meta.shape, meta.file, stored)
        out.tensors[name] = meta
    if not renamed:
        return index, []
    family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    rules = [f"{t.source_patterns[0].replace(chr(92), '')} -> {t.target_patterns[0].replace(chr(92), '')}"
             for t in renamings] + [f"experts' {a} -> {b}" for a, b in leaves.items()]
    note = (f"{renamed} checkpoint tensor name(s) read under the model's names ({family}'s checkpoint conversion "
            f"mapping in transformers: {', '.join(rules)})")
    logger.info("load_pretrained: %s", note)
    return out, [note]


__all__ = ["conversion_rules", "model_names"]
