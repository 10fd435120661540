"""The audit page, OUT/report.html: one self-contained HTML file to look at and listen to a job.

On it: the summary as a table, and the hearing limits each voice used (the summary's
qc.calibration) when there are any; inline SVG plots drawn here (duration against text length
coloured by passed / flagged / failed, the histogram of the hearing score `qc_support` with its
limit marked, the CER histogram of the clips transcribed instead (too long for one window, or an
older folder), pass rate per voice, throughput over the run); audio players for the 20 worst clips
(highest `qc_score`, ties by id) and a seeded random 20 of the others, each clip's WAV embedded as
a data: URI, each with its hearing (support, worst, beyond_s, stretch_s) and its text's words as
the hearing placed them, coloured by how well the audio supports each. The words are the row's
`words` (qc.parquet's JSON string, or a list), else its KEY.json's qc.asr.words, read from its
shard as store/readback.py says (never through a link, only a regular tar member under
RECORD_CAP bytes), and only when that record's support is the row's. Nothing on the page refers to
anything outside it (no network, no CDN, no other file; a Content-Security-Policy tells the browser
so), and a small inline script marks each <audio> once its metadata has loaded, so a browser test
(and a reader) can see how many clips play. The policy allows that one script by its sha256,
computed as the page is written, not every inline script: escaping is not the only guard.

Everything taken from rows and the summary is HTML-escaped: ids and texts come from a user's
corpus. Each such string shown in the page's flow is also isolated (<bdi>), so a bidi control in
it (U+202E RIGHT-TO-LEFT OVERRIDE, ...) cannot reorder the rest of its line; in ids, voices,
flags, the summary and the title, where nothing needs them, the controls are shown as [U+202E]
(in the SVG tooltips and the <title> too, which cannot isolate). Long ids and texts wrap inside
their cards. The same arguments give the same bytes (no clock on the page; randomness from `seed`).
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import os
import random
import secrets
import tarfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import Optional

from ..store.audio import mime_type
from ..store.readback import NotReadable, open_regular

SCATTER_CAP = 5000  # more points than this: a seeded sample of this many is plotted, and the page says so
WORST = 20  # clips shown with the highest qc_score
SAMPLE = 20  # clips shown at random (seeded) among the others
CER_BIN = 0.05  # the histogram's bins: [0, 0.05), ..., [0.95, 1), then one bin for CER >= 1
CER_BINS = 20
SUPPORT_BIN = 0.5  # the support histogram: one bar below 0, [0, 0.5), ..., [9.5, 10), one bar for 10 and above
SUPPORT_TOP = 10.0
SUPPORT_BINS = round(SUPPORT_TOP / SUPPORT_BIN) + 2
MIN_SUPPORT = 3.0  # the limit marked when the summary gives none (the gate's default `min_support`)
WORD_LOW, WORD_WEAK = 0.1, 0.5  # a word's probability below these: red ("low"), amber ("weak")
WORDS_CAP = 1000  # words shown per clip
RECORD_CAP = 1 << 20  # the largest KEY.json (or qc.parquet `words` string) read for a clip's words

# Plot geometry, in SVG user units: width, and the margins around the plotting area.
WIDTH, LEFT, RIGHT, TOP, BOTTOM = 640, 64, 24, 16, 48


def write_report(
    path: Path,
    rows: list[dict],
    summary: dict,
    clip: Callable[[str], bytes],
    *,
    seed: int = 0,
    throughput: Sequence[tuple[float, float]] = (),
    rate: Optional[tuple[float, float]] = None,
    title: str = "cosybatch report",
    record: Optional[Callable[[dict], dict]] = None,
) -> None:
    """Write the audit page to `path` atomically (a temporary file beside it, then a rename).

    rows: one dict per clip; `id`, `text` and `duration_s` are expected, every other key (`voice`,
    `units`, `qc_pass`, `qc_flags`, `qc_cer`, `qc_wer`, `qc_asr_text`, `qc_attempts`, `qc_score`) may
    be missing. summary: shown as a table, nested dicts flattened to dotted keys. clip(id): the audio
    bytes of one clip, called only for the (at most 40) clips the page plays. throughput: points
    (seconds since the job started, cumulative audio seconds committed). rate: (audio seconds, wall
    seconds) of the run, for the throughput note; without it the note's rate is the last point's
    audio over its time (the points must then start at the job's start). seed: the random sample's
    and the scatter cap's seed. record(row): the clip's KEY.json, asked only for a shown clip whose
    hearing the row does not hold whole; by default read from the shard the row names (`shard`,
    relative to the page's folder, and `key`), as shard_records says.

    The summary's qc block (summary["qc"], else the summary itself) may give `limits.min_support`
    (marked on the support histogram, else MIN_SUPPORT) and `calibration` (voice -> min_support,
    min_word_support, clips), shown as a table.
    """
    if record is None:
        record = shard_records(Path(path).parent)
    page = render_report(rows, summary, clip, seed=seed, throughput=throughput, rate=rate, title=title,
                         record=record)
    _write_atomic(Path(path), page.encode("utf-8"))


def render_report(
    rows: list[dict],
    summary: dict,
    clip: Callable[[str], bytes],
    *,
    seed: int = 0,
    throughput: Sequence[tuple[float, float]] = (),
    rate: Optional[tuple[float, float]] = None,
    title: str = "cosybatch report",
    record: Optional[Callable[[dict], dict]] = None,
) -> str:
    """The page as a string (write_report writes it). Without `record`, only the rows' own words."""
    worst, sample = choose_clips(rows, seed)
    record = record or (lambda _row: {})
    qc = _qc_block(summary)
    body = [
        f"<h1>{_ident(title)}</h1>",
        _summary_table(summary),
        _calibration_table(qc.get("calibration")),
        '<section id="plots"><h2>Plots</h2>',
        _scatter(rows, seed),
        *_hearing_histograms(rows, qc),
        _pass_rate(rows),
        _throughput(throughput, rate),
        "</section>",
        '<section id="clips"><h2>Listen</h2>',
        '<p id="audio-status" class="note">Checking the clips…</p>',
        _clip_section(
            "worst",
            f"The {len(worst)} worst clips",
            "Highest qc_score first (higher is worse), ties by id.",
            [rows[i] for i in worst],
            clip,
            record,
        ),
        _clip_section(
            "sample",
            f"{len(sample)} clips at random",
            f"A random sample (seed {_e(seed)}) of the clips not shown above, in id order.",
            [rows[i] for i in sample],
            clip,
            record,
        ),
        "</section>",
        f"<script>{_SCRIPT}</script>",
    ]
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{csp(_SCRIPT)}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(_visible(title))}</title><style>{_CSS}</style></head>\n<body>\n" + "\n".join(body)
        + "\n</body></html>\n"
    )


def csp(script: str) -> str:
    """The page's Content-Security-Policy: nothing from outside; inline styles; of scripts, only
    the one whose text is `script` (by its sha256, as CSP level 2 hashes an inline script's text)."""
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    return (f"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{digest}'; media-src data:; "
            "img-src data:")


def choose_clips(rows: list[dict], seed: int) -> tuple[list[int], list[int]]:
    """Indexes into rows: the WORST highest qc_score (ties by id), and a seeded random SAMPLE of
    the rest in id order. The sample is drawn from the rest sorted by id, so it does not depend on
    the order the rows came in."""
    by_badness = sorted(range(len(rows)), key=lambda i: (-_score(rows[i]), str(rows[i].get("id")), i))
    worst = by_badness[:WORST]
    shown = set(worst)
    rest = sorted((i for i in range(len(rows)) if i not in shown), key=lambda i: (str(rows[i].get("id")), i))
    sample = random.Random(seed).sample(rest, min(SAMPLE, len(rest)))
    sample.sort(key=lambda i: (str(rows[i].get("id")), i))
    return worst, sample


def status(row: dict) -> str:
    """passed / flagged / failed, the scatter's colours: failed when the gate said no, flagged when
    a signal fired (whatever the gate said), passed otherwise."""
    if row.get("qc_pass") is False:
        return "failed"
    if row.get("qc_flags"):
        return "flagged"
    return "passed"


def passes(row: dict) -> bool:
    """What the pass rate counts: the gate's verdict where one ran, no flag where none did."""
    verdict = row.get("qc_pass")
    return bool(verdict) if verdict is not None else not row.get("qc_flags")


def shard_records(root: Path) -> Callable[[dict], dict]:
    """row -> its clip's KEY.json record, read from the shard the row names (`shard`, a path
    relative to root, and `key`): {} when the row names none. As store/readback.py says: the shard
    is opened only as a regular file (never through a link, never waiting on a FIFO), and the
    member only when it is a regular member of at most RECORD_CAP bytes; otherwise NotReadable
    (or the error of the read), which the page shows on the clip's card."""
    root = Path(root)

    def record(row: dict) -> dict:
        shard, key = row.get("shard"), row.get("key")
        if not (isinstance(shard, str) and isinstance(key, str) and shard and key):
            return {}
        rel = PurePosixPath(shard)
        if rel.is_absolute() or ".." in rel.parts:
            raise NotReadable(f"the shard {shard!r} is not inside the folder")
        with open_regular(root / rel) as f, tarfile.open(fileobj=f) as tar:
            member = tar.getmember(f"{key}.json")
            if not member.isfile():
                raise NotReadable(f"{key}.json in {shard} is not a file")
            if member.size > RECORD_CAP:
                raise NotReadable(f"{key}.json in {shard} is {member.size:,} bytes, more than the {RECORD_CAP:,} "
                                  "read back")
            data = tar.extractfile(member).read(RECORD_CAP + 1)
        value = json.loads(data)
        return value if isinstance(value, dict) else {}

    return record


# -- the summary --------------------------------------------------------------------------------
def _flatten(d: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    for key, value in d.items():
        if isinstance(value, dict) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _value(v: object) -> str:
    """A summary value as text (not yet escaped)."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return _num(v)
    if isinstance(v, (list, tuple)):
        return ", ".join(_value(x) for x in v)
    if isinstance(v, dict):
        return "{}"
    return str(v)


def _summary_table(summary: dict) -> str:
    lines = ['<section id="summary-section"><h2>Summary</h2><table id="summary"><tbody>']
    for key, value in _flatten(summary):
        lines.append(f'<tr data-key="{_e(key)}"><th>{_ident(key)}</th><td>{_ident(_value(value))}</td></tr>')
    lines.append("</tbody></table></section>")
    return "\n".join(lines)


def _qc_block(summary: dict) -> dict:
    """The quality gate's part of the summary: summary["qc"] (a run's page), else the summary
    itself (stats.json's qc block, or `cosybatch qc`'s summary)."""
    qc = summary.get("qc") if isinstance(summary, dict) else None
    return qc if isinstance(qc, dict) else summary if isinstance(summary, dict) else {}


def _calibration_table(calibration: object) -> str:
    """voice -> the hearing limits the gate used for it and the passing clips they were learned from."""
    if not isinstance(calibration, dict) or not calibration:
        return ""
    lines = [
        '<section id="calibration-section"><h2>Hearing limits per voice</h2>',
        '<p class="note">The limits each voice\'s clips were heard against: the configured ones, moved down '
        "to what the voice's passing clips score on this corpus once there are enough of them (clips: how "
        "many).</p>",
        '<table id="calibration"><thead><tr><th>voice</th><th>min_support</th><th>min_word_support</th>'
        "<th>clips</th></tr></thead><tbody>",
    ]
    for voice, limits in sorted(calibration.items(), key=lambda kv: str(kv[0])):
        limits = limits if isinstance(limits, dict) else {}
        cells = "".join(
            f'<td data-name="{name}">{_e(_num(float(limits[name])) if _finite(limits.get(name)) else "–")}</td>'
            for name in ("min_support", "min_word_support", "clips")
        )
        lines.append(f'<tr data-voice="{_e(voice)}"><th>{_ident(voice)}</th>{cells}</tr>')
    lines.append("</tbody></table></section>")
    return "\n".join(lines)


# -- plots --------------------------------------------------------------------------------------
class _Frame:
    """A plotting area: maps data (0..x1, 0..y1) to SVG units, draws axes with ticks and labels."""

    def __init__(self, x1: float, y1: float, height: int = 320, left: int = LEFT, right: int = RIGHT):
        self.x1, self.y1, self.height, self.left = x1, y1, height, left
        self.inner_w = WIDTH - left - right
        self.inner_h = height - TOP - BOTTOM

    def x(self, v: float) -> float:
        return self.left + v / self.x1 * self.inner_w

    def y(self, v: float) -> float:
        return TOP + (1 - v / self.y1) * self.inner_h

    def open(self, svg_id: str, label: str) -> str:
        return (
            f'<svg id="{svg_id}" class="plot" viewBox="0 0 {WIDTH} {self.height}" role="img" aria-label="{_e(label)}">'
        )

    def axes(self, xticks: list[float], yticks: list[float], xlabel: str, ylabel: str, xfmt=None, yfmt=None) -> str:
        xfmt, yfmt = xfmt or _tick, yfmt or _tick
        bottom, right = TOP + self.inner_h, self.left + self.inner_w
        out = ['<g class="axes">']
        out.append(f'<line class="axis" x1="{self.left}" y1="{bottom}" x2="{right}" y2="{bottom}"/>')
        out.append(f'<line class="axis" x1="{self.left}" y1="{TOP}" x2="{self.left}" y2="{bottom}"/>')
        for t in xticks:
            x = _f(self.x(t))
            out.append(f'<line class="tick" x1="{x}" y1="{bottom}" x2="{x}" y2="{bottom + 5}"/>')
            out.append(f'<text class="xtick" x="{x}" y="{bottom + 18}" text-anchor="middle">{_e(xfmt(t))}</text>')
        for t in yticks:
            y = _f(self.y(t))
            out.append(f'<line class="grid" x1="{self.left}" y1="{y}" x2="{right}" y2="{y}"/>')
            out.append(
                f'<text class="ytick" x="{self.left - 8}" y="{y}" text-anchor="end" dy="0.32em">{_e(yfmt(t))}</text>'
            )
        out.append(
            f'<text class="label" x="{_f(self.left + self.inner_w / 2)}" y="{self.height - 8}" text-anchor="middle">'
            f"{_e(xlabel)}</text>"
        )
        ymid = _f(TOP + self.inner_h / 2)
        out.append(
            f'<text class="label" x="14" y="{ymid}" text-anchor="middle" transform="rotate(-90 14 {ymid})">'
            f"{_e(ylabel)}</text>"
        )
        out.append("</g>")
        return "\n".join(out)


def _ticks(vmax: float, n: int = 5) -> list[float]:
    """Round tick values 0, step, 2*step, ... up to the first one at or above vmax."""
    if not (vmax > 0 and math.isfinite(vmax)):
        vmax = 1.0
    raw = vmax / n
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    count = math.ceil(vmax / step - 1e-9)
    return [i * step for i in range(count + 1)]


def _scatter(rows: list[dict], seed: int) -> str:
    points, skipped = [], 0
    for row in rows:
        units = row.get("units")
        if units is None:
            units = len(str(row.get("text", "")))
        duration = row.get("duration_s")
        if _finite(units) and _finite(duration):
            points.append((float(units), float(duration), row))
        else:
            skipped += 1
    notes = []
    if len(points) > SCATTER_CAP:
        kept = sorted(random.Random(seed).sample(range(len(points)), SCATTER_CAP))
        notes.append(
            f'<p class="note" id="scatter-cap">The plot shows {SCATTER_CAP:,} of the {len(points):,} clips, '
            f"a random sample (seed {_e(seed)}); the counts in the legend are of all clips.</p>"
        )
        plotted = [points[i] for i in kept]
    else:
        plotted = points
    if skipped:
        notes.append(
            f'<p class="note" id="scatter-skipped">{skipped:,} clips without a duration or length are not plotted.</p>'
        )
    counts = {s: sum(1 for p in points if status(p[2]) == s) for s in ("passed", "flagged", "failed")}
    frame = _Frame(max((p[0] for p in plotted), default=0) or 1, max((p[1] for p in plotted), default=0) or 1)
    xt, yt = _ticks(frame.x1), _ticks(frame.y1)
    frame.x1, frame.y1 = xt[-1], yt[-1]
    radius = 2.5 if len(plotted) <= 500 else 1.6
    legend = "".join(
        f'<li class="{s}" data-status="{s}"><span class="swatch"></span>{s} ({n:,})</li>' for s, n in counts.items()
    )
    out = [
        '<figure id="plot-duration"><figcaption>Duration against text length, one point per clip</figcaption>',
        f'<ul class="legend" id="scatter-legend">{legend}</ul>',
        frame.open("duration-vs-length", "duration in seconds against spoken characters"),
        frame.axes(xt, yt, "text length (spoken characters)", "duration (s)"),
        '<g class="points">',
    ]
    # Failed points last, so they are drawn on top.
    for wanted in ("passed", "flagged", "failed"):
        for units, duration, row in plotted:
            s = status(row)
            if s != wanted:
                continue
            tip = f"{_visible(row.get('id'))}: {units:g} characters, {duration:.2f} s"
            if row.get("qc_flags"):
                tip += " – " + ", ".join(_visible(f) for f in row["qc_flags"])
            out.append(
                f'<circle class="{s}" cx="{_f(frame.x(units))}" cy="{_f(frame.y(duration))}" r="{radius}" '
                f'data-id="{_e(row.get("id"))}"><title>{_e(tip)}</title></circle>'
            )
    out += ["</g></svg>", *notes, "</figure>"]
    return "\n".join(out)


def _hearing_histograms(rows: list[dict], qc: dict) -> list[str]:
    """The support histogram where clips were heard; the CER histogram where clips were
    transcribed instead (too long for one window, or a folder from before the hearing), or where
    neither (then only its note)."""
    heard = any(_finite(r.get("qc_support")) for r in rows)
    transcribed = any(_finite(r.get("qc_cer")) for r in rows)
    out = []
    if heard:
        limits = qc.get("limits")
        limit = limits.get("min_support") if isinstance(limits, dict) else None
        out.append(_support_histogram(rows, float(limit) if _finite(limit) else MIN_SUPPORT,
                                      isinstance(qc.get("calibration"), dict) and bool(qc["calibration"])))
    if transcribed or not heard:
        out.append(_cer_histogram(rows, heard))
    return out


def _support_bin(s: float) -> int:
    if s < 0:
        return 0
    return min(int(s / SUPPORT_BIN) + 1, SUPPORT_BINS - 1)


def _support_histogram(rows: list[dict], limit: float, calibrated: bool) -> str:
    supports = [float(r["qc_support"]) for r in rows if _finite(r.get("qc_support"))]
    counts = [0] * SUPPORT_BINS  # the first bin: below 0; the last: SUPPORT_TOP and above
    for s in supports:
        counts[_support_bin(s)] += 1
    # Data positions are support + SUPPORT_BIN, so the bar below 0 starts at position 0.
    shift = SUPPORT_BIN
    frame = _Frame(SUPPORT_TOP + 2 * SUPPORT_BIN, 1.0)
    yt = _ticks(max(counts))
    frame.y1 = yt[-1]
    xt = [v + shift for v in range(0, int(SUPPORT_TOP) + 1, 2)]
    out = [
        '<figure id="plot-support"><figcaption>How well each clip\'s audio supports its text: the mean '
        "log-probability gain per token of the text with the audio over without it</figcaption>",
        frame.open("support-histogram", "histogram of the hearing score, support"),
        frame.axes(xt, yt, f"support (the end bars: below 0, {SUPPORT_TOP:g} and above)", "clips",
                   xfmt=lambda v: f"{v - shift:g}", yfmt=lambda v: f"{v:g}"),
        '<g class="bars">',
    ]
    for i, n in enumerate(counts):
        lo = (i - 1) * SUPPORT_BIN  # the first bar is drawn over [-SUPPORT_BIN, 0)
        hi = lo + SUPPORT_BIN
        if i == 0:
            label, kind, data_lo = "support below 0", " under", "-inf"
        elif i == SUPPORT_BINS - 1:
            label, kind, data_lo = f"support ≥ {lo:g}", " over", f"{lo:g}"
        else:
            label, kind, data_lo = f"support {lo:g} to {hi:g}", "", f"{lo:g}"
        if hi <= limit and i != SUPPORT_BINS - 1:
            kind += " below"
        x0, x1, y = frame.x(lo + shift), frame.x(hi + shift), frame.y(n)
        out.append(
            f'<rect class="bar{kind}" x="{_f(x0 + 1)}" y="{_f(y)}" width="{_f(x1 - x0 - 2)}" '
            f'height="{_f(frame.y(0) - y)}" data-lo="{data_lo}" data-count="{n}"><title>{_e(label)}: {n}</title></rect>'
        )
    at = frame.x(min(max(limit, -SUPPORT_BIN), SUPPORT_TOP + SUPPORT_BIN) + shift)
    out += [
        "</g>",
        f'<line class="limit" x1="{_f(at)}" y1="{TOP}" x2="{_f(at)}" y2="{_f(frame.y(0))}" data-limit="{limit:g}">'
        f"<title>the limit, min_support {limit:g}</title></line>",
        f'<text class="limit-label" x="{_f(at + 4)}" y="{TOP + 10}">limit {limit:g}</text>',
        "</svg>",
        f'<p class="note">{len(supports):,} of {len(rows):,} clips heard; median support '
        f"{_num(_median(supports))}; {sum(1 for s in supports if s < limit):,} below the limit {limit:g}"
        + (" (each voice's own limit is in the table above)" if calibrated else "") + ".</p>",
        "</figure>",
    ]
    return "\n".join(out)


def _cer_histogram(rows: list[dict], heard: bool = False) -> str:
    cers = [float(r["qc_cer"]) for r in rows if _finite(r.get("qc_cer"))]
    caption = ("Character error rate of the clips transcribed rather than heard (too long for one window)"
               if heard else "Character error rate of the ASR round trip")
    head = f'<figure id="plot-cer"><figcaption>{caption}</figcaption>'
    if not cers:
        return head + '\n<p class="note" id="cer-none">No clip has a CER: no ASR ran on these clips.</p>\n</figure>'
    counts = [0] * (CER_BINS + 1)  # the last bin: CER >= 1
    for c in cers:
        counts[min(int(max(c, 0.0) / CER_BIN), CER_BINS)] += 1
    frame = _Frame(CER_BIN * (CER_BINS + 1), 1.0)
    yt = _ticks(max(counts))
    frame.y1 = yt[-1]
    xt = [i * 0.2 for i in range(6)]
    out = [
        head,
        frame.open("cer-histogram", "histogram of character error rates"),
        frame.axes(xt, yt, "CER (the last bar: 1 and above)", "clips", yfmt=lambda v: f"{v:g}"),
        '<g class="bars">',
    ]
    for i, n in enumerate(counts):
        lo = i * CER_BIN
        label = f"CER ≥ {lo:g}" if i == CER_BINS else f"CER {lo:.2f} to {lo + CER_BIN:.2f}"
        x0, x1, y = frame.x(lo), frame.x(lo + CER_BIN), frame.y(n)
        out.append(
            f'<rect class="bar{" overflow" if i == CER_BINS else ""}" x="{_f(x0 + 1)}" y="{_f(y)}" '
            f'width="{_f(x1 - x0 - 2)}" height="{_f(frame.y(0) - y)}" data-lo="{lo:g}" data-count="{n}">'
            f"<title>{_e(label)}: {n}</title></rect>"
        )
    out += [
        "</g></svg>",
        f'<p class="note">{len(cers):,} of {len(rows):,} clips transcribed; median CER {_num(_median(cers))}.</p>',
        "</figure>",
    ]
    return "\n".join(out)


def _pass_rate(rows: list[dict]) -> str:
    voices: dict[str, list[int]] = {}
    for row in rows:
        tally = voices.setdefault(str(row.get("voice") or "(no voice)"), [0, 0])
        tally[0] += passes(row)
        tally[1] += 1
    head = (
        '<figure id="plot-voices"><figcaption>Pass rate per voice (the gate\'s verdict where it ran, '
        "no flag where it did not)</figcaption>"
    )
    if not voices:
        return head + '\n<p class="note">No clips.</p>\n</figure>'
    row_h = 26
    frame = _Frame(1.0, 1.0, height=TOP + row_h * len(voices) + BOTTOM, left=150, right=110)  # room for the labels
    xt = [i * 0.25 for i in range(5)]
    out = [
        head,
        frame.open("pass-rate", "pass rate per voice"),
        frame.axes(xt, [], "pass rate", "", xfmt=lambda v: f"{v * 100:g}%"),
        '<g class="bars">',
    ]
    for i, (voice, (passed, total)) in enumerate(sorted(voices.items())):
        y = TOP + i * row_h
        rate = passed / total
        shown = _visible(voice)
        name = shown if len(shown) <= 22 else shown[:21] + "…"
        out.append(
            f'<text class="ytick" x="{frame.left - 8}" y="{_f(y + row_h / 2)}" text-anchor="end" dy="0.32em">'
            f"<title>{_e(shown)}</title>{_e(name)}</text>"
        )
        out.append(
            f'<rect class="bar" x="{frame.left}" y="{_f(y + 4)}" width="{_f(frame.x(rate) - frame.left)}" '
            f'height="{row_h - 8}" '
            f'data-voice="{_e(voice)}" data-passed="{passed}" data-total="{total}">'
            f"<title>{_e(shown)}: {passed} of {total} passed</title></rect>"
        )
        out.append(
            f'<text class="value" x="{_f(frame.x(rate) + 6)}" y="{_f(y + row_h / 2)}" '
            f'dy="0.32em">{passed}/{total} ({rate:.0%})</text>'
        )
    out += ["</g></svg>", "</figure>"]
    return "\n".join(out)


def _throughput(points: Sequence[tuple[float, float]], rate: Optional[tuple[float, float]] = None) -> str:
    pts = sorted((float(t), float(a)) for t, a in points if _finite(t) and _finite(a))
    head = '<figure id="plot-throughput"><figcaption>Audio committed over the run</figcaption>'
    if rate is not None and all(_finite(v) for v in rate) and rate[0] >= 0 and rate[1] > 0:
        audio, wall = map(float, rate)
        note = (f'<p class="note" id="throughput-rate">The run made {_num(audio)} s of audio in {_num(wall)} s of '
                f"wall time: {audio / wall:.2f} audio-seconds per second.</p>")
    elif pts and pts[-1][0] > 0:  # the points start at the job's start (write_report's contract)
        t_end, a_end = pts[-1]
        note = (f'<p class="note" id="throughput-rate">{_num(a_end)} s of audio in {_num(t_end)} s since the job '
                f"started: {a_end / t_end:.2f} audio-seconds per second.</p>")
    else:
        note = ""
    if not pts:
        none = '<p class="note" id="throughput-none">No throughput was recorded for this job.</p>'
        return f"{head}\n{none}{note}\n</figure>"
    frame = _Frame(1.0, 1.0)
    xt, yt = _ticks(max(t for t, _ in pts)), _ticks(max(a for _, a in pts))
    frame.x1, frame.y1 = xt[-1], yt[-1]
    line = " ".join(f"{_f(frame.x(t))},{_f(frame.y(a))}" for t, a in pts)
    out = [
        head,
        frame.open("throughput", "cumulative audio seconds against seconds since the start"),
        frame.axes(xt, yt, "seconds since the job started", "audio committed (s)"),
        f'<polyline class="line" points="{line}" data-points="{len(pts)}"/>',
        "</svg>",
        note,
        "</figure>",
    ]
    return "\n".join(out)


# -- the clips ----------------------------------------------------------------------------------
def _clip_section(group: str, heading: str, note: str, chosen: list[dict], clip: Callable[[str], bytes],
                  record: Callable[[dict], dict]) -> str:
    out = [f'<section class="clip-group" id="{group}"><h3>{_e(heading)}</h3><p class="note">{note}</p>']
    for row in chosen:
        out.append(_clip_card(group, row, clip, record))
    out.append("</section>")
    return "\n".join(out)


HEARING = ("worst", "beyond_s", "stretch_s")


def _hearing(row: dict, record: Callable[[dict], dict]) -> dict:
    """A clip's hearing: support, worst, beyond_s, stretch_s, words (a list, see _words, or None)
    and error (why its record could not be read, or None). From the row (`qc_support`; `qc_worst`
    or `worst` and so on; `words`), what it lacks from its KEY.json's qc.asr, taken only when that
    record's support is the row's (the same hearing, not the run's under an audit's)."""
    out = {"support": row.get("qc_support"), "words": _words(row.get("words")), "error": None}
    for name in HEARING:
        out[name] = row.get(f"qc_{name}") if _finite(row.get(f"qc_{name}")) else row.get(name)
    if not _finite(out["support"]) or (out["words"] is not None and all(_finite(out[n]) for n in HEARING)):
        return out
    try:
        rec = record(row)
    except Exception as e:  # a record that cannot be read costs its words, not the page
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    qc = rec.get("qc") if isinstance(rec, dict) else None
    asr = qc.get("asr") if isinstance(qc, dict) else None
    if isinstance(asr, dict) and _finite(asr.get("support")) and abs(asr["support"] - out["support"]) <= 5e-4:
        for name in HEARING:
            if not _finite(out[name]):
                out[name] = asr.get(name)
        if out["words"] is None:
            out["words"] = _words(asr.get("words"))
    return out


def _words(value: object) -> Optional[list]:
    """[[word, start_s, end_s, probability], ...] (or its JSON) -> a list of such tuples, None in
    place of each malformed entry; None when value is not such a list."""
    if isinstance(value, (str, bytes)):
        if len(value) > RECORD_CAP:
            return None
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    if not isinstance(value, (list, tuple)):
        return None
    out: list = []
    for w in value:
        ok = isinstance(w, (list, tuple)) and len(w) >= 4 and isinstance(w[0], str) and all(_finite(x) for x in w[1:4])
        out.append((w[0], float(w[1]), float(w[2]), float(w[3])) if ok else None)
    return out


def _word_class(p: float) -> str:
    return "w low" if p < WORD_LOW else "w weak" if p < WORD_WEAK else "w"


def _words_line(words: Optional[list]) -> str:
    """The text's words as the hearing placed them, each isolated (<bdi>) and coloured by its
    probability given the audio; its times and probability in its tooltip."""
    if not words:
        return ""
    valid = [w for w in words if w is not None]
    spans = [
        f'<bdi class="{_word_class(p)}" data-p="{p:g}" title="{start:.2f}–{end:.2f} s, p {p:.3f}">{_e(word)}</bdi>'
        for word, start, end, p in valid[:WORDS_CAP]
    ]
    notes = []
    if len(valid) > WORDS_CAP:
        notes.append(f"{len(valid) - WORDS_CAP:,} more words not shown")
    if len(valid) < len(words):
        notes.append(f"{len(words) - len(valid):,} malformed entries left out")
    tail = f' <span class="note">({"; ".join(notes)})</span>' if notes else ""
    return f'<p class="words"><span class="what">words</span> {" ".join(spans)}{tail}</p>'


def _clip_card(group: str, row: dict, clip: Callable[[str], bytes], record: Callable[[dict], dict]) -> str:
    rid = str(row.get("id"))
    facts = [f"voice {_visible(row.get('voice') or '–')}"]
    if _finite(row.get("duration_s")):
        facts.append(f"{float(row['duration_s']):.2f} s")
    if row.get("qc_score") is not None:
        facts.append(f"score {_num(float(row['qc_score']))}")
    if row.get("qc_attempts") is not None:
        facts.append(f"attempts {row['qc_attempts']}")
    for key, name in (("qc_cer", "CER"), ("qc_wer", "WER")):
        if _finite(row.get(key)):
            facts.append(f"{name} {float(row[key]):.3f}")
    heard = _hearing(row, record)
    for key, name, fmt in (("support", "support", "{:.3f}"), ("worst", "worst", "{:.3f}"),
                           ("beyond_s", "beyond", "{:.2f} s"), ("stretch_s", "stretch", "{:.2f} s")):
        if _finite(heard[key]):
            facts.append(f"{name} {fmt.format(float(heard[key]))}")
    flags = row.get("qc_flags") or []
    try:
        data = clip(rid)
        player = (
            f'<audio controls preload="metadata" data-id="{_e(rid)}" '
            f'src="data:{mime_type(data)};base64,{base64.b64encode(data).decode("ascii")}"></audio>'
        )
    except Exception as e:  # one unreadable clip must not cost the whole page; it is shown instead
        player = f'<p class="clip-error">The audio could not be read: {_ident(f"{type(e).__name__}: {e}")}</p>'
    asr = row.get("qc_asr_text")
    return "\n".join(
        line for line in [
            f'<article class="clip {status(row)}" data-id="{_e(rid)}" data-group="{group}">',
            f'<p class="head"><bdi class="id">{_e(_visible(rid))}</bdi> · <bdi>{_e(" · ".join(facts))}</bdi>'
            + "".join(f' <bdi class="flag">{_e(_visible(f))}</bdi>' for f in flags)
            + "</p>",
            player,
            f'<p class="text"><span class="what">text</span> <bdi>{_e(row.get("text", ""))}</bdi></p>',
            _words_line(heard["words"]),
            f'<p class="note words-error">The hearing\'s words could not be read: {_ident(heard["error"])}</p>'
            if heard["error"] else "",
            f'<p class="asr"><span class="what">heard</span> <bdi>{_e(asr)}</bdi></p>' if asr is not None else "",
            "</article>",
        ] if line
    )


# -- small helpers ------------------------------------------------------------------------------
def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


# The bidirectional formatting characters (Unicode's Bidi_Control property): marks, embeddings,
# overrides and isolates. In an id one can reverse what follows it on the line.
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _visible(value: object) -> str:
    """value as text with each bidi control shown as [U+XXXX] (for ids, voices, flags, keys)."""
    text = str(value)
    if not BIDI_CONTROLS.intersection(text):
        return text
    return "".join(f"[U+{ord(c):04X}]" if c in BIDI_CONTROLS else c for c in text)


def _ident(value: object) -> str:
    """An identifier-like user string for the page's flow: controls shown, escaped, isolated."""
    return f"<bdi>{_e(_visible(value))}</bdi>"


def _f(v: float) -> str:
    """An SVG coordinate: one decimal is finer than a pixel."""
    return f"{v:.1f}"


def _tick(v: float) -> str:
    return f"{v:,.6g}"


def _num(v: float) -> str:
    """A number for a reader: integers as such, otherwise about four significant digits."""
    if not math.isfinite(v):
        return str(v)
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v):,}"
    if abs(v) >= 1:
        return f"{v:,.3f}".rstrip("0").rstrip(".")
    return f"{v:.4g}"


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _score(row: dict) -> float:
    score = row.get("qc_score")
    if score is None:
        return 0.0
    score = float(score)
    return math.inf if math.isnan(score) else score  # a NaN score is something broken: among the worst


def _median(values: list[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _write_atomic(path: Path, data: bytes) -> None:
    # A unique temporary name, so two writers never share one; opened with "x" so the umask applies.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Only inline styles, the page's one script (by its hash, csp()) and data: audio: the page cannot
# reach anything outside itself, and a script that escaping missed would not run.

_CSS = """
body{font:15px/1.45 system-ui,sans-serif;margin:2rem auto;max-width:960px;padding:0 1rem;color:#222}
h1{font-size:1.6rem}h2{margin-top:2rem;border-bottom:1px solid #ddd}
table#summary{border-collapse:collapse}
#summary th,#summary td{padding:2px 12px;border-bottom:1px solid #eee;text-align:left;overflow-wrap:anywhere}
#summary th{font-weight:600;font-family:ui-monospace,monospace;font-size:13px}
figure{margin:1.5rem 0}figcaption{font-weight:600}
svg.plot{width:100%;max-width:640px;height:auto;display:block}
.axis,.tick{stroke:#444}.grid{stroke:#eee}text{font-size:11px;fill:#333}.label{font-size:12px}
.points circle{fill-opacity:.7}circle.passed{fill:#2a9d8f}circle.flagged{fill:#e9a23b}circle.failed{fill:#d62839}
.legend{list-style:none;padding:0;display:flex;gap:1rem}.swatch{display:inline-block;width:10px;height:10px;
border-radius:50%;margin-right:4px}.legend .passed .swatch{background:#2a9d8f}
.legend .flagged .swatch{background:#e9a23b}.legend .failed .swatch{background:#d62839}
rect.bar{fill:#457b9d}rect.overflow{fill:#d62839}polyline.line{fill:none;stroke:#457b9d;stroke-width:2}
rect.below{fill:#e76f51}line.limit{stroke:#d62839;stroke-width:1.5;stroke-dasharray:5 3}
.limit-label{fill:#d62839}
#calibration{border-collapse:collapse}#calibration th,#calibration td{padding:2px 12px;border-bottom:1px solid #eee;
text-align:left;overflow-wrap:anywhere}#calibration td{font-variant-numeric:tabular-nums}
.words .w{border-radius:3px;padding:0 1px}.words .w.weak{background:#fde8c8}
.words .w.low{background:#f8d0d4;color:#a4161a}
.note{color:#555;font-size:13px}
.clip{min-width:0;max-width:100%;box-sizing:border-box;
border-left:4px solid #2a9d8f;padding:4px 12px;margin:12px 0;background:#fafafa}
.clip.flagged{border-color:#e9a23b}.clip.failed{border-color:#d62839}
.clip p{margin:4px 0;overflow-wrap:anywhere}.clip .id{font-family:ui-monospace,monospace;font-weight:600;
word-break:break-all}bdi{unicode-bidi:isolate}
.flag{background:#fde8c8;border-radius:3px;padding:0 4px;font-size:12px}
.what{color:#888;font-size:12px;text-transform:uppercase;margin-right:4px}audio{width:100%;max-width:480px}
.clip-error{color:#d62839}
"""

# After load: each <audio> gets data-loaded="1" and data-duration on loadedmetadata (data-error on
# an error); once all have settled, body's data-audio-ready is "<loaded>/<total>" and the page says it.
_SCRIPT = """
(function () {
  var players = Array.prototype.slice.call(document.querySelectorAll("audio"));
  var total = players.length, settled = 0, loaded = 0;
  function finish() {
    document.body.dataset.audioReady = loaded + "/" + total;
    document.getElementById("audio-status").textContent = loaded + " of " + total + " clips playable";
  }
  function settle() {
    settled += 1;
    if (settled === total) finish();
  }
  if (total === 0) { finish(); return; }
  players.forEach(function (a) {
    var done = false;
    function ok() {
      if (done) return;
      done = true;
      a.dataset.loaded = "1";
      a.dataset.duration = a.duration.toFixed(3);
      loaded += 1;
      settle();
    }
    function failed() {
      if (done) return;
      done = true;
      a.dataset.error = a.error ? String(a.error.code) : "1";
      settle();
    }
    a.addEventListener("loadedmetadata", ok);
    a.addEventListener("error", failed);
    if (a.readyState >= 1) ok();
    else if (a.error) failed();
  });
})();
"""
