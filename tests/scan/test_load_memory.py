"""The offline tools keep the memory their analysis frees (megatron.scan.load.retain_freed_memory):
an array of hundreds of MB freed and made again is not faulted in from the kernel a second time.
Run in a fresh interpreter: the setting is for the tools' own process, never the test runner's."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, resource, sys
import numpy as np
from megatron.scan.load import retain_freed_memory
applied = retain_freed_memory() if sys.argv[1] == "retain" else None

def faults_of_a_new_array():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.ones(40_000_000)  # 320 MB, as the columns of a few thousand ranks' traces
    del a
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

first = faults_of_a_new_array()
print(json.dumps({"applied": applied, "first": first, "again": faults_of_a_new_array()}))
"""


def probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


@pytest.mark.multiprocess
def test_a_freed_large_array_is_reused_not_faulted_in_again():
    plain, kept = probe("plain"), probe("retain")
    if not kept["applied"]:
        pytest.skip("not glibc: mallopt is not there to keep freed memory")
    # Without it, every new 320 MB array is mapped afresh and faults its pages in (and the kernel
    # zeroes them) again, as many as the first time (fewer faults with transparent huge pages) ...
    assert plain["first"] > 100 and plain["again"] > 0.5 * plain["first"]
    # ... with it, the second array reuses the first one's pages.
    assert kept["first"] > 100 and kept["again"] < 0.05 * kept["first"]
