"""LocalSource: a checkpoint folder on this machine, named file:///abs/dir, inside an allowed root."""

from pathlib import Path
from typing import BinaryIO

from adapter_store.config import StoreConfig
from shared.errors import InvalidArgument, NotFound, PermissionDenied


class LocalSource:
    """Every path is resolved before it is checked against the allowed roots, so neither `..` nor
    a symlink (to the folder or to one file in it) reaches outside them. The path is taken as
    written, without percent-decoding."""

    def __init__(self, uri: str, config: StoreConfig, where: str):
        self._where = where
        self._roots = tuple(_resolve(Path(root), where) for root in config.allowed_roots)
        if not self._roots:
            raise PermissionDenied(f"{where}: file:// sources are refused: no --allowed-root is configured")
        path = Path(uri.removeprefix("file://"))
        if not path.is_absolute():
            raise InvalidArgument(f"{where}: {uri!r} must name an absolute path, as in file:///abs/dir")
        # Containment before existence, so a refusal tells nothing about paths outside the roots.
        self._folder = self._inside_roots(path)
        if not self._folder.is_dir():
            raise NotFound(f"{where}: source folder {path} does not exist")
        self.uri = f"file://{self._folder}"

    def size(self, name: str) -> int | None:
        path = self._inside_roots(self._folder / name)
        return path.stat().st_size if path.is_file() else None

    def open(self, name: str) -> BinaryIO:
        # Opened by its resolved path: the very path checked against the roots.
        path = self._inside_roots(self._folder / name)
        try:
            return path.open("rb")
        except PermissionError:
            raise PermissionDenied(f"{self._where}: {path} is not readable by the store") from None

    def _inside_roots(self, path: Path) -> Path:
        resolved = _resolve(path, self._where)
        if not any(resolved.is_relative_to(root) for root in self._roots):
            raise PermissionDenied(
                f"{self._where}: {path} resolves to {resolved}, outside the allowed roots "
                f"({', '.join(map(str, self._roots))})"
            )
        return resolved


def _resolve(path: Path, where: str) -> Path:
    try:
        return path.resolve(strict=False)
    except (OSError, RuntimeError, ValueError) as e:  # symlink loops, NUL bytes
        raise InvalidArgument(f"{where}: path {path} cannot be resolved ({e})") from None
