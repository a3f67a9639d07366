"""Promotion: the gated move of the MLflow alias ``champion`` to the ``challenger`` plan, and rollback.

A challenger is promoted only if the gate report (stage ``gate``) is for exactly its plan (same SHA-256), every
expectation in it held, and its served perplexity is within ``gates.tolerance_rel`` of the champion's for every
model both serve. The promoted version records the gate results, the DVC hashes of its inputs and the git commit.
Any failure raises :class:`~exitplan.errors.GateFailed` before the alias is touched.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from exitplan import tracking
from exitplan.artifacts import ROUTER_FILE, gate_path, plan_path
from exitplan.config import Params
from exitplan.errors import ExitplanError, GateFailed
from exitplan.gate_report import GateReport, read_gate_report

CHAMPION, CHALLENGER = "champion", "challenger"
LINEAGE_STAGES = ("plan", "online_profile", "gate")
"""Stages whose dependency hashes (from ``dvc.lock``) are recorded on a promoted version."""


@dataclass
class Promotion:
    """What a promotion did (or, dry, would do).

    Attributes:
        challenger: Version the challenger alias points at.
        champion_before: Champion before (None: there was none).
        champion_after: Champion after.
        failures: Failed expectations (empty when promoted).
        dry_run: Nothing was changed.
        changes: What changed (or would change), in words.
    """

    challenger: str
    champion_before: str | None
    champion_after: str | None
    failures: list[str] = field(default_factory=list)
    dry_run: bool = False
    changes: list[str] = field(default_factory=list)


def champion_failures(report: GateReport, champion: dict[str, Any] | None, tolerance: float) -> list[str]:
    """Models whose served perplexity rose more than ``tolerance`` (relative) over the champion's."""
    if champion is None or "gate_quality" not in champion["tags"]:
        return []
    before = {row["model"]: row for row in json.loads(champion["tags"]["gate_quality"])}
    failures = []
    for row in report.quality:
        old = before.get(row["model"])
        if old is not None and row["ppl_helios"] > old["ppl_helios"] * (1 + tolerance):
            failures.append(f"vs champion v{champion['version']}: {row['model']} perplexity {row['ppl_helios']:.4f} "
                            f"> {old['ppl_helios']:.4f} x (1 + {tolerance})")
    return failures


def lineage(params: Params) -> dict[str, str]:
    """The git commit and the DVC hashes of the plan's inputs (from ``dvc.lock``)."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=params.root, capture_output=True, text=True,
                            check=False).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=params.root,
                           capture_output=True, text=True, check=False).stdout.strip()
    lock_path = params.root / "dvc.lock"
    lock = yaml.safe_load(lock_path.read_text()) if lock_path.is_file() else {}
    deps = {f"{stage}:{d['path']}": d.get("md5", "") for stage in LINEAGE_STAGES
            for d in lock.get("stages", {}).get(stage, {}).get("deps", [])}
    return {"git_commit": commit + ("-dirty" if dirty else ""), "dvc_inputs": json.dumps(deps, sort_keys=True),
            "dvc_lock_sha256": hashlib.sha256(lock_path.read_bytes()).hexdigest() if lock_path.is_file() else ""}


def register_pulled_plan(params: Params) -> dict[str, Any] | None:
    """Register the pipeline's current plan as ``challenger`` in a tracking store that has none.

    DVC's outputs are the truth of what is current; the registry is where plans are promoted. A clone that pulled
    its outputs from the DVC remote (every stage current, so the plan stage does not run) starts with an empty
    embedded store, and so does a new tracking server: the plan the gate report is for is registered from the
    outputs, tagged ``registered_from=dvc_outputs``, and then goes through the same gate as any challenger.

    Returns:
        The new challenger (as :func:`exitplan.tracking.alias_version` gives it), or None without a plan output.
    """
    section = params.plan
    first = section.scenarios[0].name
    path = plan_path(params, first)
    out = path.parent
    if not path.is_file():
        return None
    reports = [p for p in (params.path("reports") / "plan" / "metrics.json", out / "front.parquet") if p.is_file()]
    router = out / ROUTER_FILE
    name = section.registered_name(first)
    version = tracking.register_plan(params.tracking, params.root, "plan", path, name,
                                     section.model_dump(), {}, reports, router_path=router if router.is_file()
                                     else None)
    if version is None:
        return None
    tracking.set_alias(params.tracking, params.root, name, CHALLENGER, version, {"registered_from": "dvc_outputs"})
    return tracking.alias_version(params.tracking, params.root, name, CHALLENGER)


def promote(params: Params, dry_run: bool = False) -> Promotion:
    """Gate the challenger and, if it passes, point ``champion`` at it.

    Raises:
        GateFailed: on any failed expectation (not in a dry run, which reports them instead).
        ExitplanError: when there is no challenger or no gate report.
    """
    settings, name = params.tracking, params.plan.registered_model
    challenger = tracking.alias_version(settings, params.root, name, CHALLENGER)
    if challenger is None and not dry_run:
        challenger = register_pulled_plan(params)
    if challenger is None:
        raise ExitplanError(f"no '{CHALLENGER}' version of {name}: run the plan stage first")
    champion = tracking.alias_version(settings, params.root, name, CHAMPION)
    report = read_gate_report(gate_path(params))
    failures = report.failures
    registered = hashlib.sha256(tracking.plan_artifact(settings, params.root, name, challenger["version"])).hexdigest()
    if registered != report.plan_sha256:
        failures.insert(0, f"the gate report is for plan {report.plan_sha256[:12]}, the challenger "
                           f"v{challenger['version']} is plan {registered[:12]}: run `dvc repro gate`")
    failures += champion_failures(report, champion, params.gates.tolerance_rel)
    before = champion["version"] if champion else None
    result = Promotion(challenger["version"], before, before, failures, dry_run)
    if failures:
        if dry_run:
            result.changes.append(f"would refuse v{challenger['version']}: {len(failures)} failed expectation(s)")
            return result
        raise GateFailed(f"challenger v{challenger['version']} of {name}", failures)
    if before == challenger["version"]:
        result.changes.append(f"v{before} is already the champion")
        return result
    result.champion_after = challenger["version"]
    result.changes.append(f"champion: {'v' + before if before else 'none'} -> v{challenger['version']}")
    if not dry_run:
        tags = {"gate_passed": "true", "gate_quality": json.dumps(report.quality),
                "gate_suites": json.dumps([s.model_dump(include={"suite", "success", "evaluated"})
                                           for s in report.suites]),
                "promoted_at": f"{time.time():.3f}", **lineage(params)}
        tracking.set_alias(settings, params.root, name, CHAMPION, challenger["version"], tags)
    return result


def rollback(params: Params, to: str | None = None) -> Promotion:
    """Point ``champion`` back at ``to`` or, by default, at the version promoted before the current champion.

    Raises:
        ExitplanError: when there is no champion, no earlier promoted version, or ``to`` does not exist.
    """
    settings, name = params.tracking, params.plan.registered_model
    champion = tracking.alias_version(settings, params.root, name, CHAMPION)
    if champion is None:
        raise ExitplanError(f"{name} has no '{CHAMPION}' to roll back")
    known = tracking.versions(settings, params.root, name)
    if to is None:
        earlier = [v for v in known if "promoted_at" in v["tags"] and v["version"] != champion["version"]
                   and float(v["tags"]["promoted_at"]) < float(champion["tags"].get("promoted_at", "inf"))]
        if not earlier:
            raise ExitplanError(f"no version of {name} was promoted before v{champion['version']}")
        to = max(earlier, key=lambda v: float(v["tags"]["promoted_at"]))["version"]
    elif to not in {v["version"] for v in known}:
        raise ExitplanError(f"{name} has no version {to} (versions: {[v['version'] for v in known]})")
    tracking.set_alias(settings, params.root, name, CHAMPION, to, {"rolled_back_to_at": f"{time.time():.3f}"})
    return Promotion(champion["version"], champion["version"], to,
                     changes=[f"champion: v{champion['version']} -> v{to}"])
