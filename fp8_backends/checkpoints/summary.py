"""What loading a quantized checkpoint did: :class:`CheckpointSummary` (torch-free)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ServedLinear:
    """One checkpoint linear served by an :class:`~fp8_backends.layers.Fp8Linear`: its name, ``N x K``, scheme, the
    provider(s) and the siblings it runs fused with (``"q_proj+k_proj+v_proj"``; empty when alone)."""

    name: str
    n: int
    k: int
    scheme: str
    backends: str
    fused_with: str = ""


@dataclass
class CheckpointSummary:
    """The format, what became FP8 layers (``served``), fused groups (``fused``: ``(group, fused N x K)``), what
    fusing changed (``requantized``: groups whose shards were rescaled to their largest weight scale because the
    provider takes one per-tensor scale, ``merged_input_scales``: static groups whose input scales differed, served
    with their maximum as engines do), ``not_fused`` and ``kept`` (module, reason), ``ignored`` (tensors not used),
    ``notes``, bytes and seconds."""

    format: str = ""
    source: str = ""
    served: list[ServedLinear] = field(default_factory=list)
    fused: list[tuple[str, str]] = field(default_factory=list)
    requantized: list[tuple[str, str]] = field(default_factory=list)
    merged_input_scales: list[tuple[str, str]] = field(default_factory=list)
    not_fused: list[tuple[str, str]] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: bytes of the FP8 linears' tensors as stored, and read from the checkpoint in all
    fp8_bytes: int = 0
    checkpoint_bytes: int = 0
    load_seconds: float = 0.0
    #: where ``load_seconds`` went, in order: ``{"read headers": s, "build model": s, "plan": s, "scales": s,
    #: "weights": s, "process": s}`` (filled by :func:`~fp8_backends.checkpoints.load_pretrained`)
    load_phases: dict[str, float] = field(default_factory=dict)
    objective: str = ""

    @property
    def count(self) -> int:
        return len(self.served)

    @property
    def gemms(self) -> int:
        """GEMMs per forward of the served linears: one per fused group, one per other linear."""
        return self.count - sum(len(group.split("+")) - 1 for group, _ in self.fused)

    def schemes(self) -> dict[str, int]:
        """``{scheme: number of linears}``."""
        return dict(Counter(s.scheme for s in self.served))

    def providers(self) -> dict[str, int]:
        """``{provider label(s): number of linears}``."""
        return dict(Counter(s.backends for s in self.served))

    def __str__(self) -> str:
        lines = [f"{self.format} checkpoint ({self.source}): {self.count} linears -> Fp8Linear in {self.gemms} "
                 f"GEMMs, {len(self.kept)} kept in the model dtype; {self.checkpoint_bytes / 2**20:.1f} MiB read"
                 + (f" in {self.load_seconds:.2f} s" if self.load_seconds else "")
                 + (" (" + ", ".join(f"{k} {v:.2f}" for k, v in self.load_phases.items()) + ")"
                    if self.load_phases else "")]
        lines += [f"  {count:4d} x {scheme}" for scheme, count in sorted(self.schemes().items())]
        lines += [f"  {count:4d} on {label}" for label, count in sorted(self.providers().items())]
        sections = (("fused", [f"{g} -> one {shape} GEMM" for g, shape in self.fused]),
                    ("requantized to the largest shard scale", [f"{g}: {why}" for g, why in self.requantized]),
                    ("static input scales merged (their maximum)", [f"{g}: {why}" for g, why in
                                                                    self.merged_input_scales]),
                    ("not fused", [f"{g}: {why}" for g, why in self.not_fused]),
                    ("kept in the model dtype", [f"{m}: {why}" for m, why in self.kept]),
                    ("tensors not used", self.ignored), ("notes", self.notes))
        for title, items in sections:
            if items:
                lines.append(f"  {title} ({len(items)}):")
                lines += [f"    {item}" for item in items[:12]]
                if len(items) > 12:
                    lines.append(f"    ... and {len(items) - 12} more")
        return "\n".join(lines)


__all__ = ["CheckpointSummary", "ServedLinear"]
