"""Prometheus metrics for batch jobs: a textfile for node_exporter's textfile collector (written
to a temporary name and renamed, so the collector never reads half a file), and an optional push
to a Pushgateway when the run ends."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

# Upper bounds of the batch-duration histogram, in seconds.
BATCH_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class BatchHistogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(BATCH_SECONDS_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.sum += seconds
        for i, bound in enumerate(BATCH_SECONDS_BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, count in zip([*map(str, BATCH_SECONDS_BUCKETS), "+Inf"], self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


def default_job_name(root: Path) -> str:
    """A stable job name from the job's output folder: its name plus a hash of its full path, so
    two jobs whose folders merely share a name never share a Pushgateway group."""
    path = Path(root).resolve()
    digest = hashlib.blake2b(str(path).encode("utf-8", "surrogateescape"), digest_size=4).hexdigest()
    return f"{path.name}-{digest}"


def registry(snapshot: dict, histogram: BatchHistogram, labels: dict[str, str]):
    """A CollectorRegistry holding the job's metrics from a stats snapshot (Stats.to_dict)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily

    names = sorted(labels)
    values = [labels[n] for n in names]

    class _Snapshot:
        def collect(self):
            totals = snapshot["job_totals"]
            items = CounterMetricFamily("cosybatch_items", "Rows finished, by status (whole job).",
                                        labels=[*names, "status"])
            items.add_metric([*values, "done"], totals["items_done"])
            items.add_metric([*values, "failed"], totals["items_failed"])
            yield items
            audio = CounterMetricFamily("cosybatch_audio_seconds", "Seconds of audio written (whole job).",
                                        labels=names)
            audio.add_metric(values, totals["audio_seconds"])
            yield audio
            hist = HistogramMetricFamily("cosybatch_batch_seconds", "Inference time per batch (this run).",
                                         labels=names)
            hist.add_metric(values, histogram.cumulative(), histogram.sum)
            yield hist
            for name, key, doc in (
                ("cosybatch_padding_ratio", "padding_ratio", "Share of computed frames that were padding."),
                ("cosybatch_audio_seconds_per_second", "audio_seconds_per_wall_second",
                 "Audio seconds written per wall-clock second (this run)."),
                ("cosybatch_run_wall_seconds", "wall_seconds", "Wall-clock seconds of this run so far."),
            ):
                g = GaugeMetricFamily(name, doc, labels=names)
                g.add_metric(values, float(snapshot.get(key) or 0.0))
                yield g
            for kind in ("allocated", "reserved"):
                value = snapshot.get("gpu_memory", {}).get(f"peak_{kind}_bytes")
                if value is not None:
                    g = GaugeMetricFamily(f"cosybatch_gpu_memory_{kind}_bytes", f"Peak GPU memory {kind}.",
                                          labels=names)
                    g.add_metric(values, float(value))
                    yield g
            done = GaugeMetricFamily("cosybatch_run_complete", "1 when the run finished its corpus, else 0.",
                                     labels=names)
            done.add_metric(values, 1.0 if snapshot.get("status") == "complete" else 0.0)
            yield done
            last_success = snapshot.get("last_success_timestamp_seconds")
            if last_success is not None:  # kept from run to run in stats.json
                g = GaugeMetricFamily("cosybatch_last_success_timestamp_seconds",
                                      "Unix time at which a run of this job last completed its corpus.", labels=names)
                g.add_metric(values, float(last_success))
                yield g
            info = InfoMetricFamily("cosybatch_run", "What this run is.", labels=names)
            info.add_metric(values, {k: str(snapshot.get(k, "")) for k in ("engine", "voice", "device", "status")})
            yield info

    reg = CollectorRegistry()
    reg.register(_Snapshot())
    return reg


def write_textfile(path, reg) -> None:
    from prometheus_client import write_to_textfile

    write_to_textfile(str(path), reg)  # writes a temporary file and renames it


def push(url: str, reg, job: str, grouping: Optional[dict] = None) -> None:
    """Replace the group /metrics/job/JOB[/shard/I/N] with this registry (an HTTP PUT)."""
    from prometheus_client import push_to_gateway

    push_to_gateway(url, job=job, registry=reg, grouping_key=grouping or {}, timeout=10)
