"""The audit page, OUT/report.html: one self-contained HTML file to look at and listen to a job.

On it: the summary as a table; four inline SVG plots drawn here (duration against text length
coloured by passed / flagged / failed, the CER histogram, pass rate per voice, throughput over
the run); audio players for the 20 worst clips (highest `qc_score`, ties by id) and a seeded
random 20 of the others, each clip's WAV embedded as a data: URI. Nothing on the page refers to
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
import math
import os
import random
import secrets
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Optional

SCATTER_CAP = 5000  # more points than this: a seeded sample of this many is plotted, and the page says so
WORST = 20  # clips shown with the highest qc_score
SAMPLE = 20  # clips shown at random (seeded) among the others
CER_BIN = 0.05  # the histogram's bins: [0, 0.05), ..., [0.95, 1), then one bin for CER >= 1
CER_BINS = 20

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
) -> None:
    """Write the audit page to `path` atomically (a temporary file beside it, then a rename).

    rows: one dict per clip; `id`, `text` and `duration_s` are expected, every other key (`voice`,
    `units`, `qc_pass`, `qc_flags`, `qc_cer`, `qc_wer`, `qc_asr_text`, `qc_attempts`, `qc_score`) may
    be missing. summary: shown as a table, nested dicts flattened to dotted keys. clip(id): the WAV
    bytes of one clip, called only for the (at most 40) clips the page plays. throughput: points
    (seconds since the job started, cumulative audio seconds committed). rate: (audio seconds, wall
    seconds) of the run, for the throughput note; without it the note's rate is the last point's
    audio over its time (the points must then start at the job's start). seed: the random sample's
    and the scatter cap's seed.
    """
    page = render_report(rows, summary, clip, seed=seed, throughput=throughput, rate=rate, title=title)
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
) -> str:
    """The page as a string (write_report writes it)."""
    worst, sample = choose_clips(rows, seed)
    body = [
        f"<h1>{_ident(title)}</h1>",
        _summary_table(summary),
        '<section id="plots"><h2>Plots</h2>',
        _scatter(rows, seed),
        _cer_histogram(rows),
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
        ),
        _clip_section(
            "sample",
            f"{len(sample)} clips at random",
            f"A random sample (seed {_e(seed)}) of the clips not shown above, in id order.",
            [rows[i] for i in sample],
            clip,
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


def _cer_histogram(rows: list[dict]) -> str:
    cers = [float(r["qc_cer"]) for r in rows if _finite(r.get("qc_cer"))]
    head = '<figure id="plot-cer"><figcaption>Character error rate of the ASR round trip</figcaption>'
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
def _clip_section(group: str, heading: str, note: str, chosen: list[dict], clip: Callable[[str], bytes]) -> str:
    out = [f'<section class="clip-group" id="{group}"><h3>{_e(heading)}</h3><p class="note">{note}</p>']
    for row in chosen:
        out.append(_clip_card(group, row, clip))
    out.append("</section>")
    return "\n".join(out)


def _clip_card(group: str, row: dict, clip: Callable[[str], bytes]) -> str:
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
    flags = row.get("qc_flags") or []
    try:
        wav = clip(rid)
        player = (
            f'<audio controls preload="metadata" data-id="{_e(rid)}" '
            f'src="data:audio/wav;base64,{base64.b64encode(wav).decode("ascii")}"></audio>'
        )
    except Exception as e:  # one unreadable clip must not cost the whole page; it is shown instead
        player = f'<p class="clip-error">The audio could not be read: {_ident(f"{type(e).__name__}: {e}")}</p>'
    asr = row.get("qc_asr_text")
    return "\n".join(
        [
            f'<article class="clip {status(row)}" data-id="{_e(rid)}" data-group="{group}">',
            f'<p class="head"><bdi class="id">{_e(_visible(rid))}</bdi> · <bdi>{_e(" · ".join(facts))}</bdi>'
            + "".join(f' <bdi class="flag">{_e(_visible(f))}</bdi>' for f in flags)
            + "</p>",
            player,
            f'<p class="text"><span class="what">text</span> <bdi>{_e(row.get("text", ""))}</bdi></p>',
            f'<p class="asr"><span class="what">heard</span> <bdi>{_e(asr)}</bdi></p>' if asr is not None else "",
            "</article>",
        ]
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
