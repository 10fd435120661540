"""`cosybatch status`: how far a job is, read from its files without touching its lock, so a
running job is never disturbed."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from ..errors import UsageError
from .checkpoint import (
    JOB_FILE,
    JOURNAL_FILE,
    LOCK_FILE,
    RAY_FAILURES_DIR,
    RAY_ITEMS_DIR,
    RUN_FILE,
    STATE_DIR,
    STATS_FILE,
    Journal,
    Ledger,
    OutputDir,
)
from .distributed import job_folders

RATE_WINDOW_S = 120.0  # the rate is measured over the last two minutes of commits


def _read_json(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# run.json's fields and the types status relies on: a file edited by hand or cut by a full disk
# may hold anything, and status must still say what the journal says.
RUN_FIELDS = {"started": (int, float), "total_rows": (int,), "total_is_estimate": (bool,)}


def _read_run(path: Path) -> tuple[dict, Optional[str]]:
    """run.json with its fields checked -> (run, None), or ({}, why) when it is unreadable."""
    if not path.exists():
        return {}, None
    run = _read_json(path)
    if run is None:
        return {}, f"{STATE_DIR}/{RUN_FILE} is unreadable (not a JSON object); status is from the journal"
    for name, types in RUN_FIELDS.items():
        value = run.get(name)
        wrong = not isinstance(value, types) or (bool not in types and isinstance(value, bool))
        if value is not None and wrong:
            return {}, (f"{STATE_DIR}/{RUN_FILE} is unreadable ({name} is {type(value).__name__} {value!r}); "
                        "status is from the journal")
    return run, None


def _ray_counts(folder: Path) -> tuple[int, int]:
    """A ray-run folder has no journal: its finished shards and failure files are its state.
    Only tar headers are read (one .json member per item), never the audio. A view of a job in
    object storage has each shard's item records (`ray-items/DIGEST.jsonl`) instead of the shard."""
    import tarfile

    recorded = {p.stem: p for p in (folder / STATE_DIR / RAY_ITEMS_DIR).glob("*.jsonl")}
    done = sum(len([line for line in p.read_text().splitlines() if line.strip()]) for p in recorded.values())
    for shard in folder.glob("shard-*.tar"):
        if shard.name[len("shard-"):-len(".tar")] in recorded:
            continue
        with tarfile.open(shard) as tar:
            done += sum(1 for m in tar if m.name.endswith(".json"))
    failed = sum(len([line for line in p.read_text().splitlines() if line.strip()])
                 for p in (folder / STATE_DIR / RAY_FAILURES_DIR).glob("*.jsonl"))
    return done, failed


def part_status(folder: Path, now: Optional[float] = None) -> dict:
    now = time.time() if now is None else now
    state = folder / STATE_DIR
    run, run_problem = _read_run(state / RUN_FILE)
    stats = _read_json(folder / STATS_FILE)
    ledger = Ledger.replay(state / JOURNAL_FILE)  # what is committed, after repairs and corpus changes
    done, failed = len(ledger.live), ledger.failures
    commits = [(rec["ts"], len(rec["items"])) for rec in Journal.read(state / JOURNAL_FILE)
               if rec.get("t") == "items" and "ts" in rec]
    if (state / RAY_FAILURES_DIR).is_dir():
        done, failed = _ray_counts(folder)
    try:
        pid_text = (state / LOCK_FILE).read_text().strip()
    except OSError:
        pid_text = ""
    running = OutputDir(folder).lock_held()
    if running:
        status = "running"
    elif stats is not None and stats.get("wall_seconds") is not None and (
            (folder / STATS_FILE).stat().st_mtime >= run.get("started", 0)):
        status = stats["status"]
    elif run or (state / JOB_FILE).exists():
        status = "stopped"  # killed or crashed: rerun the same command to resume
    else:
        status = "not started"
    problems: list[str] = []
    if status == "complete" and not (state / RAY_FAILURES_DIR).is_dir():
        from .repair import check_members, check_sizes

        # sizes and counts, then each member's name, id and recorded checksum (headers, never the audio)
        problems = check_sizes(OutputDir(folder), ledger) or check_members(OutputDir(folder), ledger)
        if problems:
            status = "damaged"  # rerun the same command to repair; `cosybatch verify` reads it all
    rate = None
    if running and commits:
        since = max(now - RATE_WINDOW_S, run.get("started", now))
        recent = sum(n for ts, n in commits if ts >= since)
        rate = recent / max(now - since, 1e-6)
    total, estimate = run.get("total_rows"), bool(run.get("total_is_estimate"))
    if status == "complete":
        total, estimate = done + failed, False  # a finished part knows its real count
    elif estimate and total is not None:
        total = max(total, done + failed)  # an estimate is never below what is already counted
    eta = None
    if rate and total is not None:
        eta = max(total - done - failed, 0) / rate
    return {"folder": str(folder), "status": status, "done": done, "failed": failed, "total": total,
            "total_is_estimate": estimate, "items_per_second": rate,
            "eta_seconds": eta, "pid": int(pid_text) if running and pid_text.isdigit() else None,
            "audio_seconds": stats.get("job_totals", {}).get("audio_seconds") if stats and not running else None,
            "problems": problems, "warnings": [run_problem] if run_problem else []}


def job_status(root: Path) -> dict:
    folders = job_folders(Path(root), "show the status of")  # one job's parts, as merge requires
    if not folders:
        raise UsageError(f"{root} holds no cosybatch job (no .cosybatch folder, no part-* folders)")
    parts = [part_status(f) for f in folders]
    missing = []
    counts = {int(f.name.split("-of-")[1]) for f in folders if f.name.startswith("part-")}
    if len(counts) == 1:
        count = counts.pop()
        present = {int(f.name.split("-")[1]) for f in folders}
        missing = sorted(set(range(count)) - present)
    totals = [p["total"] for p in parts]
    rates = [p["items_per_second"] for p in parts if p["items_per_second"]]
    done = sum(p["done"] for p in parts)
    failed = sum(p["failed"] for p in parts)
    total = sum(totals) if all(t is not None for t in totals) and not missing else None
    rate = sum(rates) if rates else None
    statuses = {p["status"] for p in parts} | ({"not started"} if missing else set())
    status = statuses.pop() if len(statuses) == 1 else ("running" if "running" in statuses else "partial")
    return {"root": str(root), "status": status, "done": done, "failed": failed, "total": total,
            "total_is_estimate": any(p["total_is_estimate"] for p in parts), "items_per_second": rate,
            "eta_seconds": max(total - done - failed, 0) / rate if rate and total is not None else None,
            "parts": parts if len(parts) > 1 or missing else [], "missing_parts": missing,
            "problems": [(f"{Path(p['folder']).name}: " if len(parts) > 1 else "") + problem
                         for p in parts for problem in p["problems"]],
            "warnings": [(f"{Path(p['folder']).name}: " if len(parts) > 1 else "") + warning
                         for p in parts for warning in p["warnings"]]}


def describe(status: dict) -> str:
    total = status["total"]
    of = f"/{'~' if status['total_is_estimate'] else ''}{total}" if total is not None else ""
    line = f"{status['root']}: {status['status']}, {status['done']}{of} done, {status['failed']} failed"
    if status["items_per_second"]:
        line += f", {status['items_per_second']:.2f} items/s"
    if status["eta_seconds"] is not None:
        line += f", eta {status['eta_seconds']:.0f} s"
    lines = [line]
    for p in status["parts"]:
        lines.append(f"  {Path(p['folder']).name}: {p['status']}, {p['done']} done, {p['failed']} failed")
    for p in [*status["warnings"], *status["problems"]]:
        lines.append(f"  {p}")
    if status["problems"]:
        lines.append("  rerun the same `cosybatch run` command to repair the folder")
    if status["missing_parts"]:
        lines.append(f"  parts not started: {status['missing_parts']}")
    return "\n".join(lines)
