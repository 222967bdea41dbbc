"""Hypothesis strategies for malformed gRPC requests: any message of a descriptor with hostile field values,
near-valid requests with one or more fields off, and raw bytes that may not parse at all."""

from __future__ import annotations

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

F = FieldDescriptor
INT32, INT64 = (-(2**31), 2**31 - 1), (-(2**63), 2**63 - 1)
HOSTILE_TEXT = st.sampled_from(["", " ", "\x00", "../../etc/passwd", "a:1", "127.0.0.1:1", "\U0001f600" * 3])
LONG_TEXT = st.sampled_from([257, 300, 65537, 70000]).map(lambda n: "x" * n)  # just over the default limits
SHORT_TEXT = st.one_of(st.text(max_size=24), HOSTILE_TEXT)
TEXT = st.one_of(SHORT_TEXT, LONG_TEXT)
FLOATS = st.one_of(st.floats(), st.sampled_from([0.0, -0.0, 1e-45, -1.0, 1e308]))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    kind = field.type
    if kind in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return st.integers(*INT32)
    if kind in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return st.integers(*INT64)
    if kind in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return st.integers(0, 2**32 - 1)
    if kind in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1)
    if kind == F.TYPE_FLOAT:
        return st.floats(width=32)
    if kind == F.TYPE_DOUBLE:
        return FLOATS
    if kind == F.TYPE_BOOL:
        return st.booleans()
    if kind == F.TYPE_STRING:
        return TEXT
    if kind == F.TYPE_BYTES:
        return st.binary(max_size=32)
    if kind == F.TYPE_ENUM:
        return st.integers(-3, 8)  # proto3 enums are open: unknown numbers parse
    raise TypeError(f"no strategy for field type {kind}")


def _field(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return st.dictionaries(_field(key, depth + 1), _field(value, depth + 1), max_size=4)
    single = messages(field.message_type, depth + 1) if field.type == F.TYPE_MESSAGE else _scalar(field)
    if field.is_repeated:
        return st.lists(single, max_size=6 if field.type == F.TYPE_MESSAGE else 40)
    return single


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy:
    """Any instance of ``descriptor``'s message: each field absent or set to a hostile value."""
    cls = message_factory.GetMessageClass(descriptor)
    if depth > 3:
        return st.just(cls())
    fields = {f.name: _field(f, depth) for f in descriptor.fields}
    return st.fixed_dictionaries({}, optional=fields).map(lambda values: cls(**values))


def raw_bytes(valid: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    """Arbitrary bytes, and serialized messages with bytes flipped, truncated or appended."""

    @st.composite
    def mutated(draw) -> bytes:
        data = bytearray(draw(valid).SerializeToString())
        for _ in range(draw(st.integers(1, 4))):
            if data and draw(st.booleans()):
                data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
            else:
                data += draw(st.binary(min_size=1, max_size=8))
        return bytes(data[: draw(st.integers(0, len(data)))])

    return st.one_of(st.binary(max_size=256), mutated())
