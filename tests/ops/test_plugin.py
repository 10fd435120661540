"""A third-party engine, installed the way a user installs a plugin (`pip install ./tests/plugin`,
which .ci/run does), runs through the whole runner: options, batching, shards, failures, resume,
stats and ray-run, with no change to cosybatch."""

from __future__ import annotations

import json
from importlib.metadata import entry_points

import pytest
from helpers import cli, read_output, write_jsonl

TEXTS = ["One. Two three.", "A longer sentence here. And a second one. Third.", "Short.", "Hello there friend.",
         "Last one, really."]


@pytest.fixture(autouse=True)
def installed():
    if not any(ep.name == "tone" for ep in entry_points(group="cosybatch.engines")):
        pytest.fail("the test plugin is not installed: pip install --no-deps ./tests/plugin (as .ci/run does)")


@pytest.mark.slow
def test_the_plugin_is_listed_with_its_options():
    listing = json.loads(cli("engines", "--json").stdout)
    assert {"piper", "cosyvoice", "tone"} <= set(listing)
    assert listing["tone"]["class"] == "cosybatch_tone.ToneEngine"
    assert listing["tone"]["options"]["base_hz"].startswith("Lowest pitch")


@pytest.mark.slow
def test_a_plugin_engine_gets_batching_shards_failures_and_resume(tmp_path):
    rows = [{"id": f"t{i}", "text": t} for i, t in enumerate(TEXTS * 3)] + [{"id": "long", "text": "x" * 50}]
    corpus = write_jsonl(tmp_path / "c.jsonl", rows)
    out = tmp_path / "out"
    proc = cli("run", corpus, "--engine", "tone", "--engine-opt", "base_hz=300", "--engine-opt", "max_chars=40",
               "--out", out, "--shard-max-items", "4", "--no-normalize")
    assert proc.returncode == 0, proc.stderr
    items = read_output(out)
    assert sorted(items) == sorted(r["id"] for r in rows[:-1])
    for row in rows[:-1]:
        sentences = [s.strip() for s in row["text"].split(".") if s.strip()]
        assert len(items[row["id"]]["audio"]) == sum(len(s) for s in sentences) * 160  # 10 ms per character
        assert items[row["id"]]["meta"]["settings"]["base_hz"] == 300.0
        assert "segments" not in items[row["id"]]["meta"]  # its pieces tell no text (Piece.text None)
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    assert [(f["id"], f["reason"]) for f in failures] == [("long", "a sentence is over max_chars 40")]
    stats = json.loads((out / "stats.json").read_text())
    assert stats["engine"] == "tone" and stats["batch_size_limit"] == 4 and stats["batch_size_max"] == 4
    assert len(list(out.glob("shard-*.tar"))) >= 3  # closed after 4 items (a batch commits whole)
    again = cli("run", corpus, "--engine", "tone", "--engine-opt", "base_hz=300", "--engine-opt", "max_chars=40",
                "--out", out, "--no-normalize")
    assert again.returncode == 0  # the stdout line counts this run; job_totals the whole job
    assert json.loads(again.stdout.splitlines()[-1])["job_totals"]["items_done"] == len(rows) - 1
    assert json.loads((out / "stats.json").read_text())["items_done"] == 0  # nothing redone
    changed = cli("run", corpus, "--engine", "tone", "--engine-opt", "base_hz=310", "--engine-opt", "max_chars=40",
                  "--out", out, "--no-normalize")
    assert changed.returncode == 2 and "engine.base_hz was 300.0, now 310.0" in changed.stderr
    assert json.loads(cli("verify", out, "--json").stdout)["ok"]


@pytest.mark.slow
def test_plugin_options_are_checked_with_errors_that_name_the_key(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "Hi."}])
    typo = cli("run", corpus, "--engine", "tone", "--engine-opt", "base=3", "--check")
    assert typo.returncode == 2 and "engine 'tone' has no option 'base'; did you mean 'base_hz'?" in typo.stderr
    wrong = cli("run", corpus, "--engine", "tone", "--engine-opt", "base_hz=high", "--check")
    assert wrong.returncode == 2 and "option base_hz = 'high' should be a float" in wrong.stderr
    bad = cli("run", corpus, "--engine", "tone", "--engine-opt", "base_hz=-1", "--check")
    assert bad.returncode == 2 and "base_hz must be > 0" in bad.stderr
    infinite = cli("run", corpus, "--engine", "tone", "--engine-opt", "max_chars=inf", "--check")
    assert infinite.returncode == 2 and "option max_chars = 'inf' should be a int" in infinite.stderr
    spec = tmp_path / "job.toml"
    spec.write_text(f'corpus = "{corpus}"\nengine = "tone"\n\n[engine_options]\nbase_hz = 400\n')
    checked = cli("run", "--job", spec, "--check")
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout.splitlines()[-1])["config"]["engine_options"] == {"base_hz": 400}
    # Precedence: the spec's table, then --engine-opt; an alias key at the spec's top level is a
    # spec value too (here Piper's noise_scale), so a command-line --engine-opt overrides it.
    piper = tmp_path / "piper.toml"
    piper.write_text(f'corpus = "{corpus}"\nnoise_scale = 0.3\n')
    overridden = cli("run", "--job", piper, "--engine-opt", "noise_scale=0.5", "--check")
    assert json.loads(overridden.stdout.splitlines()[-1])["config"]["engine_options"] == {"noise_scale": "0.5"}


def test_a_plugin_engine_under_ray_run_matches_run(tmp_path):
    pytest.importorskip("ray")
    from cosybatch.config import RunConfig
    from cosybatch.run.local import run
    from cosybatch.run.ray import RayOptions, ray_run

    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": f"t{i}", "text": t} for i, t in enumerate(TEXTS)])
    cfg = RunConfig.from_options(corpus=corpus, out=tmp_path / "local", engine="tone", engine_options={"base_hz": 250},
                    progress="none")
    local = run(cfg)
    remote = ray_run(RunConfig.from_options(**{**cfg.options(), "out": tmp_path / "ray"}), RayOptions(actors=1))
    assert remote.stats["batch_sizes"] == local.stats["batch_sizes"]
    a, b = read_output(tmp_path / "local"), read_output(tmp_path / "ray")
    assert sorted(a) == sorted(b) and all((a[k]["audio"] == b[k]["audio"]).all() for k in a)
