"""Plan a fleet of one's own: ``exitplan plan <fleet.yaml>``.

A fleet file names the scenario (models, GPUs available, budget, load, SLO), the catalog entries it adds (a new GPU
type with its price and specs, a new model with its architecture numbers) and the label CSVs of its models. Planning
it leaves the embedded default's pipeline alone: the perf DB's rows are reused for the (model, GPU) pairs it already
covers, and what it lacks is simulated here; the plan lands in its own folder (``data/fleets/<name>/`` by default).

A file, not a long command line, because a fleet is an input that is reviewed and versioned like ``params.yaml``:
it can be committed, diffed, and listed as a dependency of a DVC stage (``exitplan plan my-fleet.yaml`` as its
``cmd``); the flags of ``exitplan plan`` override its budget, load and SLO for a what-if without editing it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from pydantic import Field, PositiveFloat, PositiveInt, field_validator

from exitplan.catalog import Catalog, Gpu, Model
from exitplan.config import Params, PlanScenario
from exitplan.errors import CatalogError, ConfigError, ExitplanError
from exitplan.yaml_model import StrictModel, load_yaml_model

LENGTH_COLUMNS = ("prompt_len", "output_len")
"""Optional columns of a label CSV: the token lengths of each query's prompt and of the model's answer, which the
simulator then draws that model's requests from."""

PROMPT_COLUMN = "prompt"
"""Optional column of a label CSV: the query's text, which the router embeds (else it comes from the pipeline's
query tables)."""


class CatalogAdditions(StrictModel):
    """Catalog entries a fleet adds to ``model_repository/catalog.yaml`` (the same schema, see
    :mod:`exitplan.catalog`); an id the catalog already holds is an error, not an override."""

    gpus: list[Gpu] = Field(default_factory=list)
    """New GPU types: specs, link, price per GPU-hour, efficiency factors with their source."""

    models: list[Model] = Field(default_factory=list)
    """New models: their architecture numbers (no ``source``: they are simulated, not run here)."""


class FleetFile(StrictModel):
    """A fleet to plan: what ``exitplan plan`` reads."""

    scenario: PlanScenario
    """Models (smallest first), GPUs available per type, budget, load and SLO (as a scenario of ``plan`` in params)."""

    catalog: CatalogAdditions = Field(default_factory=CatalogAdditions)
    """GPU types and models to add to the catalog for this fleet."""

    labels: list[str] = Field(min_length=1)
    """Label CSVs (``model, dataset, query_id, quality`` and optionally ``prompt``, ``prompt_len``, ``output_len``),
    relative to the fleet file. Every model of the scenario needs labels on the same queries."""

    qps: list[PositiveFloat] | None = None
    """Load grid of the perf-DB sweep of what the perf DB lacks, in requests per second (null: a grid of 12 loads up
    to twice the scenario's load, so the curves reach the share of the load a model may carry)."""

    requests_per_point: int = Field(default=300, ge=50, le=100_000)
    """Requests simulated per grid point of that sweep (the pipeline's perf DB uses ``build_perf_db``'s)."""

    max_gpus_per_replica: PositiveInt = Field(default=8, le=64)
    """Largest TP x PP of one replica in that sweep."""

    @field_validator("qps")
    @classmethod
    def _finite(cls, values: list[float] | None) -> list[float] | None:
        if values is not None and not all(np.isfinite(values)):
            raise ValueError("loads must be finite")
        return values


@dataclass(frozen=True)
class Fleet:
    """A loaded fleet: its file, the catalog with its additions, and its labels (validated against both)."""

    spec: FleetFile
    catalog: Catalog
    labels: Any
    """Rows (model, dataset, query_id, quality, metric) plus the optional columns of the CSVs."""
    path: Path


OVERRIDES = {"budget": "budget_per_hour", "qps": "load_qps", "quality_floor": "min_quality", "max_p95": "max_p95_s"}
"""``exitplan plan``'s flags (as Python names) -> the scenario field each overrides."""


def with_overrides(spec: FleetFile, **flags: float | None) -> FleetFile:
    """The fleet with the scenario fields of the flags given (not None) replaced, validated as the file would be.

    Args:
        spec: The fleet file.
        flags: Keys of :data:`OVERRIDES` and their values.

    Raises:
        ConfigError: naming the flag whose value is out of range (NaN, infinity, negative).
    """
    from pydantic import ValidationError

    given = {flag: v for flag, v in flags.items() if v is not None}
    for flag, value in given.items():
        option = "--" + flag.replace("_", "-")
        if not np.isfinite(value):
            raise ConfigError("exitplan plan", [f"{option}: must be a finite number, got {value}"])
        try:
            PlanScenario.model_validate({**spec.scenario.model_dump(), OVERRIDES[flag]: value})
        except ValidationError as exc:
            raise ConfigError("exitplan plan", [f"{option}: {exc.errors()[0]['msg']}, got {value}"]) from None
    scenario = spec.scenario.model_copy(update={OVERRIDES[f]: v for f, v in given.items()})
    return spec.model_copy(update={"scenario": scenario})


def merged_catalog(base: Catalog, additions: CatalogAdditions, where: str) -> Catalog:
    """``base`` with the fleet's entries added.

    Raises:
        CatalogError: naming an id the catalog already holds.
    """
    from pydantic import ValidationError

    from exitplan.yaml_model import format_validation_error

    raw = base.model_dump()
    raw["gpus"] += [g.model_dump() for g in additions.gpus]
    raw["models"] += [m.model_dump() for m in additions.models]
    try:
        return Catalog.model_validate(raw)
    except ValidationError as exc:
        raise CatalogError(where, [f"catalog: {p}" for p in format_validation_error(exc, Catalog)]) from None


def _check_scenario(spec: FleetFile, catalog: Catalog, where: str) -> None:
    """Every GPU and model of the scenario is in the catalog (with its additions), models are not embedders, and the
    traffic is the labelled queries (the file's labels are its traffic: there is no workload sample to route)."""
    problems = [f"scenario.gpus: unknown GPU '{g}' (not in the catalog nor in this file's catalog.gpus)"
                for g in spec.scenario.gpus if not catalog.has_gpu(g)]
    if spec.scenario.traffic != "labelled":
        problems.append(f"scenario.traffic: '{spec.scenario.traffic}' is the pipeline's (prepare_workload's queries); "
                        f"a fleet file plans for its labelled queries: leave it out or set 'labelled'")
    for name in spec.scenario.models:
        found = catalog.find_model(name)
        if found is None:
            problems.append(f"scenario.models: unknown model '{name}' (not in the catalog nor in this file's "
                            f"catalog.models)")
        elif not isinstance(found, Model):
            problems.append(f"scenario.models: '{name}' is an embedder, not a language model")
    if problems:
        raise ConfigError(where, problems)


def read_labels(paths: list[Path], catalog: Catalog, models: list[str]) -> Any:
    """The label CSVs in one frame, each row's model checked against the catalog and the scenario.

    Raises:
        ExitplanError: naming the file and the model that the catalog does not hold, or that the scenario does not
            plan; or a bad CSV (see :func:`exitplan.routing.labels.read_user_labels`).
    """
    import pandas as pd

    from exitplan.files import read_table
    from exitplan.routing.labels import read_user_labels

    frames = []
    for path in paths:
        labels = read_user_labels(path)
        extra = read_table(path, "label file")
        for column in (PROMPT_COLUMN, *LENGTH_COLUMNS):
            if column in extra.columns:
                labels[column] = extra[column].to_numpy()
        for name in labels["model"].unique():
            if catalog.find_model(name) is None:
                raise ExitplanError(f"{path}: labels for '{name}', which is not in the catalog (add it under "
                                    f"catalog.models of the fleet file, with its architecture numbers)")
            if name not in models:
                raise ExitplanError(f"{path}: labels for '{name}', which scenario.models does not plan "
                                    f"({models})")
        frames.append(labels)
    return pd.concat(frames, ignore_index=True)


def load_fleet(path: Path, params: Params) -> Fleet:
    """Read and validate a fleet file, its catalog additions and its labels, before any work.

    Raises:
        ConfigError: the file is missing or malformed (a missing architecture number, NaN, a negative budget), a GPU
            or model of the scenario is unknown, or an added entry clashes with the catalog.
        ExitplanError: a label CSV is bad or labels a model the catalog or the scenario lacks.
    """
    from exitplan.catalog import load_catalog

    spec = load_yaml_model(path, FleetFile, ConfigError)
    catalog = merged_catalog(load_catalog(params.path(params.catalog)), spec.catalog, str(path))
    _check_scenario(spec, catalog, str(path))
    labels = read_labels([path.parent / p for p in spec.labels], catalog, spec.scenario.models)
    return Fleet(spec, catalog, labels, path)


def model_lengths(fleet: Fleet, fallback: tuple[np.ndarray, np.ndarray] | None,
                  models: list[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each of ``models``'  (prompt, output) token lengths: from its label rows' ``prompt_len`` and
    ``output_len`` when the CSV has them, else ``fallback`` (the pipeline's lengths trace).

    Raises:
        ExitplanError: naming a model without lengths when there is no fallback, or with lengths that are not
            positive whole numbers.
    """
    import pandas as pd

    out = {}
    for name in models:
        rows = fleet.labels[fleet.labels["model"] == name]
        if name in own_lengths(fleet):
            values = rows[list(LENGTH_COLUMNS)].apply(pd.to_numeric, errors="coerce").to_numpy(float)
            if not (np.isfinite(values).all() and (values >= 1).all() and (values == np.round(values)).all()):
                raise ExitplanError(f"{fleet.path}: the prompt_len / output_len of {name}'s labels must be whole "
                                    f"token counts >= 1")
            out[name] = (values[:, 0].astype(int), values[:, 1].astype(int))
        elif fallback is not None:
            out[name] = fallback
        else:
            raise ExitplanError(f"{name}: no token lengths to simulate it with: give prompt_len and output_len "
                                f"columns in its label CSV, or run the prepare_workload stage (its lengths trace)")
    return out


def own_lengths(fleet: Fleet) -> set[str]:
    """The scenario models whose label rows all carry ``prompt_len`` and ``output_len``."""
    labels = fleet.labels
    if not all(c in labels.columns for c in LENGTH_COLUMNS):
        return set()
    complete = labels[list(LENGTH_COLUMNS)].notna().all(axis=1).groupby(labels["model"]).all()
    return {m for m in fleet.spec.scenario.models if complete.get(m, False)}


def load_grid(spec: FleetFile) -> list[float]:
    """The perf-DB sweep's loads: the file's, else 12 geometric steps from 1/50 to twice the scenario's load."""
    if spec.qps:
        return sorted(spec.qps)
    top = 2 * spec.scenario.load_qps
    return [float(q) for q in np.geomspace(top / 50, top, 12)]


def coverage(db: Any, models: list[str], gpus: list[str], own_lengths: set[str]) -> tuple[list, list]:
    """Which (model, GPU) pairs the existing perf DB covers and which must be simulated: a pair is reused when the
    perf DB has rows for it and the fleet does not give the model lengths of its own (the perf DB's rows were
    simulated with the pipeline's lengths)."""
    have = set() if db is None else set(map(tuple, db[["model", "gpu"]].drop_duplicates().to_numpy()))
    pairs = [(m, g) for m in models for g in gpus]
    reused = [p for p in pairs if p in have and p[0] not in own_lengths]
    return reused, [p for p in pairs if p not in reused]


@contextmanager
def _sweep_client(params: Params) -> Iterator[Any]:
    """The Dask client of the sweep: none when it runs in this process."""
    from exitplan.fanout import dask_client, in_process

    if in_process(params.dask):
        yield None
        return
    with dask_client(params.dask) as client:
        yield client


def simulate_missing(fleet: Fleet, params: Params, missing: list[tuple[str, str]],
                     lengths: dict[str, tuple[np.ndarray, np.ndarray]],
                     advance: Callable[[str], None] | None = None) -> Any:
    """The perf-DB rows of the (model, GPU) pairs the perf DB lacks, swept on ``params.dask``.

    Raises:
        SimulationError: naming a model with no layout that fits any of its GPUs.
    """
    import pandas as pd

    from exitplan.simulator.perf_db import build_perf_db

    spec, frames = fleet.spec, []
    with _sweep_client(params) as client:
        for model in dict.fromkeys(m for m, _ in missing):
            gpus = [g for m, g in missing if m == model]
            frames.append(build_perf_db(fleet.catalog, [model], gpus, params.simulator.engine, load_grid(spec),
                                        lengths[model], spec.requests_per_point, params.build_perf_db.seed,
                                        spec.max_gpus_per_replica, [1.0], params.dask, progress=advance,
                                        client=client))
    return pd.concat(frames, ignore_index=True) if frames else None


def layouts_to_sweep(fleet: Fleet, params: Params, missing: list[tuple[str, str]]) -> int:
    """How many layouts :func:`simulate_missing` sweeps (the progress bar's total)."""
    from exitplan.simulator.perf_db import enumerate_layouts

    return sum(len(enumerate_layouts(fleet.catalog.llm(m), fleet.catalog.gpu(g), fleet.spec.max_gpus_per_replica,
                                     [1.0], params.simulator.engine)) for m, g in missing)


def check_budget(fleet: Fleet, params: Params) -> None:
    """Each model must have a layout that fits the scenario's GPUs and budget (from the catalog alone, before any
    simulation).

    Raises:
        ExitplanError: naming the model whose cheapest replica costs more than the budget, or fits no GPU offered.
    """
    from exitplan.simulator.perf_db import enumerate_layouts

    scenario = fleet.spec.scenario
    for name in scenario.models:
        costs = [layout.tp * layout.pp * gpu.price_per_hour
                 for gpu in map(fleet.catalog.gpu, scenario.gpus)
                 for layout in enumerate_layouts(fleet.catalog.llm(name), gpu, fleet.spec.max_gpus_per_replica,
                                                 [1.0], params.simulator.engine)
                 if layout.tp * layout.pp <= scenario.gpus[gpu.id]]
        if not costs:
            raise ExitplanError(f"scenario.gpus: no replica of {name} fits on {dict(scenario.gpus)} (its weights "
                                f"and KV cache need more GPUs of these types)")
        if min(costs) > scenario.budget_per_hour:
            raise ExitplanError(f"scenario.budget_per_hour: ${scenario.budget_per_hour}/h fits no plan: the "
                                f"cheapest replica of {name} on {sorted(scenario.gpus)} costs ${min(costs):.2f}/h")


class Reporter(Protocol):
    """What :func:`plan_fleet` tells as it goes (the CLI's is a rich progress bar)."""

    def stage(self, line: str) -> None:
        """A part of the work starts."""

    def sweep(self, total: int) -> AbstractContextManager[Callable[[str], None]]:
        """The perf-DB sweep of ``total`` layouts: yields the callback called with a line per layout swept."""


class Quiet:
    """A :class:`Reporter` that says nothing."""

    def stage(self, line: str) -> None:
        """Nothing."""

    @contextmanager
    def sweep(self, total: int) -> Iterator[Callable[[str], None]]:
        """A callback that does nothing."""
        yield lambda _line: None


def _queries(fleet: Fleet, params: Params) -> Any:
    """The prompt of every labelled query: the CSVs' ``prompt`` column, else the pipeline's query tables."""
    import pandas as pd

    from exitplan.artifacts import QUERIES_FILE, imported_path, queries_path

    frames = []
    if PROMPT_COLUMN in fleet.labels.columns:
        frames.append(fleet.labels.dropna(subset=[PROMPT_COLUMN])[["dataset", "query_id", PROMPT_COLUMN]])
    for path in (queries_path(params), imported_path(params, QUERIES_FILE)):
        if path.is_file():
            table = pd.read_parquet(path, columns=["dataset", "query_id", PROMPT_COLUMN])
            frames.append(table.assign(query_id=table["query_id"].astype(str)))
    if not frames:
        raise ExitplanError(f"{fleet.path}: the labels have no prompt column and the pipeline's query tables are "
                            f"absent: add a prompt column to the label CSVs (or run prepare_workload)")
    return pd.concat(frames, ignore_index=True)


def _embedder(params: Params, catalog: Catalog, reporter: Reporter) -> Path:
    """The router's embedder checkpoint: ``fetch_models``' output, fetched here once when it is absent."""
    from exitplan.checkpoints import SOURCE_RECORD, fetch_checkpoint

    path = params.checkpoint_path(params.plan.embedder)
    if not (path / SOURCE_RECORD).is_file():
        reporter.stage(f"fetching the router's embedder {params.plan.embedder} (once)")
        fetch_checkpoint(catalog.model(params.plan.embedder), path)
    return path


def _lengths_trace(params: Params) -> tuple[np.ndarray, np.ndarray] | None:
    """The pipeline's lengths trace (``build_perf_db.lengths_trace``), if ``prepare_workload`` wrote it."""
    import pandas as pd

    path = params.path(params.prepare_workload.output_dir) / f"trace_{params.build_perf_db.lengths_trace}.parquet"
    if not path.is_file():
        return None
    trace = pd.read_parquet(path, columns=list(LENGTH_COLUMNS))
    return trace["prompt_len"].to_numpy(), trace["output_len"].to_numpy()


def fleet_perf_db(fleet: Fleet, params: Params, reporter: Reporter) -> tuple[Any, dict[str, list[str]]]:
    """The perf DB of the fleet: the pipeline's rows where they cover a pair, the rest simulated here.

    Returns:
        The table, and which pairs were ``reused`` and ``simulated`` (as ``model on gpu``).
    """
    import pandas as pd

    from exitplan.artifacts import perf_db_path

    scenario = fleet.spec.scenario
    existing = pd.read_parquet(perf_db_path(params)) if perf_db_path(params).is_file() else None
    reused, missing = coverage(existing, scenario.models, list(scenario.gpus), own_lengths(fleet))
    lengths = model_lengths(fleet, _lengths_trace(params), list(dict.fromkeys(m for m, _ in missing)))
    reporter.stage(f"perf DB: {len(reused)} (model, GPU) pairs from {perf_db_path(params).name if reused else '-'},"
                   f" {len(missing)} to simulate")
    parts = []
    if existing is not None and reused:
        keep = pd.MultiIndex.from_frame(existing[["model", "gpu"]]).isin(reused)
        parts.append(existing[keep])
    if missing:
        with reporter.sweep(layouts_to_sweep(fleet, params, missing)) as advance:
            parts.append(simulate_missing(fleet, params, missing, lengths, advance))
    names = {"reused": [f"{m} on {g}" for m, g in reused], "simulated": [f"{m} on {g}" for m, g in missing]}
    return pd.concat(parts, ignore_index=True), names


def plan_fleet(fleet: Fleet, params: Params, out: Path, reporter: Reporter | None = None) -> dict[str, Any]:
    """Plan the fleet into ``out``: ``plan.json``, ``front.parquet``, ``router.json``, ``perf_db.parquet`` and
    ``front.png`` (what the ``plan`` stage writes per scenario, plus the perf DB it planned on).

    Returns:
        ``plan`` (the typed plan), ``perf_db`` (which pairs were reused and simulated), the paths written.

    Raises:
        ExitplanError: a model has no replica within the budget, no plan meets the SLO (naming the constraint that
            binds), or an input is missing (naming it).
    """
    from exitplan.atomic import write_parquet
    from exitplan.planner.scenario import plan_scenario, train_on_labels

    reporter = reporter or Quiet()
    check_budget(fleet, params)
    db, pairs = fleet_perf_db(fleet, params, reporter)
    queries = _queries(fleet, params)
    embedder = _embedder(params, fleet.catalog, reporter)
    reporter.stage(f"router: {params.plan.embedder} + ridge on {fleet.labels['query_id'].nunique()} labelled queries")
    routing = train_on_labels(params.plan, fleet.labels, queries, fleet.spec.scenario.models, embedder)
    result = plan_scenario(params.plan, fleet.spec.scenario, db, fleet.catalog, routing, out, out,
                           progress=reporter.stage)
    write_parquet(out / "perf_db.parquet", db)
    return {**result, "perf_db": pairs}
