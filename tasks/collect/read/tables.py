"""Parquet and Arrow readers for the collect stage: one document per row (pyarrow).

Columns are the JSON-lines ones: `text` (required), `id`, `url`, `metadata` (a struct whose `url`
wins). A Hugging Face `datasets` folder written by `save_to_disk` holds its rows in Arrow stream
files (`data-00000-of-0000N.arrow`, in order) beside JSON state, so pointing a source at the
folder reads it without importing `datasets`; Arrow IPC *file* format (magic `ARROW1`) works too.

A Parquet file is read row group by row group: a large one in parts of whole row groups
(`parquet_parts`), and a row group that cannot be decoded is one error, the next one read.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import IO

from gristmill.tasks.collect.read.records import WHOLE, Part, ReadEvent, Skipped, quarantine, record_event, runs

COLUMNS = ("text", "id", "url", "metadata")  # read only what a document needs
BATCH_ROWS = 1024
ARROW_FILE_MAGIC = b"ARROW1"


def _no_text_column(names: list[str], name: str) -> Skipped | None:
    if "text" in names:
        return None
    return Skipped(reason="error_no_text_column", nbytes=0, where=f"{name} (columns: {', '.join(names)})")


def _rows(batches: Iterable, names: list[str], name: str, fmt: str, row: int = 0) -> Iterator[ReadEvent]:
    """Events of the rows of record batches, the first being row `row` of the file; a batch that
    cannot be decoded ends them with one error, a bad value in one is one quarantined row."""
    import pyarrow as pa

    columns = [c for c in COLUMNS if c in names]
    try:
        for batch in batches:
            for event in _batch_events(batch.select(columns), name, row):
                yield event
                row += 1
    except (pa.ArrowException, OSError) as exc:
        yield quarantine(f"error_corrupt_{fmt}", 0, f"{name}#{row}", str(exc))


def _batch_events(batch, name: str, first_row: int) -> Iterator[ReadEvent]:
    """One event per row. Parquet and Arrow IPC readers do not check string data (UTF-8,
    offsets) unless asked, and to_pylist would raise on a bad value (or read out of bounds): a
    batch that fails full validation is read row by row, and each bad row is quarantined as
    `error_invalid_row`, the rows around it read."""
    import pyarrow as pa

    try:
        batch.validate(full=True)
    except pa.ArrowInvalid as exc:
        if batch.num_rows == 1:
            yield quarantine("error_invalid_row", 0, f"{name}#{first_row}", str(exc))
            return
        for i in range(batch.num_rows):
            yield from _batch_events(batch.slice(i, 1), name, first_row + i)
        return
    for i, record in enumerate(batch.to_pylist()):
        text = record["text"]
        nbytes = len(text.encode("utf-8", "replace")) if isinstance(text, str) else 0
        yield record_event(record, nbytes, f"{name}#{first_row + i}")


def read_parquet(f: IO[bytes], name: str, max_doc_bytes: int,
                 part: Part = WHOLE) -> Iterator[ReadEvent]:
    """Rows of a Parquet file's row groups (those in `part`), BATCH_ROWS at a time
    (max_doc_bytes is applied by read_file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as exc:
        yield quarantine("error_corrupt_parquet", 0, name, str(exc))
        return
    names = table.schema_arrow.names
    if (missing := _no_text_column(names, name)) is not None:
        yield missing
        return
    columns = [c for c in COLUMNS if c in names]
    groups = range(table.num_row_groups)[part.start:part.end]
    row = sum(table.metadata.row_group(g).num_rows for g in range(groups.start))
    for group in groups:  # row numbers come from the metadata: a damaged group shifts none
        yield from _rows(table.iter_batches(BATCH_ROWS, row_groups=[group], columns=columns),
                         names, name, "parquet", row)
        row += table.metadata.row_group(group).num_rows


def parquet_parts(f: IO[bytes], unit_bytes: int) -> list[Part]:
    """Runs of whole row groups of about `unit_bytes` each (compressed, as on disk); a file whose
    metadata cannot be read is one part (read_parquet reports it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(f).metadata
    except (pa.ArrowException, OSError):
        return [WHOLE]
    sizes = [sum(metadata.row_group(g).column(c).total_compressed_size
                 for c in range(metadata.num_columns)) for g in range(metadata.num_row_groups)]
    cuts = runs(sizes, unit_bytes)
    return [Part(i, j) for i, j in cuts] if len(cuts) > 1 else [WHOLE]


def read_arrow(f: IO[bytes], name: str, max_doc_bytes: int,
               part: Part = WHOLE) -> Iterator[ReadEvent]:
    """Rows of an Arrow IPC stream (what `datasets` writes) or IPC file; never split (one part)."""
    import pyarrow as pa

    is_file_format = f.read(len(ARROW_FILE_MAGIC)) == ARROW_FILE_MAGIC
    f.seek(0)
    try:
        if is_file_format:
            reader = pa.ipc.open_file(f)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            reader = pa.ipc.open_stream(f)
            batches = iter(reader)
    except (pa.ArrowException, OSError) as exc:
        yield quarantine("error_corrupt_arrow", 0, name, str(exc))
        return
    if (missing := _no_text_column(reader.schema.names, name)) is not None:
        yield missing
        return
    yield from _rows(batches, reader.schema.names, name, "arrow")
