#!/usr/bin/env python3
"""A small, real OTLP receiver for tether's end-to-end tests.

It speaks OTLP/HTTP (protobuf and JSON) and OTLP/gRPC for traces and metrics, using only the
official `opentelemetry-proto` messages and `grpcio`, and writes what it receives as JSON lines:
one line per span to --out, one line per metric data point to --metrics-out. Tests poll those files.

Usage:
    otlp_receiver.py --http-port 0 --grpc-port 0 --out spans.jsonl --metrics-out metrics.jsonl

It prints `READY http=<host>:<port> grpc=<host>:<port>` (flushed) once both listeners are up; a port of 0
picks a free one, and the READY line names the ports actually bound. `GET /healthz` answers 200.
"""

import argparse
import base64
import gzip
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

# OTLP/JSON spells trace and span ids as hex; proto3 JSON expects base64 for `bytes` fields.
_ID_KEYS = ("traceId", "spanId", "parentSpanId")


class Sink:
    """Appends JSON lines to the two output files, one writer at a time."""

    def __init__(self, spans_path, metrics_path):
        self._lock = threading.Lock()
        self._spans_path = spans_path
        self._metrics_path = metrics_path
        for path in (spans_path, metrics_path):
            if path:
                open(path, "w").close()

    def _append(self, path, records):
        if not path or not records:
            return
        with self._lock, open(path, "a") as f:
            for r in records:
                f.write(json.dumps(r, sort_keys=True) + "\n")
            f.flush()

    def traces(self, transport, req):
        out = []
        for rs in req.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append({
                        "kind": "span",
                        "transport": transport,
                        "service": resource.get("service.name"),
                        "resource": resource,
                        "scope": ss.scope.name,
                        "name": s.name,
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex(),
                        "span_kind": s.kind,
                        "start_time_unix_nano": s.start_time_unix_nano,
                        "duration_ns": s.end_time_unix_nano - s.start_time_unix_nano,
                        "status_code": s.status.code,
                        "status_message": s.status.message,
                        "attributes": _attrs(s.attributes),
                        "events": [{"name": e.name, "attributes": _attrs(e.attributes)} for e in s.events],
                    })
        self._append(self._spans_path, out)

    def metrics(self, transport, req):
        out = []
        for rm in req.resource_metrics:
            resource = _attrs(rm.resource.attributes)
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    base = {
                        "kind": "metric",
                        "transport": transport,
                        "service": resource.get("service.name"),
                        "scope": sm.scope.name,
                        "name": m.name,
                        "unit": m.unit,
                    }
                    out.extend(_data_points(base, m))
        self._append(self._metrics_path, out)


def _data_points(base, m):
    data = m.WhichOneof("data")
    if data in ("sum", "gauge"):
        body = getattr(m, data)
        extra = {"type": data}
        if data == "sum":
            extra["monotonic"] = body.is_monotonic
            extra["temporality"] = body.aggregation_temporality
        for p in body.data_points:
            value = p.as_int if p.WhichOneof("value") == "as_int" else p.as_double
            yield {**base, **extra, "attributes": _attrs(p.attributes), "value": value}
    elif data == "histogram":
        for p in m.histogram.data_points:
            yield {
                **base,
                "type": "histogram",
                "temporality": m.histogram.aggregation_temporality,
                "attributes": _attrs(p.attributes),
                "count": p.count,
                "sum": p.sum,
                "bucket_counts": list(p.bucket_counts),
                "explicit_bounds": list(p.explicit_bounds),
            }
    elif data == "exponential_histogram":
        for p in m.exponential_histogram.data_points:
            yield {**base, "type": "exponential_histogram", "attributes": _attrs(p.attributes),
                   "count": p.count, "sum": p.sum}
    elif data == "summary":
        for p in m.summary.data_points:
            yield {**base, "type": "summary", "attributes": _attrs(p.attributes), "count": p.count, "sum": p.sum}


def _attrs(kvs):
    return {kv.key: _value(kv.value) for kv in kvs}


def _value(v):
    which = v.WhichOneof("value")
    if which in ("string_value", "bool_value", "int_value", "double_value"):
        return getattr(v, which)
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return str(v) if which else None


def _hex_ids_to_base64(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k in _ID_KEYS and isinstance(v, str):
                node[k] = base64.b64encode(bytes.fromhex(v)).decode()
            else:
                _hex_ids_to_base64(v)
    elif isinstance(node, list):
        for x in node:
            _hex_ids_to_base64(x)
    return node


class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink):
        self.sink = sink

    def Export(self, request, context):
        self.sink.traces("grpc", request)
        return trace_service_pb2.ExportTraceServiceResponse()


class MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, sink):
        self.sink = sink

    def Export(self, request, context):
        self.sink.metrics("grpc", request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


# path -> (request type, response type, sink method name)
_HTTP_ROUTES = {
    "/v1/traces": (trace_service_pb2.ExportTraceServiceRequest, trace_service_pb2.ExportTraceServiceResponse, "traces"),
    "/v1/metrics": (metrics_service_pb2.ExportMetricsServiceRequest,
                    metrics_service_pb2.ExportMetricsServiceResponse, "metrics"),
}


def make_handler(sink):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self._reply(200 if self.path == "/healthz" else 404, "text/plain", b"ok\n" if self.path == "/healthz" else b"")

        def do_POST(self):
            route = _HTTP_ROUTES.get(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            if route is None:
                self._reply(404, "text/plain", b"not found\n")
                return
            req_type, resp_type, method = route
            is_json = (self.headers.get("Content-Type") or "").startswith("application/json")
            try:
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if is_json:
                    req = json_format.ParseDict(_hex_ids_to_base64(json.loads(body)), req_type())
                else:
                    req = req_type()
                    req.ParseFromString(body)
            except Exception as e:  # any malformed body is the client's fault, as the collector says
                self._reply(400, "text/plain", str(e).encode())
                return
            getattr(sink, method)("http", req)
            if is_json:
                self._reply(200, "application/json", json_format.MessageToJson(resp_type()).encode())
            else:
                self._reply(200, "application/x-protobuf", resp_type().SerializeToString())

        def _reply(self, status, content_type, payload):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    return Handler


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--http-port", type=int, default=4318)
    ap.add_argument("--grpc-port", type=int, default=4317)
    ap.add_argument("--out", required=True, help="JSONL file for spans (created empty)")
    ap.add_argument("--metrics-out", default=None, help="JSONL file for metric data points (created empty)")
    args = ap.parse_args()

    sink = Sink(args.out, args.metrics_out)
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(sink), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(MetricsService(sink), server)
    grpc_port = server.add_insecure_port(f"{args.host}:{args.grpc_port}")
    if grpc_port == 0:
        sys.exit(f"cannot bind gRPC port {args.host}:{args.grpc_port}")
    server.start()

    httpd = ThreadingHTTPServer((args.host, args.http_port), make_handler(sink))
    print(f"READY http={args.host}:{httpd.server_address[1]} grpc={args.host}:{grpc_port}", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(grace=None)


if __name__ == "__main__":
    main()
