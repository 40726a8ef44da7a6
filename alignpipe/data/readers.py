"""Source readers (JSONL, JSON array, Parquet, shard directories, Hugging Face datasets).

A file source (``kind: jsonl|json|parquet``; ``path`` a file or a directory of shards) or a
Hugging Face source (``kind: hf``) yields records with their file and 1-based line (JSONL/JSON)
or row (Parquet/HF) number; :mod:`alignpipe.data.formats` converts each record from its NeMo-RL
format into a prepared row of the source's family. Every problem is a
:class:`~alignpipe.errors.DataError` naming the file, line and field and how to fix it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from alignpipe.artifacts import dvc_hash
from alignpipe.data.formats import ANSWER_FORMATS, FORMATS, SourceRecord, convert, math_gold_error
from alignpipe.data.schema import FAMILIES
from alignpipe.errors import ConfigError, DataError

FILE_KINDS = ("jsonl", "json", "parquet")
SHARD_SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}


# --------------------------------------------------------------------------- readers


def _decode(raw: bytes, where: str, line: int | None, offset_base: int = 0) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if line is None:  # whole file: find the line of the bad byte
            line = raw.count(b"\n", 0, e.start) + 1
            col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        else:
            col = e.start + 1
        raise DataError(
            where,
            line,
            None,
            f"invalid UTF-8 (byte {raw[e.start : e.start + 1]!r} at column {col}: {e.reason})",
            "re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 in > out`",
        ) from None


def read_jsonl(path: Path, where: str) -> Iterator[tuple[int, Any] | DataError]:
    """Each non-blank line decoded and parsed on its own, so an error names its line."""
    data = path.read_bytes()
    for i, raw in enumerate(data.split(b"\n"), 1):
        if i == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        if not raw.strip():
            continue
        try:
            text = _decode(raw, where, i)
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(
                    where,
                    i,
                    None,
                    f"invalid JSON at column {e.colno}: {e.msg}",
                    "each line must hold one complete JSON object (JSON Lines)",
                ) from None
        except DataError as err:
            yield err
            continue
        yield i, obj


def read_json(path: Path, where: str) -> Iterator[tuple[int, Any]]:
    """A JSON array of records; each record is reported at the line where it starts."""
    data = path.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    text = _decode(data, where, None)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            where, e.lineno, None, f"invalid JSON at column {e.colno}: {e.msg}", "fix the syntax"
        ) from None
    if not isinstance(doc, list):
        raise DataError(
            where,
            1,
            None,
            f"expected a JSON array of records, found a JSON {type(doc).__name__}",
            "wrap the records in [...], or use kind: jsonl for one object per line",
        )
    # Find the line each element starts on (the document is valid, so raw_decode cannot fail).
    decoder = json.JSONDecoder()
    pos, line, counted = text.index("[") + 1, 1, 0
    for obj in doc:
        while text[pos] in " \t\r\n,":
            pos += 1
        line += text.count("\n", counted, pos)
        counted = pos
        _, pos = decoder.raw_decode(text, pos)
        yield line, obj


def read_parquet(path: Path, where: str) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
        raise DataError(
            where, None, None, f"not a readable Parquet file: {e}", "check the file and its kind"
        ) from None
    yield from enumerate(table.to_pylist(), 1)


def load_hf(src: dict[str, Any], root: Path, where: str):
    """``datasets.load_dataset`` (or ``load_from_disk`` for a ``save_to_disk`` directory)."""
    import datasets

    name = str(src["name"])
    local = Path(name) if Path(name).is_absolute() else root / name
    split = src.get("split") or "train"
    try:
        if local.is_dir() and ((local / "dataset_dict.json").is_file() or (local / "state.json").is_file()):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(
                        where,
                        None,
                        "split",
                        f"split '{split}' not found; it has {', '.join(ds)}",
                        "set split:",
                    )
                ds = ds[split]
        else:
            kwargs = {"split": split}
            if src.get("data_files") is not None:
                kwargs["data_files"] = src["data_files"]
            target = str(local) if local.exists() else name
            ds = datasets.load_dataset(target, src.get("config"), **kwargs)
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            where,
            None,
            None,
            f"cannot load the dataset: {type(e).__name__}: {e}",
            "check name/config/split; runs are offline, so name a local directory "
            "(save_to_disk output or data files) or a dataset already in the HF cache",
        ) from None
    return ds, (local if local.exists() else None)


# --------------------------------------------------------------------------- sources


def _source_settings(src: dict[str, Any], index: int) -> tuple[str, str, str]:
    kind, family, fmt = src["kind"], src.get("family"), src.get("format")
    label = f"prep config: sources[{index}] ({kind})"
    if family not in FAMILIES:
        raise ConfigError(f"{label}: 'family' is {family!r}; set one of {', '.join(FAMILIES)}")
    if fmt not in FORMATS:
        raise ConfigError(f"{label}: 'format' is {fmt!r}; set one of {', '.join(FORMATS)}")
    if family not in FORMATS[fmt]:
        raise ConfigError(
            f"{label}: format '{fmt}' cannot feed family '{family}'; it feeds {', '.join(FORMATS[fmt])}"
        )
    on_invalid = src.get("on_invalid", "error")
    if on_invalid not in ("error", "skip"):
        raise ConfigError(f"{label}: 'on_invalid' is {on_invalid!r}; use error (default) or skip")
    answer_format = src.get("answer_format", "text")
    if answer_format not in ANSWER_FORMATS:
        raise ConfigError(
            f"{label}: 'answer_format' is {answer_format!r}; use one of {', '.join(ANSWER_FORMATS)}"
        )
    columns = src.get("columns")
    if columns is not None and not isinstance(columns, dict):
        raise ConfigError(f"{label}: 'columns' must map source column -> field name")
    return kind, family, fmt


def shards(path: Path, where: str, kind: str) -> list[Path]:
    """The data files of a shard directory in sorted relative-path order (the order rows are read)."""
    files = sorted(
        (
            p
            for p in path.rglob("*")
            if p.is_file() and not any(x.startswith(".") for x in p.relative_to(path).parts)
        ),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    data = [p for p in files if p.suffix in SHARD_SUFFIXES]
    found = sorted({SHARD_SUFFIXES[p.suffix] for p in data})
    if not data:
        names = ", ".join(p.name for p in files[:5]) or "nothing"
        raise DataError(
            where,
            None,
            None,
            f"is a directory with no .jsonl, .json or .parquet shards (found: {names})",
            "put the shards in it, or point path at one data file",
        )
    if len(found) > 1:
        raise DataError(
            where,
            None,
            None,
            f"is a directory that mixes shard formats ({', '.join(found)})",
            "keep one format per directory and give each its own source",
        )
    if found[0] != kind:
        raise DataError(
            where,
            None,
            None,
            f"holds {found[0]} shards but the source says kind: {kind}",
            f"set kind: {found[0]}",
        )
    return data


def _file_records(
    src: dict[str, Any], index: int, root: Path, kind: str, entry: dict
) -> tuple[Iterator, str]:
    """Records of a file source (a file, or every shard of a directory in order), and its default task."""
    if not src.get("path"):
        raise ConfigError(
            f"prep config: sources[{index}] ({kind}) needs a 'path' (relative to the repo root)"
        )
    path = Path(src["path"])
    path = path if path.is_absolute() else root / path
    where = str(src["path"])
    if path.is_dir():
        files = shards(path, where, kind)
        entry["shards"] = [p.relative_to(path).as_posix() for p in files]
        named = [(p, f"{where.rstrip('/')}/{p.relative_to(path).as_posix()}") for p in files]
    elif path.is_file():
        named = [(path, where)]
    else:
        raise DataError(
            where, None, None, f"does not exist (looked for {path})", f"fix sources[{index}].path"
        )
    entry.update(path=where, md5=dvc_hash(path))
    reader = {"jsonl": read_jsonl, "json": read_json, "parquet": read_parquet}[kind]

    def records() -> Iterator:
        for file, name in named:
            for item in reader(file, name):
                yield item if isinstance(item, DataError) else (name, *item)

    return records(), path.stem if path.is_file() else path.name


def _hf_records(src: dict[str, Any], index: int, root: Path, entry: dict) -> tuple[Iterator, str]:
    if not src.get("name"):
        raise ConfigError(f"prep config: sources[{index}] (hf) needs a 'name' (hub id or local directory)")
    where = f"hf:{src['name']}[{src.get('split') or 'train'}]"
    ds, local = load_hf(src, root, where)
    entry.update(
        name=str(src["name"]),
        config=src.get("config"),
        split=src.get("split") or "train",
        md5=dvc_hash(local) if local is not None else None,
        fingerprint=getattr(ds, "_fingerprint", None),
    )
    return ((where, i, rec) for i, rec in enumerate(ds, 1)), Path(str(src["name"])).name


def _convert_records(
    records: Iterator, src: dict[str, Any], fmt: str, family: str, default_task: str
) -> tuple[list[dict[str, Any]], list[DataError], int, int]:
    """Rows (with ``_where``/``_line``), the skipped records' errors, records read, ties dropped."""
    columns = src.get("columns") or {}
    skip = src.get("on_invalid", "error") == "skip"
    rows: list[dict[str, Any]] = []
    bad: list[DataError] = []
    read = ties = 0
    for item in records:
        read += 1
        try:
            if isinstance(item, DataError):
                raise item
            where, line, rec = item
            if columns and isinstance(rec, dict):
                rec = {columns.get(k, k): v for k, v in rec.items()}
            row = convert(fmt, family, src, SourceRecord(where, line, rec), default_task)
        except DataError as err:
            if not skip:
                raise
            bad.append(err)
            continue
        if row is None:
            ties += 1
            continue
        rows.append({**row, "_where": where, "_line": line})
    return rows, bad, read, ties


def check_math_golds(rows: list[dict[str, Any]], skip: bool) -> tuple[list[dict[str, Any]], list[DataError]]:
    """Rows whose ``math`` gold answer math-verify parses, and errors for the others.

    The check is math-verify's own gold parsing as the ``math`` verifier does it
    (:func:`alignpipe.rewards.math_verify_pool.gold_parses`): a gold it cannot parse scores
    every completion 0, so it is an input error, not a silent run.
    """
    golds = [r for r in rows if r.get("verifier") == "math"]
    if not golds:
        return rows, []
    from alignpipe.rewards.math_verify_pool import golds_parse

    failed = {id(r) for r, ok in zip(golds, golds_parse([r["answer"] for r in golds]), strict=True) if not ok}
    kept, bad = [], []
    for r in rows:
        if id(r) in failed:
            err = math_gold_error(r["_where"], r["_line"], r["_answer_field"], r["answer"])
            if not skip:
                raise err
            bad.append(err)
        else:
            kept.append(r)
    return kept, bad


def read_source(
    src: dict[str, Any], index: int, root: Path
) -> tuple[str, list[dict[str, Any]], dict[str, Any], list[DataError]]:
    """Rows (without ids; ``_where``/``_line`` say where each came from) of one file/HF source,
    its manifest entry, and the records it skipped."""
    kind, family, fmt = _source_settings(src, index)
    entry: dict[str, Any] = {"kind": kind, "family": family, "format": fmt}
    if kind in FILE_KINDS:
        records, default_task = _file_records(src, index, root, kind, entry)
        where = str(src["path"])
    elif kind == "hf":
        records, default_task = _hf_records(src, index, root, entry)
        where = f"hf:{src['name']}[{src.get('split') or 'train'}]"
    else:  # pragma: no cover - prepare.collect dispatches only these kinds
        raise ConfigError(f"prep config: sources[{index}].kind '{kind}' is not a file or hf source")
    rows, bad, read, ties = _convert_records(records, src, fmt, family, default_task)
    if read == 0:
        raise DataError(
            where,
            None,
            None,
            "holds no records" + (f" in its {len(entry['shards'])} shard(s)" if "shards" in entry else ""),
            f"fill it, or remove sources[{index}] from the prep config",
        )
    rows, bad_golds = check_math_golds(rows, src.get("on_invalid", "error") == "skip")
    bad.extend(bad_golds)
    for r in rows:
        r.pop("_answer_field", None)
    entry.update(rows_read=read, rows_kept=len(rows), rows_rejected=len(bad))
    if fmt == "helpsteer3":
        entry["ties_dropped"] = ties
    return family, rows, entry, bad
