"""``python -m fp8_backends.list``: every provider, where it comes from, and whether it can run here.

Options:
  --json                 the same information as JSON (schema ``fp8_backends.list/1``, see README)
  --problem M,N,K        resolve a GEMM problem and show every rejected provider's reasons
                         (with --act-scale, --weight-scale, --input-dtype, --weight-dtype,
                         --out-dtype, --bias, --device)
  --norm-problem T,H     resolve a norm-quant problem (with --in-dtype, --residual, --device)
  --gemm-backend NAME    resolve this explicit choice instead of $FP8_GEMM_BACKEND / auto
  --norm-quant-backend NAME
  --simulate-sm X.Y      pretend the GPU is SM X.Y (also: FP8_BACKENDS_SIMULATE_SM)
  --objective kernel|host  what auto optimizes for --problem (also: FP8_SELECTION_OBJECTIVE; default kernel)

Exits 0 when it could print the listing (a machine without a GPU included) and every explicit choice
(``--gemm-backend``, ``--norm-quant-backend``, or ``FP8_GEMM_BACKEND`` / ``FP8_NORM_QUANT_BACKEND``) resolved;
1 when one of them did not (unknown, ambiguous, unusable or unable to serve the problem: the listing says
why); 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from fp8_backends.core import settings
from fp8_backends.core.errors import ConfigurationError, Fp8BackendError
from fp8_backends.core.objective import SelectionObjective
from fp8_backends.core.text_table import text_table
from fp8_backends.core.types import ActScale, GemmProblem, NormQuantProblem, WeightScale
from fp8_backends.registry import discovery, host_aware, resolution
from fp8_backends.registry.platform import Platform, detect_platform, list_platforms, simulate_platform

SCHEMA = "fp8_backends.list/1"


def _caps_dict(cls: Any) -> dict[str, Any]:
    caps = getattr(cls, "capabilities", None)
    if caps is None:
        return {}
    out: dict[str, Any] = {
        "devices": sorted(d.value for d in caps.devices),
        "arch": caps.arch_summary(),
        "pdl": caps.pdl,
        "priority": caps.priority,
    }
    for attr in ("act_scales", "weight_scales", "input_dtypes", "out_dtypes", "in_dtypes", "out_fp8"):
        if hasattr(caps, attr):
            out[attr] = sorted(v.value for v in getattr(caps, attr))
    for attr in ("bias", "k_align", "n_align", "align_reason", "mixed_inputs", "residual", "hidden_align",
                 "strided_rows", "group_scale_layout"):
        if hasattr(caps, attr):
            value = getattr(caps, attr)
            out[attr] = getattr(value, "value", value)
    if hasattr(caps, "align_devices"):
        out["align_devices"] = sorted(d.value for d in caps.align_devices)
    if hasattr(caps, "group_sizes"):
        out["group_sizes"] = sorted(caps.group_sizes)
    if hasattr(caps, "weight_blocks"):
        out["weight_blocks"] = [list(b) for b in sorted(caps.weight_blocks)]
    if hasattr(caps, "block_scaled"):
        out["block_scaled"] = caps.block_scaled
    return out


def _options_dict(cls: Any) -> dict[str, list[str]]:
    """A provider class's options as JSON (empty for none, no class, or options that are not a well-formed mapping:
    discovery refuses such a class when it loads, and the listing must print whatever a class holds later)."""
    options = getattr(cls, "options", {}) if cls is not None else {}
    if discovery.options_problem(options) is not None:
        return {}
    return {str(k): list(v) for k, v in options.items()}


def _platform_dict(p: Platform) -> dict[str, Any]:
    return {
        "kind": p.kind.value,
        "name": p.name,
        "device_index": p.device_index,
        "sm": None if p.sm is None else f"{p.sm[0]}.{p.sm[1]}",
        "arch": p.arch,
        "pdl": p.pdl,
        "simulated": p.simulated,
        "driver_version": p.driver_version,
        "cuda_runtime_version": p.cuda_runtime_version,
        "library_versions": dict(p.library_versions),
    }


def _host_context(res: resolution.Resolution) -> float | None:
    """The host objective's context µs this resolution was decided with (None under another objective, or when the
    variable is malformed: the resolution's own error says so)."""
    if res.objective is not SelectionObjective.HOST:
        return None
    try:
        return settings.host_context_us()
    except ConfigurationError:
        return None


def _resolution_dict(res: resolution.Resolution) -> dict[str, Any]:
    chosen = res.chosen.entry if res.chosen else None
    return {
        "request": res.request,
        "source": res.source,
        "note": res.note,
        "objective": res.objective.value,
        "host_context_us": _host_context(res),
        "problem": None if res.problem is None else res.problem.describe(),
        "chosen": None if chosen is None else chosen.name,
        "chosen_config": None if res.backend is None else res.backend.describe_config(),
        "chosen_distribution": None if chosen is None else chosen.dist,
        "error": None if res.error is None else f"{type(res.error).__name__}: {res.error}",
        "candidates": [
            {"name": c.entry.name, "distribution": c.entry.dist, "ok": c.ok, "reasons": c.reasons,
             "auto_skips": c.explicit_only}
            for c in res.candidates
        ],
    }


def collect(
    platform: Platform,
    gemm_problem: GemmProblem | None = None,
    norm_problem: NormQuantProblem | None = None,
    gemm_request: str | None = None,
    norm_request: str | None = None,
    objective: str | None = None,
) -> dict[str, Any]:
    """Everything the listing shows, as a JSON-ready dict (schema ``fp8_backends.list/1``). ``objective``: what
    ``auto`` optimizes for the GEMM resolution (``kernel`` / ``host``; default ``FP8_SELECTION_OBJECTIVE``, else
    kernel)."""
    # explain_loaded, as resolve does: the `*` marks exactly what auto resolves to (a provider that fails to load
    # is passed over by both); on a simulated platform nothing is loaded (the listing stays fast and imports no
    # kernel library for a GPU that is not there)
    explain = resolution.explain if platform.simulated else resolution.explain_loaded
    resolutions = {
        "gemm": explain("gemm", gemm_request, problem=gemm_problem, platform=platform, objective=objective),
        "norm_quant": explain("norm_quant", norm_request, problem=norm_problem, platform=platform),
    }
    providers = []
    for kind in ("gemm", "norm_quant"):
        res = resolutions[kind]
        # matched by what an entry is, not by object: a rescan between the resolution and this listing (an install)
        # renews changed entries only, and an unchanged provider keeps its verdict
        by_entry = {_entry_key(c.entry): c for c in res.candidates}
        for entry in sorted(discovery.discover(kind), key=resolution.rank_key):
            cand = by_entry.get(_entry_key(entry))
            unusable = entry.unusable_reason()
            reasons = cand.reasons if cand is not None else [unusable] if unusable else []
            avail = entry.availability()
            notes = [n for n in (avail.reason if avail.ok and avail.reason else None,
                                 None if cand is None or cand.explicit_only is None else cand.explicit_only) if n]
            providers.append(
                {
                    "kind": kind,
                    "name": entry.name,
                    "aliases": list(entry.aliases),
                    "distribution": entry.dist,
                    "version": entry.dist_version,
                    "builtin": entry.builtin,
                    "target": entry.target,
                    "origin": entry.origin,
                    "status": entry.status,
                    "disabled": entry.disabled,
                    "available": avail.ok,
                    "usable": not reasons,
                    "reasons": reasons,
                    "install_hint": avail.install_hint or None,
                    "note": "; ".join(notes) or None,
                    "description": getattr(entry.cls, "description", "") if entry.cls else "",
                    "options": _options_dict(entry.cls),
                    "capabilities": _caps_dict(entry.cls),
                    "host_us": host_aware.host_us_of(entry.cls) if kind == "gemm" and entry.cls else None,
                    "block_host_us": (host_aware.host_us_of(entry.cls, block=True)
                                      if kind == "gemm" and entry.cls else None),
                    "selected": res.chosen is not None and res.chosen.entry is entry,
                }
            )
    env = {var.name: os.environ[var.name] for var in settings.ENV_VARS if var.name in os.environ}
    return {
        "schema": SCHEMA,
        "platform": _platform_dict(platform),
        "devices": [_platform_dict(p) for p in list_platforms()],
        "env": env,
        "providers": providers,
        "resolution": {kind: _resolution_dict(res) for kind, res in resolutions.items()},
        "clashes": {kind: _clashes_list(kind) for kind in ("gemm", "norm_quant")},
        "lockfile": _lockfile_dict(platform),
        "shipped_data": _shipped_dict(platform),
        "measured_defaults": {kind: _defaults_list(kind, platform, resolutions[kind].problem if kind in resolutions
                                                   else None) for kind in ("gemm", "norm_quant")},
    }


def _clashes_list(kind: str) -> list[dict[str, Any]]:
    """Provider names that several distributions register (neither disabled nor blocked), with the
    qualified names that pick each."""
    entries = [e for e in discovery.discover(kind) if e.status != discovery.BLOCKED and not e.disabled]
    return [{"name": name, "distributions": [e.dist for e in group], "qualified": [e.qualified_name for e in group]}
            for name, group in resolution.name_clashes(entries).items()]


def _entry_key(entry: Any) -> tuple:
    return (entry.kind, entry.name, entry.dist, entry.target, entry.origin)


def _defaults_list(kind: str, platform: Platform, problem: Any = None) -> list[dict[str, Any]]:
    """The measured ``auto`` defaults that apply to ``problem`` on ``platform`` (``registry/defaults.py``), as rules
    (``max_m`` None: any larger M; ``block``: the block-wise table, whose ladders take ready providers only)."""
    try:
        from fp8_backends.registry import defaults

        table = defaults.defaults_for(kind, platform, problem)
    except ConfigurationError:
        raise  # a bad FP8_BACKENDS_DEFAULTS: the listing fails with it, it does not list "no defaults"
    except Exception:  # the listing must print even if the defaults module breaks
        return []
    if table is None:
        return []
    return [{"max_m": r.max_m, "prefer": list(r.prefer), "source": r.source or table.source, "block": table.block}
            for r in table.rules]


def _lockfile_dict(platform: Platform) -> dict[str, Any]:
    try:
        from fp8_backends.registry import lockfile

        return lockfile.describe_lockfile(platform)
    except Exception as exc:  # the listing must print even if the lockfile code breaks
        return {"path": None, "status": "error", "detail": f"{type(exc).__name__}: {exc}", "entries": 0}


def _shipped_dict(platform: Platform) -> dict[str, Any]:
    try:
        from fp8_backends.registry import shipped

        return shipped.describe(platform)
    except Exception as exc:  # the listing must print even if the shipped-data code breaks
        return {"path": None, "status": "error", "detail": f"{type(exc).__name__}: {exc}", "entries": 0}


def _short(values: list[str] | None) -> str:
    abbrev = {
        "per_tensor_static": "tensor-static", "per_tensor_dynamic": "tensor-dyn", "per_token": "token",
        "per_tensor": "tensor", "per_channel": "channel", "bfloat16": "bf16", "float16": "fp16",
        "float32": "fp32",
    }
    return ",".join(abbrev.get(v, v) for v in values or []) or "-"


def render(data: dict[str, Any]) -> str:
    p = data["platform"]
    out = []
    if p["kind"] == "cpu":
        where = "CPU (no CUDA device)"
    else:
        where = p["name"] if p["sm"] is None else f"{p['name']}, SM {p['arch']}"
    if p["simulated"]:
        where += " (simulated)"
    out.append(f"platform: {where}; PDL {'yes' if p['pdl'] else 'no'}")
    versions = ", ".join(f"{k} {v}" for k, v in p["library_versions"].items())
    out.append(f"libraries: {versions or 'none found'}")
    if data["env"]:
        out.append("env: " + ", ".join(f"{k}={v}" for k, v in data["env"].items()))
    lock = data.get("lockfile")
    if lock:
        detail = f": {lock['detail']}" if lock["detail"] else ""
        out.append(f"lockfile: {lock['path'] or '-'} ({lock['status']}{detail})")
    shipped = data.get("shipped_data")
    if shipped:
        out.append(f"shipped selection data: {shipped['path'] or '-'} ({shipped['status']}: {shipped['detail']})")
    for kind, title in (("gemm", "FP8 GEMM providers"), ("norm_quant", "RMSNorm+FP8-quant providers")):
        rows = []
        for pr in (x for x in data["providers"] if x["kind"] == kind):
            caps = pr["capabilities"]
            if pr["status"] == "blocked":
                usable = "blocked"
            elif pr["disabled"]:
                usable = "disabled"
            else:
                usable = "yes" if pr["usable"] else "no"
            dist = f"{pr['distribution'] or '?'} {pr['version'] or ''}".strip()
            if pr.get("origin") == "in_process":
                dist += " (in-process)"
            names = pr["name"] + (f" ({','.join(pr['aliases'])})" if pr["aliases"] else "")
            if kind == "gemm":
                plain = [v for v in caps.get("act_scales") or [] if v != "per_token_group"]
                scales = f"{_short(plain)} x {_short([v for v in caps.get('weight_scales') or [] if v != 'block'])}"
                if caps.get("block_scaled"):
                    blocks = "/".join("x".join(map(str, b)) for b in caps.get("weight_blocks", []))
                    scales += f"; block {blocks} x group {'/'.join(map(str, caps.get('group_sizes', [])))}"
                dtypes = f"{_short(caps.get('input_dtypes'))}->{_short(caps.get('out_dtypes'))}"
            else:
                scales = _short(caps.get("act_scales")) if caps else "-"
                dtypes = f"{_short(caps.get('in_dtypes'))}->{_short(caps.get('out_fp8'))}"
            rows.append([
                "*" if pr["selected"] else "", names, dist, usable, caps.get("arch", "-"),
                "yes" if caps.get("pdl") else "no", scales, dtypes, caps.get("priority", "-"),
            ])
        out.append("")
        out.append(title + ":")
        out.append(text_table(["auto", "name", "distribution", "usable", "arch", "PDL", "scales",
                               "dtypes", "prio"], rows))
        reasons = [
            (pr["name"], pr["distribution"], r, pr["install_hint"])
            for pr in data["providers"] if pr["kind"] == kind for r in pr["reasons"]
        ]
        for name, dist, reason, _hint in reasons:
            out.append(f"  {name} ({dist}): {reason}")
        for pr in data["providers"]:
            if pr["kind"] == kind and pr.get("note"):
                out.append(f"  {pr['name']} ({pr['distribution']}): note: {pr['note']}")
        for clash in data.get("clashes", {}).get(kind, []):
            out.append(f"  name clash: {clash['name']!r} is registered by {', '.join(clash['distributions'])}; "
                       f"auto ranks them all; pin one as {' or '.join(clash['qualified'])}")
        for rule in data.get("measured_defaults", {}).get(kind, []):
            where = "any M" if rule["max_m"] is None else f"M <= {rule['max_m']}"
            ready = " and is ready (nothing to build for minutes)" if rule.get("block") else ""
            out.append(f"  measured {'block-wise ' if rule.get('block') else ''}default: {where} -> "
                       f"{', '.join(rule['prefer'])}: the first that can serve{ready} "
                       f"({rule['source']}; FP8_BACKENDS_DEFAULTS=0 turns it off)")
        res = data["resolution"][kind]
        problem = res["problem"] or "any problem"
        if res["error"]:
            out.append(f"  resolution of {res['request']!r} for {problem}: {res['error']}")
        else:
            cfg = f" [{res['chosen_config']}]" if res["chosen_config"] else ""
            note = f": {res['note']}" if res["note"] else ""
            objective = ""
            if res.get("objective") == "host" and res["request"] == "auto":
                context = res.get("host_context_us")
                objective = " [host objective" + ("" if context is None else f", context {context:g} µs") + "]"
            out.append(
                f"  {res['request']}{objective} ({res['source']}{note}) for {problem} -> {res['chosen']}{cfg}"
            )
    return "\n".join(out)


def _parse_ints(text: str, count: int, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be {count} integers separated by commas") from None
    if len(values) != count:
        raise argparse.ArgumentTypeError(f"{what} must be {count} integers separated by commas")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m fp8_backends.list",
        description="List FP8 GEMM and RMSNorm+FP8-quant providers and whether they can run here.",
    )
    ap.add_argument("--json", action="store_true", help="emit JSON (schema fp8_backends.list/1)")
    ap.add_argument("--simulate-sm", metavar="X.Y", help="pretend the GPU is this SM (e.g. 10.0)")
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: current GPU, else CPU)")
    ap.add_argument("--problem", metavar="M,N,K", help="GEMM problem to resolve")
    ap.add_argument("--act-scale", default=None, choices=[a.value for a in ActScale])
    ap.add_argument("--weight-scale", default=None, choices=[w.value for w in WeightScale])
    ap.add_argument("--input-dtype", default=None, choices=["e4m3fn", "e5m2"])
    ap.add_argument("--weight-dtype", default=None, choices=["e4m3fn", "e5m2"])
    ap.add_argument("--out-dtype", default=None, choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--bias", action="store_true", help="the GEMM problem has a bias")
    ap.add_argument("--norm-problem", metavar="T,H", help="norm-quant problem to resolve")
    ap.add_argument("--in-dtype", default=None, choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--residual", action="store_true", help="the norm-quant problem adds a residual")
    ap.add_argument("--gemm-backend", default=None, help="resolve this GEMM choice instead of env/auto")
    ap.add_argument("--norm-quant-backend", default=None, help="resolve this norm-quant choice")
    ap.add_argument("--objective", default=None, choices=["kernel", "host"],
                    help="what auto optimizes for --problem: the fastest kernel in CUDA graphs (kernel) or the cost "
                         "of a call the host enqueues (host); default FP8_SELECTION_OBJECTIVE, else kernel")
    return ap


#: the options that describe ``--problem`` / ``--norm-problem``, with their defaults (an option given without its
#: problem describes nothing: refused rather than ignored)
_GEMM_OPTIONS = {"act_scale": "per_tensor_dynamic", "weight_scale": "per_tensor", "input_dtype": "e4m3fn",
                 "weight_dtype": None, "out_dtype": "bfloat16", "bias": False, "objective": None}
_NORM_OPTIONS = {"in_dtype": "bfloat16", "residual": False}


def _problem_options(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a problem's options without the problem, then fill in their defaults."""
    for problem, options in (("problem", _GEMM_OPTIONS), ("norm_problem", _NORM_OPTIONS)):
        given = [name for name, default in options.items() if getattr(args, name) not in (None, False)]
        if given and not getattr(args, problem):
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            ap.error(f"{flags} describe{'s' if len(given) == 1 else ''} the problem of "
                     f"--{problem.replace('_', '-')}: give it too")
        for name, default in options.items():
            if getattr(args, name) is None:
                setattr(args, name, default)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    _problem_options(ap, args)
    try:
        if args.simulate_sm:
            platform = simulate_platform(args.simulate_sm)
            if args.device == "cpu":
                ap.error("--simulate-sm and --device cpu contradict each other")
        else:
            platform = detect_platform(args.device)
        device = "cpu" if platform.kind.value == "cpu" else "cuda"
        gemm_problem = norm_problem = None
        if args.problem:
            m, n, k = _parse_ints(args.problem, 3, "--problem")
            gemm_problem = GemmProblem(
                n=n, k=k, m=m, input_dtype=args.input_dtype,
                weight_dtype=args.weight_dtype or args.input_dtype, out_dtype=args.out_dtype,
                act_scale=args.act_scale, weight_scale=args.weight_scale, has_bias=args.bias, device=device,
            )
        if args.norm_problem:
            t, h = _parse_ints(args.norm_problem, 2, "--norm-problem")
            norm_problem = NormQuantProblem(hidden=h, tokens=t, in_dtype=args.in_dtype,
                                            residual=args.residual, device=device)
    except ConfigurationError as exc:  # a bad FP8_BACKENDS_SIMULATE_SM: as every variable, exit 1
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except (ValueError, argparse.ArgumentTypeError) as exc:
        ap.error(str(exc))
    # the library's warnings while listing (a plugin that fails to load, an FP8_BACKENDS_DISABLED item that matches
    # nothing, a lockfile it cannot use) go to stderr: the listing is where a user looks for them
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    logger = logging.getLogger("fp8_backends")
    logger.addHandler(handler)
    try:
        settings.check_environment()  # the listing reads some variables only where it would use them
        data = collect(platform, gemm_problem, norm_problem, args.gemm_backend, args.norm_quant_backend,
                       args.objective)
    except Fp8BackendError as exc:  # e.g. a bad FP8_BACKENDS_PDL: say so, no traceback
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        logger.removeHandler(handler)
    if args.json:
        # rendered whole before anything is written (a value JSON cannot hold, from a plugin, becomes its text)
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    else:
        print(render(data))
    # an explicit choice that cannot be resolved fails the listing; so does a configuration error (a bad
    # environment variable), whatever the request
    failed = [f"{kind}: {res['error']}" for kind, res in data["resolution"].items()
              if res["error"] and (res["request"].strip() != resolution.AUTO
                                   or res["error"].startswith(ConfigurationError.__name__))]
    if failed:
        print(f"error: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
