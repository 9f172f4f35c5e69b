#!/usr/bin/python3
# An independent reader of TensorBoard event files, used by tests/core/test_tensorboard.cpp to check
# kiln's writer: its own bitwise CRC32C, and protobuf message classes built from a hand-made descriptor.
"""Usage: read_tfevents.py FILE

Prints one JSON line per file_version event and per summary value:
  {"wall_time": ..., "step": ..., "file_version": "brain.Event:2"}
  {"wall_time": ..., "step": ..., "tag": ..., "simple_value": ...}   (NaN/inf as the strings "nan", "inf", "-inf")
  {"wall_time": ..., "step": ..., "tag": ..., "text": ..., "plugin_name": "text"}
Exits 1 with a message on stderr at the first CRC mismatch, truncated record or undecodable event;
exits 3 when python3-protobuf is missing.
"""
import json
import math
import struct
import sys

try:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
except ImportError:
    sys.stderr.write("read_tfevents: python3-protobuf is missing; run tools/setup.sh (it installs python3-protobuf)\n")
    sys.exit(3)

# Written from the format description, bit by bit, so it shares nothing with the C++ table or SSE4.2 code.
CASTAGNOLI_REFLECTED = 0x82F63B78


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ CASTAGNOLI_REFLECTED if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data):
    crc = crc32c(data)
    rotated = ((crc >> 15) | (crc << 17)) & 0xFFFFFFFF
    return (rotated + 0xA282EAD8) & 0xFFFFFFFF


# Field numbers from tensorboard/compat/proto/{event,summary,tensor,tensor_shape,types}.proto.
F = descriptor_pb2.FieldDescriptorProto
OPTIONAL, REPEATED = F.LABEL_OPTIONAL, F.LABEL_REPEATED


def add_field(msg, name, number, ftype, label=OPTIONAL, type_name=None, oneof=None):
    field = msg.field.add(name=name, number=number, type=ftype, label=label)
    if type_name:
        field.type_name = type_name
    if oneof is not None:
        field.oneof_index = oneof


def build_classes():
    fd = descriptor_pb2.FileDescriptorProto(name="kiln_read_tfevents.proto", package="kilnreader", syntax="proto3")

    dtype = fd.enum_type.add(name="DataType")
    for name, number in (("DT_INVALID", 0), ("DT_FLOAT", 1), ("DT_STRING", 7)):
        dtype.value.add(name=name, number=number)

    shape = fd.message_type.add(name="TensorShapeProto")
    dim = shape.nested_type.add(name="Dim")
    add_field(dim, "size", 1, F.TYPE_INT64)
    add_field(dim, "name", 2, F.TYPE_STRING)
    add_field(shape, "dim", 2, F.TYPE_MESSAGE, REPEATED, ".kilnreader.TensorShapeProto.Dim")
    add_field(shape, "unknown_rank", 3, F.TYPE_BOOL)

    tensor = fd.message_type.add(name="TensorProto")
    add_field(tensor, "dtype", 1, F.TYPE_ENUM, type_name=".kilnreader.DataType")
    add_field(tensor, "tensor_shape", 2, F.TYPE_MESSAGE, type_name=".kilnreader.TensorShapeProto")
    add_field(tensor, "string_val", 8, F.TYPE_BYTES, REPEATED)

    meta = fd.message_type.add(name="SummaryMetadata")
    plugin = meta.nested_type.add(name="PluginData")
    add_field(plugin, "plugin_name", 1, F.TYPE_STRING)
    add_field(plugin, "content", 2, F.TYPE_BYTES)
    add_field(meta, "plugin_data", 1, F.TYPE_MESSAGE, type_name=".kilnreader.SummaryMetadata.PluginData")
    add_field(meta, "display_name", 2, F.TYPE_STRING)
    add_field(meta, "summary_description", 3, F.TYPE_STRING)

    summary = fd.message_type.add(name="Summary")
    value = summary.nested_type.add(name="Value")
    value.oneof_decl.add(name="value")
    add_field(value, "tag", 1, F.TYPE_STRING)
    add_field(value, "simple_value", 2, F.TYPE_FLOAT, oneof=0)
    add_field(value, "tensor", 8, F.TYPE_MESSAGE, type_name=".kilnreader.TensorProto", oneof=0)
    add_field(value, "metadata", 9, F.TYPE_MESSAGE, type_name=".kilnreader.SummaryMetadata")
    add_field(summary, "value", 1, F.TYPE_MESSAGE, REPEATED, ".kilnreader.Summary.Value")

    event = fd.message_type.add(name="Event")
    event.oneof_decl.add(name="what")
    add_field(event, "wall_time", 1, F.TYPE_DOUBLE)
    add_field(event, "step", 2, F.TYPE_INT64)
    add_field(event, "file_version", 3, F.TYPE_STRING, oneof=0)
    add_field(event, "summary", 5, F.TYPE_MESSAGE, type_name=".kilnreader.Summary", oneof=0)

    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    descriptor = pool.FindMessageTypeByName("kilnreader.Event")
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)  # Debian 12's 3.x / 4.21


def json_float(x):
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def fail(path, index, offset, what):
    sys.stderr.write("read_tfevents: %s: record %d at byte %d: %s\n" % (path, index, offset, what))
    sys.exit(1)


def records(path, data):
    offset, index = 0, 0
    while offset < len(data):
        if len(data) - offset < 12:
            fail(path, index, offset, "truncated header (%d bytes left)" % (len(data) - offset))
        header = data[offset:offset + 8]
        (length,) = struct.unpack("<Q", header)
        (stored,) = struct.unpack("<I", data[offset + 8:offset + 12])
        computed = masked_crc32c(header)
        if stored != computed:
            fail(path, index, offset, "length CRC mismatch (stored=0x%08x, computed=0x%08x)" % (stored, computed))
        start = offset + 12
        if len(data) - start < length + 4:
            fail(path, index, offset, "truncated data (length=%d, bytes left=%d)" % (length, len(data) - start))
        payload = data[start:start + length]
        (stored,) = struct.unpack("<I", data[start + length:start + length + 4])
        computed = masked_crc32c(payload)
        if stored != computed:
            fail(path, index, offset, "data CRC mismatch (stored=0x%08x, computed=0x%08x)" % (stored, computed))
        yield index, offset, payload
        offset = start + length + 4
        index += 1


def main():
    if len(sys.argv) != 2:
        sys.stderr.write(__doc__)
        sys.exit(2)
    path = sys.argv[1]
    with open(path, "rb") as f:
        data = f.read()
    Event = build_classes()
    out = []
    for index, offset, payload in records(path, data):
        event = Event()
        try:
            event.ParseFromString(payload)
        except Exception as e:  # the message type differs between protobuf backends
            fail(path, index, offset, "cannot decode the Event (%s)" % e)
        head = {"wall_time": event.wall_time, "step": event.step}
        what = event.WhichOneof("what")
        if what == "file_version":
            out.append(dict(head, file_version=event.file_version))
        elif what == "summary":
            for value in event.summary.value:
                kind = value.WhichOneof("value")
                if kind == "simple_value":
                    out.append(dict(head, tag=value.tag, simple_value=json_float(value.simple_value)))
                elif kind == "tensor":
                    t = value.tensor
                    plugin_name = value.metadata.plugin_data.plugin_name
                    if t.dtype != 7 or len(t.tensor_shape.dim) != 0 or len(t.string_val) != 1 or plugin_name != "text":
                        fail(path, index, offset, "tensor value is not a scalar text summary (dtype=%d, rank=%d, "
                             "strings=%d, plugin=%r)" % (t.dtype, len(t.tensor_shape.dim), len(t.string_val),
                                                         plugin_name))
                    out.append(dict(head, tag=value.tag, text=t.string_val[0].decode("utf-8"),
                                    plugin_name=plugin_name))
                else:
                    fail(path, index, offset, "summary value %r holds %s" % (value.tag, kind))
        else:
            fail(path, index, offset, "event holds %s, neither file_version nor summary" % what)
    for line in out:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
