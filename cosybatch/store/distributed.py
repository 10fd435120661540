"""Splitting one job over many workers with the schedulers teams already run (Kubernetes Indexed
Jobs, Airflow task mapping, SLURM arrays), and presenting their outputs as one dataset.

Each id goes to exactly one of N workers by a stable hash, so any worker can be rerun alone and
the union of all workers is the whole corpus, disjoint. Worker I writes a self-contained output
folder `OUT/part-IIIII-of-NNNNN/`; `cosybatch merge OUT` lists all parts in one manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from ..errors import CorpusError, UsageError
from .tables import read_parquet

INDEX_VARIABLES = ("JOB_COMPLETION_INDEX", "SLURM_ARRAY_TASK_ID", "COSYBATCH_SHARD_INDEX")


def shard_of(item_id: str, count: int) -> int:
    """Stable across processes, machines and Python versions (unlike hash())."""
    digest = hashlib.blake2b(item_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


def parse_shard(spec: Optional[str], env: Mapping[str, str] = os.environ) -> tuple[Optional[int], Optional[int]]:
    """`I/N` -> (I, N). `N` alone takes I from the scheduler's index variable. None -> (None, None)."""
    if spec is None:
        return None, None
    text = spec.strip()
    index = None
    try:
        if "/" in text:
            index_text, count_text = text.split("/", 1)
            index, count = int(index_text), int(count_text)
        else:
            count = int(text)
    except ValueError:
        raise UsageError(f"--shard {spec!r}: use I/N (worker I of N) or N (index from the scheduler)") from None
    if count < 1:
        raise UsageError(f"--shard {spec}: the worker count N must be at least 1; use I/N with 0 <= I < N, "
                         "for example 0/4 for the first of 4 workers")
    if index is not None:
        if not 0 <= index < count:
            raise UsageError(f"--shard {spec}: the worker index I must be in 0..{count - 1} (workers are "
                             "numbered from 0)")
        return index, count
    for name in INDEX_VARIABLES:
        if env.get(name, "").strip():
            index, source = _env_index(env, name, spec), f"{name}={env[name].strip()}"
            if name == "SLURM_ARRAY_TASK_ID" and env.get("SLURM_ARRAY_TASK_MIN", "").strip():
                index -= _env_index(env, "SLURM_ARRAY_TASK_MIN", spec)
                source += f" minus SLURM_ARRAY_TASK_MIN={env['SLURM_ARRAY_TASK_MIN'].strip()}"
            if not 0 <= index < count:  # RunConfig checks too, but cannot say where the index came from
                raise UsageError(f"--shard {spec}: the worker index from {source} is {index}, outside "
                                 f"0..{count - 1}; give the scheduler {count} tasks numbered from 0, "
                                 "or use --shard I/N")
            return index, count
    raise UsageError(f"--shard {spec}: no worker index in the environment ({', '.join(INDEX_VARIABLES)}); "
                     "use --shard I/N")


def _env_index(env: Mapping[str, str], name: str, spec: str) -> int:
    """A scheduler variable as an int. A wrong value is the job template's mistake (a typo, a
    variable set by hand), so it is a usage error naming the variable, not a traceback."""
    value = env[name]
    try:
        return int(value)
    except ValueError:
        shown = repr(value) if len(value) <= 40 else repr(value[:40]) + "…"
        raise UsageError(f"{name}={shown} is not a worker index; --shard {spec} takes this worker's index "
                         f"from {name}, which must be a whole number: fix or unset it, or use --shard I/N") from None


def part_name(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}"


def output_dirs(root: Path) -> list[Path]:
    """The job folders under `root`: itself, or its part-* folders for a sharded job."""
    root = Path(root)
    if (root / ".cosybatch").is_dir():
        return [root]
    return sorted(p for p in root.glob("part-*-of-*") if (p / ".cosybatch").is_dir())


def merge(root: Path, allow_partial: bool = False) -> dict:
    """Write ROOT/manifest.parquet listing every part's items (shard paths relative to ROOT),
    ROOT/failures.jsonl and ROOT/stats.json (the job's totals).

    Every part must be the same job: its job.json (settings, engine, corpus hash, columns) must
    match the first part's, and its recorded shard must be the I/N of its folder name; any
    difference is refused, naming the part and the field. A part is left out when a run holds
    its lock (it is being written now), when it never finished, or when its shards do not have
    the sizes its journal says (a shard deleted or cut after it finished): then merge refuses
    unless `allow_partial`, and `problems` says what was left out.

    Returns (and stats.json holds): ``parts`` the job's number of parts (N of --shard I/N),
    ``parts_found`` the part folders present, ``parts_merged`` the finished ones merged,
    ``items`` and ``failed`` the rows merged, ``audio_seconds`` their audio, ``problems``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .checkpoint import FAILURES_FILE, MANIFEST_FILE, STATS_FILE, atomic_file, json_bytes, write_atomic

    root = Path(root)
    parts = sorted(root.glob("part-*-of-*"))
    if not parts:
        raise UsageError(f"{root} has no part-*-of-* folders to merge; merge is for jobs run with --shard")
    count = check_one_job(root, parts, "merge")
    problems = []
    present = {int(p.name.split("-")[1]) for p in parts}
    missing = sorted(set(range(count)) - present)
    if missing:
        problems.append(f"parts {missing} of {count} are missing")
    tables, failures = [], []
    for part in parts:
        why = unmergeable(part)
        if why:
            problems.append(f"{part.name} {why}")
            continue
        table = read_parquet(part / MANIFEST_FILE)
        shards = [f"{part.name}/{s}" for s in table.column("shard").to_pylist()]
        tables.append(table.set_column(table.schema.get_field_index("shard"), "shard", pa.array(shards)))
        if (part / FAILURES_FILE).exists():
            failures.extend(line for line in (part / FAILURES_FILE).read_text().splitlines() if line)
    if problems and not allow_partial:
        raise UsageError(f"cannot merge {root}: " + "; ".join(problems) + ". Run the missing or damaged "
                         "workers again (each resumes, and repairs its folder), or pass --partial to merge "
                         "what is finished and whole.")
    # Parts differ in optional columns (instruct) when only some of their rows have one.
    table = pa.concat_tables(tables, promote_options="default") if tables else None
    ids = table.column("id").to_pylist() if table is not None else []
    if len(ids) != len(set(ids)):
        raise CorpusError(f"{root}: the parts share ids; were they run with different --shard counts?")
    if table is not None:
        with atomic_file(root / MANIFEST_FILE) as f:
            pq.write_table(table, f)
    else:
        (root / MANIFEST_FILE).unlink(missing_ok=True)  # an older merge's list would name parts left out now
    write_atomic(root / FAILURES_FILE, "".join(line + "\n" for line in failures).encode())
    audio_s = sum(table.column("duration_s").to_pylist()) if table is not None else 0.0
    result = {"parts": count, "parts_found": len(parts), "parts_merged": len(tables), "items": len(ids),
              "failed": len(failures), "audio_seconds": round(audio_s, 3), "problems": problems}
    write_atomic(root / STATS_FILE, json_bytes({"status": "partial" if problems else "complete", **result}))
    return result


def job_folders(root: Path, verb: str) -> list[Path]:
    """`output_dirs(root)`, after the check `merge` makes: a root's parts must be the workers of
    one job (one worker count, one corpus and settings). `export`, `qc` and `status` read a root
    through this, so none of them presents what `merge` refuses; `verb` says which in the refusal
    ("cannot export ROOT: ...")."""
    root = Path(root)
    folders = output_dirs(root)
    if folders and folders[0] != root:
        check_one_job(root, sorted(root.glob("part-*-of-*")), verb)
    return folders


def check_one_job(root: Path, parts: list[Path], verb: str) -> int:
    """The worker count N shared by all `parts` (part-I-of-N folders of `root`), after refusing
    parts of different counts or of different jobs (`check_same_job`)."""
    counts: dict[int, list[str]] = {}
    for part in parts:
        counts.setdefault(int(part.name.split("-of-")[1]), []).append(part.name)
    if len(counts) != 1:
        listing = "; ".join(f"{n} workers: {', '.join(names)}" for n, names in sorted(counts.items()))
        raise UsageError(f"cannot {verb} {root}: it mixes jobs split into different worker counts: "
                         f"{sorted(counts)} ({listing}). A root holds the part-*-of-N folders of one job: "
                         "move the other job's parts to a root of their own, then try again.")
    count = next(iter(counts))
    check_same_job(root, parts, count, verb)
    return count


def check_same_job(root: Path, parts: list[Path], count: int, verb: str = "merge") -> None:
    """Refuse parts that are not workers of one job: another corpus, other settings or engine,
    or a recorded shard that is not the folder's I/N. --partial does not lift this: a merge of
    two jobs is never a dataset."""
    from .checkpoint import OutputDir, differences

    reference: Optional[tuple[str, dict]] = None
    found = []
    for part in parts:
        try:
            recorded = OutputDir(part).recorded()
        except (OSError, ValueError):
            recorded = None
        fingerprint = recorded.get("fingerprint") if isinstance(recorded, dict) else None
        if not isinstance(fingerprint, dict):
            continue  # a part that never started: unmergeable() says so
        index = int(part.name.split("-")[1])
        if "shard" in fingerprint and fingerprint["shard"] != [index, count]:
            found.append(f"{part.name}: field shard is {fingerprint.get('shard')!r} in its job.json, "
                         f"not [{index}, {count}] as its folder name says")
        job = {k: v for k, v in fingerprint.items() if k != "shard"}
        if reference is None:
            reference = (part.name, job)
            continue
        diffs = differences(reference[1], job)
        if diffs:
            fields = ", ".join(d.split(" was ", 1)[0] for d in diffs)
            found.append(f"{part.name} differs from {reference[0]} in {fields} ("
                         + "; ".join(d.replace(" was ", f": {reference[0]} has ", 1).replace(", now ",
                                                                                          f", {part.name} has ", 1)
                                     for d in diffs) + ")")
    if found:
        raise UsageError(f"cannot {verb} {root}: its parts are not the workers of one job: " + "; ".join(found)
                         + ". Rerun those parts with the job's corpus and settings (into their own folders), "
                         f"or {verb} each job's parts on their own (one root per job).")


def unmergeable(part: Path) -> Optional[str]:
    """Why one part cannot be merged now (a sentence that follows its name), or None."""
    from .checkpoint import MANIFEST_FILE, RAY_FAILURES_DIR, STATE_DIR, STATS_FILE, OutputDir
    from .repair import check_sizes

    out = OutputDir(part)
    if out.lock_held():
        return "is being written by a run now (its lock is held); wait for it to finish"
    try:
        stats = json.loads((part / STATS_FILE).read_text())
    except (OSError, ValueError):
        stats = None
    status = stats.get("status") if isinstance(stats, dict) else None
    if status != "complete" or not (part / MANIFEST_FILE).exists():
        return f"is not complete (status: {status or 'never finished'})"
    if (part / STATE_DIR / RAY_FAILURES_DIR).is_dir():
        return None  # a ray-run part has no journal to check sizes against
    damage = check_sizes(out)
    if damage:
        return "is damaged since it finished (" + "; ".join(damage) + ")"
    return None
