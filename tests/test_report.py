"""The demo report's reading of /metrics: a series that is not there is an error, not 0."""

from __future__ import annotations

import pytest

from demo import report

EXPOSITION = """\
# TYPE vllm:nixl_pushes counter
vllm:nixl_pushes_total{engine="0",model_name="m",outcome="completed"} 3.0
vllm:nixl_pushes_total{engine="0",model_name="m",outcome="failed"} 0.0
"""


def test_a_present_series_sums_and_a_zero_one_reads_zero() -> None:
    data = report.samples(EXPOSITION)
    assert report.total(data, "vllm:nixl_pushes_total", outcome="completed") == 3.0
    assert report.total(data, "vllm:nixl_pushes_total", outcome="failed") == 0.0
    assert report.total(data, "vllm:nixl_pushes_total") == 3.0


@pytest.mark.parametrize("name, labels", [("vllm:nixl_push_total", {}),  # a renamed metric
                                          ("vllm:nixl_pushes_total", {"outcome": "done"})])  # a label
def test_a_missing_series_fails_instead_of_reading_zero(name: str, labels: dict[str, str]) -> None:
    data = report.samples(EXPOSITION)
    with pytest.raises(report.MissingSeries):
        report.total(data, name, **labels)
    assert report.total(data, name, missing_ok=True, **labels) == 0.0
