"""The study registry: ``register`` a study by name, ``check_studies`` before training, ``run_studies`` /
``report_studies`` after the report (``lowprec_lab.studies`` imports every study module, so importing the package
fills the registry)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowprec.errors import ConfigError
from lowprec_lab.report.build import ReportContext
from lowprec_lab.tracking.tracker import ABLATION_TAG

#: What a study gets (``lowprec_lab.report.build.ReportContext``): the store, the ablation, its runs and the main
#: report's verdict table.
StudyContext = ReportContext


#: Parent-run tag naming the first ablation of a ``models`` list or a ``grid`` (``lowprec_lab.runner.ablate.ablate``);
#: an ablation run alone is its own group.
GROUP_TAG = "ablation_group"

#: name -> study function; each returns the markdown path it wrote.
STUDIES: dict[str, Callable[[StudyContext], Path]] = {}


#: name -> validator of the study's settings (``study.<name>`` in the experiment): raises ``ConfigError``.
SETTINGS_CHECKS: dict[str, Callable[[dict], Any]] = {}


def register(
    name: str, check_settings: Callable[[dict], Any] | None = None
) -> Callable[[Callable[[StudyContext], Path]], Callable[[StudyContext], Path]]:
    """Decorator: make ``fn(ctx) -> Path`` the study called ``name``; ``check_settings(dict)`` validates its
    ``study.<name>`` settings before any training. Raises ``ValueError`` for a repeated name."""

    def deco(fn: Callable[[StudyContext], Path]) -> Callable[[StudyContext], Path]:
        if name in STUDIES:
            raise ValueError(f"study {name!r} is registered twice")
        STUDIES[name] = fn
        if check_settings is not None:
            SETTINGS_CHECKS[name] = check_settings
        return fn

    return deco


def check_studies(names: list[str], settings: dict | None = None) -> list[str]:
    """``names`` if every one is a registered study and ``settings`` (``study``: name -> mapping) names only listed
    studies, each valid for its study; ``ConfigError`` otherwise."""
    names = list(names or [])
    unknown = [n for n in names if n not in STUDIES]
    if unknown:
        raise ConfigError(f"studies={names}: unknown {unknown}; known: {sorted(STUDIES) or 'none'}")
    settings = dict(settings or {})
    stray = sorted(set(settings) - set(names))
    if stray:
        raise ConfigError(f"study.{stray[0]} configures a study that is not in studies={names}")
    for n, d in settings.items():
        if n in SETTINGS_CHECKS:
            SETTINGS_CHECKS[n](dict(d or {}))
    return names


def group_ablations(ctx: StudyContext) -> list[tuple[str, Any]]:
    """``(ablation id, parent run)`` of every ablation of ``ctx``'s group (tag ``GROUP_TAG``: a ``models`` list or a
    ``grid``), oldest first, ``ctx``'s own ablation last."""
    group = ctx.parent.data.tags.get(GROUP_TAG, ctx.ablation_id)
    found = ctx.tracker.client.search_runs(
        [ctx.tracker.experiment_id],
        filter_string=f"tags.`{GROUP_TAG}` = '{group}' and tags.`lowprec.kind` = 'ablation'",
    )
    found = sorted(found, key=lambda r: r.info.start_time)
    out = [(r.data.tags[ABLATION_TAG], r) for r in found if r.data.tags[ABLATION_TAG] != ctx.ablation_id]
    return [*out, (ctx.ablation_id, ctx.parent)]


def run_studies(names: list[str], ctx: StudyContext) -> list[Path]:
    """Each study of ``names`` on ``ctx``, in order; the markdown paths written."""
    return [STUDIES[n](ctx) for n in check_studies(names)]


def report_studies(ctx: StudyContext) -> list[Path]:
    """The studies the ablation recorded on its parent run (tag ``studies``), run on ``ctx``: the ``after`` hook of
    ``lowprec_lab.report.build.build_report``; the markdown paths written."""
    return run_studies(json.loads(ctx.parent.data.tags.get("studies", "[]")), ctx)
