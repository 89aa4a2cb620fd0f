"""Non-tensor values of a state dict (``step: 5``, an optimizer's ``param_groups``, configs).

Saved by tessera as a pickle of plain values only (ints, floats, complex, bools, None, strings,
bytes, lists, tuples, dicts, sets), so they load back without running code; ``bytes`` and
``io.BytesIO`` values are stored as their raw bytes. DCP stores every non-tensor value as a
``torch.save`` archive (a zip whose ``data.pkl`` is a pickle); tessera decodes those too when the
pickle holds plain values. Anything else needs ``allow_pickle=True``, which runs the pickle (only
for checkpoints you trust)."""

from __future__ import annotations

import io
import pickle
import sys
import zipfile
from typing import Any

# Classes a plain-value pickle may name: containers and numbers pickle refers to by name.
_PLAIN_CLASSES = {
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "complex"),
    ("builtins", "slice"),
    ("builtins", "range"),
    ("collections", "OrderedDict"),
    ("_codecs", "encode"),  # how protocol 2 spells bytes
    ("_io", "BytesIO"),  # DCP saves a BytesIO value pickled (its state: the bytes and a position)
}


class NotPlainError(ValueError):
    """The stored object is a pickle that needs more than plain values."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN_CLASSES:
            return super().find_class(module, name)
        raise NotPlainError(f"it pickles {module}.{name}, which is not a plain value")

    def persistent_load(self, pid: Any) -> Any:
        raise NotPlainError("it holds tensor storage (a torch.save of tensors)")


def _torch_archive_pickle(data: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(names) != 1:
            raise NotPlainError(f"it is a zip with {len(names)} data.pkl entries, not a torch.save archive")
        info = archive.getinfo(names[0])
        # torch.save stores every member uncompressed. A compressed one is not torch's, and
        # inflating it is unbounded (a 1 MiB member can become 1 GiB): refused, as the Rust
        # readers refuse compressed members, without reading it.
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(
                f"its {names[0]} is compressed (zip method {info.compress_type}, {info.compress_size} bytes "
                f"inflating to {info.file_size}): torch.save archives store members uncompressed, and "
                "tessera does not inflate one"
            )
        if info.file_size > len(data):
            raise ValueError(f"its {names[0]} claims {info.file_size} bytes in a {len(data)}-byte archive")
        return archive.read(names[0])


def is_torch_archive(data: bytes) -> bool:
    return data[:4] == b"PK\x03\x04"


def decode(key: str, data: bytes, like: Any, *, allow_pickle: bool, archived: bool = False) -> Any:
    """The value of object ``key`` from its stored bytes. ``like`` is the state dict's current
    value: ``bytes``/``bytearray``/``io.BytesIO`` get the raw bytes back in that type (tessera
    stores them raw). With ``archived`` (a DCP checkpoint, whose writer stores every non-tensor
    value as a ``torch.save`` archive, bytes and BytesIO included) the value is the archive's, as
    ``dcp.load`` gives it. Bytes that are neither a torch.save archive nor a pickle come back as
    ``bytes`` (a bytes value saved raw)."""
    if isinstance(like, (bytes, bytearray, io.BytesIO)) and not (archived and is_torch_archive(data)):
        return io.BytesIO(data) if isinstance(like, io.BytesIO) else type(like)(data)
    if allow_pickle:
        if is_torch_archive(data):
            torch = sys.modules.get("torch")
            if torch is None:
                import torch  # noqa: F811 (a torch.save archive of tensors needs torch)
            return torch.load(io.BytesIO(data), weights_only=False)
        return pickle.loads(data)
    try:
        if not is_torch_archive(data) and data[:1] != b"\x80":
            return bytes(data)  # neither a torch.save archive nor a pickle: raw bytes, as saved
        payload = _torch_archive_pickle(data) if is_torch_archive(data) else data
        return _PlainUnpickler(io.BytesIO(payload)).load()
    except NotPlainError as e:
        raise ValueError(
            f"object {key}: tessera loads non-tensor values that decode to plain Python values, and {e}; "
            "pass allow_pickle=True to unpickle it (runs code from the checkpoint: trusted checkpoints only)"
        ) from None
    except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, ValueError, TypeError) as e:
        raise ValueError(f"object {key}: the stored bytes do not decode ({type(e).__name__}: {e})") from None


def encode(key: str, value: Any) -> bytes:
    """The stored bytes of a non-tensor value: raw for bytes-like values, else a plain-value
    pickle, checked to load back with the plain unpickler (a value that would need code to load
    is refused here, at save time, naming the key)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, io.BytesIO):
        return value.getvalue()
    try:
        data = pickle.dumps(value, protocol=4)
    except Exception as e:  # pickling user objects can raise anything
        raise TypeError(f"{key}: cannot save a {type(value).__name__}: {e}") from None
    try:
        _PlainUnpickler(io.BytesIO(data)).load()
    except NotPlainError as e:
        raise TypeError(
            f"{key}: tessera saves tensors and plain values (int, float, bool, None, str, bytes, list, "
            f"tuple, dict, set); a {type(value).__name__} is not one ({e})"
        ) from None
    return data
