"""``benchmarks/peers/run_http.py``'s kvserve variants: ``--kvserve-env`` specs become extra
kvserve servers named after them, with exactly those variables; bad specs stop the run."""

from __future__ import annotations

import pytest

from benchmarks.peers.run_http import kvserve_variants


def test_each_spec_adds_one_named_server_with_its_variables() -> None:
    got = kvserve_variants(["GOMP_SPINCOUNT=1000", "OMP_WAIT_POLICY=ACTIVE,KVSERVE_X=a=b"])
    assert got == {
        "kvserve": {},
        "kvserve[GOMP_SPINCOUNT=1000]": {"GOMP_SPINCOUNT": "1000"},
        "kvserve[OMP_WAIT_POLICY=ACTIVE,KVSERVE_X=a=b]": {
            "OMP_WAIT_POLICY": "ACTIVE", "KVSERVE_X": "a=b"},
    }  # fmt: skip
    assert kvserve_variants([]) == {"kvserve": {}}


@pytest.mark.parametrize("spec", ["GOMP_SPINCOUNT", "=1", ",", ""])
def test_a_spec_without_a_name_and_value_stops_the_run(spec: str) -> None:
    with pytest.raises(SystemExit, match="expected K=V"):
        kvserve_variants([spec])
