"""Typed errors of shared.patch: callers branch on the class, humans read the message."""


class PatchError(Exception):
    """Base class of every error raised by shared.patch."""


class FormatError(PatchError):
    """Not a sparsecast patch, an unsupported format version, or a malformed header."""


class CorruptPatchError(PatchError):
    """Bytes do not match their checksum, or an encoded stream does not decode."""


class TruncatedPatchError(PatchError):
    """The patch is shorter than its header says."""


class WrongBaseError(PatchError):
    """The weights are not the patch's base (fingerprint or chain mismatch)."""


class UnknownTensorError(PatchError):
    """The patch names a tensor the model does not have (or the key sets differ)."""


class TensorMismatchError(PatchError):
    """A tensor has another shape or dtype than the patch expects, or cannot be patched in place."""


class TargetMismatchError(PatchError):
    """After applying, the weights do not have the patch's target fingerprint (they were restored)."""
