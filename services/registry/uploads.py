"""Uploads checked while they stream in: size limits, magic bytes, the length a header declares."""

from __future__ import annotations

from typing import Literal

from services.registry.errors import Invalid, RegistryError, TooLarge
from shared.patch import MAGIC, PatchError, header_size, read_header, snapshot_header_size, snapshot_size

# Config and tokenizer JSON: the largest common tokenizer.json files are ~10-20 MB.
MAX_MODEL_FILE_BYTES = 64 << 20
UploadKind = Literal["patch", "snapshot", "model"]


class UploadCheck:
    """An upload checked as its bytes arrive: the size limit, then the magic bytes and the length
    its own header declares, so junk is refused after its first bytes instead of being held in
    memory up to the limit. The whole body is still needed to verify it (chunks, fingerprint)."""

    def __init__(self, kind: UploadKind, limit: int, declared: int | None = None) -> None:
        self.kind = kind
        self.limit = min(limit, MAX_MODEL_FILE_BYTES) if kind == "model" else limit
        self.declared = declared
        self.expected: int | None = None  # total size, once the header has arrived
        self.opened = False  # model files: the first non-blank byte was a '{'
        self.body = bytearray()
        if declared is not None and declared > self.limit:
            raise TooLarge(f"body of {declared} bytes exceeds the limit of {self.limit}")

    def feed(self, chunk: bytes) -> None:
        self.body += chunk
        if len(self.body) > self.limit:
            raise TooLarge(f"body exceeds the limit of {self.limit} bytes")
        if self.kind == "model":
            if not self.opened and (start := chunk.lstrip()[:1]):  # earlier chunks were all blank
                if start != b"{":
                    raise Invalid("a model file is a JSON object")
                self.opened = True
        elif self.expected is None:
            try:
                self.expected = self._declared_size()
            except PatchError as exc:
                raise Invalid(f"malformed {self.kind}: {type(exc).__name__}: {exc}") from exc
            if self.expected is not None:
                if self.expected > self.limit:
                    raise TooLarge(f"{self.kind} of {self.expected} bytes exceeds the limit of {self.limit}")
                if self.declared is not None and self.declared != self.expected:
                    raise Invalid(f"Content-Length is {self.declared}, the {self.kind} says {self.expected} bytes")
        if self.expected is not None and len(self.body) > self.expected:
            raise Invalid(f"{self.kind} is longer than the {self.expected} bytes its header declares")

    def _declared_size(self) -> int | None:
        """The total size a patch or snapshot declares once its header is in; None until then."""
        body = self.body
        if self.kind == "patch":
            if bytes(body[: len(MAGIC)]) != MAGIC[: len(body)]:
                raise Invalid("not a sparsecast patch (bad magic)")
            if len(body) < 16:
                return None
            size = header_size(bytes(body[:16]))  # refuses an oversized header length
            return read_header(bytes(body[:size])).total_size if len(body) >= size else None
        if len(body) < 9:
            return None
        size = snapshot_header_size(bytes(body[:9]))
        return snapshot_size(bytes(body[:size])) if len(body) >= size else None

    def finish(self) -> bytes:
        if not self.body:
            raise RegistryError("empty body")
        if self.expected is not None and len(self.body) < self.expected:
            raise Invalid(f"{self.kind} is truncated: {len(self.body)} of {self.expected} bytes")
        return bytes(self.body)
