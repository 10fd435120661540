"""Where a corpus comes from: one local file, a folder of parts, a glob, or a URI (`s3://`, `gs://`,
`file://`, any store `pyarrow.fs.FileSystem.from_uri` opens), and a corpus of many parts presented
to the rest of cosybatch as one stream of rows (`PartedCorpus`).

The decisions, also in docs/input.md ("A corpus in parts"):

- A local path to a file is the one-file `Corpus` of `cosybatch.corpus`, exactly as before. A
  folder, a glob and a URI are a list of parts, even when the list holds one part. `file://PATH` is
  the local PATH.
- Parts: every file under the folder or prefix (subfolders included), or that the glob matches
  (`*`, `?` and `[...]` within one path component, `**` for any number of them), whose path holds
  no component starting with `.` or `_` (`_SUCCESS`, `_metadata`, `.crc` files: Spark's and Hive's
  markers, skipped as pyarrow.dataset skips them). A part's name is its path below the folder,
  prefix or the glob's fixed start, `/`-separated. Parts are read in the sorted order of their names
  (component by component), the same order on every run and every machine.
- One format: every part's suffix must name the same format (`.jsonl` and `.jsonl.gz` are one);
  a part of another format or with no known suffix is a CorpusError naming it, and the fix (move
  it out, name the parts with a glob, or --format). No parts at all is a CorpusError too.
- Rows: one stream, part after part. A row's `index` is a running row number over the parts in
  their order (part k's rows are numbered after the rows, or lines, of parts 0..k-1), so --limit
  and failure records work as for one file. Ids: with an id column, the column's values, which must
  be unique over the whole corpus (a repeat is the usual duplicate-id failure, the first row in
  part order wins); every part must then have the column (a part without it is refused, naming
  it). Without one, a row's id is `PART:ROW`, ROW being the id the part alone would give the row
  (the 0-based row or line number; a .txt part's 1-based line number): stable across reruns and
  machines whatever the other parts hold, and so is --shard's split by id. A bad row's reason
  starts with its part's name.
- A part that turns out damaged partway costs only its unreadable rows: the parts after it are
  read, and the run ends with one CorpusError naming every damaged part (exit 3, as for a file).
- Fingerprint: {"name", "parts": {PART: {...}}}. A local part records its size and sha256 (as a
  one-file corpus does: about 1 s a GB, and copies and `touch` keep it); a remote part its size and
  the store's own version, asked once with a HEAD request (S3's ETag and VersionId, GCS's
  generation; else its modification time), so its bytes are downloaded once, when rows are read. A
  part added, removed or changed is the "corpus changed" refusal (`--allow-corpus-change`), the
  headline naming the parts (store/checkpoint.py).
- Stores: through `pyarrow.fs` alone (its wheels carry the S3, GCS and HDFS clients); fsspec is not
  used. Credentials the usual way: pyarrow's S3 client (the AWS SDK) reads AWS_ACCESS_KEY_ID,
  AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE, AWS_DEFAULT_REGION and the instance's role
  itself; AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (an S3-compatible store: MinIO, Ceph, R2) is read
  here and handed over as `endpoint_override` (path-style addressing): checked with pyarrow 26
  against moto's server, `from_uri` reads AWS_ENDPOINT_URL but a plain `S3FileSystem()` does not
  (it then looks the bucket up as a host name), and older pyarrow reads neither. GCS reads
  GOOGLE_APPLICATION_CREDENTIALS. A URI holding credentials
  (`s3://KEY:SECRET@bucket`, `?secret_key=`) is refused: the URI is recorded in the output folder.
- A store that cannot be listed (no such bucket, access denied, no connection) is a UsageError
  (exit 2) before any work, naming the bucket and the settings to check.
- Relative paths in rows (prompt_wav) resolve in the corpus's folder: a file's folder, the folder
  of parts, a glob's fixed start; for a corpus in a store, the current folder (`corpus_folder`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Union
from urllib.parse import parse_qsl, urlsplit

from .cache import file_sha256
from .corpus import DEFAULT_MAX_CHARS, FORMATS, BadRow, Columns, Corpus, RemoteFile, detect_format
from .errors import CorpusError, UsageError

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_GLOB = re.compile(r"[*?\[]")
SECRET_QUERY_KEYS = ("access_key", "secret_key", "session_token")
HEAD_THREADS = 16  # parts of a remote corpus asked for their version at once
SUFFIXES = "*.parquet, *.jsonl(.gz), *.csv, *.tsv or *.txt"


def is_uri(value) -> bool:
    """Whether a corpus argument is a URI (`s3://bucket/prefix/`), not a local path."""
    return isinstance(value, str) and bool(_URI.match(value))


@dataclass(frozen=True)
class Part:
    """One part of a corpus: its name (its path below the corpus's root, `/`-separated: what ids
    and messages name) and where it is read from."""

    name: str
    where: Union[Path, RemoteFile]


def open_corpus(source: Union[str, Path], columns: Columns = Columns(), fmt: Optional[str] = None,
                max_chars: int = DEFAULT_MAX_CHARS) -> Union[Corpus, PartedCorpus]:
    """The corpus `source` names: a `Corpus` for a local file, else a `PartedCorpus`."""
    local = _local_path(source)
    if local is None:
        return PartedCorpus(str(source), *_remote_parts(str(source)), columns, fmt, max_chars)
    if _GLOB.search(str(local)) and not local.exists():
        base, pattern = _split_glob(str(local))
        return PartedCorpus(str(source), pattern, _glob_parts(Path(base or "."), pattern), columns, fmt, max_chars)
    if local.is_dir():
        return PartedCorpus(str(source), local.resolve().name, _folder_parts(local), columns, fmt, max_chars)
    return Corpus(local, columns, fmt, max_chars)  # the one-file corpus, as ever


def corpus_folder(source: Union[str, Path]) -> Path:
    """Where relative paths in the corpus's rows resolve (no I/O beyond a stat): a file's folder,
    the folder of parts, a glob's fixed start; the current folder for a corpus in a store."""
    local = _local_path(source)
    if local is None:
        return Path.cwd()
    if _GLOB.search(str(local)) and not local.exists():
        return Path(_split_glob(str(local))[0] or ".").resolve()
    return local.resolve() if local.is_dir() else local.resolve().parent


def describe(source: Union[str, Path]) -> str:
    """The corpus as run.json records it: a local path resolved, a URI as given (it holds no
    credentials: `store_for` refuses those)."""
    local = _local_path(source)
    return str(source) if local is None else str(local.resolve())


def default_name(source: Union[str, Path]) -> str:
    """The corpus's last path component without glob characters (`data/train-*.parquet`:
    `train-.parquet`), for the default --out folder."""
    text = str(source).split("?", 1)[0]
    if is_uri(text):
        text = text.split("://", 1)[1]
    name = next((c for c in reversed(text.split("/")) if c), "corpus")
    return _GLOB.sub("", name.replace("]", "")) or "corpus"


# -- local folders and globs ----------------------------------------------------------------------


def _local_path(source: Union[str, Path]) -> Optional[Path]:
    """The local path a corpus argument names (a file:// URI's path too), or None for a store."""
    if isinstance(source, Path):
        return source
    if not is_uri(source):
        return Path(source)
    if source.split("://", 1)[0].lower() != "file":
        return None
    from pyarrow import fs as pafs

    try:
        _, path = pafs.FileSystem.from_uri(source)
    except (ValueError, OSError) as exc:  # ArrowInvalid is a ValueError
        raise UsageError(f"{source}: not a file:// URI pyarrow can read ({exc}); write file:///ABSOLUTE/PATH "
                         "or give the path itself") from None
    return Path(path)


def _skipped(name: str) -> bool:
    """A hidden or marker file or folder (`.crc`, `_SUCCESS`, `_temporary/`): never a part."""
    return any(c.startswith((".", "_")) for c in name.split("/"))


def _sort_key(name: str) -> list[str]:
    return name.split("/")


def _folder_parts(folder: Path) -> list[Part]:
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
        for file in files:
            path = Path(root) / file
            name = path.relative_to(folder).as_posix()
            if not _skipped(name) and path.is_file():
                found.append(Part(name, path))
    return sorted(found, key=lambda p: _sort_key(p.name))


def _split_glob(pattern: str) -> tuple[str, str]:
    """`data/train-*.parquet` -> ("data", "train-*.parquet"): the fixed start and the rest."""
    components = pattern.split("/")
    first = next(i for i, c in enumerate(components) if _GLOB.search(c))
    return "/".join(components[:first]) or ("/" if pattern.startswith("/") else ""), "/".join(components[first:])


def _matches(name: str, pattern: str) -> bool:
    """Whether a `/`-separated name matches a glob, component by component (`**`: any number)."""
    def match(names: list[str], pats: list[str]) -> bool:
        if not pats:
            return not names
        if pats[0] == "**":
            return any(match(names[i:], pats[1:]) for i in range(len(names) + 1))
        return bool(names) and fnmatch.fnmatchcase(names[0], pats[0]) and match(names[1:], pats[1:])

    return match(name.split("/"), [p for p in pattern.split("/") if p])


def _glob_parts(base: Path, pattern: str) -> list[Part]:
    if not base.is_dir():
        raise CorpusError(f"{base}: no such folder (the fixed start of the glob {pattern!r})")
    if "**" in pattern.split("/"):
        candidates = _folder_parts(base)
    else:  # only as deep as the pattern goes
        candidates = [Part(p.relative_to(base).as_posix(), p) for p in base.glob(pattern)]
    return sorted((p for p in candidates if not _skipped(p.name) and _matches(p.name, pattern)
                   and Path(p.where).is_file()), key=lambda p: _sort_key(p.name))


# -- stores ---------------------------------------------------------------------------------------


def redacted(uri: str) -> str:
    split = urlsplit(uri)
    host = split.hostname or ""
    return f"{split.scheme}://{host}{split.path}" + ("?..." if split.query else "")


def endpoint_url() -> Optional[str]:
    """The S3-compatible store's URL from the usual environment, or None for AWS itself."""
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return None
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def store_for(uri: str):
    """(pyarrow filesystem, path in it) for a URI; credentials in the URI are refused."""
    split = urlsplit(uri)
    query = {k.lower() for k, _ in parse_qsl(split.query)}
    if split.username or split.password or query & set(SECRET_QUERY_KEYS):
        raise UsageError(f"{redacted(uri)}: the URI holds credentials, and the corpus URI is recorded in the "
                         "output folder; give them the usual way instead (AWS_ACCESS_KEY_ID and "
                         "AWS_SECRET_ACCESS_KEY, a profile, or the machine's role; GOOGLE_APPLICATION_CREDENTIALS)")
    from pyarrow import fs as pafs

    scheme = split.scheme.lower()
    endpoint = endpoint_url() if scheme == "s3" else None
    try:
        if endpoint and not split.query:
            where = urlsplit(endpoint)
            if where.scheme not in ("http", "https") or not where.netloc:
                raise UsageError(f"AWS_ENDPOINT_URL {endpoint!r}: give the store's URL, http(s)://HOST[:PORT]")
            fs = pafs.S3FileSystem(endpoint_override=where.netloc, scheme=where.scheme)
            return fs, uri.split("://", 1)[1].strip("/")
        fs, path = pafs.FileSystem.from_uri(uri)
        return fs, path.strip("/")
    except (ValueError, OSError) as exc:  # ArrowInvalid is a ValueError
        raise UsageError(f"{redacted(uri)}: pyarrow cannot open this store ({exc}). A corpus is a local path, "
                         "or a URI pyarrow.fs reads: s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, file:///PATH") from None


def store_error(uri: str, bucket: str, exc: BaseException, what: str = "list the corpus") -> UsageError:
    """A store that refused a request (no such bucket, bad credentials, no endpoint), as a usage
    error naming what to check."""
    endpoint = endpoint_url()
    return UsageError(f"{redacted(uri)}: cannot {what} in bucket {bucket!r} ({str(exc)[:300]}). Check the "
                      "bucket's name, the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile or "
                      "the machine's role; GOOGLE_APPLICATION_CREDENTIALS for gs://) and the endpoint "
                      f"(AWS_ENDPOINT_URL: {endpoint or 'not set, so AWS itself'})")


def check_bucket(fs, uri: str, bucket: str, what: str = "list the corpus") -> None:
    """The bucket exists and these credentials reach it: else a usage error (exit 2) saying what
    to check, before any work."""
    from pyarrow import fs as pafs

    try:
        found = fs.get_file_info(bucket).type
    except OSError as exc:
        raise store_error(uri, bucket, exc, what) from None
    if found == pafs.FileType.NotFound:
        raise UsageError(f"{redacted(uri)}: the bucket {bucket!r} does not exist (or these credentials cannot "
                         f"see it). Check the URI, the credentials and AWS_ENDPOINT_URL "
                         f"({endpoint_url() or 'not set, so AWS itself'})")


def _remote_parts(uri: str) -> tuple[str, list[Part]]:
    """(the corpus's name, its parts) in a store: one object, or every part under a prefix or
    matching a glob."""
    from pyarrow import fs as pafs

    fs, path = store_for(uri)
    scheme = urlsplit(uri).scheme
    pattern = None
    if _GLOB.search(path):
        path, pattern = _split_glob(path)
    bucket = path.split("/", 1)[0]
    if not bucket:
        raise UsageError(f"{redacted(uri)}: name a bucket, then the prefix, object or glob in it "
                         f"({scheme}://BUCKET/PREFIX/)")
    check_bucket(fs, uri, bucket)
    try:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.File and pattern is None:
            listed = [info]
            root = path.rsplit("/", 1)[0]
        else:
            listed = [i for i in fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
                      if i.type == pafs.FileType.File]
            root = path
    except OSError as exc:
        raise store_error(uri, bucket, exc) from None
    parts = []
    for found in listed:
        name = found.path[len(root):].lstrip("/")
        if _skipped(name) or (pattern is not None and not _matches(name, pattern)):
            continue
        parts.append(Part(name, RemoteFile(fs, found.path, f"{scheme}://{found.path}", found.size,
                                           {"mtime": found.mtime.isoformat()} if found.mtime else None)))
    parts.sort(key=lambda p: _sort_key(p.name))
    _ask_versions(fs, [p.where for p in parts], uri, bucket)
    name = default_name(uri) if pattern is None else pattern
    return name, parts


def _ask_versions(fs, files: list[RemoteFile], uri: str, bucket: str) -> None:
    """Each remote part's version as its store gives it, one HEAD request a part (no bytes read):
    S3's ETag and VersionId, GCS's generation; the listing's mtime when the store gives neither."""
    def ask(file: RemoteFile) -> dict:
        with fs.open_input_file(file.key) as f:
            meta = f.metadata() or {}
        found = {}
        for key, value in meta.items():
            key = key.decode() if isinstance(key, bytes) else str(key)
            value = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            if key.lower() in ("etag", "versionid", "generation"):
                found[{"versionid": "version"}.get(key.lower(), key.lower())] = value.strip('"')
        return found

    try:
        with ThreadPoolExecutor(max_workers=min(HEAD_THREADS, max(1, len(files)))) as pool:
            for file, version in zip(files, pool.map(ask, files), strict=True):
                if version:
                    file.version = version
    except OSError as exc:
        raise store_error(uri, bucket, exc) from None


# -- many parts as one corpus ---------------------------------------------------------------------


def _check_name(shown: str, name: str) -> None:
    """A part's name becomes part of ids and messages: no control characters, valid Unicode."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise CorpusError(f"{shown}: the part {name!r} has a name that is not valid UTF-8; rename it") from None
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        raise CorpusError(f"{shown}: the part {name!r} has a control character in its name; rename it")


class PartedCorpus:
    """A corpus of many parts, read as one: the parts in the sorted order of their names, rows
    numbered on across them, default ids `PART:ROW` (see the module's docstring). Offers what
    the run uses of a `Corpus`: format, num_rows, iteration, fingerprint()."""

    def __init__(self, shown: str, name: str, parts: list[Part], columns: Columns = Columns(),
                 fmt: Optional[str] = None, max_chars: int = DEFAULT_MAX_CHARS):
        self.shown, self.name, self.parts = shown, name, parts
        if not parts:
            raise CorpusError(f"{shown}: no corpus parts found (files named {SUFFIXES}; names starting with . or _ "
                              "are skipped). Check the path, the prefix or the glob")
        for part in parts:
            _check_name(shown, part.name)
        self.format = self._one_format(fmt)
        self.readers = [Corpus(part.where, columns, self.format, max_chars) for part in parts]
        # A JSONL part with no object in its first lines (empty, or all bad) says nothing about ids.
        undecided = {k for k, r in enumerate(self.readers) if r.sniffed == 0}
        decided = [(p.name, r.has_id_column) for k, (p, r) in enumerate(zip(parts, self.readers, strict=True))
                   if k not in undecided]
        with_ids = [name for name, has in decided if has]
        without = [name for name, has in decided if not has]
        if with_ids and without:
            raise CorpusError(f"{shown}: the part {with_ids[0]!r} has an id column {columns.id!r} and the part "
                              f"{without[0]!r} has none; ids must come from one place. Give every part the id "
                              "column, or none (ids are then PART:ROW)")
        self.has_ids = bool(with_ids)
        for k in undecided if self.has_ids else ():  # its rows must bring ids too
            self.readers[k] = Corpus(parts[k].where, replace(columns, id_required=True), self.format, max_chars)
        self.columns = self.readers[0].columns
        self._fingerprint: Optional[dict] = None
        self._rows: dict[int, Optional[int]] = {}  # part number -> its row count, once known

    def _one_format(self, fmt: Optional[str]) -> str:
        formats: dict[str, list[str]] = {}
        for part in self.parts:
            try:
                found = detect_format(Path(part.name.rsplit("/", 1)[-1]), fmt)
            except CorpusError:
                raise CorpusError(
                    f"{self.shown}: the part {part.name!r} is not named as a corpus file ({SUFFIXES}). Move it "
                    "out, name the parts with a glob (DIR/*.parquet), or pass --format " + "|".join(FORMATS)
                    + " to read every part as that format") from None
            formats.setdefault(found, []).append(part.name)
        if len(formats) > 1:
            listed = "; ".join(f"{kind}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
                               for kind, names in formats.items())
            raise CorpusError(f"{self.shown}: the parts are in more than one format ({listed}). A corpus is read in "
                              "one format: keep the parts of one format here, or name them with a glob "
                              "(DIR/*.parquet)")
        return next(iter(formats))

    @property
    def num_rows(self) -> Optional[int]:
        """The sum of the parts' row counts when every one is cheap to know, else None."""
        total = 0
        for k in range(len(self.parts)):
            rows = self._part_rows(k)
            if rows is None:
                return None
            total += rows
        return total

    def _part_rows(self, k: int) -> Optional[int]:
        """Part k's row count when cheap to know (a Parquet footer), asked once."""
        if k not in self._rows:
            self._rows[k] = self.readers[k].num_rows
        return self._rows[k]

    def __iter__(self):
        """Every readable row of every part, parts in order. A damaged part costs its unreadable
        rows only: the next parts are read, then one CorpusError names every damaged part."""
        offset = 0
        damaged = []
        for k, (part, reader) in enumerate(zip(self.parts, self.readers, strict=True)):
            span = 0
            try:
                for row in reader:
                    span = max(span, row.index + 1)
                    yield self._in_corpus(part, row, offset)
            except CorpusError as exc:
                damaged.append(str(exc))
            if reader.format == "parquet":  # rows of a damaged row group still take their numbers
                with contextlib.suppress(OSError, ValueError):  # unreadable now: numbered as far as read
                    span = max(span, self._part_rows(k) or 0)
            offset += span
        if damaged:
            raise CorpusError(" ".join(damaged))

    def _in_corpus(self, part: Part, row, offset: int):
        """A part's row as a row of the whole corpus: numbered on, its default id `PART:ROW`."""
        row_id = row.id if self.has_ids or row.id is None else f"{part.name}:{row.id}"
        if isinstance(row, BadRow):
            return BadRow(offset + row.index, row_id, f"{part.name}: {row.reason}")
        return replace(row, index=offset + row.index, id=row_id)

    def fingerprint(self) -> dict:
        """{"name", "parts": {PART: size and sha256 (local) or the store's version (remote)}};
        computed once per corpus object."""
        if self._fingerprint is None:
            parts = {}
            for part in self.parts:
                if isinstance(part.where, RemoteFile):
                    parts[part.name] = {"size": part.where.size, **part.where.version}
                else:
                    parts[part.name] = file_sha256(part.where)
            self._fingerprint = {"name": self.name, "parts": parts}
        return self._fingerprint
