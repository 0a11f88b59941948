"""Rows read from their sources, streamed: local JSONL, CSV and text files (gzip-compressed too) line by line, so
that a bad row is reported with its file and line; JSON lists, Parquet (in record batches) and hub datasets
through their libraries. A folder is read as `datasets.load_dataset` reads one: the files of the split
(train-*, data/train-*, a train/ folder; else every data file is train), or a folder written by
`save_to_disk`. `checked_rows` brings each row to its format's shape (rows.canonical) and applies the
bad-row policy."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from finetune.config.errors import UserError
from finetune.data import images
from finetune.data.rows import FORMATS, canonical

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt")  # and .jsonl.gz, .json.gz, .csv.gz, .txt.gz


LINE_BITS = 40  # a row of a folder is numbered (file index << LINE_BITS) | line, so that errors can name file:line


@dataclass
class _Invalid:
    problem: str


def located(source: str, split: str = "train") -> Iterator[tuple[int, object]]:
    """(line or row number, row) of one source, streamed; a line that is not JSON comes as _Invalid."""
    path = Path(source).expanduser()
    if not path.exists():
        yield from _hub_rows(source, split)
    elif path.is_dir() and _saved(path):
        yield from _saved_rows(path, split)
    elif path.is_dir():
        for index, file in enumerate(folder_files(path, split)):
            for number, row in _file_rows(file):
                yield index << LINE_BITS | number, row
    else:
        yield from _file_rows(path)


def _saved(folder: Path) -> bool:
    """Written by datasets' save_to_disk (a Dataset or a DatasetDict)?"""
    return (folder / "state.json").exists() or (folder / "dataset_dict.json").exists()


def data_kind(path: Path) -> str:
    """The data format a file's name says: '.jsonl' for both x.jsonl and x.jsonl.gz."""
    return Path(path.stem).suffix if path.suffix == ".gz" else path.suffix


def folder_files(folder: Path, split: str) -> list[Path]:
    """The data files of `split` in a folder, found by datasets' own rules, all of one kind."""
    from datasets.data_files import EmptyDatasetError, get_data_patterns, resolve_pattern

    try:
        patterns = get_data_patterns(str(folder))
    except EmptyDatasetError:
        patterns = {}
    if patterns and split not in patterns:
        raise UserError(f"{folder}: no files of split '{split}' in this folder (it has {', '.join(map(str, patterns))}); "
                        f"set the source's split (data.split for all)")
    found = sorted({Path(f) for pattern in patterns.get(split, []) for f in resolve_pattern(pattern, str(folder))})
    files = [f for f in found if readable(f)]
    kinds = sorted({data_kind(f) for f in files})
    if not files:
        raise UserError(f"{folder}: no data files ({', '.join(SUFFIXES)}, or those gzipped) in this folder")
    if len(kinds) > 1:
        raise UserError(f"{folder}: holds data files of {len(kinds)} kinds ({', '.join(kinds)}); keep one kind in it, or name the files")
    return files


def _file_rows(path: Path) -> Iterator[tuple[int, object]]:
    try:
        yield from _read_file(path)
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise UserError(f"{path}: not a readable gzip file ({err})") from None


def _read_file(path: Path) -> Iterator[tuple[int, object]]:
    kind = data_kind(path)
    if not readable(path):
        raise UserError(f"{path}: unsupported data file type '{''.join(path.suffixes[-2:]) if path.suffix == '.gz' else path.suffix or path.name}' "
                        f"(expected {', '.join(SUFFIXES)}, or one of those but .parquet gzipped)")
    if kind in (".csv", ".txt"):
        yield from _text_rows(path)
    elif kind == ".jsonl":
        with _open(path) as fh:
            for number, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    yield number, _Invalid("not UTF-8 text")
                    continue
                if line.strip():
                    try:
                        yield number, json.loads(line)
                    except json.JSONDecodeError as err:
                        yield number, _Invalid(f"invalid JSON ({err.msg})")
    elif kind == ".json":
        try:
            with _open(path) as fh:
                rows = json.loads(fh.read().decode("utf-8"))
        except UnicodeDecodeError:
            raise UserError(f"{path}: not UTF-8 text") from None
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
        if isinstance(rows, dict) and isinstance(rows.get("data"), list):
            rows = rows["data"]
        if not isinstance(rows, list):
            raise UserError(f"{path}: expected a JSON list of rows (or JSONL)")
        yield from enumerate(rows, 1)
    else:
        yield from _parquet_rows(path)


def readable(path: Path) -> bool:
    """A data file finetune reads: one of SUFFIXES, or one of those gzipped (Parquet compresses inside)."""
    return data_kind(path) in SUFFIXES and not (path.suffix == ".gz" and data_kind(path) == ".parquet")


def _open(path: Path, text: bool = False):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="") if text else gzip.open(path, "rb")
    return path.open(encoding="utf-8", newline="") if text else path.open("rb")


def _text_rows(path: Path) -> Iterator[tuple[int, object]]:
    """CSV rows as {column: text} (the header names the columns), numbered by the line they end on;
    a .txt file's non-empty lines as {"text": line}, as datasets' text loader reads them."""
    import csv

    try:
        with _open(path, text=True) as fh:
            if data_kind(path) == ".txt":
                for number, line in enumerate(fh, 1):
                    if line.strip():
                        yield number, {"text": line.rstrip("\r\n")}
                return
            reader = csv.DictReader(fh)
            for row in reader:
                yield reader.line_num, row if None not in row else _Invalid(f"{len(row[None])} more fields than the header names")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    except csv.Error as err:
        raise UserError(f"{path}: not readable as CSV ({err})") from None


def _parquet_rows(path: Path) -> Iterator[tuple[int, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        number = 0
        for batch in batches:
            for row in batch.to_pylist():
                number += 1
                yield number, row
    except (pa.ArrowException, OSError) as err:
        raise UserError(f"{path}: not a readable Parquet file ({str(err).splitlines()[0]})") from None


def _hub_rows(source: str, split: str) -> Iterator[tuple[int, object]]:
    import datasets

    try:
        ds = datasets.load_dataset(source, split=split)
    except Exception as err:  # noqa: BLE001 - any failure here means "can't get this dataset"
        raise UserError(f"data: cannot load dataset '{source}': {str(err).splitlines()[0]}") from None
    yield from enumerate(_pictures_as_bytes(ds), 1)


def _saved_rows(path: Path, split: str) -> Iterator[tuple[int, object]]:
    """The rows of a folder that `datasets`' save_to_disk wrote (a Dataset, or a DatasetDict's split)."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001 - any failure here means "can't read this folder"
        raise UserError(f"{path}: cannot load this save_to_disk folder: {str(err).splitlines()[0]}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(f"{path}: no split '{split}' in this dataset (it has {', '.join(ds)}); set the source's split (data.split for all)")
        ds = ds[split]
    yield from enumerate(_pictures_as_bytes(ds), 1)


def _pictures_as_bytes(ds):
    """A dataset whose Image columns (one picture, or a list of them) give their stored bytes, not PIL
    images: the pictures are cached as their files' bytes (finetune/data/images.py), never decoded twice."""
    import datasets

    for name, feature in ds.features.items():
        if isinstance(feature, datasets.Image):
            ds = ds.cast_column(name, datasets.Image(decode=False))
        elif isinstance(feature, (datasets.List, datasets.LargeList, datasets.Sequence)) and isinstance(feature.feature, datasets.Image):
            ds = ds.cast_column(name, type(feature)(datasets.Image(decode=False)))
    return ds


def where(source: str, number: int, split: str = "train") -> str:
    """How an error names a row: file:line where a file has lines (in a folder too), the row number elsewhere."""
    path = Path(source).expanduser()
    if path.is_dir() and not _saved(path):
        source, number = str(folder_files(path, split)[number >> LINE_BITS]), number & ((1 << LINE_BITS) - 1)
    lines = data_kind(Path(source)) in (".jsonl", ".csv", ".txt")
    return f"{source}:{number}" if lines else f"{source}: row {number}"


class Skipped:
    """Bad rows skipped so far (data.bad_rows: skip): how many, and where the first was."""

    def __init__(self):
        self.count, self.first = 0, None

    def add(self, source: str, number: int, split: str, problem: str) -> None:
        self.count += 1
        if self.first is None:  # only the first is named: where() lists a folder's files to find the row's
            self.first = f"{where(source, number, split)}: {problem}"


def checked_rows(source: str, fmt: str, bad_rows: str, skipped: Skipped, split: str = "train",
                 columns: dict[str, str] | None = None) -> Iterator[tuple[int, dict]]:
    """The usable rows of one source with their numbers, in their format's own shape; a bad row fails
    with its location, or is skipped and counted."""
    for number, raw in located(source, split):
        row, problem = (raw, raw.problem) if isinstance(raw, _Invalid) else canonical(raw, fmt, columns)
        if problem is None and images.has_images(row):
            row, problem = images.located(row, _file_of(source, number, split))
        if problem is None:
            yield number, row
        elif bad_rows == "fail":
            other = [f for f in FORMATS if f != fmt and not isinstance(raw, _Invalid) and canonical(raw, f, columns)[1] is None]
            hint = f"this row looks like format '{other[0]}': set data.format: {other[0]}" if other else "set data.bad_rows: skip to skip bad rows"
            raise UserError(f"{where(source, number, split)}: {problem} (format '{fmt}'; {hint})")
        else:
            skipped.add(source, number, split, problem)


def _file_of(source: str, number: int, split: str) -> Path:
    """The file a row was read from (a folder's rows are numbered with their file's index)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path / "dataset_info.json" if _saved(path) else folder_files(path, split)[number >> LINE_BITS]
    return path
