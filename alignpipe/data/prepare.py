"""Collect rows from every configured source, validate, dedupe, split and write ``data/prepared``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from alignpipe.artifacts import md5_file
from alignpipe.data import builtin, mixture
from alignpipe.data.schema import FAMILIES, SCHEMA, SPLITS, canonical_json, prompt_of, row_id, with_id
from alignpipe.data.split import SplitSpec, normalize_prompt, split_spec
from alignpipe.errors import ConfigError, DataError

MANIFEST_NAME = "manifest.json"
SOURCE_KINDS = ("builtin", "jsonl", "json", "parquet", "hf")


def collect(
    cfg: dict[str, Any], root: Path, split: SplitSpec
) -> tuple[dict[str, list[dict]], list[dict], dict]:
    """Rows per family from every source, the sources' manifest entries, and rejection info."""
    sources = cfg.get("sources")
    if not isinstance(sources, list) or not sources:
        raise ConfigError(
            "prep config: 'sources' must be a non-empty list, e.g. [{kind: builtin}] or "
            "[{kind: jsonl, path: data/sources/x.jsonl, format: binary_preference, family: preference}]"
        )
    rows: dict[str, list[dict]] = {f: [] for f in FAMILIES}
    entries: list[dict] = []
    rejected = {"total": 0, "by_family": {f: 0 for f in FAMILIES}, "examples": []}
    for i, src in enumerate(sources):
        if not isinstance(src, dict) or "kind" not in src:
            raise ConfigError(
                f"prep config: sources[{i}] must be a mapping with a 'kind' ({', '.join(SOURCE_KINDS)})"
            )
        kind = src["kind"]
        mixture.source_weight(src, i)  # a bad weight stops prep before any source is read
        if kind == "builtin":
            spec = builtin.builtin_spec({k: v for k, v in src.items() if k != "weight"}, cfg.get("builtin"))
            generated = builtin.generate(spec, split)
            for fam, fam_rows in generated.items():
                rows[fam].extend({**r, "_source": i} for r in fam_rows)
            entries.append({"kind": "builtin", **spec, "rows": {f: len(r) for f, r in generated.items()}})
        elif kind in SOURCE_KINDS:
            from alignpipe.data import readers

            fam, fam_rows, entry, bad = readers.read_source(src, i, root)
            rows[fam].extend({**r, "_source": i} for r in fam_rows)
            entries.append(entry)
            rejected["total"] += len(bad)
            rejected["by_family"][fam] += len(bad)
            rejected["examples"].extend(str(e) for e in bad[: max(0, 20 - len(rejected["examples"]))])
        else:
            raise ConfigError(
                f"prep config: sources[{i}].kind '{kind}' is unknown; use one of {', '.join(SOURCE_KINDS)}"
            )
    return rows, entries, rejected


ORIGIN_KEYS = ("_where", "_line", "_source")  # where a source row came from; never written
# A row as placed in a split: (row with id, origin "file:line", index of its source in the config).
Placed = tuple[dict, str, int]


def _origin(row: dict[str, Any]) -> str:
    return f"{row['_where']}:{row['_line']}" if "_where" in row else "builtin source"


def split_family(fam: str, rows: list[dict], split: SplitSpec) -> tuple[dict[str, list[Placed]], int]:
    """Rows placed per split, exact duplicates dropped (first occurrence kept), and their count."""
    seen: set[str] = set()
    by_split: dict[str, list[Placed]] = {s: [] for s in SPLITS}
    dups = 0
    for row in rows:
        origin, source = _origin(row), row.get("_source", -1)
        row = {k: v for k, v in row.items() if k not in ORIGIN_KEYS}
        # Exact duplicates: same content fields, whatever task label each source gave them.
        key = row_id(fam, {k: v for k, v in row.items() if k not in ("id", "task")})
        if key in seen:
            dups += 1
            continue
        seen.add(key)
        row = with_id(fam, row)
        by_split[split.assign(prompt_of(fam, row))].append((row, origin, source))
    return by_split, dups


def check_heldout_leaks(splits: dict[str, dict[str, list[Placed]]], limit: int = 10) -> None:
    """Fail when a validation/test prompt of any family is in any family's train split.

    Prompts are compared normalised (:func:`~alignpipe.data.split.normalize_prompt` of their
    user turn(s)); the error names each pair: family, split, origin (file:line) and the prompt.
    """
    heldout: dict[str, str] = {}
    for fam, by_split in splits.items():
        for s in ("validation", "test"):
            for row, origin, _ in by_split[s]:
                heldout.setdefault(normalize_prompt(prompt_of(fam, row)), f"{fam}/{s} ({origin})")
    pairs = []
    for fam, by_split in splits.items():
        for row, origin, _ in by_split["train"]:
            prompt = prompt_of(fam, row)
            other = heldout.get(normalize_prompt(prompt))
            if other is not None:
                pairs.append(f"{fam}/train ({origin}) and {other}: {prompt[:80]!r}")
    if pairs:
        more = f"\n  ... and {len(pairs) - limit} more" if len(pairs) > limit else ""
        raise DataError(
            "data/prepared",
            None,
            None,
            f"{len(pairs)} held-out prompt(s) also in a train split:\n  " + "\n  ".join(pairs[:limit]) + more,
            "every family must split by the normalised user turn(s) (alignpipe.data.schema.prompt_of); "
            "report this as a bug",
        )


def _write_family(out_dir: Path, fam: str, by_split: dict[str, list[Placed]]) -> dict[str, dict]:
    files = {}
    (out_dir / fam).mkdir(parents=True, exist_ok=True)
    for s in SPLITS:
        path = out_dir / fam / f"{s}.jsonl"
        with path.open("w", encoding="utf-8", newline="\n") as f:
            for row in sorted((r for r, _, _ in by_split[s]), key=lambda r: r["id"]):
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        files[f"{fam}/{s}.jsonl"] = {"rows": len(by_split[s]), "md5": md5_file(path)}
    return files


def prepare(cfg: dict[str, Any], root: Path, out_dir: Path) -> dict[str, Any]:
    """Write ``<family>/<split>.jsonl`` and ``manifest.json`` into ``out_dir``; return the manifest."""
    root, out_dir = Path(root), Path(out_dir)
    split = split_spec(cfg.get("split"))
    rows, entries, rejected = collect(cfg, root, split)

    splits, duplicates = {}, {}
    for fam in FAMILIES:
        splits[fam], duplicates[fam] = split_family(fam, rows[fam], split)
    check_heldout_leaks(splits)
    mixtures = mixture.mix_families(cfg, cfg["sources"], splits, split.seed)
    placed = Counter((src, fam, s) for fam in FAMILIES for s in SPLITS for _, _, src in splits[fam][s])
    for i, entry in enumerate(entries):  # what each source put in each split, after mixing
        fams = [f for f in FAMILIES if any(placed[(i, f, s)] for s in SPLITS)]
        entry["splits"] = {f: {s: placed[(i, f, s)] for s in SPLITS} for f in fams}
    counts = {fam: {s: len(splits[fam][s]) for s in SPLITS} for fam in FAMILIES}
    files: dict[str, dict[str, Any]] = {}
    for fam in FAMILIES:
        files.update(_write_family(out_dir, fam, splits[fam]))
    ties = {f: sum(e.get("ties_dropped", 0) for e in entries if e.get("family") == f) for f in FAMILIES}

    manifest = {
        "counts": counts,
        "total_rows": sum(sum(c.values()) for c in counts.values()),
        "files": files,
        "sources": entries,
        "split": split.as_dict(),
        "schema": SCHEMA,
        "duplicates_removed": {"total": sum(duplicates.values()), "by_family": duplicates},
        "rows_rejected": rejected,
        "ties_dropped": {"total": sum(ties.values()), "by_family": ties},
        "heldout": "rlvr/test.jsonl",
        "mixtures": mixtures,
    }
    (out_dir / MANIFEST_NAME).write_text(
        json.dumps(json.loads(canonical_json(manifest)), indent=2, sort_keys=True, ensure_ascii=False) + "\n",
        encoding="utf-8",
    )
    return manifest
