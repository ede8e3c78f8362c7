"""Studies: an experiment's own report beside the ablation's verdict report.

An experiment (``conf/experiment/<name>.yaml``) lists ``studies: [name, ...]``; the ablation records them on its
parent run (tag ``studies``) and ``lowprec_lab.report.build.build_report`` calls ``report_studies`` (its ``after``
hook) after the main report, so ``lowprec report <id>`` rebuilds them too. A study reads the ablation's runs from
the store (``lowprec_lab.tracking.runs``; never from the process that trained them) and writes ``<reports>/<ablation
id>/<study>.md`` with its figures.

Register one with ``@register("name")`` (``lowprec_lab.studies.registry``) in a module imported here;
``check_studies`` refuses unknown names before any training.
"""

from lowprec_lab.studies import deepseek_v3, lr, noise, nvfp4  # each registers its study
from lowprec_lab.studies.registry import (
    GROUP_TAG,
    SETTINGS_CHECKS,
    STUDIES,
    StudyContext,
    check_studies,
    group_ablations,
    register,
    report_studies,
    run_studies,
)

__all__ = [
    "GROUP_TAG",
    "SETTINGS_CHECKS",
    "STUDIES",
    "StudyContext",
    "check_studies",
    "group_ablations",
    "deepseek_v3",
    "lr",
    "noise",
    "nvfp4",
    "register",
    "report_studies",
    "run_studies",
]
