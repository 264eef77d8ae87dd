"""Download cache of raw files: location, mirror, download with sha256 check (via pooch: a download is moved
into place only after its sha256 matched, so a failed or corrupt one leaves nothing behind)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote, urlparse

import pooch
import requests

from dpsgd_cli.data.registry import DatasetEntry, RemoteFile, get_entry
from dpsgd_cli.errors import DataError

DATA_DIR_ENV = "DPSGD_DATA_DIR"
MIRROR_ENV = "DPSGD_DATA_MIRROR"
DEFAULT_DATA_DIR = "datasets"
TIMEOUT_SECONDS = 60

pooch.get_logger().setLevel("WARNING")


def _read_umask() -> int:
    """The process umask (read once at import by setting and restoring it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def make_readable(path: Path) -> None:
    """Give a file made by tempfile (mode 0600) the usual mode 0666 & ~umask; best effort."""
    with contextlib.suppress(OSError):
        os.chmod(path, 0o666 & ~_UMASK)


def cache_dir() -> Path:
    """Root of the download cache: $DPSGD_DATA_DIR, default ./datasets (absolute, resolved now)."""
    return Path(os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR).expanduser().absolute()


def mirror_base() -> str | None:
    """$DPSGD_DATA_MIRROR without trailing slash, or None when unset."""
    base = os.environ.get(MIRROR_ENV, "").strip()
    return base.rstrip("/") or None


def file_path(dataset: str, filename: str) -> Path:
    """Where `filename` of `dataset` lives in the cache: <cache>/<dataset>/<filename>."""
    return cache_dir() / dataset / filename


def file_url(dataset: str, remote: RemoteFile) -> str:
    """The URL to fetch: <mirror>/<dataset>/<file> if DPSGD_DATA_MIRROR is set, else canonical."""
    base = mirror_base()
    return f"{base}/{dataset}/{remote.name}" if base else remote.url


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_verified(dataset: str, remote: RemoteFile) -> bool:
    """True if the cached copy exists and its sha256 matches the registry."""
    path = file_path(dataset, remote.name)
    return path.is_file() and path.stat().st_size == remote.size and sha256_of(path) == remote.sha256


def _local_source(url: str) -> Path | None:
    """The local path behind a file:// URL or a plain directory mirror, else None."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "":
        return Path(url)
    return None


class TooLarge(OSError):
    """A source sent more bytes than the registry's size of the file (a mirror can stream forever)."""


def _copy_at_most(chunks: Iterable[bytes], output_file: str, size: int) -> None:
    """Write `chunks` to `output_file`, stopping (TooLarge) as soon as they exceed `size` bytes."""
    written = 0
    with open(output_file, "wb") as fh:
        for chunk in chunks:
            written += len(chunk)
            if written > size:
                raise TooLarge(f"the source sent more than the registry's {size:,} bytes of this file; stopped")
            fh.write(chunk)


class _CopyDownloader:
    """pooch downloader for a local mirror (a folder or file:// URL): copies the file, at most `size` bytes."""

    def __init__(self, source: Path, size: int) -> None:
        self.source, self.size = source, size

    def __call__(self, url: str, output_file: str, pooch_obj: object) -> None:
        if self.source.exists() and not self.source.is_file():  # opening a FIFO would wait for a writer
            raise TooLarge(f"{self.source} is not a regular file")
        with open(self.source, "rb") as fh:
            _copy_at_most(iter(lambda: fh.read(1 << 20), b""), output_file, self.size)


class _HttpDownloader:
    """pooch downloader for HTTP(S): streams at most `size` bytes, always closing the connection."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, url: str, output_file: str, pooch_obj: object) -> None:
        with requests.get(url, stream=True, timeout=TIMEOUT_SECONDS) as response:
            response.raise_for_status()
            _copy_at_most(response.iter_content(chunk_size=1 << 20), output_file, self.size)


def _downloader(url: str, size: int):
    """A pooch downloader for `url` that stops past `size` bytes (None: pooch's own, for ftp, doi)."""
    local = _local_source(url)
    if local is not None:
        return _CopyDownloader(local, size)
    if urlparse(url).scheme in ("http", "https"):
        return _HttpDownloader(size)
    return None


def _describe(exc: BaseException) -> str:
    """A short one-line reason for a download failure."""
    if isinstance(exc, requests.exceptions.HTTPError) and exc.response is not None:
        return f"HTTP {exc.response.status_code} {exc.response.reason}"
    if isinstance(exc, requests.exceptions.Timeout):
        return f"timed out after {TIMEOUT_SECONDS} s"
    text = " ".join(str(exc).split())
    errno = re.search(r"\[Errno -?\d+\][^'\")]*", text)
    if isinstance(exc, requests.exceptions.ConnectionError):
        return "connection failed" + (f" ({errno.group(0).strip()})" if errno else "")
    if isinstance(exc, TooLarge):
        return str(exc)
    if isinstance(exc, FileNotFoundError):
        return f"no such file {exc.filename}"
    return f"{type(exc).__name__}: {text[:200]}"


def _fixes(dest: Path, remote: RemoteFile) -> str:
    """The standard how-to-fix tail of a download error."""
    return (f"set {MIRROR_ENV} to a mirror that serves <dataset>/<file>, "
            f"or place the file manually at {dest} (sha256 {remote.sha256})")


def check_cache_folder(folder: Path) -> None:
    """DataError naming the fix when the cache folder (or a folder above it) is a file."""
    for path in [folder, *folder.parents]:
        if path.exists() and not path.is_dir():
            where = (f"{DATA_DIR_ENV}={os.environ[DATA_DIR_ENV]}" if os.environ.get(DATA_DIR_ENV)
                     else f"the default cache folder {cache_dir()}")
            raise DataError(f"{where}: {path} is a file, not a folder; set {DATA_DIR_ENV} to a folder for the "
                            f"dataset cache (it is created if missing), or move the file away")
        if path.exists():
            return


def fetch_file(dataset: str, filename: str) -> Path:
    """Path of a verified cached copy of one raw file, downloading it if needed (DataError: file, URL, fixes)."""
    entry = get_entry(dataset)
    remote = entry.file(filename)
    dest = file_path(dataset, filename)
    url = file_url(dataset, remote)
    check_cache_folder(dest.parent)
    before = dest.stat().st_ino if dest.exists() else None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        got = pooch.retrieve(url, known_hash=f"sha256:{remote.sha256}", fname=filename, path=dest.parent,
                             downloader=_downloader(url, remote.size), progressbar=False)
    except (requests.exceptions.RequestException, ValueError, OSError, EOFError) as exc:
        # a valid cached copy never reaches here, so an existing file is a stale one
        raise _download_error(dataset, remote, url, dest, exc, dest.exists()) from exc
    got = Path(got)
    if got.stat().st_ino != before:  # freshly downloaded from a 0600 temp file
        make_readable(got)
    return got


def _download_error(dataset: str, remote: RemoteFile, url: str, dest: Path, exc: Exception, stale: bool) -> DataError:
    if isinstance(exc, ValueError) and "hash" in str(exc).lower():
        got = re.search(r"but got ([0-9a-fA-F]+)", str(exc))
        actual = f" (got {got.group(1)})" if got else ""
        reason = f"the downloaded file does not have sha256 {remote.sha256}{actual} and was discarded"
    elif isinstance(exc, PermissionError) and not os.access(dest.parent, os.W_OK):
        return DataError(f"cannot write {remote.name} of dataset '{dataset}' to {dest.parent}: permission denied; "
                         f"set {DATA_DIR_ENV} to a writable folder")
    else:
        reason = _describe(exc)
    old = f"; the existing {dest} has a wrong sha256, replace or delete it" if stale else ""
    return DataError(f"cannot fetch {remote.name} of dataset '{dataset}' from {url}: {reason}{old}; "
                     + _fixes(dest, remote))


def fetch(name: str) -> list[Path]:
    """Download (if needed) and verify every file of dataset `name`; synthetic returns []."""
    entry: DatasetEntry = get_entry(name)
    return [fetch_file(entry.name, f.name) for f in entry.files]
