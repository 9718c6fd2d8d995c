"""grpcurl's command line, for the examples in docs/api.md, on grpcio.

    grpcurl.py [-plaintext] [-H 'name: value']... [-d JSON] [-max-time SECONDS] ADDRESS list [SERVICE]
    grpcurl.py [-plaintext] [-H 'name: value']... [-d JSON] [-max-time SECONDS] ADDRESS SERVICE/METHOD

grpcurl is a Go program that no package registry this project installs from carries,
so the tests run the documented commands through this instead. It does what grpcurl
does for them, the same way:

- the schema comes from the server's reflection, grpc.reflection.v1 first and
  v1alpha if the server has no v1, with the -H metadata on those calls too;
- `list` prints the services, sorted, one per line;
- a method call turns each JSON object of -d into a request by protobuf's JSON
  mapping (field names as in the .proto or in lowerCamelCase), sends them (one empty
  request when -d is absent and the method takes one), half-closes, and prints each
  response as JSON in lowerCamelCase with two-space indents;
- a call that ends with a status other than OK prints `ERROR:`, its code and message
  on standard error, and exits with 64 plus the code.

Only these flags are taken (and, like grpcurl, only before ADDRESS); any other is a
usage error (exit 2), not silently ignored. Without -plaintext grpcurl would speak
TLS, which this does not: that is a usage error too.
"""
import json
import sys

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

STATUS_CODE_OFFSET = 64


def usage(problem):
    print(f"grpcurl: {problem}", file=sys.stderr)
    sys.exit(2)


def parse(argv):
    """Flags first, then the address, then `list [SERVICE]` or SERVICE/METHOD."""
    flags = {"plaintext": False, "headers": [], "data": None, "max_time": None}
    rest = list(argv)
    while rest and rest[0].startswith("-"):
        flag = rest.pop(0).lstrip("-")
        name, _, inline = flag.partition("=")

        def value():
            if inline:
                return inline
            if not rest:
                usage(f"-{name} needs a value")
            return rest.pop(0)

        if name == "plaintext":
            flags["plaintext"] = inline in ("", "true")
        elif name == "H":
            flags["headers"].append(value())
        elif name == "d":
            flags["data"] = value()
        elif name == "max-time":
            flags["max_time"] = float(value())
        else:
            usage(f"-{name}: not a flag the documented examples use")
    if not flags["plaintext"]:
        usage("TLS is not supported here: pass -plaintext")
    if not rest:
        usage("no address")
    address, symbol = rest[0], rest[1:]
    if len(symbol) > 2 or not symbol:
        usage(f"expected `list [SERVICE]` or SERVICE/METHOD, got {symbol}")
    return flags, address, symbol


def metadata(headers):
    pairs = []
    for header in headers:
        name, sep, value = header.partition(":")
        if not sep:
            usage(f"-H {header!r}: expected 'name: value'")
        pairs.append((name.strip().lower(), value.strip()))
    return pairs


class Reflection(ProtoReflectionDescriptorDatabase):
    """grpcio's reflection client, on the v1 service when the server has it (the
    messages of v1 and v1alpha are the same on the wire), with the -H metadata."""

    def __init__(self, channel, md):
        super().__init__(channel)
        alpha = self._stub.ServerReflectionInfo
        v1 = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )

        class Stub:
            @staticmethod
            def ServerReflectionInfo(requests, **kwargs):
                requests = list(requests)
                try:
                    return iter(list(v1(iter(requests), metadata=md, **kwargs)))
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                        raise
                return alpha(iter(requests), metadata=md, **kwargs)

        self._stub = Stub()


def requests_from(data, request_type):
    """The JSON objects in `data`, one after another, as requests."""
    decoder = json.JSONDecoder()
    at, out = 0, []
    while True:
        while at < len(data) and data[at].isspace():
            at += 1
        if at == len(data):
            return out
        try:
            obj, at = decoder.raw_decode(data, at)
        except json.JSONDecodeError as e:
            print(f"Error invoking method: bad JSON in -d: {e}", file=sys.stderr)
            sys.exit(1)
        message = request_type()
        try:
            json_format.ParseDict(obj, message)
        except json_format.ParseError as e:
            print(f"Error invoking method: -d is no {request_type.DESCRIPTOR.full_name}: {e}",
                  file=sys.stderr)
            sys.exit(1)
        out.append(message)


def camel(code):
    """grpc.StatusCode.INVALID_ARGUMENT -> InvalidArgument, as Go's codes print."""
    return "".join(part.capitalize() for part in code.name.split("_"))


def main(argv):
    flags, address, symbol = parse(argv)
    md = metadata(flags["headers"])
    channel = grpc.insecure_channel(address)
    reflection = Reflection(channel, md)
    try:
        if symbol[0] == "list":
            names = sorted(reflection.get_services())
            if len(symbol) == 2:
                service = descriptor_pool.DescriptorPool(reflection).FindServiceByName(symbol[1])
                names = [m.full_name for m in service.methods]
            print("\n".join(names) or "(No services)")
            return 0
        if len(symbol) != 1:
            usage(f"expected SERVICE/METHOD, got {symbol}")
        full = symbol[0].replace("/", ".")
        method = descriptor_pool.DescriptorPool(reflection).FindMethodByName(full)
    except grpc.RpcError as e:
        print(f"Failed to read the schema by reflection: {camel(e.code())}: {e.details()}",
              file=sys.stderr)
        return 1
    except KeyError as e:
        print(f"Failed to resolve symbol {symbol[-1]!r}: {e}", file=sys.stderr)
        return 1

    request_type = message_factory.GetMessageClass(method.input_type)
    response_type = message_factory.GetMessageClass(method.output_type)
    requests = requests_from(flags["data"] or "", request_type)
    if not requests and not method.client_streaming:
        requests = [request_type()]
    if len(requests) != 1 and not method.client_streaming:
        print(f"Error invoking method: {full} takes one request, -d has {len(requests)}",
              file=sys.stderr)
        return 1
    path = f"/{method.containing_service.full_name}/{method.name}"
    kind = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[(method.client_streaming, method.server_streaming)]
    call = kind(
        path,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=response_type.FromString,
    )
    argument = iter(requests) if method.client_streaming else requests[0]
    try:
        responses = call(argument, metadata=md, timeout=flags["max_time"])
        if not method.server_streaming:
            responses = [responses]
        for response in responses:
            print(json_format.MessageToJson(response, indent=2), flush=True)
    except grpc.RpcError as e:
        print(f"ERROR:\n  Code: {camel(e.code())}\n  Message: {e.details()}", file=sys.stderr)
        return STATUS_CODE_OFFSET + e.code().value[0]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
