"""OUT/README.md against a hostile or careless folder (issue 31, holes 11 and 12): what the card reads
back is a regular file of bounded size, never a link, a FIFO or a device followed or waited on; and
the user's license survives a folder name that YAML must quote and that holds `---`."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import yaml
from helpers import ROOT, write_jsonl
from huggingface_hub import DatasetCard
from typer.testing import CliRunner

from cosybatch.cli import app
from cosybatch.run.local import run
from cosybatch.store.card import MARKER, front_matter, write_card
from cosybatch.store.readback import CARD_CAP, NotReadable, read_regular

HOSTILE_NAME = 'my "data": v1---draft\'s'


def finished(tmp_path, tone, name="out"):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": f"r{i}", "text": f"Row number {i}."} for i in range(3)])
    out = tmp_path / name
    assert run(tone(corpus, out)).status == "complete"
    assert MARKER in (out / "README.md").read_text()
    return corpus, out


def in_thread(target, timeout=20.0):
    """target() in a daemon thread: (finished within timeout, its result)."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", target()), daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive(), result.get("value")


def release(fifo):
    """Let a reader blocked on FIFO go on (it reads end of file): open it for writing, close it."""
    with contextlib.suppress(OSError):  # ENXIO: no reader is waiting
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_readme_that_is_a_fifo_does_not_hang_a_rerun(tmp_path, tone, caplog):
    corpus, out = finished(tmp_path, tone)
    (out / "README.md").unlink()
    os.mkfifo(out / "README.md")
    try:
        with caplog.at_level(logging.WARNING, logger="cosybatch"):
            done, result = in_thread(lambda: run(tone(corpus, out)))
        assert done, "the rerun hung on OUT/README.md, a FIFO"
    finally:
        release(out / "README.md")
    assert result.status == "complete"
    assert (out / "README.md").is_fifo()  # left as it is
    assert "README.md is a FIFO, not a regular file; left as it is" in caplog.text


def test_a_readme_that_links_elsewhere_is_neither_read_nor_replaced(tmp_path, tone, caplog):
    _, out = finished(tmp_path, tone)
    elsewhere = tmp_path / "elsewhere.md"
    elsewhere.write_text((out / "README.md").read_text())  # even a card of ours, with the marker
    (out / "README.md").unlink()
    (out / "README.md").symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="cosybatch"):
        assert write_card(out) is None
    assert (out / "README.md").is_symlink() and (out / "README.md").readlink() == elsewhere
    assert "README.md is a symbolic link; it is not followed; left as it is" in caplog.text


def test_a_readme_linked_to_dev_zero_is_not_read(tmp_path, tone):
    """In a child process whose address space is capped 400 MB above what it holds: reading
    /dev/zero whole would run into the cap (MemoryError); refusing the link takes nothing."""
    _, out = finished(tmp_path, tone)
    (out / "README.md").unlink()
    (out / "README.md").symlink_to("/dev/zero")
    code = textwrap.dedent(f"""
        import logging, resource, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
        import pyarrow.parquet, yaml  # noqa: F401  (imported before the cap)
        from cosybatch.store.card import write_card
        vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (400 << 20), resource.RLIM_INFINITY))
        print("result", write_card({str(out)!r}))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "README.md is a symbolic link; it is not followed; left as it is" in done.stdout, done.stdout
    assert "result None" in done.stdout
    assert os.readlink(out / "README.md") == "/dev/zero"


def test_a_readme_over_the_cap_is_left_alone(tmp_path, tone, caplog):
    _, out = finished(tmp_path, tone)
    big = MARKER + "\n" + "x" * CARD_CAP
    (out / "README.md").write_text(big)
    with caplog.at_level(logging.WARNING, logger="cosybatch"):
        assert write_card(out) is None
    assert (out / "README.md").read_text() == big
    assert f"more than the {CARD_CAP:,} read back; left as it is" in caplog.text


@pytest.mark.parametrize("name", ["stats.json", "manifest.parquet", ".cosybatch/job.json"])
def test_the_other_files_the_card_reads_are_not_waited_on(tmp_path, tone, name):
    """stats.json and job.json that cannot be read back are left out of the card; a manifest
    that cannot be read costs the card (a warning), not the run."""
    _, out = finished(tmp_path, tone)
    (out / name).unlink()
    os.mkfifo(out / name)
    try:
        done, _ = in_thread(lambda: write_card(out))
        assert done, f"the card hung on {name}, a FIFO"
    finally:
        release(out / name)
    assert (out / name).is_fifo()


def test_read_regular_refuses_what_is_not_a_regular_file(tmp_path):
    (tmp_path / "zero").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_bytes(b"12345")
    for path, why in ((tmp_path / "zero", "is a symbolic link"), (tmp_path / "fifo", "is a FIFO"),
                      ("/dev/zero", "is a character device"), (tmp_path, "is a folder"),
                      (tmp_path / "file", "5 bytes, more than the 4 read back")):
        with pytest.raises(NotReadable, match=why):
            read_regular(path, 4)
    assert read_regular(tmp_path / "file", 5) == b"12345"
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing", 5)


def test_the_license_survives_a_folder_name_with_quotes_a_colon_and_dashes(tmp_path, tone):
    """pretty_name is the folder's name: YAML quotes this one, and it holds `---`. The license the
    user set is read from the front matter, not from a split on `---`."""
    corpus, out = finished(tmp_path, tone, name=HOSTILE_NAME)
    card = (out / "README.md").read_text()
    assert any(line.startswith("pretty_name: '") and "---" in line for line in card.splitlines())  # quoted
    (out / "README.md").write_text(card.replace("license: unknown", "license: cc0-1.0"))
    result = CliRunner().invoke(app, ["export", str(out), "--to", "hf"])  # rewrites the card
    assert result.exit_code == 0, result.output
    data = DatasetCard.load(out / "README.md").data
    assert data.license == "cc0-1.0" and data.pretty_name == HOSTILE_NAME
    assert run(tone(corpus, out)).status == "complete"  # a rerun rewrites the card: the license stays
    assert DatasetCard.load(out / "README.md").data.license == "cc0-1.0"


def test_front_matter_ends_at_the_first_line_that_is_exactly_three_dashes():
    for name in (HOSTILE_NAME, "a\n---\nb", "---", "x: ---y", "'---'"):
        header = {"license": "cc-by-4.0", "pretty_name": name}
        card = f"---\n{yaml.safe_dump(header, sort_keys=False)}---\n{MARKER}\n\n# {name}\n\n---\n"
        assert front_matter(card) == header, name
    assert front_matter("# no header\n---\nlicense: mit\n---\n") is None
    assert front_matter("---\nlicense: mit\n") is None  # never closed
    assert front_matter("---\n- a list\n---\n") is None
    assert front_matter("---\n!!python/object:os.system ls\n---\n") is None  # the safe loader refuses it
