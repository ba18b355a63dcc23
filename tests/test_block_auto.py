"""``auto`` for block-wise FP8 problems (issue 34 part 5): lockfile and shipped-data keys per mode (group size and
weight block included), no lookup across modes, the block shipped grid's shapes, tuning a block problem on the CPU
into a lockfile that ``auto`` then answers from, the block default ladder (ready providers first, with its reasons),
and merging a block run into shipped data.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fake_provider import FakeMM, install_fake

from fp8_backends import selection_data
from fp8_backends import tune as tune_cli
from fp8_backends.core.errors import DataFileError
from fp8_backends.core.types import GemmProblem
from fp8_backends.registry import defaults, lockfile, nearest, resolution, shipped, shipped_data
from fp8_backends.registry.discovery import discover
from fp8_backends.registry.platform import cpu_platform, simulate_platform
from fp8_backends.tuning import grid, models
from fp8_backends.tuning.plan import plan_from_args
from fp8_backends.tuning.timing import Measurement
from fp8_backends.tuning.workloads import expand_candidates

CPU = cpu_platform()
BLOCK = {"act_scale": "per_token_group", "weight_scale": "block"}
BLOCK_KEY = "gemm/n=7168/k=16384/e4m3fn.e4m3fn->bfloat16/act=per_token_group/g=128/w=block/128x128/bias=0"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", str(tmp_path / "unused.json"))
    monkeypatch.delenv("FP8_BACKENDS_SHIPPED", raising=False)
    monkeypatch.delenv("FP8_BACKENDS_DEFAULTS", raising=False)
    lockfile.reset_state()
    shipped.reset_state()
    resolution.reset_caches()
    yield
    lockfile.reset_state()
    shipped.reset_state()
    resolution.reset_caches()


def key_of(problem: GemmProblem) -> str:
    return lockfile.problem_key("gemm", lockfile.problem_fields("gemm", problem))


def fake_timer(times=None):
    """Runs each candidate once for real (verified against the reference); reports ``times`` (µs, default 100)."""
    def timer(runs):
        out = {}
        for label, run in runs.items():
            run.fn(0)
            out[label] = Measurement.of([(times or {}).get(label, 100.0)] * 3, "fake")
        return out

    return timer


# ------------------------------------------------------------------------------------------ keys
def test_block_problems_key_on_their_mode_group_and_block():
    assert key_of(GemmProblem(n=7168, k=16384, **BLOCK)) == BLOCK_KEY
    g64 = key_of(GemmProblem(n=7168, k=16384, group_size=64, **BLOCK))
    assert g64 == BLOCK_KEY.replace("/g=128/", "/g=64/") != BLOCK_KEY
    fields = lockfile.problem_fields("gemm", GemmProblem(n=7168, k=16384, **BLOCK))
    assert (fields["act_scale"], fields["group_size"], fields["weight_scale"], fields["weight_block"]) == (
        "per_token_group", 128, "block", "128x128")
    assert lockfile.entry_problems({"kind": "gemm", "problem": fields, "m": 4, "choice": {"provider": "x"}}) == []


def test_the_other_modes_keep_their_keys_byte_for_byte():
    assert key_of(GemmProblem(n=4096, k=4096)) == (
        "gemm/n=4096/k=4096/e4m3fn.e4m3fn->bfloat16/act=per_tensor/w=per_tensor/bias=0")
    assert key_of(GemmProblem(n=4096, k=4096, act_scale="per_tensor_static", has_bias=True)) == (
        "gemm/n=4096/k=4096/e4m3fn.e4m3fn->bfloat16/act=per_tensor/w=per_tensor/bias=1")
    assert key_of(GemmProblem(n=4096, k=4096, act_scale="per_token", weight_scale="per_channel")) == (
        "gemm/n=4096/k=4096/e4m3fn.e4m3fn->bfloat16/act=per_token/w=per_channel/bias=0")
    for p in (GemmProblem(n=64, k=64), GemmProblem(n=64, k=64, act_scale="per_token", weight_scale="per_channel")):
        assert not {"group_size", "weight_block"} & set(lockfile.problem_fields("gemm", p))


def test_every_shipped_h200_entry_keeps_its_key():
    """Each entry of the shipped file, rebuilt as a problem, keys exactly as the file names it."""
    doc = shipped_data.load_file(shipped.packaged_dir() / "sm90-nvidia-h200.json")
    entries = shipped_data.the_section(doc)["entries"]
    per_class = {}
    for entry in entries.values():
        cls = (entry["problem"]["act_scale"], entry["problem"]["weight_scale"])
        per_class[cls] = per_class.get(cls, 0) + 1
    # the per-tensor grid (25 models x TP 1/2/4/8 x 7 M buckets), the per-token x per-channel grid (5 models x
    # TP 1/2 x 7 M buckets) and the block grid (DeepSeek-V3 and Qwen3 0.6B-32B x TP 1/2/4/8 x 7 M buckets, TP splits
    # that would cut 128x128 blocks left out)
    assert per_class == {("per_tensor", "per_tensor"): 1820, ("per_token", "per_channel"): 196,
                         ("per_token_group", "block"): 798}
    acts = {"per_tensor": "per_tensor_dynamic", "per_token": "per_token", "per_token_group": "per_token_group"}
    for name, entry in entries.items():
        f = entry["problem"]
        p = GemmProblem(n=f["n"], k=f["k"], input_dtype=f["input_dtype"], weight_dtype=f["weight_dtype"],
                        out_dtype=f["out_dtype"], act_scale=acts[f["act_scale"]], weight_scale=f["weight_scale"],
                        has_bias=f["has_bias"])
        assert lockfile.entry_key("gemm", lockfile.problem_fields("gemm", p), entry["m"]) == name


@pytest.mark.parametrize(("change", "needle"), [
    ({"act_scale": "per_tensor"}, "block weights pair with per_token_group"),  # what the tuner wrote before
    ({"group_size": None}, "'group_size' is not a positive int"),
    ({"weight_block": "128"}, "'weight_block' is not a block"),
    ({"weight_block": [128, 128]}, "'weight_block' is not a block"),
])
def test_bad_block_entries_are_refused(change, needle):
    problem = {**lockfile.problem_fields("gemm", GemmProblem(n=256, k=256, **BLOCK)), **change}
    problem = {k: v for k, v in problem.items() if v is not None}
    bad = lockfile.entry_problems({"kind": "gemm", "problem": problem, "m": 1, "choice": {"provider": "x"}})
    assert any(needle in why for why in bad), bad


def test_block_fields_on_another_mode_are_refused():
    problem = {**lockfile.problem_fields("gemm", GemmProblem(n=256, k=256)), "group_size": 128}
    bad = lockfile.entry_problems({"kind": "gemm", "problem": problem, "m": 1, "choice": {"provider": "x"}})
    assert bad == ["problem field 'group_size' belongs to block-wise entries only"]


# ------------------------------------------------------------------------------------------ no lookup across modes
def _entry(problem: GemmProblem, m: int, provider: str) -> tuple[str, dict]:
    fields = lockfile.problem_fields("gemm", problem)
    rec = {"provider": provider, "distribution": "fp8-backends", "options": {}, "us": 10.0}
    return lockfile.entry_key("gemm", fields, m), {"kind": "gemm", "problem": fields, "m": m, "choice": rec,
                                                   "ranking": [rec]}


def test_lookups_never_cross_modes_or_group_sizes():
    block128 = GemmProblem(n=4096, k=4096, **BLOCK)
    per_tensor = GemmProblem(n=4096, k=4096)
    entries = dict([_entry(block128, 16, "flashinfer_block"), _entry(per_tensor, 16, "triton")])
    index = lockfile.SectionIndex.build({"platform": {}, "entries": entries})
    assert index.skipped == 0
    assert index.lookup("gemm", block128.with_m(4))[1]["choice"]["provider"] == "flashinfer_block"
    assert index.lookup("gemm", per_tensor.with_m(4))[1]["choice"]["provider"] == "triton"
    assert index.lookup("gemm", GemmProblem(n=4096, k=4096, m=4, group_size=64, **BLOCK)) is None
    assert index.lookup("gemm", GemmProblem(n=4096, k=4096, m=4, act_scale="per_token",
                                            weight_scale="per_channel")) is None
    # the nearest-shape models: one per class, the block class apart from the per-tensor one and per group size
    built = nearest.build_models(entries)
    assert len(built) == 2
    assert nearest.class_key(lockfile.problem_fields("gemm", block128)) in built
    g64 = nearest.class_key(lockfile.problem_fields("gemm", GemmProblem(n=64, k=64, group_size=64, **BLOCK)))
    assert g64 not in built


def test_shipped_data_answers_block_problems_from_the_block_class_only():
    sm90 = simulate_platform("9.0")
    data = shipped.data_for(sm90)
    assert data is not None
    # DeepSeek-V3's o_proj is in the block grid: its measured buckets, its measured choice
    problem = GemmProblem(n=7168, k=16384, m=4, device="cuda", **BLOCK)
    assert shipped.exact_buckets("gemm", problem, sm90) == [1, 4, 16, 64, 256, 1024, 4096]
    res = resolution.explain("gemm", problem=problem, platform=sm90)
    assert res.source == "shipped-exact" and "bucket M=4" in res.note, (res.source, res.note)
    # a block shape outside the grid takes the block class's nearest-shapes model, never the per-tensor one
    odd = GemmProblem(n=7040, k=16512, m=4, device="cuda", **BLOCK)
    model = data.model_for(lockfile.problem_fields("gemm", odd))
    assert model is not None and model is not data.model_for(lockfile.problem_fields(
        "gemm", GemmProblem(n=7040, k=16512, m=4, device="cuda")))
    res = resolution.explain("gemm", problem=odd, platform=sm90)
    assert res.source == "shipped-nearest", (res.source, res.note)
    # group size 64 is not measured: no shipped answer, the measured block-wise defaults decide
    g64 = GemmProblem(n=7168, k=16384, m=4, device="cuda", group_size=64, weight_scale="block",
                      act_scale="per_token_group")
    assert shipped.buckets("gemm", g64, sm90) == []
    res = resolution.explain("gemm", problem=g64, platform=sm90)
    assert res.source in ("measured-default", "priority"), (res.source, res.note)
    # and a per-tensor problem still gets the per-tensor data
    res = resolution.explain("gemm", problem=GemmProblem(n=7168, k=16384, m=4, device="cuda"), platform=sm90)
    assert res.source.startswith("shipped-") and "block" not in res.note


def test_shipped_choice_that_would_build_for_minutes_is_passed_over_with_a_note(monkeypatch):
    """The H200 data measured flashinfer_block fastest on DeepSeek-V3's o_proj at M = 64; where its module is not
    built, auto takes the measured choice among the others and says what to build (never a silent 2-minute stall)."""
    from fp8_backends.providers.flashinfer.block import FlashinferBlockBackend
    from fp8_backends.registry.candidates import Candidate

    sm90 = simulate_platform("9.0")
    problem = GemmProblem(n=7168, k=16384, m=64, device="cuda", **BLOCK)
    entries = {e.name: e for e in discover("gemm")}
    serving = [Candidate(entries[name]) for name in ("flashinfer_block", "torch_scaled_mm", "triton", "cutlass")]
    monkeypatch.setattr(FlashinferBlockBackend, "block_reasons", lambda self, problem: [])  # flashinfer "installed"
    pending = {"flashinfer_block": "flashinfer's module is not built (~2 min; build ahead: python -m "
                                   "fp8_backends.build flashinfer_block)"}
    monkeypatch.setattr(shipped, "pending_build", lambda cand, p, pl: pending.get(cand.entry.name))
    name, (entry, _, note) = shipped._answer("gemm", problem, sm90, serving)
    assert name == "shipped-exact" and entry.name != "flashinfer_block"
    assert "ranked #2" in note and "flashinfer_block (measured faster) passed over: flashinfer's module" in note
    pending["cutlass"] = pending["triton"] = pending["torch_scaled_mm"] = "not built"  # nothing ready: next policy
    shipped.reset_state()
    assert shipped._answer("gemm", problem, sm90, serving) is None
    pending.clear()
    shipped.reset_state()
    name, (entry, _, note) = shipped._answer("gemm", problem, sm90, serving)
    assert entry.name == "flashinfer_block" and "passed over" not in note


# ------------------------------------------------------------------------------------------ the block grid
def test_block_models_have_their_published_sizes():
    v3 = {(s.name, s.n, s.k) for s in models.linear_shapes("deepseek-v3")}
    assert {("q_a_proj", 1536, 7168), ("q_b_proj", 24576, 1536), ("kv_a_proj_with_mqa", 576, 7168),
            ("kv_b_proj", 32768, 512), ("o_proj", 7168, 16384), ("gate_up_proj", 36864, 7168),
            ("down_proj", 7168, 18432), ("fused_qkv_a_proj", 2112, 7168)} <= v3
    tp8 = {(s.name, s.n, s.k) for s in models.linear_shapes("deepseek-v3", 8)}
    assert {("q_a_proj", 1536, 7168), ("q_b_proj", 3072, 1536), ("kv_b_proj", 4096, 512), ("o_proj", 7168, 2048),
            ("gate_up_proj", 4608, 7168), ("down_proj", 7168, 2304)} <= tp8
    assert [(s.n, s.k) for s in models.linear_shapes("qwen3-8b")] == [(6144, 4096), (4096, 4096), (24576, 4096),
                                                                        (4096, 12288)]
    assert [(s.n, s.k) for s in models.linear_shapes("qwen3-32b", 2)] == [(5120, 5120), (5120, 4096),
                                                                            (25600, 5120), (5120, 12800)]
    assert not any(s.bias for name in grid.BLOCK_MODELS for s in models.linear_shapes(name))


def test_the_block_grid_keeps_only_shapes_whose_blocks_fit():
    shapes, skipped = grid.model_shapes(grid.BLOCK_MODELS, grid.SHIPPED_TPS, block=grid.BLOCK_WEIGHT,
                                        first=grid.BLOCK_FIRST)
    assert len(shapes) == 114
    # the one split left out: Qwen3-4B at TP 8 (intermediate 9728 / 8 = 1216 = 9.5 blocks per rank)
    assert [line.split(":")[0] for line in skipped] == ["qwen3-4b/tp8/gate_up_proj", "qwen3-4b/tp8/down_proj"]
    by_label = {}
    for name in grid.BLOCK_MODELS:
        for tp in grid.SHIPPED_TPS:
            for layer in models.linear_shapes(name, tp):
                by_label[f"{name}/tp{tp}/{layer.name}"] = layer
    for s in shapes:
        assert s.n % 16 == 0 and s.k % 16 == 0
        for label in s.labels:
            layer = by_label[label]
            assert (layer.n, layer.k) == (s.n, s.k) and models.block_misfit(layer) is None, label
            parts = layer.parts if layer.split == "n" else layer.parts[:-1]
            assert all(part % 128 == 0 for part in parts), label
            assert layer.split != "k" or layer.k % 128 == 0, label
    # the only N not a multiple of 128: DeepSeek-V3's replicated kv_a (576 = 4.5 blocks) and its fused q/kv_a (2112)
    assert {(s.n, s.k) for s in shapes if s.n % 128} == {(576, 7168), (2112, 7168)}
    assert all(s.k % 128 == 0 for s in shapes)
    # the first pairs lead: the plan's first shapes are DeepSeek-V3 TP1/TP8 and Qwen3-8B/32B TP1/TP2
    firsts = {f"{m}/tp{t}/" for m, t in grid.BLOCK_FIRST}
    lead = next(i for i, s in enumerate(shapes) if not any(label[:label.rindex("/") + 1] in firsts
                                                           for label in s.labels))
    assert lead == 32 and all(any(lbl.startswith(tuple(firsts)) for lbl in s.labels) for s in shapes[:lead])


def test_the_block_shipped_grid_plan():
    args = tune_cli.build_parser().parse_args(["--shipped-grid", "--block", "--device", "cpu"])
    plan = plan_from_args(args, "cpu")
    assert len(plan.problems) == 114 and plan.total == 798 and plan.buckets == list(grid.SHIPPED_M_BUCKETS)
    assert all(p.block_scaled and p.group_size == 128 and p.weight_block == (128, 128) for p in plan.problems)
    assert plan.pins == grid.SHIPPED_PINS and plan.grid["models"] == list(grid.BLOCK_MODELS)
    assert plan.grid["scales"] == [["per_token_group", "block"]] and plan.grid["weight_block"] == [128, 128]
    entry_keys = plan.keys()
    assert len(entry_keys) == 798 and all("/g=128/w=block/128x128/" in key for key in entry_keys)
    assert any("qwen3-4b/tp8/down_proj" in note for note in plan.notes)
    small = plan_from_args(tune_cli.build_parser().parse_args(
        ["--block", "--shapes", "256,512", "--group-size", "64", "--device", "cpu"]), "cpu")
    assert [key_of(p) for p in small.problems] == [
        "gemm/n=256/k=512/e4m3fn.e4m3fn->bfloat16/act=per_token_group/g=64/w=block/128x128/bias=0"]
    with pytest.raises(ValueError, match="--block sets the scales"):
        plan_from_args(tune_cli.build_parser().parse_args(["--block", "--scales", "per_token:per_channel"]), "cpu")


# ------------------------------------------------------------------------------------------ tune, then auto
@pytest.mark.parametrize("scales", [["--block"], ["--act-scale", "per_token_group", "--weight-scale", "block"]])
def test_tuning_a_block_problem_on_the_cpu_then_auto_answers_from_it(tmp_path, monkeypatch, capsys, scales):
    lock = tmp_path / "block.lock.json"
    rc = tune_cli.main(["--device", "cpu", "--shapes", "256,256", "--m", "4", *scales, "--lockfile", str(lock),
                        "--quick", "--no-progress"], timer=fake_timer())
    assert rc == 0, capsys.readouterr()
    (section,) = json.loads(lock.read_text())["sections"].values()
    key = "gemm/n=256/k=256/e4m3fn.e4m3fn->bfloat16/act=per_token_group/g=128/w=block/128x128/bias=0/m=4"
    assert list(section["entries"]) == [key]
    entry = section["entries"][key]
    assert entry["problem"]["group_size"] == 128 and entry["problem"]["weight_block"] == "128x128"
    chosen = entry["choice"]["provider"]
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", str(lock))
    lockfile.reset_state()
    resolution.reset_caches()
    res = resolution.explain("gemm", problem=GemmProblem(n=256, k=256, m=3, device="cpu", **BLOCK), platform=CPU)
    assert res.source == "lockfile" and res.backend.name == chosen, (res.source, res.note)
    # a group-64 problem of the same shape is not covered by that entry
    res = resolution.explain("gemm", problem=GemmProblem(n=256, k=256, m=3, device="cpu", group_size=64, **BLOCK),
                             platform=CPU)
    assert res.source != "lockfile"


def test_the_tuners_block_workload_measures_block_scaled_gemms():
    """A block problem is timed with 128x128 weight-block scales and 1x128 activation-group scales (in each
    candidate's declared layout), never as a per-tensor GEMM of the same shape."""
    from fp8_backends.core.types import ScaleLayout, WeightScale
    from fp8_backends.tuning.workloads import CandidateSpec, GemmWorkload

    problem = GemmProblem(n=320, k=384, device="cpu", **BLOCK)
    work = GemmWorkload(problem, "cpu")
    assert tuple(work.w_scale.shape) == (3, 3)  # ceil(320/128) x ceil(384/128)
    xs, scales, expected = work.activations(5)
    assert tuple(scales[0].shape) == (5, 3) and tuple(expected.shape) == (5, 320)
    (entry,) = [e for e in discover("gemm") if e.name == "torch_scaled_mm"]
    backend = entry.cls()
    cand = CandidateSpec(entry, {}, backend, (0, ()), "torch_scaled_mm")
    (prepared,) = work.prepared(cand)
    assert prepared.weight_scale is WeightScale.BLOCK
    laid = work.scales_for(cand, 5)
    from fp8_backends.core.group_scales import is_layout

    assert is_layout(laid[0], backend.capabilities.group_scale_layout)
    assert work.verify(cand, 5)[1] is None  # the block GEMM against the block reference
    tma = SimpleNamespace(backend=SimpleNamespace(capabilities=SimpleNamespace(
        group_scale_layout=ScaleLayout.M_MAJOR_TMA)))
    assert is_layout(work.scales_for(tma, 5)[0], ScaleLayout.M_MAJOR_TMA)


class SlowBuildMM(FakeMM):
    """``fake_mm`` whose first call would build a module for minutes."""

    def first_use_build(self, problem, platform):
        return "its module is not built (about 2 min; build ahead: make it)"


def test_the_tuner_skips_candidates_that_would_build_for_minutes(monkeypatch):
    install_fake(monkeypatch, SlowBuildMM)
    problem = GemmProblem(n=32, k=64, m=1, device="cpu")
    cands, skipped = expand_candidates("gemm", problem, CPU)
    assert not any(c.provider == "fake_mm" for c in cands)
    assert any(label.startswith("fake_mm") and "not built" in why for label, why in skipped)
    cands, _ = expand_candidates("gemm", problem, CPU, allow_builds=True)
    assert any(c.provider == "fake_mm" for c in cands)


# ------------------------------------------------------------------------------------------ the default ladder
def test_block_default_ladder_passes_over_providers_that_cannot_serve_or_would_build(monkeypatch):
    sm90 = simulate_platform("9.0")
    problem = GemmProblem(n=7168, k=16384, m=100, device="cuda", **BLOCK)

    def cand(name):
        return SimpleNamespace(entry=SimpleNamespace(name=name, builtin=True))

    building = {"flashinfer_block": "flashinfer's fp8_blockscale_gemm_sm90 module is not built (~2 min)"}
    monkeypatch.setattr(defaults, "pending_build", lambda c, p, pl: building.get(c.entry.name))
    serving = [cand("torch_scaled_mm"), cand("triton"), cand("flashinfer_block")]
    entry, options, note = defaults.measured_default_policy("gemm", problem, sm90, serving)
    assert entry is serving[0].entry and options == {}
    assert "measured block-wise default for M <= 128" in note and "H200 2026-12-03" in note
    assert "flashinfer_block passed over: flashinfer's fp8_blockscale_gemm_sm90 module is not built" in note
    building.clear()
    entry, _, note = defaults.measured_default_policy("gemm", problem, sm90, serving)
    assert entry is serving[2].entry and "passed over" not in note
    # torch_scaled_mm cannot serve (not SM 9.0's cuBLASLt, a disabled provider): the ladder goes on to triton
    building["flashinfer_block"] = "not built"
    entry, _, note = defaults.measured_default_policy("gemm", problem, sm90, serving[1:])
    assert entry is serving[1].entry and "torch_scaled_mm cannot serve it here" in note
    assert "cutlass cannot serve it here" in note
    # decode: triton's GEMV first
    decode = GemmProblem(n=7168, k=16384, m=1, device="cuda", **BLOCK)
    entry, _, note = defaults.measured_default_policy("gemm", decode, sm90, serving)
    assert entry is serving[1].entry and "M <= 4" in note
    # the per-tensor rule never applies to block problems, nor the block rules to per-tensor ones
    assert defaults.defaults_for("gemm", sm90, GemmProblem(n=64, k=64, m=1)) is None  # shipped data covers it
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", "off")
    assert not defaults.defaults_for("gemm", sm90, GemmProblem(n=64, k=64, m=1)).block
    assert defaults.defaults_for("gemm", sm90, problem).block
    assert defaults.defaults_for("gemm", simulate_platform("10.0"), problem) is None


def test_block_default_buckets_and_switch(monkeypatch):
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", "off")  # the defaults apply where no shipped data covers the GPU
    sm90 = simulate_platform("9.0")
    problem = GemmProblem(n=7168, k=16384, device="cuda", **BLOCK)
    assert defaults.buckets("gemm", sm90, problem) == [4, 16, 128, 129]
    assert defaults.buckets("gemm", simulate_platform("8.9"), problem) == []
    monkeypatch.setenv("FP8_BACKENDS_DEFAULTS", "0")
    assert defaults.buckets("gemm", sm90, problem) == []
    res = resolution.explain("gemm", problem=problem.with_m(4), platform=sm90)
    assert res.source == "priority"


def test_listing_shows_the_block_ladder_and_why(capsys, monkeypatch):
    from fp8_backends import list as listing

    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", "off")  # the defaults apply where no shipped data covers the GPU
    rc = listing.main(["--problem", "16,7168,16384", "--act-scale", "per_token_group", "--weight-scale", "block",
                       "--simulate-sm", "9.0", "--device", "cuda"])
    out = capsys.readouterr().out
    assert rc in (0, None)
    assert "measured block-wise default: M <= 16 -> flashinfer_block, triton, cutlass, torch_scaled_mm" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("auto (") and "act=per_token_group" in x)
    assert "measured-default: measured block-wise default for M <= 16" in line
    assert "flashinfer_block" in line  # passed over here: not installed on this machine, or its module not built


# ------------------------------------------------------------------------------------------ merging into shipped data
def _block_run(tmp_path, shipped_doc) -> dict:
    """A tuner lockfile with provenance for one tiny block problem, relabelled as measured on the shipped GPU."""
    lock = tmp_path / "block.lock.json"
    rc = tune_cli.main(["--device", "cpu", "--shapes", "256,256", "--m", "1,4", "--block", "--lockfile", str(lock),
                        "--quick", "--no-progress", "--provenance"], timer=fake_timer())
    assert rc == 0
    doc = json.loads(lock.read_text())
    prov = shipped_doc["provenance"]
    for where in (doc["provenance"], *(s["platform"] for s in doc["sections"].values())):
        where.update(gpu=prov["gpu"], sm=prov["sm"], driver=prov["driver"], cuda=prov["cuda"])
    return doc


def test_merge_adds_a_block_run_to_the_shipped_data(tmp_path):
    base = shipped_data.load_file(shipped.packaged_dir() / "sm90-nvidia-h200.json")
    before = set(shipped_data.the_section(base)["entries"])
    doc = _block_run(tmp_path, base)
    merged = selection_data.merge(base, doc, command="python -m fp8_backends.selection_data merge a b")
    entries = shipped_data.the_section(merged)["entries"]
    added = [k for k in entries if k not in before]
    assert len(entries) == len(before) + 2 and len(added) == 2
    assert all("/n=256/k=256/" in k and "/act=per_token_group/g=128/w=block/128x128/" in k for k in added)
    record = merged["provenance"]["merged"][-1]
    assert record["entries"] == 2 and record["replaced"] == 0 and record["grid"]["weight_block"] == [128, 128]
    assert shipped_data.check_document(merged) == []
    out = tmp_path / "sm90-nvidia-h200.json"
    out.write_text(shipped_data.dumps_compact(merged))
    data = shipped.load(out)
    problem = GemmProblem(n=256, k=256, m=2, device="cuda", **BLOCK)
    assert data.index.lookup("gemm", problem)[0] == 4
    assert data.index.lookup("gemm", GemmProblem(n=256, k=256, m=2, device="cuda")) is None
    assert data.model_for(lockfile.problem_fields("gemm", problem)) is not None
    # again: the same keys replace the merged ones, keeping the model labels of the entries they replace (what
    # held-out evaluations leave out by) over the bare shape labels of a --shapes run
    assert all(entries[k]["labels"] == ["256x256"] for k in added)
    labelled = json.loads(json.dumps(merged))
    shipped_data.the_section(labelled)["entries"][added[0]]["labels"] = ["tiny/tp1/o_proj"]
    again = selection_data.merge(labelled, doc)
    assert len(shipped_data.the_section(again)["entries"]) == len(before) + 2
    assert again["provenance"]["merged"][-1]["replaced"] == 2
    assert [shipped_data.the_section(again)["entries"][k]["labels"] for k in added] == [["tiny/tp1/o_proj"],
                                                                                          ["256x256"]]
    other = json.loads(json.dumps(doc))
    other["provenance"]["gpu"] = "NVIDIA H100"
    for s in other["sections"].values():
        s["platform"]["gpu"] = "NVIDIA H100"
    with pytest.raises(DataFileError, match="different GPUs"):
        selection_data.merge(base, other)


def test_merge_and_pack_out_take_a_folder_or_a_file_name_in_any_case(tmp_path, capsys):
    """``--out`` names a data file (``.json`` / ``.json.gz``, any case) or a folder that receives the file under its
    own name; a folder is never mistaken for a file nor a file name for a folder."""
    shipped_file = shipped.packaged_dir() / "sm90-nvidia-h200.json"
    doc = _block_run(tmp_path, shipped_data.load_file(shipped_file))
    lock = tmp_path / "run.lock.json"
    lock.write_text(json.dumps(doc))
    folder = tmp_path / "existing"
    folder.mkdir()
    assert selection_data.main(["merge", str(shipped_file), str(lock), "--out", str(folder)]) == 0
    assert [p.name for p in folder.iterdir()] == ["sm90-nvidia-h200.json"]
    upper = tmp_path / "MERGED.JSON"
    assert selection_data.main(["merge", str(shipped_file), str(lock), "--out", str(upper)]) == 0
    assert upper.is_file() and shipped_data.check_document(shipped_data.load_file(upper)) == []
    packed = tmp_path / "PACKED.JSON"
    rc = selection_data.main(["pack", str(lock), "--out", str(packed), "--partial"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert packed.is_file()
