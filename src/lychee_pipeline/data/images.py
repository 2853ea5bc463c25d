"""Image path resolution with root confinement, and one-time image verification (Kedro-free).

The one image-path rule of the project: ingestion, normalization, the batch rerank and the served MLflow model
all parse their roots with :func:`parse_image_roots` and confine a reference with :class:`Resolver`, so a file
name training accepted is accepted where the model is served, and a path outside the roots is refused by both.
"""

from __future__ import annotations

import os
import re
import unicodedata
import warnings
from pathlib import Path
from typing import Any

from PIL import Image

# PIL's decompression-bomb guard (Image.MAX_IMAGE_PIXELS) stays on for the whole process (the reranker's
# image loading relies on it); check_image applies the configured, usually lower, max_pixels on top, from the
# header, before anything is decoded. Only a max_pixels above PIL's limit raises that limit.
MAX_ASPECT_RATIO = 200  # the Qwen2.5-VL processor refuses longer/shorter sides beyond 200:1

#: Why a reference is refused (the first words of a resolver reason, counted in the logs by these words).
ESCAPES_ROOTS = "path escapes the image roots"
NOT_FOUND = "image not found"
A_FOLDER = "a folder, not an image file"
URL_NOT_FETCHED = "URLs are not fetched (download the images and give local paths)"
#: `~` in a data file's reference is not the home folder: expanding it would let a line name a path by
#: whoever runs the job; a reference is relative to an image root, or absolute.
TILDE_NOT_EXPANDED = "'~' is not expanded in image paths (give a path relative to an image root, or absolute)"
REFUSAL_KINDS = (ESCAPES_ROOTS, NOT_FOUND, A_FOLDER, URL_NOT_FETCHED, TILDE_NOT_EXPANDED)
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def parse_image_roots(value: Any) -> list[str]:
    """Image roots as a list: a YAML list, or one string of roots separated by os.pathsep (':').

    The string form is what works on the command line, where Kedro splits --params on commas
    (``--params "data.image_roots=/data/shop:/mnt/img"``), and in the ``LYCHEE_IMAGE_ROOTS`` variable.
    Blank entries are dropped; nothing is resolved here (:class:`Resolver` resolves them where they are used).
    """
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        value = str(value).split(os.pathsep)
    return [str(v).strip() for v in value if v is not None and str(v).strip()]


class ImagePathError(ValueError):
    """An image reference the roots refuse; ``kind`` is one of :data:`REFUSAL_KINDS`."""

    def __init__(self, kind: str, ref: str) -> None:
        super().__init__(f"{kind}: {ref}")
        self.kind, self.ref = kind, ref


class Resolver:
    """Resolves image references against several roots; refuses any path that leaves them."""

    def __init__(self, roots: list[str]) -> None:
        if not roots:
            raise ValueError("at least one image root is needed")
        self.roots = [Path(r).expanduser().resolve() for r in roots]
        self._cache: dict[str, tuple[str | None, str | None]] = {}
        self._listings: dict[Path, dict[str, str]] = {}

    def _inside(self, path: Path) -> bool:
        return any(path == root or path.is_relative_to(root) for root in self.roots)

    def _listing(self, folder: Path) -> dict[str, str]:
        """{NFC form of a name: the name on disk} of a folder's entries (cached; empty if unreadable)."""
        names = self._listings.get(folder)
        if names is None:
            try:
                names = {unicodedata.normalize("NFC", n): n for n in sorted(os.listdir(folder))}
            except OSError:
                names = {}
            self._listings[folder] = names
        return names

    def other_normalization(self, path: Path) -> Path | None:
        """The file on disk whose name differs from ``path`` only in Unicode normalization (NFC / NFD, as
        macOS writes names), matched component by component; None when there is none."""
        if str(path).isascii():
            return None
        current = Path(path.anchor)
        for part in path.parts[1:]:
            candidate = current / part
            if not os.path.lexists(candidate):
                real = self._listing(current).get(unicodedata.normalize("NFC", part))
                if real is None:
                    return None
                candidate = current / real
            current = candidate
        return current

    def resolve(self, ref: str) -> tuple[str | None, str | None]:
        """(absolute resolved path, None) or (None, reason). Symlinks are resolved before the check.

        Relative references are looked up under each root in order (the first file found wins); a name
        that differs from the file on disk only in Unicode normalization is found too. What is found must
        be a file inside a root (a folder is refused as one); the answer is cached for the resolver's life.
        A URL is refused (nothing is downloaded), and so is a reference starting with ``~`` (never expanded).
        """
        hit = self._cache.get(ref)
        if hit is not None:
            return hit
        result: tuple[str | None, str | None]
        if _URL.match(ref):
            result = (None, f"{URL_NOT_FETCHED}: {ref}")
        elif ref.startswith("~"):
            result = (None, f"{TILDE_NOT_EXPANDED}: {ref}")
        else:
            result = self._look_up(ref)
        self._cache[ref] = result
        return result

    def _look_up(self, ref: str) -> tuple[str | None, str | None]:
        given = Path(ref)
        candidates = [given.resolve()] if given.is_absolute() else [(root / given).resolve() for root in self.roots]
        inside = [c for c in candidates if self._inside(c)]
        if not inside:
            return None, f"{ESCAPES_ROOTS}: {ref}"
        found = next((c for c in inside if c.is_file()), None)
        if found is None:  # a name in the other Unicode normalization form (NFC in the JSONL, NFD on disk)
            others = (self.other_normalization(c) for c in inside)
            found = next((o.resolve() for o in others if o is not None and self._inside(o.resolve())
                          and o.is_file()), None)
        if found is not None:
            return str(found), None
        if any(c.is_dir() for c in inside):
            return None, f"{A_FOLDER}: {ref}"
        return None, f"{NOT_FOUND}: {ref}"

    def confine(self, ref: str) -> str:
        """The resolved absolute path of ``ref``, or :class:`ImagePathError` saying why it is refused."""
        path, reason = self.resolve(ref)
        if path is None:
            raise ImagePathError(next((k for k in REFUSAL_KINDS if reason.startswith(k)), NOT_FOUND), ref)
        return path


def stat_key(path: str) -> tuple[int, int] | None:
    """(size in bytes, mtime in ns) of a file, or None when it cannot be stat-ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def check_image(path: str, max_pixels: int, max_aspect_ratio: float = MAX_ASPECT_RATIO) -> dict[str, Any]:
    """Open, verify and fully decode one image; return its manifest row (ok, reason, size, format, mode).

    Refused from the header alone (bounded memory): more than `max_pixels` pixels (decompression bombs), or
    an aspect ratio beyond `max_aspect_ratio` (the model's processor cannot resize those).
    """
    row: dict[str, Any] = {"path": path, "ok": False, "reason": None, "width": None, "height": None,
                           "format": None, "mode": None, "frames": None, "orientation": None, "size_bytes": None,
                           "mtime_ns": None, "max_pixels": max_pixels}
    key = stat_key(path)
    if key is None:
        row["reason"] = NOT_FOUND
        return row
    if os.path.isdir(path):  # PIL would say "Is a directory" as a corrupt image
        row["reason"] = A_FOLDER
        return row
    row["size_bytes"], row["mtime_ns"] = key
    if key[0] == 0:
        row["reason"] = "zero-byte file"
        return row
    if Image.MAX_IMAGE_PIXELS is not None and max_pixels > Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = max_pixels  # the configured limit is the higher one: PIL's guard follows it
    try:
        with warnings.catch_warnings():
            # PIL's own bomb warning: our max_pixels check below decides (and names the size)
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                row.update(width=image.width, height=image.height, format=image.format, mode=image.mode,
                           frames=int(getattr(image, "n_frames", 1)))
                if image.width * image.height > max_pixels:
                    row["reason"] = f"too many pixels: {image.width}x{image.height} > {max_pixels}"
                    return row
                ratio = max(image.width, image.height) / max(1, min(image.width, image.height))
                if ratio > max_aspect_ratio:
                    row["reason"] = f"aspect ratio too extreme: {image.width}x{image.height} > {max_aspect_ratio:g}:1"
                    return row
                image.verify()
            with Image.open(path) as image:  # verify() leaves the file unusable: decode from a fresh open
                image.load()
                row["orientation"] = exif_orientation(image)
    except Image.UnidentifiedImageError:
        row["reason"] = "not a decodable image"
        return row
    except Image.DecompressionBombError as error:  # beyond PIL's hard limit: refused while reading the header
        row["reason"] = f"too many pixels: {error}"
        return row
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, EOFError) as error:
        row["reason"] = f"corrupt image: {error}"
        return row
    row["ok"] = True
    return row


def exif_orientation(image: Image.Image) -> int:
    """The EXIF orientation tag (1-8; 1 when absent or unreadable): the loader turns the pixels by it."""
    try:
        value = int(image.getexif().get(0x0112, 1))
    except (OSError, ValueError, TypeError, SyntaxError):  # a broken EXIF block: the pixels are used as stored
        return 1
    return value if 1 <= value <= 8 else 1


def check_image_task(args: tuple[str, int]) -> dict[str, Any]:
    """Process-pool entry point for :func:`check_image`."""
    return check_image(*args)
