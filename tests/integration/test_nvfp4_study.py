"""``lowprec ablate experiment=nvfp4_quick``: the NVFP4 stabiliser study end to end (CLI -> training -> MLflow ->
report -> study), on the debug model."""

import re

from lowprec_lab.cli import main
from lowprec_lab.studies.nvfp4 import PAPER


def test_nvfp4_quick_ablation_writes_the_stabiliser_table(run_dirs, tmp_path, capsys):
    assert main(["ablate", "experiment=nvfp4_quick"] + run_dirs) == 0
    abl = re.search(r"ablation (abl-[\w-]+) done", capsys.readouterr().out).group(1)
    text = (tmp_path / "reports" / abl / "nvfp4.md").read_text()
    what, finding = PAPER["sr"][1], PAPER["sr"][2]
    row = next(line for line in text.splitlines() if line.startswith(f"| {what} | `nvfp4_no_sr` |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # 2 seeds: an interval and a verdict against nvfp4 and against bf16, and the paper's section beside them
    for cell in cells[2:4]:
        assert re.fullmatch(r"[+-]\d+\.\d+% \[[+-]\d+\.\d+%, [+-]\d+\.\d+%\] \*\*[a-z-]+\*\*", cell), cell
    assert cells[4] == finding and "section 4.4" in finding
    assert re.fullmatch(
        r"(agrees: .*|disagrees: .*|(same|opposite) direction .* not resolved: (\d+ seeds needed|no seed .*))", cells[5]
    ), cells[5]
    assert "| (reference) | `nvfp4` |" in text and "## What this scale cannot show" in text
    assert re.search(r"\| `nvfp4` \| \d+\.\d \| \d+\.\d \| \d+\.\d \| \d+\.\d\d% \|", text)  # RHT telemetry
