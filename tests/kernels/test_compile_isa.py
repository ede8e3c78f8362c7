"""The suite's shortcut through inductor's CPU vector-ISA probe changes nothing that is compiled.

tests/conftest.py sets ``TORCHINDUCTOR_VEC_ISA_OK=1``: inductor then takes every vector ISA that /proc/cpuinfo lists
as usable, instead of compiling and loading a probe file per ISA in a child process at the first compile of each
process (``torch/_inductor/cpu_vec_isa.py``, ``VecISA.check_build``). That is only the same compile if the probe
accepts each of them on this machine: a child process without the setting runs the probe, and both lists and the
ISA picked for the kernels must be equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SHOW = (
    "import json; from torch._inductor import cpu_vec_isa as c; "
    "print(json.dumps([[str(i) for i in c.valid_vec_isa_list()], str(c.pick_vec_isa())]))"
)


def _isas(env: dict[str, str]) -> list:
    p = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.splitlines()[-1])


def test_the_isas_taken_without_the_probe_are_the_probes():
    assert os.environ["TORCHINDUCTOR_VEC_ISA_OK"] == "1"
    probed = _isas({k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"})
    assert probed[0], "the probe accepted no vector ISA on this machine"
    assert _isas(dict(os.environ)) == probed
