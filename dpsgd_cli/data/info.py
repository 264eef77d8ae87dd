"""Dataset descriptions for the CLI (`dpsgd datasets list / info`): plain dicts, no formatting."""

from __future__ import annotations

from typing import Any

from dpsgd_cli.data.download import cache_dir, file_path, file_url, is_verified, mirror_base
from dpsgd_cli.data.load import resolve_spec
from dpsgd_cli.data.registry import REGISTRY, DatasetEntry, RemoteFile, get_entry
from dpsgd_cli.data.spec import DatasetSpec


def _present(entry: DatasetEntry) -> list[bool]:
    """Per file: present in the cache with the expected size (cheap, no hashing)."""
    out = []
    for f in entry.files:
        path = file_path(entry.name, f.name)
        out.append(path.is_file() and path.stat().st_size == f.size)
    return out


def _summary(entry: DatasetEntry) -> dict[str, Any]:
    """The fields shared by `list_datasets` and `dataset_info`."""
    present = _present(entry)
    size = sum(file_path(entry.name, f.name).stat().st_size for f, ok in zip(entry.files, present) if ok)
    return {"name": entry.name, "description": entry.description, "records": entry.total_records,
            "files": [f.name for f in entry.files], "cached": all(present), "cache_state": _cache_state(present),
            "size_bytes": size, "source": entry.source, "license": entry.licence}


def _cache_state(present: list[bool]) -> str:
    """yes (every file cached), partial (some), no (none), or generated (no files: synthetic)."""
    if not present:
        return "generated"
    return "yes" if all(present) else "partial" if any(present) else "no"


def list_datasets() -> list[dict[str, Any]]:
    """One dict per dataset: name, description, records, files, cached, cache_state, size_bytes, source, license."""
    return [_summary(entry) for entry in REGISTRY.values()]


def dataset_info(name: str) -> dict[str, Any]:
    """`list_datasets()` fields of `name` plus its details, its resolved defaults and per-file details."""
    entry = get_entry(name)
    info = _summary(entry)
    info.update(records_detail=dict(entry.records), notes=entry.notes, reference=entry.reference,
                cache_dir=str(cache_dir()), mirror=mirror_base(),
                defaults=resolve_spec(DatasetSpec(name=entry.name)).model_dump(exclude={"name"}),
                file_details=[_file_detail(entry, f) for f in entry.files])
    return info


def _file_detail(entry: DatasetEntry, remote: RemoteFile) -> dict[str, Any]:
    """One file of `dataset_info`: where it comes from, where it goes, whether it is verified."""
    path = file_path(entry.name, remote.name)
    return {"name": remote.name, "description": remote.description, "url": remote.url,
            "fetch_url": file_url(entry.name, remote), "sha256": remote.sha256, "size": remote.size,
            "records": remote.records, "path": str(path), "cached": path.is_file(),
            "verified": is_verified(entry.name, remote)}
