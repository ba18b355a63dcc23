"""Shipped selection data: the format and its checks, exact / nearest / no-data lookups, precedence (lockfile >
shipped > measured defaults > priority), determinism, simulated SMs, the listing, packing and the leave-out
evaluation.

The data here is SYNTHETIC (built by :func:`make_doc` from a made-up cost rule, never shipped): small shapes run
fastest on ``fake_mm[variant=a]``, large ones on ``torch_scaled_mm``, so a correct model must answer by shape.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_provider import FAKE_DIST, install_fake

from fp8_backends import selection_data
from fp8_backends.core.errors import DataFileError, Fp8BackendError
from fp8_backends.core.types import GemmProblem
from fp8_backends.list import collect, render
from fp8_backends.registry import lockfile, nearest, resolution, shipped, shipped_data
from fp8_backends.registry.platform import DeviceKind, Platform, simulate_platform
from fp8_backends.selection_data import leave_out_report, pack

TORCH = {"provider": "torch_scaled_mm", "distribution": "fp8-backends", "options": {"fast_accum": "false"}}
FAST_A = {"provider": "fake_mm", "distribution": FAKE_DIST, "options": {"variant": "a"}}
FAST_B = {"provider": "fake_mm", "distribution": FAKE_DIST, "options": {"variant": "b"}}
SM90 = simulate_platform("9.0", name="NVIDIA H200")
BUCKETS = (1, 16, 256)
SMALL = [(2048, 2048), (3072, 2048), (2048, 3072), (4096, 4096)]
LARGE = [(16384, 4096), (28672, 4096), (16384, 8192), (32768, 8192)]


def synthetic_us(n: int, k: int, m: int) -> dict[str, float]:
    """Made-up timings: fake_mm[a] is 20% faster than torch on small weights, 30% slower on large ones."""
    base = 1.0 + n * k / 4e6 + m * n * k / 1e12
    small = n * k <= 2**24
    return {"torch": base, "a": base * (0.8 if small else 1.3), "b": base * 1.1}


def make_entry(n: int, k: int, m: int, *, bias: bool = False, act: str = "per_tensor",
               labels: tuple[str, ...] = ()) -> tuple[str, dict]:
    times = synthetic_us(n, k, m)
    ranking = sorted([{**TORCH, "us": times["torch"]}, {**FAST_A, "us": times["a"]}, {**FAST_B, "us": times["b"]}],
                     key=lambda r: r["us"])
    fields = {"n": n, "k": k, "input_dtype": "e4m3fn", "weight_dtype": "e4m3fn", "out_dtype": "bfloat16",
              "act_scale": act, "weight_scale": "per_tensor", "has_bias": bias}
    entry = {"kind": "gemm", "problem": fields, "m": m, "choice": dict(ranking[0]), "ranking": ranking,
             "tie_break": False, "tie_margin": 0.02, "rejected": [], "method": "synthetic"}
    if labels:
        entry["labels"] = list(labels)
    return lockfile.entry_key("gemm", fields, m), entry


def make_doc(shapes=SMALL + LARGE, buckets=BUCKETS, *, gpu="NVIDIA H200", sm="9.0", labels=None) -> dict:
    platform = {"device": "cuda", "gpu": gpu, "sm": sm, "driver": "13.0", "cuda": "13.0",
                "libraries": {"fp8-backends": "0.1.0", "torch": "2.11.0"}}
    entries = dict(make_entry(n, k, m, labels=(labels or {}).get((n, k), ())) for n, k in shapes for m in buckets)
    prov = {"format": shipped_data.FORMAT, "gpu": gpu, "sm": sm, "driver": "13.0", "cuda": "13.0",
            "libraries": dict(platform["libraries"]), "date": "2026-12-01T00:00:00Z",
            "command": "python -m fp8_backends.tune --shipped-grid --lockfile sm90.json", "grid": {}}
    return {"schema": lockfile.SCHEMA, "updated": None, "provenance": prov,
            "sections": {lockfile.key_digest(platform): {"platform": platform, "entries": entries}}}


def write_doc(folder: Path, doc: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    prov = doc["provenance"]
    path = folder / shipped_data.file_name(prov["sm"], prov["gpu"])
    path.write_text(shipped_data.dumps_compact(doc), encoding="utf-8")
    return path


pytestmark = pytest.mark.usefixtures("fresh_selection_state")  # tests/conftest.py


@pytest.fixture
def with_fake(monkeypatch):
    return install_fake(monkeypatch)


@pytest.fixture
def data_dir(tmp_path, monkeypatch, with_fake) -> Path:
    folder = tmp_path / "shipped"
    write_doc(folder, make_doc())
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", str(folder))
    return folder


def gemm(n, k, m=None, **kw) -> GemmProblem:
    return GemmProblem(n=n, k=k, m=m, **kw)


def auto(problem, platform=SM90) -> resolution.Resolution:
    res = resolution.explain("gemm", "auto", problem=problem, platform=platform)
    assert res.error is None, res.error
    return res


# ------------------------------------------------------------------------------------------ format
def test_file_names():
    assert shipped_data.file_name("9.0", "NVIDIA H200") == "sm90-nvidia-h200.json"
    assert shipped_data.file_name((10, 0), "NVIDIA B200") == "sm100-nvidia-b200.json"
    assert shipped_data.parse_file_name("sm90-nvidia-h200.json") == ("90", "nvidia-h200")
    assert shipped_data.parse_file_name("sm90-nvidia-h200.json.gz") == ("90", "nvidia-h200")
    assert shipped_data.parse_file_name("selection.lock.json") is None


def test_a_good_document_passes_and_round_trips(tmp_path):
    doc = make_doc()
    assert shipped_data.check_document(doc) == []
    text = shipped_data.dumps_compact(doc)
    assert json.loads(text) == doc and shipped_data.dumps_compact(json.loads(text)) == text  # deterministic
    assert text.count("\n") >= len(SMALL + LARGE) * len(BUCKETS)  # one entry per line
    path = write_doc(tmp_path, doc)
    assert shipped_data.load_file(path) == doc
    gz = tmp_path / "sm90-nvidia-h200.json.gz"
    gz.write_bytes(gzip.compress(text.encode()))
    assert shipped_data.load_file(gz) == doc


def _damaged(kind: str) -> dict:
    doc = make_doc()
    section = shipped_data.the_section(doc)
    first = sorted(section["entries"])[0]
    if kind == "no-provenance":
        del doc["provenance"]
    elif kind == "format":
        doc["provenance"]["format"] = "fp8_backends.shipped/99"
    elif kind == "no-driver":
        doc["provenance"]["driver"] = ""
    elif kind == "no-torch-version":
        del doc["provenance"]["libraries"]["torch"]
    elif kind == "schema":
        doc["schema"] = "fp8_backends.selection/0"
    elif kind == "two-sections":
        doc["sections"]["other"] = {"platform": {}, "entries": {}}
    elif kind == "sm-mismatch":
        doc["provenance"]["sm"] = "10.0"
    elif kind == "key-mismatch":
        section["entries"]["gemm/n=1/k=1/wrong"] = section["entries"].pop(first)
    elif kind == "no-us":
        del section["entries"][first]["ranking"][0]["us"]
    elif kind == "inf-us":  # Python's json reads Infinity: no time a ranking can compare
        section["entries"][first]["ranking"][0]["us"] = float("inf")
    elif kind == "bad-labels":
        section["entries"][first]["labels"] = 5
    elif kind == "bad-entry":
        section["entries"][first]["m"] = "sixteen"
    elif kind == "bad-ranking-options":  # refused here: the index of a checked document trusts its ranking items
        section["entries"][first]["ranking"][1]["options"] = {"config": ["a", "list"]}
    return doc


@pytest.mark.parametrize(("kind", "needle"), [
    ("no-provenance", "'provenance' is missing"),
    ("format", "provenance format is 'fp8_backends.shipped/99'"),
    ("no-driver", "provenance.driver is missing"),
    ("no-torch-version", "provenance.libraries lacks torch"),
    ("schema", "schema is 'fp8_backends.selection/0'"),
    ("two-sections", "exactly one platform section, found 2"),
    ("sm-mismatch", "provenance.sm '10.0' differs from the section's platform '9.0'"),
    ("key-mismatch", "key does not match its problem and m"),
    ("no-us", "has no finite measured µs > 0"),
    ("inf-us", "has no finite measured µs > 0"),
    ("bad-labels", "'labels' is not a list of strings"),
    ("bad-entry", "no integer 'm'"),
    ("bad-ranking-options", "ranking #2: 'options' is not an object of plain values"),
])
def test_bad_documents_are_rejected_with_clear_errors(tmp_path, kind, needle):
    doc = _damaged(kind)
    problems = shipped_data.check_document(doc)
    assert any(needle in p for p in problems), problems
    path = tmp_path / "sm90-x.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(DataFileError) as info:
        shipped_data.load_file(path)
    assert isinstance(info.value, Fp8BackendError) and isinstance(info.value, ValueError)
    assert str(path) in str(info.value) and any(needle in p for p in info.value.problems)


def test_unreadable_files_are_rejected(tmp_path):
    bad = tmp_path / "sm90-a.json"
    bad.write_text('{"schema": ')
    with pytest.raises(DataFileError, match="not valid JSON"):
        shipped_data.load_file(bad)
    with pytest.raises(DataFileError, match="no such file"):
        shipped_data.load_file(tmp_path / "missing.json")
    gz = tmp_path / "sm90-b.json.gz"
    gz.write_bytes(b"not gzip")
    with pytest.raises(DataFileError, match="unreadable"):
        shipped_data.load_file(gz)


# ------------------------------------------------------------------------------------------ the model
def _shape(n, k, m, ratios):
    ratios = {nearest.cand_key(r): v for r, v in ratios}
    return nearest.MeasuredShape(n, k, m, f"{n}x{k}", (), 10.0, ratios, {})


def test_nearest_weights_distance_and_penalizes_missing_candidates():
    close = _shape(4096, 4096, 1, [(TORCH, 1.2), (FAST_A, 1.0)])
    far = [_shape(32768, 8192, 1, [(TORCH, 1.0), (FAST_A, 1.5)]), _shape(16384, 16384, 1, [(TORCH, 1.0)])]
    model = nearest.NearestModel([close, *far], neighbours=3)
    pred = model.predict(4200, 4096, 1)
    assert pred.neighbours[0].shape is close and pred.neighbours[0].weight > 0.9
    assert pred.scores[0][0] == nearest.cand_key(FAST_A)
    # far away from the small shape the large shapes decide; the shape lacking fake_mm counts it as 2x slower
    pred = model.predict(24000, 12000, 1)
    assert pred.scores[0][0] == nearest.cand_key(TORCH)
    scores = dict(pred.scores)
    assert scores[nearest.cand_key(FAST_A)] > 1.3
    assert model.predict(4096, 4096, 16) is None  # no data at that bucket
    # the same data in any order gives the same prediction
    shuffled = nearest.NearestModel(random.Random(3).sample([close, *far], 3), neighbours=3)
    assert shuffled.predict(24000, 12000, 1) == pred


def test_choose_breaks_near_ties_by_static_rank_and_skips_what_cannot_serve():
    a, b, c = nearest.cand_key(FAST_A), nearest.cand_key(TORCH), nearest.cand_key(FAST_B)
    scores = [(a, 1.00), (b, 1.015), (c, 1.10)]
    ranks = {a: (2,), b: (0,), c: (1,)}
    assert nearest.choose(scores, ranks.get, 0.02) == (b, 1.015)  # within 2%: static priority
    assert nearest.choose(scores, ranks.get, 0.0) == (a, 1.0)
    assert nearest.choose(scores, lambda ck: None if ck in (a, b) else ranks[ck], 0.02) == (c, 1.10)
    assert nearest.choose(scores, lambda ck: None, 0.02) is None


# ------------------------------------------------------------------------------------------ the policy
def test_exact_hit(data_dir):
    res = auto(gemm(28672, 4096, m=16))
    assert res.source == "shipped-exact" and res.backend.label == "torch_scaled_mm[fast_accum=false]"
    assert res.note == "sm90-nvidia-h200.json (NVIDIA H200, 2026-12-01), bucket M=16"
    res = auto(gemm(4096, 4096, m=3))  # M=3 -> bucket 16; a small shape: the fake's variant a was fastest
    assert res.source == "shipped-exact" and res.backend.name == "fake_mm" and res.backend.config == {"variant": "a"}
    assert auto(gemm(4096, 4096, m=100000)).note.endswith("bucket M=256")  # beyond the largest bucket: clamp


def test_nearest_answers_by_shape_not_by_a_global_rule(data_dir):
    small, large = auto(gemm(2560, 2560, m=1)), auto(gemm(24576, 6144, m=1))
    assert (small.source, large.source) == ("shipped-nearest", "shipped-nearest")
    assert small.backend.label == "fake_mm[variant=a]" and large.backend.label == "torch_scaled_mm[fast_accum=false]"
    assert "bucket M=1, nearest: 2048x3072 (w 0.32), 3072x2048 (w 0.32), 2048x2048 (w 0.28)" in small.note
    assert "predicted 1.000x the fastest" in small.note
    neighbours = large.note.split("nearest: ")[1]
    assert {"28672x4096", "16384x8192"} <= {part.split(" ")[0] for part in neighbours.split(", ")}


def test_no_data_for_the_gpu_defers_to_priority(data_dir):
    for sm in ("10.0", "8.9"):
        res = auto(gemm(4096, 4096, m=16), simulate_platform(sm))
        assert res.source == "priority" and res.backend.name == "torch_scaled_mm", sm
    assert shipped.describe(simulate_platform("10.0"))["status"] == "none"
    assert auto(gemm(4096, 4096, m=None)).source == "priority"  # M unknown


def test_a_class_without_data_defers_to_the_measured_default(data_dir):
    """Per-token activations: the data file holds nothing of that class, so the global M rule still applies to it (on
    the H200, static priority would run cuBLAS at one token, where its vector-scaled kernels measured 1.9-2.0x the
    fastest candidate: ``bench/results/tune/2026-12-03-h200-per-token/``); above the rule's M, static priority. A
    class the data holds never sees the rule."""
    pytest.importorskip("triton")
    assert shipped.covers(SM90)
    res = auto(gemm(4096, 4096, m=1, act_scale="per_token"))
    assert (res.source, res.backend.name) == ("measured-default", "triton")
    assert auto(gemm(4096, 4096, m=64, act_scale="per_token")).source == "priority"
    assert auto(gemm(4096, 4096, m=1)).source.startswith("shipped")


def test_measured_defaults_still_serve_gpus_without_data(monkeypatch, with_fake):
    pytest.importorskip("triton")
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", "off")
    res = auto(gemm(4096, 4096, m=1))
    assert res.source == "measured-default" and res.backend.name == "triton"
    assert shipped.describe(SM90)["status"] == "disabled"


def test_lockfile_beats_shipped_beats_priority(data_dir, tmp_path, monkeypatch):
    gpu = Platform(kind=DeviceKind.CUDA, name="NVIDIA H200", sm=(9, 0), device_index=0, driver_version="13.0",
                   cuda_runtime_version="13.0", library_versions=SM90.library_versions)
    problem = gemm(28672, 4096, m=16)
    assert auto(problem, gpu).source == "shipped-exact"  # a real (not simulated) GPU reads shipped data too
    lock = tmp_path / "user.lock.json"
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", str(lock))
    key, entry = make_entry(28672, 4096, 16)
    entry["choice"] = dict(FAST_B)  # the user's own measurement says otherwise
    lockfile.write_entries(lock, lockfile.current_key(gpu)[0], {key: entry})
    lockfile.reset_state()
    res = auto(problem, gpu)
    assert res.source == "lockfile" and res.backend.label == "fake_mm[variant=b]"
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", "off")
    assert auto(problem, gpu).source == "shipped-exact"
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", "off")
    monkeypatch.setenv("FP8_BACKENDS_DEFAULTS", "0")  # no data for this GPU now: the measured defaults would decide
    assert auto(problem, gpu).source == "priority"


def test_the_next_measured_candidate_serves_when_the_choice_cannot(data_dir, monkeypatch):
    monkeypatch.setenv("FP8_BACKENDS_DISABLED", "fake_mm")
    res = auto(gemm(4096, 4096, m=16))  # exact: fake a, then torch
    assert res.source == "shipped-exact" and res.backend.name == "torch_scaled_mm" and "ranked #2" in res.note
    res = auto(gemm(2560, 2560, m=1))  # nearest: the best candidate that can serve here
    assert res.source == "shipped-nearest" and res.backend.name == "torch_scaled_mm"


def test_answers_are_deterministic(data_dir, tmp_path, monkeypatch):
    problems = [gemm(n, k, m=m) for n, k in [(2560, 2560), (24576, 6144), (4096, 4096), (8192, 8192)]
                for m in (1, 5, 300)]
    first = [(r.source, r.backend.label, r.note) for r in map(auto, problems)]
    assert [(r.source, r.backend.label, r.note) for r in map(auto, problems)] == first  # memoized path
    # the same data with its entries in another order, re-read from disk
    doc = make_doc()
    section = shipped_data.the_section(doc)
    items = list(section["entries"].items())
    random.Random(7).shuffle(items)
    section["entries"] = dict(items)
    other = tmp_path / "shuffled"
    other.mkdir()
    (other / "sm90-nvidia-h200.json").write_text(json.dumps(doc))
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", str(other))
    shipped.reset_state()
    resolution.reset_caches()
    assert [(r.source, r.backend.label, r.note) for r in map(auto, problems)] == first


def test_a_bad_data_file_warns_once_and_is_ignored(tmp_path, monkeypatch, with_fake, caplog):
    """An unusable file is as no file: the measured defaults decide (``triton`` up to M = 16 on SM 9.0 where it
    serves here), then static priority."""
    folder = tmp_path / "bad"
    folder.mkdir()
    doc = _damaged("no-provenance")
    (folder / "sm90-nvidia-h200.json").write_text(json.dumps(doc))
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", str(folder))
    with caplog.at_level(logging.WARNING, logger="fp8_backends"):
        small = "measured-default" if importlib.util.find_spec("triton") is not None else "priority"
        for m in (1, 16, 16, 64):
            assert auto(gemm(4096, 4096, m=m)).source == (small if m <= 16 else "priority")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "is unusable and ignored" in warnings[0] and "provenance" in warnings[0]
    assert shipped.describe(SM90)["status"] == "invalid"


def test_a_data_file_named_by_the_environment_applies_only_to_its_sm(tmp_path, monkeypatch, with_fake):
    path = write_doc(tmp_path / "one", make_doc())
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", str(path))
    assert auto(gemm(4096, 4096, m=16)).source == "shipped-exact"
    assert auto(gemm(4096, 4096, m=16), simulate_platform("10.0")).source == "priority"
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", str(tmp_path / "nowhere"))
    monkeypatch.setenv("FP8_BACKENDS_DEFAULTS", "0")
    assert auto(gemm(4096, 4096, m=16)).source == "priority"


def test_gpu_slug_prefers_the_matching_file(tmp_path, monkeypatch, with_fake):
    folder = tmp_path / "two"
    write_doc(folder, make_doc(gpu="NVIDIA H100 80GB HBM3"))
    write_doc(folder, make_doc())
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", str(folder))
    assert shipped.locate(SM90)[0].name == "sm90-nvidia-h200.json"
    h100 = simulate_platform("9.0", name="NVIDIA H100 80GB HBM3")
    assert shipped.locate(h100)[0].name == "sm90-nvidia-h100-80gb-hbm3.json"
    assert shipped.locate(simulate_platform("9.0"))[0].name == "sm90-nvidia-h100-80gb-hbm3.json"  # first by name


def test_bucket_table_for_layers_follows_the_shipped_data(data_dir):
    table = resolution.resolve_gemm_buckets("auto", problem=gemm(2560, 2560), platform=SM90)
    assert [b for b, _ in table] == list(BUCKETS)
    assert {be.label for _, be in table} == {"fake_mm[variant=a]"}
    table = resolution.resolve_gemm_buckets("auto", problem=gemm(28672, 4096), platform=SM90)
    assert {be.label for _, be in table} == {"torch_scaled_mm[fast_accum=false]"}
    assert resolution.resolve_gemm_buckets("torch", problem=gemm(2560, 2560), platform=SM90) == []


def test_listing_names_the_source_and_the_data(data_dir):
    before = collect(SM90)
    assert before["shipped_data"]["status"] == "found"  # not parsed by a plain listing
    data = collect(SM90, gemm_problem=gemm(2560, 2560, m=1))
    res = data["resolution"]["gemm"]
    assert res["source"] == "shipped-nearest" and "2048x2048 (w 0.28)" in res["note"] and res["chosen"] == "fake_mm"
    info = data["shipped_data"]
    assert info["status"] == "ok" and info["entries"] == len(SMALL + LARGE) * len(BUCKETS)
    assert info["provenance"]["gpu"] == "NVIDIA H200" and info["provenance"]["command"].startswith("python -m")
    text = render(data)
    assert "auto (shipped-nearest: sm90-nvidia-h200.json" in text
    assert f"shipped selection data: {data_dir / 'sm90-nvidia-h200.json'} (ok:" in text


def test_the_policy_modules_and_listing_stay_light(tmp_path):
    code = ("import sys; import fp8_backends.registry.shipped as s, fp8_backends.registry.nearest; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(s.POLICY_EXACT)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------------------------------ pack + leave-out
def _tuner_lockfile(doc: dict, grid_problems: int | None = None) -> dict:
    """A document as the tuner writes it: extra per-entry fields, provenance with the grid size."""
    lock = json.loads(json.dumps(doc))
    for entry in shipped_data.the_section(lock)["entries"].values():
        entry["skipped"] = [{"label": "x", "reason": "y"}]
        entry["tuned_at"] = "2026-12-01T00:00:00Z"
    lock["provenance"]["grid"] = {"problems": grid_problems or len(shipped_data.the_section(lock)["entries"])}
    return lock


def test_pack_strips_checks_and_holds_out_models():
    labels = {(n, k): (f"small-{n}/tp1/qkv_proj",) for n, k in SMALL}
    labels.update({(n, k): ("big/tp1/o_proj",) for n, k in LARGE})
    labels[(4096, 4096)] = ("small-4096/tp1/qkv_proj", "big/tp8/o_proj")  # a shape two models share
    lock = _tuner_lockfile(make_doc(labels=labels))
    packed = pack(lock, command="python -m fp8_backends.selection_data pack x")
    assert shipped_data.check_document(packed) == []
    entries = shipped_data.the_section(packed)["entries"]
    assert all("skipped" not in e and "tuned_at" not in e for e in entries.values())
    assert packed["provenance"]["packed"]["command"] == "python -m fp8_backends.selection_data pack x"
    with pytest.raises(DataFileError, match="only 24 are measured"):
        pack(_tuner_lockfile(make_doc(), grid_problems=30))
    assert pack(_tuner_lockfile(make_doc(), grid_problems=30), partial=True)
    del lock["provenance"]
    with pytest.raises(DataFileError, match="provenance"):
        pack(lock)


def test_redecide_applies_the_tuners_rule_to_the_recorded_ranking(monkeypatch):
    # torch 1% slower than fake_mm[a]: a near-tie within 2% that static priority gives torch, not within 0.5%
    key, entry = make_entry(2048, 2048, 1)
    entry["ranking"] = [{**FAST_A, "us": 10.0}, {**TORCH, "us": 10.1}, {**FAST_B, "us": 12.0}]
    entry.update(choice=dict(entry["ranking"][0]), fastest="fake_mm[variant=a]", tie_break=False)
    bare = {"kind": "gemm", "m": 1, "choice": {**TORCH, "us": 3.0}}  # no ranking: kept as it is
    install_fake(monkeypatch)
    two = selection_data.redecide({key: entry, "bare": bare}, 0.02)
    half = selection_data.redecide({key: entry}, 0.005)[key]
    assert two["bare"] == bare and entry["choice"]["provider"] == "fake_mm"  # the input is not modified
    assert two[key]["choice"] == entry["ranking"][1] and two[key]["tie_break"] is True
    assert two[key]["tie_margin"] == 0.02 and two[key]["fastest"] == two[key]["runner_up"] == "fake_mm[variant=a]"
    assert half["choice"] == entry["ranking"][0] and half["tie_break"] is False
    assert half["runner_up"] == "torch_scaled_mm[fast_accum=false]"
    for bad in (-0.01, float("nan"), "2%"):
        with pytest.raises(DataFileError, match="tie margin"):
            selection_data.redecide({key: entry}, bad)


def test_pack_tie_margin_redecides_and_keeps_the_earlier_packing():
    lock = _tuner_lockfile(make_doc())
    first = pack(lock, command="pack lock")
    again = pack(first, tie_margin=0.0, partial=True, command="pack first --tie-margin 0")
    packed = again["provenance"]["packed"]
    assert packed["tie_margin"] == 0.0 and packed["previous"]["command"] == "pack lock"
    assert shipped_data.check_document(again) == []
    for entry in shipped_data.the_section(again)["entries"].values():
        assert entry["choice"] == min(entry["ranking"], key=lambda r: r["us"])


@pytest.mark.parametrize("damage", ["provider-list", "options-list", "labels-int"])
def test_pack_refuses_malformed_entries_before_reading_them(damage):
    """A tuner lockfile with a malformed ranking or labels: one DataFileError naming the entry, before re-deciding
    or excluding by label reads them (they raised TypeError / AttributeError there)."""
    lock = _tuner_lockfile(make_doc())
    entry = next(iter(shipped_data.the_section(lock)["entries"].values()))
    if damage == "provider-list":
        entry["ranking"][0]["provider"] = ["triton"]
    elif damage == "options-list":
        entry["ranking"][0]["options"] = ["config"]
    else:
        entry["labels"] = 5
    with pytest.raises(DataFileError, match="entry gemm/"):
        pack(lock, tie_margin=0.0, partial=True)
    with pytest.raises(DataFileError, match="entry gemm/"):
        pack(lock, partial=True, exclude=("llama3-8b",))


def test_the_shipped_h200_data_records_the_measured_fastest():
    # decided at the tuner's default margin (0): every choice is the fastest of its recorded ranking, but where
    # flashinfer_bmm measured fastest by less than its win margin (2%): there the fastest of the others
    from fp8_backends.providers.flashinfer.gemm import FlashinferBmmBackend

    margin = FlashinferBmmBackend.win_margin
    doc = shipped_data.load_file(shipped.packaged_dir() / "sm90-nvidia-h200.json")
    assert lockfile.DEFAULT_TIE_MARGIN == 0.0 and doc["provenance"]["packed"]["tie_margin"] == 0.0
    stepped_aside = 0
    for entry in shipped_data.the_section(doc)["entries"].values():
        others = [r["us"] for r in entry["ranking"] if r["provider"] != "flashinfer_bmm"]
        bmm = [r["us"] for r in entry["ranking"] if r["provider"] == "flashinfer_bmm"]
        fastest = min(others + bmm)
        if entry["choice"]["provider"] == "flashinfer_bmm":
            assert entry["choice"]["us"] == fastest and fastest * (1 + margin) < min(others)
        elif bmm and min(bmm) < min(others):
            assert entry["choice"]["us"] == min(others) and min(bmm) * (1 + margin) >= min(others)
            stepped_aside += 1
        else:
            assert entry["choice"]["us"] == fastest
    assert stepped_aside == 377  # of 388 flashinfer_bmm wins at margin 0; 11 won by more than 2%


def test_pack_exclude_keeps_shapes_other_models_share(monkeypatch):
    from fp8_backends import selection_data

    labels = {(2048, 2048): ("llama3-8b/tp1/o_proj",), (4096, 4096): ("llama3-8b/tp1/o_proj", "mistral-7b/tp1/x"),
              (28672, 4096): ("qwen2-7b/tp1/gate_up_proj",)}
    entries = dict(make_entry(n, k, 1, labels=lab) for (n, k), lab in labels.items())
    kept = selection_data.exclude_models(entries, ["llama3-8b"])
    assert {e["problem"]["n"] for e in kept.values()} == {4096, 28672}


def test_leave_out_evaluation_prefers_the_model_to_a_global_rule():
    labels = {shape: (f"model{i}/tp1/x",) for i, shape in enumerate(SMALL + LARGE)}
    report = leave_out_report(make_doc(labels=labels), "model", priorities={"torch_scaled_mm": 10, "fake_mm": 1})
    (cls,) = report["classes"]
    for row in cls["buckets"]:
        assert row["points"] == len(SMALL + LARGE) and row["unmeasured_picks"] == 0
        assert row["nearest"]["min"] == pytest.approx(1.0)  # every held-out shape: its fastest candidate
        assert row["global"]["min"] < 0.8 and row["priority"]["min"] == pytest.approx(0.8)


def test_loo_cli_compares_neighbour_counts(tmp_path, capsys):
    from fp8_backends import selection_data

    labels = {shape: (f"model{i}/tp1/x",) for i, shape in enumerate(SMALL + LARGE)}
    path = write_doc(tmp_path, make_doc(labels=labels))
    out_json = tmp_path / "loo.json"
    assert selection_data.main(["loo", str(path), "--neighbours", "1", "4", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "Leave-one-model-out, 1 neighbours" in text and "| neighbours | points |" in text
    reports = json.loads(out_json.read_text())
    assert [r["neighbours"] for r in reports] == [1, 4]
    assert all(r["overall"]["points"] == len(SMALL + LARGE) * len(BUCKETS) for r in reports)
    assert selection_data.main(["loo", str(path), "--group", "shape"]) == 0


def test_the_data_can_say_how_many_neighbours_vote(tmp_path, monkeypatch, with_fake):
    doc = make_doc()
    doc["provenance"]["model"] = {"neighbours": 1}
    folder = tmp_path / "k1"
    write_doc(folder, doc)
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", str(folder))
    res = auto(gemm(2560, 2560, m=1))
    assert res.source == "shipped-nearest" and res.note.count("(w ") == 1 and "(w 1.00)" in res.note
    doc["provenance"]["model"] = {"neighbours": 0}
    assert "provenance.model.neighbours must be an integer >= 1" in shipped_data.check_document(doc)
    packed = pack(_tuner_lockfile(make_doc()), neighbours=2)
    assert packed["provenance"]["model"] == {"neighbours": 2}


# ------------------------------------------------------------------------------------------ lookup cost
def test_lookup_time_per_layer_at_load(tmp_path, monkeypatch, with_fake, capsys):
    """A realistic data file (260 shapes x 7 buckets), and the time ``resolve_gemm_buckets`` (what ``Fp8Linear``
    calls once per layer at load) takes per layer, for exact and for nearest shapes. Bounds are generous: the
    number printed is what the README reports."""
    rng = random.Random(0)
    shapes = sorted({(16 * rng.randint(32, 2400), 16 * rng.randint(32, 2400)) for _ in range(260)})
    buckets = (1, 4, 16, 64, 256, 1024, 4096)
    folder = tmp_path / "big"
    path = write_doc(folder, make_doc(shapes, buckets))
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", str(folder))
    t0 = time.perf_counter()
    assert shipped.data_for(SM90) is not None
    load_s = time.perf_counter() - t0
    timings = {}
    for kind, probe in (("exact", shapes), ("nearest", [(n + 16, k + 32) for n, k in shapes])):
        layers = probe[:40]
        t0 = time.perf_counter()
        for n, k in layers:
            table = resolution.resolve_gemm_buckets("auto", problem=gemm(n, k), platform=SM90)
            assert [b for b, _ in table] == list(buckets)
        timings[kind] = (time.perf_counter() - t0) / len(layers)
    source = auto(gemm(shapes[0][0] + 16, shapes[0][1] + 32, m=1)).source
    assert source == "shipped-nearest"
    with capsys.disabled():
        print(f"\nshipped data {path.stat().st_size / 1e6:.2f} MB, {len(shapes) * len(buckets)} entries: load "
              f"{1e3 * load_s:.0f} ms; per layer ({len(buckets)} buckets): exact {1e3 * timings['exact']:.2f} ms, "
              f"nearest {1e3 * timings['nearest']:.2f} ms")
    assert load_s < 5.0 and timings["exact"] < 0.25 and timings["nearest"] < 0.25


def test_every_packaged_data_file_is_valid_and_named_after_its_provenance():
    folder = shipped.packaged_dir()
    assert folder.name == "selection" and folder.parent.name == "data" and (folder / "README.md").is_file()
    for path in sorted(folder.glob("sm*.json*")):
        doc = shipped_data.load_file(path)  # raises DataFileError listing every problem
        prov = doc["provenance"]
        assert path.name.split(".json")[0] == shipped_data.file_name(prov["sm"], prov["gpu"]).split(".json")[0]
        assert prov["command"].startswith("python -m fp8_backends.tune")


def test_the_packaged_h200_data_loads_and_decides_on_sm90():
    """The data file that ships (measured on the H200) passes its checks and serves `auto` on a simulated H200:
    an exact hit for a shape of its grid, the nearest shapes for one outside it, nothing on another SM."""
    from fp8_backends.core.types import GemmProblem
    from fp8_backends.registry import resolution, shipped
    from fp8_backends.registry.platform import simulate_platform

    shipped.reset_state()
    h200 = simulate_platform("9.0")
    path, why = shipped.locate(h200)
    assert path is not None and path.name == "sm90-nvidia-h200.json", why
    data = shipped.data_for(h200)
    assert data is not None and data.provenance["gpu"] == "NVIDIA H200" and data.provenance["command"]
    exact = resolution.explain("gemm", problem=GemmProblem(n=6144, k=4096, m=16), platform=h200)  # Llama-3-8B QKV
    assert exact.source == "shipped-exact", (exact.source, exact.note)
    unseen = resolution.explain("gemm", problem=GemmProblem(n=5008, k=3072, m=64), platform=h200)
    assert unseen.source == "shipped-nearest" and "x" in unseen.note, (unseen.source, unseen.note)
    other = resolution.explain("gemm", problem=GemmProblem(n=6144, k=4096, m=16), platform=simulate_platform("10.0"))
    assert not other.source.startswith("shipped")


# ------------------------------------------------------------------------------------------ the model's features
TILED = ("tiled", "", ())
CUBLAS = ("cublas", "", ())
RANK = {CUBLAS: (0,), TILED: (1,)}.get
H200_FILE = Path(__file__).resolve().parents[1] / "fp8_backends" / "data" / "selection" / "sm90-nvidia-h200.json"


def shape(n: int, k: int, m: int, tiled: float, cublas: float = 1.0, labels: tuple[str, ...] = ()):
    """A measured shape with the two candidates' µs (relative times follow)."""
    us = {TILED: tiled, CUBLAS: cublas}
    fastest = min(us.values())
    return nearest.MeasuredShape(n, k, m, f"{n}x{k}", labels, fastest, {c: v / fastest for c, v in us.items()}, {})


def pick(model: nearest.NearestModel, n: int, k: int, m: int) -> tuple:
    pred = model.predict(n, k, m)
    return nearest.choose(pred.scores, RANK, nearest.TIE_MARGIN)[0]


def test_features():
    assert nearest.twos(3696, 7) == 4 and nearest.twos(3584, 7) == 7 and nearest.twos(1376, 7) == 5
    assert nearest.twos(7, 7) == 0
    # 64-wide N tiles x 64-tall M tiles on 132 SMs
    assert nearest.wave_fill(8192, 64) == pytest.approx(128 / 132)
    assert nearest.wave_fill(9216, 64) == pytest.approx(144 / 264)  # one full wave and 12 tiles
    assert nearest.wave_fill(8448, 64) == pytest.approx(1.0)
    assert nearest.wave_fill(4096, 256) == pytest.approx(256 / 264)  # 64 N tiles x 4 M tiles
    assert nearest.wave_fill(9216, 64, nearest.Metric(sms=144)) == pytest.approx(1.0)
    log_only = nearest.features(9216, 3696, 64, nearest.LOG_SHAPE_METRIC)
    assert log_only == (math.log2(9216), math.log2(3696), 0.0, 0.0)
    f = nearest.features(9216, 3696, 64)
    assert f[2] == pytest.approx(2 * 144 / 264) and f[3] == pytest.approx(2 * 4 / 7)
    with pytest.raises(ValueError):
        nearest.Metric(wave_weight=-1)
    with pytest.raises(ValueError):
        nearest.Metric(sms=0)


def test_a_shape_past_a_full_wave_follows_shapes_with_the_same_wave_fill():
    """N = 8960 at M = 64 is 140 tiles (one wave and 8 tiles): the tiled kernel is slow there like at 9216 and
    10752, although 8192 (128 tiles, one full wave) is nearer in log N."""
    data = [shape(8192, 4096, 64, 0.7), shape(7680, 4096, 64, 0.7), shape(8192, 5120, 64, 0.7),
            shape(10752, 4096, 64, 1.3), shape(9216, 5120, 64, 1.3), shape(11264, 4096, 64, 1.3)]
    assert pick(nearest.NearestModel(data, metric=nearest.LOG_SHAPE_METRIC), 8960, 4096, 64) == TILED
    model = nearest.NearestModel(data)
    assert pick(model, 8960, 4096, 64) == CUBLAS
    assert pick(model, 8192, 4608, 64) == TILED  # full wave: the tiled kernel's shapes decide


def test_a_less_aligned_k_is_a_poor_witness_for_an_aligned_one():
    """K = 3696 (a multiple of 16 only) measured slow for the tiled kernel must not decide K = 3712 (x128)."""
    data = [shape(8192, 3696, 4, 1.4), shape(8192, 3584, 4, 0.9), shape(8192, 4096, 4, 0.9),
            shape(8192, 3072, 4, 0.9)]
    assert pick(nearest.NearestModel(data, metric=nearest.LOG_SHAPE_METRIC), 8192, 3712, 4) == CUBLAS
    assert pick(nearest.NearestModel(data), 8192, 3712, 4) == TILED


def _h200_model() -> nearest.NearestModel:
    doc = shipped_data.load_file(H200_FILE)
    models = nearest.build_models(shipped_data.the_section(doc)["entries"])
    return next(m for cls, m in models.items() if not dict(cls)["has_bias"])


def test_on_the_shipped_data_it_is_deterministic_picks_measured_candidates_and_names_its_shapes():
    model = _h200_model()
    rng = random.Random(15)
    queries = [(rng.randrange(256, 80000), rng.randrange(256, 40000), rng.choice(model.buckets)) for _ in range(200)]
    shuffled = nearest.NearestModel(rng.sample([s for b in model.buckets for s in model.by_bucket[b]], len(model)))
    measured = {(s.n, s.k) for b in model.buckets for s in model.by_bucket[b]}
    for n, k, m in queries:
        pred = model.predict(n, k, m)
        assert pred == model.predict(n, k, m) == shuffled.predict(n, k, m)
        assert len(pred.neighbours) == nearest.DEFAULT_NEIGHBOURS
        assert sum(nb.weight for nb in pred.neighbours) == pytest.approx(1.0)
        assert all((nb.shape.n, nb.shape.k) in measured and nb.shape.m == m for nb in pred.neighbours)
        offered = {ck for nb in pred.neighbours for ck in nb.shape.ratios}
        assert {ck for ck, _ in pred.scores} == offered
        text = pred.describe_neighbours()
        assert all(f"{nb.shape.shape} (w " in text for nb in pred.neighbours)
        won, score = nearest.choose(pred.scores, lambda ck: (0,), nearest.TIE_MARGIN)
        assert won in offered and score >= 1.0 - 1e-12


def test_far_from_any_data_it_still_answers_from_the_nearest_measured_shapes():
    model = _h200_model()
    for n, k in ((1, 1), (3, 7), (1 << 20, 64), (64, 1 << 20), (1 << 22, 1 << 22)):
        pred = model.predict(n, k, 1)
        assert pred is not None and pred.scores and len(pred.neighbours) == nearest.DEFAULT_NEIGHBOURS
        assert all(nb.distance > 1.0 for nb in pred.neighbours)  # over a factor of 2 away: the note shows it
    assert model.predict(0, 4096, 1) is None and model.predict(4096, 4096, 3) is None  # no shape / no bucket


def test_per_lookup_cost_stays_small():
    """One prediction on the shipped H200 data (240 shapes per bucket); the bound is generous, the README and the
    evaluation's README give the measured value (~80 µs)."""
    model = _h200_model()
    rng = random.Random(1)
    queries = [(rng.randrange(256, 80000), rng.randrange(256, 40000), rng.choice(model.buckets)) for _ in range(300)]
    t0 = time.perf_counter()
    for q in queries:
        model.predict(*q)
    assert (time.perf_counter() - t0) / len(queries) < 2e-3


def _labelled_doc():
    labels = {s: (f"{fam}{i}-x/tp{1 << (i % 3)}/proj",) for i, (s, fam) in
              enumerate(zip(SMALL + LARGE, ["llama", "qwen"] * 4))}
    return make_doc(labels=labels)


@pytest.mark.parametrize("group", selection_data.GROUPS)
def test_leave_out_splits_and_the_baseline_comparison(group):
    report = selection_data.leave_out_report(_labelled_doc(), group, priorities={"torch_scaled_mm": 10, "fake_mm": 1},
                                             baseline=True)
    assert report["models"] == ["nearest", "baseline"] and report["overall"]["points"] > 0
    assert {row["m"] for row in report["by_m"]} == {1, 16, 256}
    for row in report["by_m"]:
        assert row["nearest"]["geomean"] is not None and row["baseline"]["geomean"] is not None
    table = selection_data.baseline_comparison([report])
    assert f"| {group} | all | {report['overall']['points']} |" in table
    assert "baseline (log N, log K)" in selection_data.leave_out_markdown(report)


def test_group_of_reads_model_family_and_tp_from_labels():
    s = nearest.MeasuredShape(1, 1, 1, "k", ("qwen2.5-3b/tp2/o_proj", "qwen2-7b/tp2/o_proj"), 1.0, {}, {})
    assert selection_data._group_of("model")(s) is None  # shared by two models: never held out
    assert selection_data._group_of("family")(s) == "qwen"
    assert selection_data._group_of("tp")(s) == "tp2"
    assert selection_data._group_of("shape")(s) == "1x1"
    with pytest.raises(ValueError):
        selection_data._group_of("gpu")


def test_loo_cli_writes_the_comparison(tmp_path, capsys):
    path = write_doc(tmp_path, _labelled_doc())
    out = tmp_path / "loo.json"
    assert selection_data.main(["loo", str(path), "--group", "model", "tp", "--baseline", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| held out | M | points | baseline: geomean / min / >= 0.95 |" in text and "| tp | all |" in text
    assert [r["group"] for r in json.loads(out.read_text())] == ["model", "tp"]


def test_loo_compares_the_vote_without_the_trend(tmp_path, capsys):
    path = write_doc(tmp_path, _labelled_doc())
    assert selection_data.main(["loo", str(path), "--group", "shape", "--compare", "vote", "baseline"]) == 0
    text = capsys.readouterr().out
    assert ("| held out | M | points | baseline: geomean / min / >= 0.95 | vote: geomean / min / >= 0.95 | "
            "nearest:") in text
    assert "vote (no trend) | >= 0.95 |" in text
    report = selection_data.leave_out_report(_labelled_doc(), "model", priorities={"torch_scaled_mm": 10},
                                             compare=["vote"])
    assert report["models"] == ["nearest", "vote"] and report["overall"]["vote"]["geomean"] is not None
    with pytest.raises(ValueError, match="unknown model"):
        selection_data.leave_out_report(_labelled_doc(), "model", compare=["forest"])


def test_the_data_can_say_its_sm_count():
    doc = make_doc()
    assert shipped_data.sms(doc["provenance"], 132) == 132
    doc["provenance"]["model"] = {"sms": 0}
    assert "provenance.model.sms must be an integer >= 1" in shipped_data.check_document(doc)
    packed = selection_data.pack(_tuner_lockfile(make_doc()), neighbours=2, sms=148)
    assert packed["provenance"]["model"] == {"neighbours": 2, "sms": 148}
    assert shipped_data.sms(packed["provenance"], 132) == 148


# ------------------------------------------------------------------------------------ bad files, one clear error
def test_unusable_shipped_files_are_named_and_refused(tmp_path):
    """A ``.gz`` whose stream is corrupt (zlib's error, not gzip's) and an entry with N = 0 (the nearest-shape
    model takes logs of it) are unusable, each with its reason."""
    good = shipped_data.dumps_compact(make_doc()).encode("utf-8")
    garbled = bytearray(gzip.compress(good, mtime=0))
    garbled[len(garbled) // 2:len(garbled) // 2 + 16] = bytes(16)
    (tmp_path / "garbled.json.gz").write_bytes(bytes(garbled))
    with pytest.raises(DataFileError, match="garbled.json.gz: unreadable"):
        shipped_data.load_file(tmp_path / "garbled.json.gz")
    doc = make_doc()
    entries = shipped_data.the_section(doc)["entries"]
    name, entry = next(iter(entries.items()))
    entries[name] = {**entry, "problem": {**entry["problem"], "n": 0}}
    assert any("problem field 'n' is 0, not >= 1" in p for p in shipped_data.check_document(doc))


def test_selection_data_cli_errors_are_one_line(tmp_path, capsys):
    """``pack`` of a lockfile whose entry is not an object, or whose grid is not one, names the file; a bad model
    name or an unwritable --out is one line; none is a traceback."""
    base = _tuner_lockfile(make_doc())
    cases = []
    for label, edit in (("entry", lambda d: shipped_data.the_section(d)["entries"].update(junk=[1, 2])),
                        ("grid", lambda d: d["provenance"].update(grid=[1]))):
        doc = json.loads(json.dumps(base))
        edit(doc)
        path = tmp_path / f"{label}.lock.json"
        path.write_text(json.dumps(doc), encoding="utf-8")
        cases.append((["pack", str(path), "--out", str(tmp_path / "o")], f"{path}: "))
    good = tmp_path / "good.lock.json"
    good.write_text(json.dumps(base), encoding="utf-8")
    (tmp_path / "file").write_text("x")
    cases += [(["pack", str(good), "--exclude-model", "nosuch", "--out", str(tmp_path / "o")], "unknown model"),
              (["pack", str(good), "--out", str(tmp_path / "file" / "x.json")], "error: ")]
    for argv, says in cases:
        assert selection_data.main(argv) == 1, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_tune_refuses_bad_arguments_before_measuring(tmp_path, capsys):
    """No CUDA device for --device cuda, a folder as --lockfile, a negative --tie-margin: argparse errors."""
    import torch

    from fp8_backends import tune

    folder = tmp_path / "folder"
    folder.mkdir()
    cases = [(["--device", "cpu", "--shapes", "64,64", "--m", "1", "--lockfile", str(folder)], "is a folder"),
             (["--device", "cpu", "--shapes", "64,64", "--m", "1", "--no-write", "--tie-margin", "-1"],
              "--tie-margin must be a finite number >= 0")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda", "--no-write"], "no CUDA device found"))
    for argv, says in cases:
        with pytest.raises(SystemExit) as exit_:
            tune.main(argv)
        assert exit_.value.code == 2 and says in capsys.readouterr().err, argv
    assert folder.is_dir() and not list(tmp_path.glob("folder.*"))


def test_a_lockfile_path_that_cannot_be_read_is_not_moved_aside(tmp_path):
    """A folder where the lockfile should be: the writer raises (it is not a corrupt file to keep as .corrupt)."""
    folder = tmp_path / "lock"
    folder.mkdir()
    with pytest.raises(DataFileError, match="unreadable"):
        lockfile.update_document(folder, lambda doc: None)
    assert folder.is_dir() and not (tmp_path / "lock.corrupt").exists()


def test_the_tuner_measures_again_the_entries_readers_skip(tmp_path):
    """``done_keys``: a malformed entry is not done (readers skip it; the next tune rewrites it)."""
    from fp8_backends.tuning.plan import done_keys

    platform = simulate_platform("9.0")
    doc = make_doc()
    _, digest = lockfile.current_key(platform)
    section = next(iter(doc["sections"].values()))
    doc["sections"] = {digest: section}
    names = list(section["entries"])
    section["entries"][names[0]] = {**section["entries"][names[0]], "m": "one"}
    path = tmp_path / "lock.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    assert done_keys(path, platform) == set(names[1:])


@pytest.mark.parametrize("name", ["sm90-nvidia-h200.json", "sm90-nvidia-h200.json.gz"])
def test_a_shipped_file_write_that_fails_midway_leaves_the_old_file(tmp_path, name):
    """``pack`` / ``merge`` replace the shipped file atomically: a full disk (here a file-size limit, which Python
    reports as an OSError) leaves the previous file whole and no temporary file behind."""
    resource = pytest.importorskip("resource")
    out = tmp_path / name
    selection_data._write_compact(out, make_doc())
    before = out.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) // 2, hard))
    try:
        with pytest.raises(OSError):
            selection_data._write_compact(out, make_doc(buckets=(1, 4, 16, 64, 256)))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert out.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [name]
