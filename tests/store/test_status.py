"""`status` of a finished job whose run.json is damaged: it reads the journal instead and says so
(issue 23, case 9). A running job's status is in tests/ops/test_metrics.py."""

from __future__ import annotations

import pytest
from helpers import finished_tone_job

from cosybatch.store.status import describe, job_status


@pytest.mark.parametrize("run_json", ['{"started": "yesterday", "total_rows": "ten"}', '[1, 2]',
                                      '{"total_rows": 5, "total_is_estimate": "yes"}'])
def test_status_reads_the_journal_when_run_json_has_wrong_types(tone, tmp_path, run_json):
    _, out = finished_tone_job(tone, tmp_path)
    (out / ".cosybatch" / "run.json").write_text(run_json)
    status = job_status(out)
    assert (status["status"], status["done"]) == ("complete", 8)
    assert any("run.json is unreadable" in w for w in status["warnings"])
    assert "run.json is unreadable" in describe(status)
