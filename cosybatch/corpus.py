"""Corpus readers: Parquet, JSONL(.gz), CSV/TSV (pyarrow's streaming CSV reader) and plain text
(.txt: one row a line, the 1-based line number as id), streamed row by row with bounded memory.

A reader yields `Row` for every usable row and `BadRow` for rows it cannot use, so that one bad
row is recorded with its reason and never takes the good rows around it down. Problems with the
file as a whole (unknown format, missing column, wrong column type) raise `CorpusError` before
any work starts.

A `Corpus` is one file: a local path, or a `RemoteFile` (an object in a store that pyarrow.fs
reaches, read through it and never copied to a local path). Folders, globs and URIs of many parts
are `cosybatch.sources`' business: it reads each part with a `Corpus`.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import secrets
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Union

from .cache import file_sha256
from .errors import CorpusError
from .voices import check_language

PARQUET_BATCH_ROWS = 4096
# How many JSONL objects to look at before deciding a text field name is wrong for the whole file.
JSONL_SNIFF_ROWS = 100
CSV_BLOCK_BYTES = 1 << 20  # how much of a CSV file pyarrow parses at a time
FORMATS = ("parquet", "jsonl", "csv", "tsv", "text")
DEFAULT_MAX_CHARS = 20000  # RunConfig.max_chars's default
# A row is bounded while it is read, before any string or JSON object is built of it: a JSONL or
# text line, a CSV record or a Parquet cell over row_bytes(--max-chars) is a bad row, skipped
# unread. 16 bytes a character leaves room for JSON escapes (\uXXXX is 6 bytes, a surrogate pair 12),
# whitespace that cleaning collapses and the row's other fields; no cap is under 1 MiB.
BYTES_PER_CHAR = 16
MIN_ROW_BYTES = 1 << 20
SCAN_CHUNK = 1 << 20
# A remote file is read in pieces (one ranged GET each on S3) from REMOTE_FIRST_BYTES, so that a
# look at its first lines costs little, doubling up to REMOTE_READ_BYTES for streaming.
REMOTE_FIRST_BYTES = 256 << 10
REMOTE_READ_BYTES = 4 << 20


def row_bytes(max_chars: int) -> int:
    """The most bytes (characters, for a text line) one row may take in the file with --max-chars."""
    return max(MIN_ROW_BYTES, BYTES_PER_CHAR * max_chars)


@dataclass(frozen=True)
class Row:
    """One request: synthesise `text` (with `voice`, if set) and store it under `id`."""

    index: int  # 0-based row number in the corpus file (line number - 1 for JSONL)
    id: str
    text: str
    voice: Optional[str] = None
    prompt_wav: Optional[str] = None  # zero-shot prompt audio (engines that clone voices)
    prompt_text: Optional[str] = None  # what the prompt audio says
    instruct: Optional[str] = None  # a natural-language instruction (emotion, speed, dialect...)
    language: Optional[str] = None  # the row's language code (en, de-DE), for --voice-map and the manifest


@dataclass(frozen=True)
class BadRow:
    """A row that cannot be synthesised, and why."""

    index: int
    id: Optional[str]
    reason: str


@dataclass(frozen=True)
class Columns:
    """Which corpus columns hold what. `id`, `voice` and the prompt columns are optional.

    Without an explicit voice column, 'voice' is used, else `voice_fallback` (for CosyVoice:
    'speaker') when the corpus has it."""

    id: str = "id"
    text: str = "text"
    voice: str = "voice"
    id_required: bool = False  # True when the user named the id column explicitly
    voice_required: bool = False
    prompt_wav: str = "prompt_wav"
    prompt_text: str = "prompt_text"
    instruct: str = "instruct"
    language: str = "language"
    voice_fallback: Optional[str] = None

    def with_voice(self, names) -> Columns:
        """Use the fallback voice column when no voice column was named and 'voice' is absent."""
        fallback = self.voice_fallback
        if fallback and not self.voice_required and self.voice not in names and fallback in names:
            return replace(self, voice=fallback)
        return self


def detect_format(path: Path, fmt: Optional[str] = None) -> str:
    if fmt:
        if fmt not in FORMATS:
            raise CorpusError(f"unknown corpus format {fmt!r}: use one of {', '.join(FORMATS)}")
        return fmt
    name = path.name.lower()
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz")):
        return "jsonl"
    if name.endswith((".csv", ".csv.gz")):
        return "csv"
    if name.endswith((".tsv", ".tsv.gz", ".tab")):
        return "tsv"
    if name.endswith((".txt", ".txt.gz")):
        return "text"
    raise CorpusError(
        f"{path}: cannot tell the corpus format from the file name; name it *.parquet, *.jsonl(.gz), "
        "*.csv, *.tsv or *.txt, or pass --format " + "|".join(FORMATS)
    )


class RemoteFile:
    """One file in a store that pyarrow.fs reaches (S3, GCS, ...): `fs` and its `key` there, the
    `uri` that names it in messages, its size and the store's version of it (ETag, VersionId,
    generation or mtime: what `cosybatch.sources` fingerprints). Read through the filesystem in
    growing pieces; never written to a local path."""

    def __init__(self, fs, key: str, uri: str, size: Optional[int] = None, version: Optional[dict] = None):
        self.fs, self.key, self.uri, self.size = fs, key, uri, size
        self.version = version or {}
        self.name = key.rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return self.uri

    def open_random(self):
        """A pyarrow random-access file (Parquet reads its footer and row groups by range)."""
        return self.fs.open_input_file(self.key)

    def open_stream(self) -> io.BufferedReader:
        """The raw bytes (not decompressed), front to back, as a Python binary file."""
        return io.BufferedReader(_NativeReader(self.fs.open_input_stream(self.key, compression=None)),
                                 REMOTE_READ_BYTES)


class _NativeReader(io.RawIOBase):
    """A pyarrow input stream as a Python raw stream (pyarrow's own files have no readline), read in
    pieces from REMOTE_FIRST_BYTES doubling up to REMOTE_READ_BYTES (a short read is allowed)."""

    def __init__(self, native):
        super().__init__()
        self.native = native
        self.piece = REMOTE_FIRST_BYTES

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.native.read(min(len(buffer), self.piece))
        self.piece = min(2 * self.piece, REMOTE_READ_BYTES)
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self.native.close()
        super().close()


class _OwnGzip(gzip.GzipFile):
    """A GzipFile over a file object that closes that file too."""

    def close(self) -> None:
        inner = self.fileobj
        try:
            super().close()
        finally:
            if inner is not None:
                inner.close()


def _open_raw(source: Union[Path, RemoteFile]):
    """A corpus file's bytes as stored (a .gz file still compressed)."""
    return source.open_stream() if isinstance(source, RemoteFile) else open(source, "rb")


def _open_decompressed(source: Union[Path, RemoteFile]):
    """A corpus file's bytes, decompressed for .gz."""
    gz = source.name.lower().endswith(".gz")
    if isinstance(source, RemoteFile):
        raw = source.open_stream()
        return _OwnGzip(fileobj=raw, mode="rb") if gz else raw
    return gzip.open(source, "rb") if gz else open(source, "rb")


class Corpus:
    """A corpus file with its column mapping. Iterating yields `Row` and `BadRow` in file order."""

    def __init__(self, path: Union[str, Path, RemoteFile], columns: Columns = Columns(), fmt: Optional[str] = None,
                 max_chars: int = DEFAULT_MAX_CHARS):
        self.remote = path if isinstance(path, RemoteFile) else None
        self.path = path if self.remote is not None else Path(path)
        if self.remote is None and not self.path.is_file():
            raise CorpusError(f"{self.path}: no such corpus file")
        self.columns = columns
        self.format = detect_format(self.path, fmt)
        self.max_chars = max_chars
        self.row_bytes = row_bytes(max_chars)
        self._oversized: list[tuple[int, int, int]] = []  # CSV/TSV records over row_bytes: (start, end, line)
        self._has_id = True
        self._has_voice = False
        self._prompt_cols: tuple[str, ...] = ()
        self._fingerprint: Optional[dict] = None
        self.sniffed: Optional[int] = None  # JSONL: the objects the field check looked at (0: none to go by)
        if self.format == "parquet":
            self._check_parquet_schema()
        elif self.format in ("csv", "tsv"):
            self._check_csv_header()
        elif self.format == "text":
            self._check_text()
        else:
            self._check_jsonl_fields()

    # -- schema checks, done before any work ------------------------------------------------
    def _check_names(self, names: list[str], where: str) -> None:
        """The columns every tabular format must have, by name (`where`: " in the CSV header")."""
        c = self.columns
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise CorpusError(
                f"{self.path}: the column {twice[0]!r} appears {names.count(twice[0])} times{where} (columns: "
                f"{names}); only one of them would be read, and which is not for cosybatch to guess. Rename or "
                "drop the extra columns so that every column name is used once."
            )
        if c.text not in names:
            raise CorpusError(
                f"{self.path}: no text column {c.text!r}{where}; columns found: {names}. "
                "Pass --text-col NAME to choose the text column."
            )
        self._has_id = c.id in names
        if c.id_required and not self._has_id:
            raise CorpusError(
                f"{self.path}: no id column {c.id!r}{where}; columns found: {names}. Pass --id-col NAME, "
                "or leave --id-col out to use row numbers as ids."
            )
        self.columns = c = c.with_voice(names)
        self._has_voice = c.voice in names
        self._prompt_cols = tuple(n for n in (c.prompt_wav, c.prompt_text, c.instruct, c.language) if n in names)
        if c.voice_required and not self._has_voice:
            raise CorpusError(
                f"{self.path}: no voice column {c.voice!r}{where}; columns found: {names}. "
                "Pass --voice-col NAME, or leave it out to use --voice for every row."
            )

    def _check_parquet_schema(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            schema = pq.ParquetFile(self._parquet_source()).schema_arrow
        except (pa.ArrowInvalid, OSError) as exc:
            raise CorpusError(f"{self.path}: not a readable Parquet file ({exc})") from exc
        names = schema.names
        self._check_names(names, "")
        c = self.columns
        ttype = schema.field(c.text).type
        if not (pa.types.is_string(ttype) or pa.types.is_large_string(ttype)):
            raise CorpusError(
                f"{self.path}: text column {c.text!r} has type {ttype}, expected string. "
                "Pass --text-col NAME to choose another column, or convert it to strings."
            )
        if self._has_id:
            itype = schema.field(c.id).type
            if not (pa.types.is_string(itype) or pa.types.is_large_string(itype) or pa.types.is_integer(itype)):
                raise CorpusError(
                    f"{self.path}: id column {c.id!r} has type {itype}; ids must be strings or integers."
                )
        for name in self._prompt_cols:
            ptype = schema.field(name).type
            if not (pa.types.is_string(ptype) or pa.types.is_large_string(ptype) or pa.types.is_null(ptype)):
                raise CorpusError(f"{self.path}: column {name!r} has type {ptype}, expected string.")

    def _csv_reader(self, column_types: Optional[dict] = None, on_invalid=None):
        """pyarrow's streaming CSV reader over the file: TSV is tab-separated without quoting (a
        quote inside a text is text); CSV follows RFC 4180 (quoted fields may hold newlines)."""
        import pyarrow.csv as pcsv

        tsv = self.format == "tsv"
        parse = pcsv.ParseOptions(delimiter="\t" if tsv else ",", quote_char=False if tsv else '"',
                                  newlines_in_values=not tsv, invalid_row_handler=on_invalid)
        convert = pcsv.ConvertOptions(column_types=column_types or {}, strings_can_be_null=False,
                                      quoted_strings_can_be_null=False)
        # Every record left is at most row_bytes long (longer ones are replaced, below), so it fits a block.
        block = max(CSV_BLOCK_BYTES, 2 * self.row_bytes)
        source = _Replacing(self._open_bytes(), self._oversized, self._placeholder) if self._oversized \
            else self._open_bytes() if self.remote is not None else self.path
        return pcsv.open_csv(source, read_options=pcsv.ReadOptions(use_threads=False, block_size=block),
                             parse_options=parse, convert_options=convert)

    def _open_bytes(self):
        """The file's bytes (decompressed for .gz)."""
        return _open_decompressed(self.path)

    def _parquet_source(self):
        """What pyarrow's ParquetFile reads: the local path, or the remote file by range."""
        return self.path if self.remote is None else self.remote.open_random()

    def _source_key(self) -> tuple:
        """Which file, in which version: the key of a CSV scan kept for the next opening."""
        if self.remote is not None:
            return (self.remote.uri, self.remote.size, tuple(sorted(self.remote.version.items())))
        return (str(self.path.resolve()), *_stat_key(self.path))

    def _placeholder(self, start: int, end: int, line: int) -> bytes:
        """What an over-long record is read as: a record of the header's width whose first field
        names it (with this reader's nonce, so no field in a file can pass for one)."""
        return b"%s%d:%d" % (self._marker, line, end - start) + b"," * (self._width - 1) if self.format == "csv" \
            else b"%s%d:%d" % (self._marker, line, end - start) + b"\t" * (self._width - 1)

    def _scan_records(self) -> None:
        """One pass over a CSV/TSV file's bytes before any work: an unterminated quote refuses the file
        (pyarrow would close it at the end, making the records after it part of a text), and records
        over row_bytes are noted, to be read as bad rows without their bytes."""
        key = (*self._source_key(), self.row_bytes, self.format)
        found = _SCANNED.get(key)
        if found is None:
            try:
                with self._open_bytes() as f:
                    found = _scan_csv(f, quoting=self.format == "csv", cap=self.row_bytes)
            except (OSError, EOFError) as exc:
                raise CorpusError(f"{self.path}: cannot read the file ({exc})") from exc
            if len(_SCANNED) >= SCANS_KEPT:  # a job opens its corpus (every part of it) more than once
                _SCANNED.clear()
            _SCANNED[key] = found
        oversized, open_quote = found
        if open_quote is not None:
            raise CorpusError(
                f"{self.path}: line {open_quote} opens a quoted field that is never closed: every record "
                "after it would be read as part of that text. Close the quote (a quote inside a quoted "
                'field is written twice: ""), or drop the stray one.'
            )
        self._oversized = oversized

    def _check_csv_header(self) -> None:
        import pyarrow as pa

        kind = self.format.upper()
        try:
            names = self._csv_reader(on_invalid=lambda _row: "skip").schema.names  # rows: checked when read
        except (pa.ArrowInvalid, OSError) as exc:
            raise CorpusError(f"{self.path}: not a readable {kind} file with a header line ({exc})") from exc
        self._check_names(names, f" in the {kind} header")
        self._width = len(names)
        self._marker = b"\x01cosybatch-over-" + secrets.token_hex(8).encode() + b":"
        self._scan_records()

    def _check_text(self) -> None:
        c = self.columns
        if c.id_required or c.voice_required:
            raise CorpusError(f"{self.path}: a plain-text corpus has no columns (one text a line, the line "
                              "number as id); drop --id-col and --voice-col, or use CSV, JSONL or Parquet")
        self._has_id = False
        try:
            with _open_raw(self.path) as f:
                f.read(1)
        except OSError as exc:
            raise CorpusError(f"{self.path}: cannot read the file ({exc})") from exc

    def _check_jsonl_fields(self) -> None:
        c = self.columns
        seen_keys: set[str] = set()
        objects = 0
        with_text = 0
        with_id = 0
        with_voice = 0
        with_prompt = {c.prompt_wav: 0, c.prompt_text: 0, c.instruct: 0, c.language: 0}
        try:
            for _, line in _jsonl_lines(self.path, self.row_bytes):
                if objects >= JSONL_SNIFF_ROWS:
                    break
                if isinstance(line, _Oversized):
                    continue
                try:
                    obj = json.loads(line)
                except (ValueError, UnicodeDecodeError):
                    continue
                if not isinstance(obj, dict):
                    continue
                objects += 1
                seen_keys.update(obj)
                with_text += c.text in obj
                with_id += c.id in obj
                with_voice += c.voice in obj
                for name in with_prompt:
                    with_prompt[name] += name in obj
        except (OSError, EOFError) as exc:
            if not objects:
                raise CorpusError(f"{self.path}: cannot read the file ({exc})") from exc
            # The rows before the damage are usable; reading them reports the damage afterwards.
        if objects and not with_text:
            raise CorpusError(
                f"{self.path}: none of the first {objects} rows has a {c.text!r} field; fields found: "
                f"{sorted(seen_keys)}. Pass --text-col NAME to choose the text field."
            )
        if objects and c.id_required and not with_id:
            raise CorpusError(
                f"{self.path}: none of the first {objects} rows has an id field {c.id!r}; fields "
                f"found: {sorted(seen_keys)}. Pass --id-col NAME, or leave it out to use line numbers."
            )
        # Without an explicit --id-col, an id field is used when the file has one.
        self._has_id = c.id_required or with_id > 0
        if not with_voice:
            self.columns = c = c.with_voice(seen_keys)
            with_voice = int(c.voice in seen_keys)
        self._has_voice = c.voice_required or with_voice > 0
        self._prompt_cols = tuple(name for name, count in with_prompt.items() if count)
        self.sniffed = objects

    # -- reading ------------------------------------------------------------------------------
    @property
    def num_rows(self) -> Optional[int]:
        """Row count when it is cheap to know (Parquet metadata, uncompressed JSONL), else None."""
        if self.format == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(self._parquet_source()).metadata.num_rows
        if self.format in ("csv", "tsv") or self.path.name.lower().endswith(".gz"):
            return None  # a CSV field may hold newlines: only reading it counts its rows
        if self.remote is not None:
            return None  # counting would download the file once more
        count = 0
        last = b"\n"
        text = self.format == "text"  # a lone CR ends a line of text too (see _text_lines)
        with open(self.path, "rb") as f:
            while chunk := f.read(1 << 20):
                count += chunk.count(b"\n")
                if text:
                    count += chunk.count(b"\r") - chunk.count(b"\r\n")
                last = chunk[-1:]
        return count + (last not in (b"\n", b"\r") if text else last != b"\n")

    def __iter__(self) -> Iterator[Union[Row, BadRow]]:
        """Every readable row, in file order. A part of the file that cannot be read (a corrupt
        Parquet row group, a truncated or corrupt .gz) raises CorpusError naming it, but only
        after every row that can be read was yielded: a damaged file never costs its good rows."""
        if self.format == "parquet":
            yield from self._iter_parquet()
            return
        if self.format in ("csv", "tsv"):
            yield from self._iter_csv()
            return
        last = -1
        text = self.format == "text"
        try:
            for index, line in (_text_lines if text else _jsonl_lines)(self.path, self.row_bytes):
                last = index
                yield self.row_from_text_line(index, line) if text else self.row_from_json_line(index, line)
        except (OSError, EOFError) as exc:
            raise CorpusError(f"{self.path}: reading failed after line {last + 1} ({exc}); the file is "
                              "truncated or corrupt.") from exc

    def _iter_parquet(self) -> Iterator[Union[Row, BadRow]]:
        """Row group by row group, so that one corrupt row group costs only its own rows."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        file = pq.ParquetFile(self._parquet_source())
        groups = file.metadata.num_row_groups
        unreadable = []
        first = 0
        for group in range(groups):
            rows = file.metadata.row_group(group).num_rows
            index = first
            try:
                for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group],
                                               columns=self.read_columns):
                    yield from self.rows_from_batch(batch, index)
                    index += batch.num_rows
            except (OSError, pa.ArrowException) as exc:
                unreadable.append(f"rows {index}-{first + rows - 1} (row group {group + 1} of {groups}: "
                                  f"{str(exc)[:200]})")
            first += rows
        if unreadable:
            raise CorpusError(f"{self.path}: could not read " + "; ".join(unreadable)
                              + "; the file is corrupt there.")

    def _iter_csv(self) -> Iterator[Union[Row, BadRow]]:
        """Block by block. A record with the wrong number of fields becomes a BadRow naming its line;
        it is numbered after the good rows of its block (pyarrow reports it apart from them)."""
        import pyarrow as pa

        invalid: list = []

        def on_invalid(row):
            invalid.append(row)
            return "skip"

        names = self._csv_reader(on_invalid=lambda _row: "skip").schema.names
        reader = self._csv_reader({name: pa.string() for name in names}, on_invalid)
        index = 0
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except (OSError, pa.ArrowException) as exc:
                raise CorpusError(f"{self.path}: reading failed after row {index} ({str(exc)[:200]}); the file "
                                  "is truncated or corrupt there.") from exc
            data = batch.to_pydict()
            if self._oversized:
                yield from self._marked(data, names[0], index)
            else:
                yield from self.rows_from_columns(data, index)
            index += batch.num_rows
            for row in invalid:
                where = f"record {row.number} (the header is record 1)" \
                    if row.number is not None and row.number >= 0 else "a record"
                yield BadRow(index, None, f"{where} has {row.actual_columns} fields, expected "
                                          f"{row.expected_columns} (the header's)")
                index += 1
            invalid.clear()

    def _marked(self, data: dict, first: str, index: int) -> Iterator[Union[Row, BadRow]]:
        """A CSV batch's rows, the placeholders of over-long records as bad rows."""
        marks = data[first]
        marker = self._marker.decode()
        for k, row in enumerate(self.rows_from_columns(data, index)):
            mark = marks[k]
            if isinstance(mark, str) and mark.startswith(marker):
                line, size = mark[len(marker):].split(":")
                yield BadRow(row.index, None, self._too_long(f"the record on line {line}", int(size), "bytes"))
            else:
                yield row

    def _too_long(self, what: str, size: int, unit: str) -> str:
        return (f"{what} is {size} {unit}, over the {self.row_bytes} {unit} a row may take with --max-chars "
                f"{self.max_chars}; it was skipped unread. Split the row, or raise --max-chars")

    def row_from_text_line(self, index: int, line: Union[str, bytes]) -> Union[Row, BadRow]:
        """One line of a plain-text corpus: the text, with its 1-based line number as id. A str line
        holds the bytes that are not UTF-8 as surrogate escapes."""
        if isinstance(line, _Oversized):
            return BadRow(index, str(index + 1), self._too_long(f"line {index + 1}", line.size, "characters"))
        try:
            text = line.decode("utf-8") if isinstance(line, bytes) else \
                line if _encodable(line) else line.encode("utf-8", "surrogateescape").decode("utf-8")
        except UnicodeDecodeError as exc:
            return BadRow(index, str(index + 1), f"line {index + 1} is not valid UTF-8 ({exc.reason} at byte "
                                                 f"{exc.start})")
        return _make_row(index, str(index + 1), text, None)

    def row_from_json_line(self, index: int, line: bytes) -> Union[Row, BadRow]:
        """One JSONL line (raw bytes, so bad UTF-8 is this line's problem only) -> Row or BadRow."""
        c = self.columns
        if isinstance(line, _Oversized):
            return BadRow(index, None, self._too_long(f"line {index + 1}", line.size, "bytes"))
        try:
            obj = json.loads(line.decode("utf-8"), object_pairs_hook=_unique_keys)
        except UnicodeDecodeError as exc:
            return BadRow(index, None, f"line {index + 1} is not valid UTF-8 ({exc.reason} at byte {exc.start})")
        except _DuplicateKey as exc:
            return BadRow(index, None, f"line {index + 1} has the key {exc.key!r} twice in one object: only one "
                                       "value would be read; keep one")
        except ValueError as exc:
            return BadRow(index, None, f"line {index + 1} is not valid JSON ({exc})")
        if not isinstance(obj, dict):
            return BadRow(index, None, f"line {index + 1} is a JSON {type(obj).__name__}, expected an object")
        raw_id = obj.get(c.id) if self._has_id else index
        if c.text not in obj:
            return BadRow(index, _id_or_none(raw_id), f"line {index + 1} has no {c.text!r} field")
        voice = obj.get(c.voice) if self._has_voice else None
        prompts = {name: obj.get(name) for name in self._prompt_cols}
        # instruct and language are read on every line: a field first seen after the sniffed lines still counts.
        return _make_row(index, raw_id, obj[c.text], voice, prompts.get(c.prompt_wav), prompts.get(c.prompt_text),
                         obj.get(c.instruct), obj.get(c.language))

    def rows_from_batch(self, batch, first_index: int) -> Iterator[Union[Row, BadRow]]:
        """Rows from an Arrow record batch of a Parquet corpus. A cell over row_bytes is measured in
        Arrow (its byte length) and never becomes a Python string: its row is a bad row."""
        import pyarrow as pa
        import pyarrow.compute as pc

        over, lengths, bigs = None, {}, {}
        for name in batch.schema.names:
            col = batch.column(name)
            if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)
                    or pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type)):
                continue
            lengths[name] = pc.binary_length(col)
            big = bigs[name] = pc.fill_null(pc.greater(lengths[name], self.row_bytes), False)
            over = big if over is None else pc.or_(over, big)
        if over is None or not pc.any(over).as_py():
            yield from self.rows_from_columns(batch.to_pydict(), first_index)
            return
        flags = over.to_pylist()
        cleared = pa.RecordBatch.from_arrays(
            [pc.if_else(bigs[name], pa.nulls(len(batch), batch.column(i).type), batch.column(i)) if name in bigs
             else batch.column(i) for i, name in enumerate(batch.schema.names)], schema=batch.schema)
        for k, row in enumerate(self.rows_from_columns(cleared.to_pydict(), first_index)):
            if not flags[k]:
                yield row
                continue
            name, size = max(((n, lengths[n][k].as_py() or 0) for n in lengths), key=lambda x: x[1])
            yield BadRow(row.index, row.id, self._too_long(f"row {row.index}'s {name!r} column", size, "bytes"))

    def rows_from_columns(self, data: dict, first_index: int) -> Iterator[Union[Row, BadRow]]:
        """Rows from a column batch {name: list} of a Parquet corpus, numbered from first_index."""
        c = self.columns
        texts = data[c.text]
        ids = data[c.id] if self._has_id else None
        voices = data[c.voice] if self._has_voice else None
        wavs = data.get(c.prompt_wav) if c.prompt_wav in self._prompt_cols else None
        prompt_texts = data.get(c.prompt_text) if c.prompt_text in self._prompt_cols else None
        instructs = data.get(c.instruct) if c.instruct in self._prompt_cols else None
        languages = data.get(c.language) if c.language in self._prompt_cols else None
        for k, text in enumerate(texts):
            index = first_index + k
            raw_id = ids[k] if ids is not None else index
            voice = voices[k] if voices is not None else None
            yield _make_row(index, raw_id, text, voice, wavs[k] if wavs is not None else None,
                            prompt_texts[k] if prompt_texts is not None else None,
                            instructs[k] if instructs is not None else None,
                            languages[k] if languages is not None else None)

    @property
    def has_id_column(self) -> bool:
        """Whether ids come from a column (else from row or line numbers)."""
        return self._has_id

    @property
    def read_columns(self) -> list[str]:
        c = self.columns
        return ([c.text] + ([c.id] if self._has_id else []) + ([c.voice] if self._has_voice else [])
                + list(self._prompt_cols))

    def fingerprint(self) -> dict:
        """Identifies the corpus exactly: its name, size and the sha256 of the whole file. Computed
        once per corpus object (it reads every byte, about a second per GB). A remote file: its
        name, size and the store's version of it, without reading its bytes."""
        if self._fingerprint is None:
            self._fingerprint = {"name": self.path.name, "size": self.remote.size, **self.remote.version} \
                if self.remote is not None else {"name": self.path.name, **file_sha256(self.path)}
        return self._fingerprint


class _Oversized:
    """A line over the cap, read through in pieces and never kept: its size."""

    def __init__(self, size: int):
        self.size = size


def _capped_lines(f, cap: int, newline) -> Iterator[tuple[int, Union[bytes, str, _Oversized]]]:
    """(0-based line number, line) for every line of `f` (binary or text); a line over `cap`
    (bytes or characters, its line break aside) is an _Oversized, so memory stays within the cap."""
    index = 0
    while line := f.readline(cap + 1):
        if len(line) > cap and not line.endswith(newline):
            size = len(line)
            while (more := f.readline(SCAN_CHUNK)) and not more.endswith(newline):
                size += len(more)
            yield index, _Oversized(size + len(more.rstrip(newline)))
        else:
            yield index, line
        index += 1


def _jsonl_lines(path: Union[Path, RemoteFile], cap: int = MIN_ROW_BYTES) \
        -> Iterator[tuple[int, Union[bytes, _Oversized]]]:
    """Yield (0-based line number, raw line) for non-blank lines; bytes so bad UTF-8 is per line.
    A UTF-8 byte order mark before the first line (as some Windows tools write) is skipped. JSON
    Lines ends a line at LF only (a CR before it is JSON whitespace)."""
    with _open_decompressed(path) as f:
        for index, line in _capped_lines(f, cap, b"\n"):
            if isinstance(line, _Oversized):
                yield index, line
                continue
            if index == 0 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            if line.strip():
                yield index, line


def _text_lines(path: Union[Path, RemoteFile], cap: int = MIN_ROW_BYTES) \
        -> Iterator[tuple[int, Union[str, _Oversized]]]:
    """A plain-text corpus's non-blank lines. CRLF, LF and a lone CR each end a line (universal
    newlines, as Python's text mode and the usual editors read text): a file from classic Mac OS
    tools is as many rows as it has lines, not one. Bytes that are not UTF-8 are kept as surrogate
    escapes, so that only their line fails."""
    with _open_decompressed(path) as raw:
        f = io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape", newline=None)
        for index, line in _capped_lines(f, cap, "\n"):
            if isinstance(line, _Oversized):
                yield index, line
                continue
            if index == 0 and line.startswith("\ufeff"):
                line = line[1:]
            if line.strip(" \t\n\r\x0b\x0c"):
                yield index, line


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list) -> dict:
    """json's object_pairs_hook: an object with a key twice is refused (json keeps the last silently)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


_SCANNED: dict = {}
SCANS_KEPT = 1024  # CSV scans kept (one a file): a corpus of many parts is opened more than once too


def _stat_key(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _breaks(buf: bytes, start: int, end: int) -> int:
    """Line breaks in buf[start:end]: LF, CRLF and a lone CR, as pyarrow's CSV reader counts them."""
    return buf.count(b"\n", start, end) + buf.count(b"\r", start, end) - buf.count(b"\r\n", start, end)


_CSV_TOKENS = re.compile(rb'["\r\n]')
_TSV_TOKENS = re.compile(rb"[\r\n]")


def _scan_csv(f, quoting: bool, cap: int) -> tuple[list[tuple[int, int, int]], Optional[int]]:
    """A CSV/TSV stream's records as pyarrow's reader splits them (a quote opens a quoted field only
    at a field's start; "" inside one is a quote; CRLF, LF and CR end records outside quotes):
    ([(start, end, line) of each record over `cap` bytes], the line of a quote never closed or None)."""
    tokens = _CSV_TOKENS if quoting else _TSV_TOKENS
    oversized: list[tuple[int, int, int]] = []
    base, line, start, start_line = 0, 1, 0, 1
    in_quote, quote_line, pending_quote, prev = False, 0, False, 0x0A
    while chunk := f.read(SCAN_CHUNK):
        n, p = len(chunk), 0
        if base == 0 and chunk.startswith(b"\xef\xbb\xbf"):
            p = 3  # a byte order mark: the first field starts after it
        if pending_quote:  # the last chunk ended on a quote inside a quoted field
            pending_quote = False
            if chunk[0] == 0x22:
                p = 1  # "" : a quote in the text
            else:
                in_quote = False
        while p < n:
            if in_quote:
                q = chunk.find(b'"', p)
                if q < 0:
                    line += _breaks(chunk, p, n)
                    break
                line += _breaks(chunk, p, q)
                if q + 1 == n:
                    pending_quote = True
                    break
                if chunk[q + 1] == 0x22:
                    p = q + 2
                else:
                    in_quote, p = False, q + 1
                continue
            m = tokens.search(chunk, p)
            if m is None:
                break
            t = m.start()
            before = chunk[t - 1] if t > 0 else prev
            if chunk[t] == 0x22:
                if before in (0x2C, 0x0A, 0x0D) or (base == 0 and t == 3 and p == 3):
                    in_quote, quote_line = True, line
                p = t + 1
                continue
            end = base + t  # a line break outside quotes: the record ends here
            if end - start > cap:
                oversized.append((start, end, start_line))
            if not (chunk[t] == 0x0A and before == 0x0D):
                line += 1
            start, start_line, p = end + 1, line, t + 1
        prev = chunk[-1]
        base += n
    if pending_quote:
        in_quote = False
    if in_quote:
        return oversized, quote_line
    if base - start > cap:
        oversized.append((start, base, start_line))
    return oversized, None


class _Replacing(io.RawIOBase):
    """A byte stream with some ranges replaced: each (start, end, line) by placeholder(start, end,
    line), the replaced bytes read through in pieces and dropped."""

    def __init__(self, src, ranges: list[tuple[int, int, int]], placeholder):
        super().__init__()
        self.src, self.ranges, self.placeholder = src, ranges, placeholder
        self.pos, self.next, self.pending = 0, 0, b""

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        size = SCAN_CHUNK if size is None or size < 0 else size
        out = bytearray()
        while len(out) < size:
            if self.pending:
                take = self.pending[:size - len(out)]
                out += take
                self.pending = self.pending[len(take):]
                continue
            if self.next < len(self.ranges) and self.pos == self.ranges[self.next][0]:
                start, end, line = self.ranges[self.next]
                while self.pos < end and (piece := self.src.read(min(SCAN_CHUNK, end - self.pos))):
                    self.pos += len(piece)
                self.pending = self.placeholder(start, end, line)
                self.next += 1
                continue
            limit = size - len(out)
            if self.next < len(self.ranges):
                limit = min(limit, self.ranges[self.next][0] - self.pos)
            data = self.src.read(limit)
            if not data:
                break
            out += data
            self.pos += len(data)
        return bytes(out)

    def close(self) -> None:
        self.src.close()
        super().close()


def _id_or_none(raw_id) -> Optional[str]:
    if raw_id is None or isinstance(raw_id, (dict, list)) or not _encodable(str(raw_id)):
        return None
    return str(raw_id)


_WHITESPACE = re.compile(r"\s+")


def clean_text(text: str) -> str:
    """The one normalisation applied to every text: control and format characters (NUL, escape
    codes, zero-width marks) become spaces, runs of whitespace become one space, ends are stripped."""
    if text.isprintable():
        return _WHITESPACE.sub(" ", text).strip()
    chars = (" " if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co") else ch for ch in text)
    return _WHITESPACE.sub(" ", "".join(chars)).strip()


def _encodable(value: str) -> bool:
    """False for strings holding lone surrogates (JSON allows "\\ud800"), which no file can store."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _make_row(index: int, raw_id, text, voice, prompt_wav=None, prompt_text=None, instruct=None,
              language=None) -> Union[Row, BadRow]:
    if raw_id is None or (isinstance(raw_id, str) and not raw_id.strip()):
        return BadRow(index, None, f"row {index} has an empty id")
    if isinstance(raw_id, (dict, list, float)):
        return BadRow(index, None, f"row {index} has an id of type {type(raw_id).__name__}; use strings or integers")
    row_id = str(raw_id)
    if not _encodable(row_id):
        return BadRow(index, None, f"row {index} has an id that is not valid Unicode: {row_id!r}")
    if text is None:
        return BadRow(index, row_id, "text is null")
    if not isinstance(text, str):
        return BadRow(index, row_id, f"text is a {type(text).__name__}, expected a string")
    text = clean_text(text)
    if not text:
        return BadRow(index, row_id, "text is empty (or only whitespace and control characters)")
    if voice is not None and not isinstance(voice, str):
        return BadRow(index, row_id, f"voice is a {type(voice).__name__}, expected a string")
    if voice is not None and not _encodable(voice):
        return BadRow(index, row_id, f"voice is not valid Unicode: {voice!r}")
    for name, value in (("prompt_wav", prompt_wav), ("prompt_text", prompt_text), ("instruct", instruct),
                        ("language", language)):
        if value is not None and not isinstance(value, str):
            return BadRow(index, row_id, f"{name} is a {type(value).__name__}, expected a string")
        if value is not None and not _encodable(value):
            return BadRow(index, row_id, f"{name} is not valid Unicode: {value!r}")
    if prompt_text is not None:
        prompt_text = clean_text(prompt_text)
    if instruct is not None:
        instruct = clean_text(instruct)
    if language is not None:
        language = clean_text(language)
        reason = check_language(language) if language else None
        if reason:
            return BadRow(index, row_id, f"{reason}; fix the language column")
    if prompt_text and not prompt_wav:
        return BadRow(index, row_id, "prompt_text without prompt_wav; give the prompt audio too, or drop the text")
    return Row(index=index, id=row_id, text=text, voice=voice or None, prompt_wav=prompt_wav or None,
               prompt_text=prompt_text or None, instruct=instruct or None, language=language or None)
